"""``aiosync simulate``: structure and correctness of its report (speed is shown by the CLI,
never asserted here)."""

from __future__ import annotations

import json

import pytest

from aiosync.cli.main import main
from aiosync.cli.simulate import ToyPolicy, simulate

KEYS = {"scenario", "explorers", "steps", "requests", "delivered", "coalesced", "max_pending", "versions_applied",
        "final_version", "final_bit_exact", "torn_reads", "trainer_step_ratio", "loop_lag_p99_ms", "loop_lag_max_ms"}


def check_correct(report: dict, explorers: int) -> None:
    assert KEYS <= set(report)
    assert report["explorers"] == explorers and len(report["versions_applied"]) == explorers
    assert report["final_bit_exact"] is True
    assert report["torn_reads"] == 0 and report["rollouts"] > 0
    assert report["max_pending"] <= 1
    for versions in report["versions_applied"].values():
        assert all(a < b for a, b in zip(versions, versions[1:]))
        assert versions[-1] == report["final_version"] == report["steps"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_slow_scenario_coalesces_and_ends_bit_exact(loop):
    # The slow scenario's shape (transport 10x slower than a step, no-wait), scaled down in time.
    report = simulate("slow", 2, steps=30, loop=loop, step_time=0.01, explore_time=0.005, latency=0.1, jitter=0.002)
    check_correct(report, 2)
    assert report["scenario"] == "slow" and report["config"]["sync_weight_no_wait"] is True
    assert report["coalesced"] > 0
    assert report["delivered"] < report["requests"]
    assert report["failed"] == 0


@pytest.mark.parametrize("method,style,syncer", [
    ("memory", "fixed", "patch"),
    ("checkpoint", "explorer_driven", "patch"),
    ("nccl", "trainer_driven", "patch"),
    ("memory", "fixed", "bucket"),
])
def test_default_scenario_variants(method, style, syncer):
    report = simulate("default", 2, steps=6, method=method, style=style, syncer=syncer, step_time=0.002,
                      explore_time=0.001)
    check_correct(report, 2)
    assert report["config"]["method"] == method and report["syncer"] == syncer


def test_cli_writes_the_json_report(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["simulate", "--scenario", "default", "--explorers", "1", "--steps", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_correct(report, 1)
    printed = capsys.readouterr().out
    assert "final_bit_exact" in printed and "torn_reads" in printed


def test_unknown_scenario_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--scenario", "nonsense"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="unknown scenario"):
        simulate("nonsense")


def test_toy_policy_versions_are_recognisable():
    policy = ToyPolicy(seed=0, period=4)
    v3, v4 = policy.weights(3), policy.weights(4)
    changed = sum(int((v3[k] != v4[k]).sum()) for k in v3 if k != "stamp")
    total = sum(v3[k].numel() for k in v3 if k != "stamp")
    assert 0 < changed < total  # sparse updates, like RL
    assert policy.matches(v4, 4, {}) and not policy.matches(v4, 3, {})
    torn = {k: (v3[k] if k == "block.w1" else v4[k]) for k in v4}  # half old, half new
    assert not policy.matches(torn, 4, {}) and not policy.matches(torn, 3, {})


def test_admission_control_wastes_no_rollout_where_filtering_alone_drops_them():
    # The slow scenario's shape, scaled down in time: a link 10x slower than a train step.
    shape = dict(step_time=0.01, explore_time=0.005, latency=0.1, jitter=0.002)
    filtered = simulate("slow", 2, steps=20, **shape)
    admitted = simulate("slow", 2, steps=20, max_ahead=1, **shape)
    check_correct(admitted, 2)
    assert filtered["staleness"]["max_staleness_allowed"] == admitted["staleness"]["max_staleness_allowed"] == 2
    assert filtered["rollouts_wasted"] > 0  # old samples were made, then dropped
    assert admitted["rollouts_wasted"] == 0 and admitted["rollouts"] > 0
    assert admitted["max_staleness_used"] <= 2
    assert admitted["admission"]["trainer_waits"] > 0 and admitted["admission"]["trainer_timeouts"] == 0


CHAOS_KEYS = {"synchronizer_errors", "lost", "reattached", "late_calls", "late_call_errors", "hold_back_timeouts",
              "max_ahead_exceeded", "steps", "final_bit_exact"}


@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
def test_chaos_scenario_one_explorer_never_takes_the_run_down(method, tmp_path):
    """Issue 32's done-when, shortened: explorers that go silent past liveness_timeout, call in
    late, drop mid-request and come back, on links with latency; max_ahead 1, FIXED, interval 2."""
    out = tmp_path / "chaos.json"
    argv = ["simulate", "--scenario", "chaos", "--method", method, "--steps", "40", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert CHAOS_KEYS <= set(report)
    assert report["synchronizer_errors"] == 0, report["synchronizer_error_messages"]
    assert report["lost"] >= 1 and report["reattached"] >= 1 and report["late_calls"] >= 1
    assert set(report["late_call_errors"]) == {"ExplorerLostError"}
    assert sum(report["late_call_errors"].values()) == report["late_calls"]
    assert report["hold_back_timeouts"] == 0 and report["max_ahead_exceeded"] == 0
    assert report["torn_reads"] == 0 and report["unexpected_errors"] == []
    assert report["steps"] == 40 and report["final_bit_exact"] is True
    cfg = report["config"]
    assert (cfg["max_ahead"], cfg["style"], cfg["sync_interval"], cfg["method"]) == (1, "fixed", 2, method)
