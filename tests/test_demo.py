"""``aiosync demo`` (asynchronous PPO on CartPole-v1) on short runs, and the HuggingFace example.

No timed assertions: the runs are short by step count; ``--max-seconds`` is only a safety net.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

pytest.importorskip("gymnasium")

from aiosync.cli.demo import JSON_KEYS, DemoConfig, demo  # noqa: E402
from aiosync.cli.main import main as cli_main  # noqa: E402
from aiosync.runners.ppo import ActorCritic, compute_gae  # noqa: E402
from helpers import load_example  # noqa: E402


INT_KEYS = {"steps", "syncs", "coalesced", "max_staleness", "bytes_synced"}
FLOAT_KEYS = {"final_mean_return", "mean_staleness", "seconds"}


@pytest.fixture
def torch_threads():
    """The demo and the example set torch's thread count; put it back for the other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_demo_cli_json_and_plot(tmp_path, torch_threads):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = cli_main(["demo", "--steps", "12", "--seed", "1", "--max-seconds", "120", "--quiet",
                   "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())

    assert set(JSON_KEYS) == INT_KEYS | FLOAT_KEYS
    for key in INT_KEYS:
        assert type(report[key]) is int, (key, report[key])
    for key in FLOAT_KEYS:
        assert type(report[key]) is float and math.isfinite(report[key]), (key, report[key])

    assert report["steps"] == 12
    assert report["final_mean_return"] > 0
    assert report["seconds"] > 0
    # Two explorers; every train step publishes a version that is pushed to both, and a
    # delivery is either applied or merged into a newer one (coalesced).
    assert report["syncs"] >= 2
    assert report["syncs"] + report["coalesced"] >= 2 * report["steps"]
    assert report["bytes_synced"] > 0
    assert 0 <= report["mean_staleness"] <= report["max_staleness"] <= report["max_staleness_allowed"] == 2
    # Drained: both explorers end on the trainer's last version.
    assert report["explorer_versions"] == {"explorer0": report["final_version"],
                                           "explorer1": report["final_version"]}
    assert report["final_version"] == report["steps"]
    # Each explorer ran with non-decreasing policy versions, ending on a recent one.
    for name, versions in report["lease_versions"].items():
        assert versions, name
        assert versions == sorted(versions), name
        assert 0 <= versions[-1] <= report["final_version"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_staleness_filter_bounds_used_rollouts(torch_threads):
    """With max_staleness=1 (below the pipeline's natural lag of about 2), stale rollouts
    must be dropped: every rollout trained on is checked here from the raw versions."""
    cfg = DemoConfig(steps=15, seed=2, max_staleness=1, max_seconds=120, loop="uvloop")
    report = demo(cfg)
    assert report["steps"] == 15
    used = 0
    for row in report["history"]:
        for explorer, version in row["used"]:
            assert 0 <= row["trainer_version"] - version <= 1, row
            # stamped with a version the explorer really leased (its applied version)
            assert version in report["lease_versions"][explorer]
            used += 1
    assert used == report["rollouts_used"] > 0
    assert report["max_staleness"] <= 1
    for versions in report["lease_versions"].values():
        assert versions == sorted(versions)
    assert set(report["explorer_versions"].values()) == {report["final_version"]}


def test_gae_truncation_bootstraps_and_termination_does_not():
    rewards = torch.ones(3, 2)
    values = torch.zeros(3, 2)
    next_values = torch.full((3, 2), 10.0)
    terminated = torch.tensor([[False, False], [True, False], [False, False]])
    truncated = torch.tensor([[False, False], [False, True], [False, False]])
    adv, ret = compute_gae(rewards, values, next_values, terminated, truncated, gamma=0.5, lam=1.0)
    # delta_t = r + gamma * V(reached) * (1 - terminated) - V(s); the sum stops at any episode end.
    # env 0 terminates at t=1: no bootstrap there; t=2 starts a new episode.
    # env 1 is truncated at t=1: bootstrapped from the reached observation's value.
    expected = torch.tensor([[6.0 + 0.5 * 1.0, 6.0 + 0.5 * 6.0],
                             [1.0, 6.0],
                             [6.0, 6.0]])
    assert torch.equal(adv, expected)
    assert torch.equal(ret, adv + values)


def test_actor_critic_act_matches_evaluate():
    torch.manual_seed(0)
    net = ActorCritic(4, 2)
    obs = torch.randn(16, 4)
    actions, logp = net.act(obs, torch.Generator().manual_seed(0))
    logp2, entropy, value = net.evaluate(obs, actions)
    assert torch.allclose(logp, logp2)
    assert value.shape == (16,) and entropy.shape == (16,)


def test_async_ppo_example_runs(torch_threads, capsys):
    example = load_example("async_ppo")
    mean_return = asyncio.run(example.main(6, 0))
    assert isinstance(mean_return, float)
    assert "final mean return" in capsys.readouterr().out


def test_hf_patch_sync_example_bit_exact_and_bytes(torch_threads):
    pytest.importorskip("transformers")
    example = load_example("hf_patch_sync")
    report = example.main(["--steps", "3", "--vocab", "128", "--hidden", "32", "--layers", "1", "--batch", "2",
                           "--quiet"])
    assert report["bit_exact"] is True
    assert report["final_version"] == report["explorer_version"] == 3
    assert [r["version"] for r in report["syncs"]] == [1, 2, 3]
    assert [r["explorer_version"] for r in report["syncs"]] == [1, 2, 3]
    full = report["full_bf16_bytes"]
    assert full == 2 * report["params"]
    for row in report["syncs"]:
        # real AdamW steps change a few percent of the bf16 values; the patch is far smaller
        # than the model, and costs at most a few bytes per changed value
        assert 0 < row["changed"] < report["params"]
        assert 0 < row["bytes"] < full / 4
        assert row["bytes"] <= 4 * row["changed"]
    assert sum(r["bytes"] for r in report["syncs"]) <= report["bytes_sent_total"]
