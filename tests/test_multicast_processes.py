"""One version to several explorers in other processes (issues 13 and 16), with real processes:
gloo on 127.0.0.1, free ports chosen at run time, every join bounded.

* two remote explorers take every version in one multicast round: headers point to point, the
  shared patch broadcast once (counted), encoded once (counted);
* a broadcast member dies: the others go on point to point, then in rounds of the ranks left,
  and end bit-exact within the timeouts;
* an FSDP2 trainer on two ranks syncing shard-locally to two remote explorers: bit-exact,
  nothing gathered, every shard encoded once per version and broadcast once.

Workers write their results as JSON; the test process only reads them. Nothing asserts on
elapsed time.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from processes import JOIN_BOUND, join, results, start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

OP_TIMEOUT = 20.0
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}


def weights(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 64, generator=g)
    return {"w": w + 0.25 * v * (torch.arange(w.numel()).reshape(w.shape) % 5 == v % 5), "b": torch.randn(64) * 0 - v,
            "stamp": torch.tensor(v, dtype=torch.int64)}


def rollout_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(256, 64, dtype=torch.bfloat16), "b": torch.zeros(64), "stamp": torch.tensor(-1)}


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    return all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in weights(v).items())


def _wait_for_file(path: Path, bound: float = JOIN_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def _explore(group, rank: int, out: Path, die_at: int | None = None, shy: bool = False,
             stuck_from: int | None = None) -> dict:
    import anyio

    from aiosync.coordination import Explorer
    from aiosync.errors import PeerTimeoutError

    if shy:  # this member never takes part in a broadcast: it waits for the fallback at once
        async def refuse(*args, **kwargs):
            raise RuntimeError("this member does not join broadcasts")

        group.multicast._broadcast = refuse
    waited_out = [0]
    if stuck_from is not None:  # from that round on, its broadcasts wait past their bound (a relay died)
        real = group.multicast._broadcast

        async def stuck(sub, bodies, src, deadline):
            if group.multicast._taken[src] < stuck_from:
                return await real(sub, bodies, src, deadline)
            await anyio.sleep(deadline - time.monotonic() + 2.0)
            waited_out[0] += 1  # not given up for the fallback: this member waited its whole bound
            raise PeerTimeoutError("this member's broadcast never completed")

        group.multicast._broadcast = stuck

    async def explore() -> dict:
        t = group.transport(0)
        async with Explorer(f"e{rank}", rollout_model(), t) as ex:
            while not ex.trainer_stopped:
                await ex.step_done()
                if die_at is not None and ex.version is not None and ex.version >= die_at:
                    (out / "kill-me").write_text(str(os.getpid()))
                    await anyio.sleep(3600)  # the test kills this process now
                await anyio.sleep(0.005)
        mc = group.multicast.statistics()
        await t.send({"final": ex.version, "holds": holds(ex.slot.model, ex.version),
                      "broadcasts": mc.broadcasts, "fallbacks": mc.fallbacks, "waited_out": waited_out[0]})
        return {}

    return anyio.run(explore)


def _scenario_rounds(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.errors import TransportError
    from aiosync.transports.distributed import WeightSyncGroup
    from aiosync.transports.distributed.wire import shared_statistics

    group = WeightSyncGroup.init(backend="gloo", timeout=OP_TIMEOUT)
    group.multicast.timeout = extra.get("round_timeout", OP_TIMEOUT)
    stall_from = extra.get("stall_from")
    if rank != 0:
        return _explore(group, rank, out, extra.get("die_at") if rank == world - 1 else None,
                        shy=rank == extra.get("shy"), stuck_from=stall_from if rank == extra.get("stuck") else None)
    versions = extra["versions"]
    if stall_from is not None:  # from that round on, the sender's broadcast fails at once (a member died)
        real = group.multicast._broadcast

        async def failing(sub, bodies, src, deadline):
            if group.multicast._next_round - 1 < stall_from:
                return await real(sub, bodies, src, deadline)
            raise TransportError("a member of the broadcast died")

        group.multicast._broadcast = failing

    async def train() -> dict:
        state = weights(0)
        cfg = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=OP_TIMEOUT, delivery_timeout=OP_TIMEOUT)
        lost_at = None
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            transports = {r: group.transport(r) for r in range(1, world)}
            for t in transports.values():
                sync.serve_remote(t)
            await sync.wait_for_explorers(world - 1, timeout=OP_TIMEOUT)
            encodes0 = shared_statistics().encodes
            for v in range(1, versions + 1):
                for key, t in weights(v).items():
                    state[key].copy_(t)
                # pushed to every explorer at once, and waited for: each version is one round
                await trainer.sync_weight(v, wait=True)
                doomed = sync.explorers.get(f"e{world - 1}")
                if lost_at is None and doomed is not None and doomed.lost:
                    lost_at = v
            await trainer.stop()
            encodes = shared_statistics().encodes - encodes0
        reports = {}
        for r, t in transports.items():
            if r == world - 1 and "die_at" in extra:
                continue
            reports[str(r)] = await t.recv()
        m = sync.metrics()
        sent = {str(r): t.statistics().bytes_sent for r, t in transports.items()}
        return {"reports": reports, "fanout": m["fanout"], "multicast": group.multicast.statistics().__dict__,
                "encodes": encodes, "sent": sent, "lost_at": lost_at,
                "explorers": {k: {f: row[f] for f in ("delivered", "failed", "reinits", "last_error")}
                              for k, row in m["explorers"].items()}}

    return anyio.run(train)


SCENARIOS = {"rounds": _scenario_rounds}


def test_one_version_reaches_two_remote_explorers_by_one_broadcast(tmp_path):
    versions = 4
    procs = start(__name__, "rounds", 3, tmp_path, {"versions": versions})
    join(procs)
    r = results(tmp_path, range(3))[0]
    for rank in ("1", "2"):
        rep = r["reports"][rank]
        assert rep["final"] == versions and rep["holds"], rank
        assert rep["broadcasts"] == versions  # each version's patch came by broadcast, not point to point
    fan, mc = r["fanout"], r["multicast"]
    assert fan["builds"] == versions and fan["multicast_rounds"] == versions and fan["multicast"] == 2 * versions
    assert mc["rounds"] == versions and mc["broadcasts"] == versions and mc["fallbacks"] == 0 and mc["groups"] == 1
    assert r["encodes"] == versions  # one encode per version, for both processes
    # the bytes of the patches left rank 0 once each, by broadcast: point to point only headers went
    patches = mc["bytes_broadcast"]
    assert patches > 0
    for rank in ("1", "2"):
        assert r["explorers"][f"e{rank}"]["delivered"] == versions + 1  # the bootstrap, then one per version


def test_a_dead_broadcast_member_does_not_hold_the_others_back(tmp_path):
    versions, die_at = 6, 2
    procs = start(__name__, "rounds", 4, tmp_path, {"versions": versions, "die_at": die_at})
    try:
        _wait_for_file(tmp_path / "kill-me")
        os.kill(procs[3].pid, signal.SIGKILL)
    finally:
        join({r: p for r, p in procs.items() if r != 3})
        join({3: procs[3]}, bound=5)
    r = results(tmp_path, [0, 1, 2])[0]
    for rank in ("1", "2"):
        rep = r["reports"][rank]
        assert rep["final"] == versions and rep["holds"], rank  # bit-exact, the run went on
    assert r["explorers"]["e3"]["last_error"]  # the dead one was reported lost
    mc = r["multicast"]
    assert mc["groups"] == 2  # the four ranks' group, then after the loss one of the three left
    assert mc["rounds"] >= versions - 1  # rounds went on with the explorers left


def test_survivors_take_the_fallback_while_their_broadcast_still_waits(tmp_path):
    """Issue 34 item 7: a member dies, so the sender's broadcast fails at once; a survivor's own
    broadcast (through the dead member) would wait out its bound. It listens for the fallback
    meanwhile and takes it as soon as it comes (before: it listened only after its broadcast's
    bound, when the sender had given its fallback send up — that version failed for it)."""
    versions = 4
    procs = start(__name__, "rounds", 3, tmp_path, {"versions": versions, "stall_from": 1, "stuck": 2,
                                                      "round_timeout": 4.0})
    join(procs)
    r = results(tmp_path, range(3))[0]
    for rank in ("1", "2"):
        rep = r["reports"][rank]
        assert rep["final"] == versions and rep["holds"], rank
        assert r["explorers"][f"e{rank}"]["failed"] == 0, r["explorers"]  # every version delivered, none repaired
        assert r["explorers"][f"e{rank}"]["reinits"] == 1  # its bootstrap only
    # the stuck member took round 1 by its fallback, as soon as it came: its broadcast was given up
    assert r["reports"]["2"]["fallbacks"] == 1 and r["reports"]["2"]["waited_out"] == 0
    mc = r["multicast"]
    assert mc["fallbacks"] == 1 and mc["broken"] == 1 and mc["rounds"] == 2  # later versions: point to point


def test_a_member_that_never_joins_a_broadcast_costs_one_bounded_wait(tmp_path):
    versions = 3
    procs = start(__name__, "rounds", 3, tmp_path, {"versions": versions, "shy": 2, "round_timeout": 3.0})
    join(procs)
    r = results(tmp_path, range(3))[0]
    for rank in ("1", "2"):
        rep = r["reports"][rank]
        assert rep["final"] == versions and rep["holds"], rank
    mc = r["multicast"]
    # the first round's broadcast could not complete (gloo gives up after the round's timeout): its
    # bodies went point to point, the group was given up, the later versions went point to point
    assert mc["fallbacks"] == 1 and mc["broken"] == 1 and mc["rounds"] == 1
    assert r["explorers"]["e1"]["failed"] == r["explorers"]["e2"]["failed"] == 0
