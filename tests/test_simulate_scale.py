"""``aiosync simulate --scenario scale`` (issue 30): the route model's arithmetic, and patch sizes
measured from real builds."""

from __future__ import annotations

import anyio
import pytest

from aiosync.cli import simulate
from aiosync.cli.simulate_scale import measure, route_times

GB = 1e9


def test_direct_scales_with_a_ranks_bytes_and_relay_with_the_whole_patch_times_engines():
    t = {(r, e): route_times(1e9, 1.0, r, e, GB, 0.0) for r in (4, 8) for e in (16, 32)}
    # direct, rank egress bound (E·P/R > P): twice the ranks, half the time; twice the engines, twice
    assert t[8, 32]["direct_s"] == pytest.approx(t[4, 32]["direct_s"] / 2)
    assert t[4, 32]["direct_s"] == pytest.approx(2 * t[4, 16]["direct_s"])
    assert t[4, 16]["direct_s"] == pytest.approx(16 * 1e9 / 4 / GB)
    # relay: rank 0 takes (R-1)/R of the patch, then sends it whole to every engine
    assert t[4, 16]["relay_s"] == pytest.approx((0.75 + 16) * 1e9 / GB)
    assert t[8, 16]["relay_s"] > t[4, 16]["relay_s"]  # more ranks never help the relay
    # an engine takes the whole patch through its link(s): direct never beats that floor
    wide = route_times(1e9, 1.0, 256, 4, GB, 0.0)
    assert wide["direct_s"] == pytest.approx(1.0)
    assert route_times(1e9, 1.0, 256, 4, GB, 0.0, engine_nics=8)["direct_s"] == pytest.approx(1 / 8)
    assert route_times(1e9, 1.0, 4, 4, GB, 1e-3)["direct_s"] == pytest.approx(1.0 + 3e-3)  # three hops
    with pytest.raises(ValueError, match="ranks, engines"):
        route_times(1e9, 1.0, 0, 4, GB, 0.0)


def test_measured_patch_bytes_grow_with_the_density():
    low, high = (anyio.run(measure, 1 << 20, d) for d in (0.01, 0.04))
    assert low["changed"] == pytest.approx(0.01 * low["elements"], rel=0.01)
    assert 2.5 < high["patch_bytes"] / low["patch_bytes"] < 5  # about the changed count, not the size
    assert 0.5 < low["bytes_per_changed"] < 4


def test_the_scale_scenario_runs_from_the_simulate_table():
    report = simulate.simulate("scale", bandwidth=100e9 / 8)
    (row_1, row_8) = report["rows"]
    assert row_1["gbits"] == pytest.approx(100) and row_1["engine_nics"] == 1 and row_8["engine_nics"] == 8
    assert row_1["direct_s"] < row_1["relay_broadcast_s"] < row_1["relay_s"]
    assert row_1["patch_gb"] == pytest.approx(1e12 * report["measured"]["bytes_per_param"] / 1e9, rel=1e-3)
