"""A cancellation fuzz (issue 34): random cancellations of every public await — explorers'
``lease``, ``rollout`` and its segments, ``step_done``, ``sync_weight``, ``wait_applied``,
``attach_explorer``, the trainer's ``step_done`` — across methods × styles × no-wait, over
in-process and simulated links, each cancelled call made again at once
(:mod:`aiosync.cli.simulate_cancel`). Checked: every lease holds exactly the version it reports,
every call works again after a cancellation, no explorer stays behind beyond the config's bounds
(a stuck request would keep it there for ``sync_timeout + delivery_timeout``), the exit is
prompt (no half-joined session left to wait for), and the explorers end bit-exact.

Bounds here only catch hangs and stuck explorers; nothing measures speed.
"""

from __future__ import annotations

import zlib

import pytest

from aiosync.cli.simulate import simulate

SYNC_TIMEOUT = DELIVERY_TIMEOUT = 5.0


def check(report: dict) -> None:
    assert report["wrong_leases"] == 0 and report["leases"] > 0
    assert report["failed_after_cancel"] == 0, report["failures"]
    assert report["cancellations"] > 0 and report["attach_cancels"] > 0
    # The config's bounds: every wait for the trainer ends within sync_timeout, every delivery within
    # delivery_timeout; an explorer behind for longer is stuck (a request left registered: it expires only then).
    assert report["longest_stale_s"] < SYNC_TIMEOUT + DELIVERY_TIMEOUT, report["stale_at"]
    assert report["exit_s"] < SYNC_TIMEOUT, report  # a ghost session would hold the exit for its close bound
    assert report["final_bit_exact"] is True, report["final_state"]


@pytest.mark.parametrize("link", ["inproc", "simulated"])
@pytest.mark.parametrize("no_wait", [False, True], ids=["wait", "no_wait"])
@pytest.mark.parametrize("style", ["fixed", "explorer_driven", "trainer_driven"])
@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
def test_random_cancellations_of_every_public_await(method, style, no_wait, link):
    seed = zlib.crc32(f"{method}{style}{no_wait}{link}".encode()) % 1000
    report = simulate("cancel", 3, steps=30, seed=seed, method=method,
                      style=style, no_wait=no_wait, latency=0.0 if link == "inproc" else 0.002, step_time=0.004,
                      sync_timeout=SYNC_TIMEOUT, delivery_timeout=DELIVERY_TIMEOUT)
    check(report)


@pytest.mark.parametrize("method", ["memory", "nccl"])
def test_random_cancellations_under_uvloop(method):
    check(simulate("cancel", 3, steps=30, method=method, loop="uvloop", step_time=0.004,
                   sync_timeout=SYNC_TIMEOUT, delivery_timeout=DELIVERY_TIMEOUT))
