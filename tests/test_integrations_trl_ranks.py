"""The TRL integration's trainer ranks (:class:`aiosync.integrations.trl_sync.Ranks`) in two real
processes (gloo on 127.0.0.1), without TRL: rank 0's outcome of a step reaches the other rank,
its error is raised there naming what failed, and a rank 0 that does not answer makes the other
rank fail after ``rank_timeout`` with an error naming what hung — its receive still posted, so
rank 0's late answer is the next one it reads, and nothing is left pending at exit.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from processes import join, results, start

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _fail(message: str):
    def step():
        from aiosync.errors import ApplyError

        raise ApplyError(message)

    return step


def _share(rank: int, world: int, out, extra: dict) -> dict:
    from aiosync.integrations.trl_sync import AiosyncConfig, LoopThread, Ranks

    loop = LoopThread(30.0)
    ranks = Ranks(loop, AiosyncConfig(timeout=30.0, rank_timeout=2.0))  # a collective: both ranks
    report: dict = {}
    try:
        report["value"] = ranks.share(lambda: {"version": 3, "bytes": 10} if rank == 0 else None, "a sync")
        try:
            ranks.share(_fail("the server refused it") if rank == 0 else (lambda: None), "the sync of version 4")
        except Exception as exc:
            report["failure"] = f"{type(exc).__name__}: {exc}"
        if rank == 1:  # rank 0 is not there yet: rank 1 gives up after rank_timeout, naming what it waited for
            try:
                ranks.share(lambda: None, "the sync of version 5")
            except Exception as exc:
                report["timeout"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()  # rank 0 answers only now, late
        report["late"] = [ranks.share(lambda: "late" if rank == 0 else None, "the sync of version 5"),
                          ranks.share(lambda: "next" if rank == 0 else None, "the next sync")]
    finally:
        loop.close()
    return report


SCENARIOS = {"share": _share}


def test_rank_zero_outcomes_errors_and_a_hang_reach_the_other_rank(tmp_path):
    join(start(__name__, "share", 2, tmp_path, {}))
    r = results(tmp_path, range(2))
    r0, r1 = r[0], r[1]
    assert r0["value"] == r1["value"] == {"version": 3, "bytes": 10}
    assert r0["failure"] == "ApplyError: the server refused it"
    assert r1["failure"] == ("ApplyError: trainer rank 1: the sync of version 4 failed on rank 0: ApplyError: the "
                           "server refused it")
    assert r1["timeout"].startswith("PeerTimeoutError: trainer rank 1: rank 0 did not tell its outcome of the sync "
                                    "of version 5 within 2.0s (AiosyncConfig.rank_timeout)")
    # the timed-out receive stayed posted: it took rank 0's late answer; the next one is read in order
    assert r0["late"] == r1["late"] == ["late", "next"]
