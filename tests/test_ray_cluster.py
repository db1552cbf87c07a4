"""A Ray cluster that loses a node (issue 30): ``examples/ray_cluster_sync.py`` on a
``ray.cluster_utils.Cluster`` — an FSDP2 trainer whose two ranks are Ray actors in one gloo
process group (real AdamW steps), explorer actors on other nodes fetching each rank's shards
from that rank. Each run of the example starts and shuts down its own cluster: the node of the
first explorer is removed mid-run; then a trainer rank is killed mid-run."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from helpers import load_example  # noqa: E402


def test_explorers_on_a_removed_node_are_lost_restarted_elsewhere_and_rejoin(tmp_path):
    example = load_example("ray_cluster_sync")
    out = tmp_path / "out.json"
    code = example.main(["--nodes", "3", "--ranks", "2", "--explorers", "2", "--steps", "8", "--remove-node-at",
                         "3", "--step-pause", "0.1", "--timeout", "60", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["fsdp2"] and result["final_version"] == 8  # the ranks' FSDP2 model, trained with AdamW
    assert result["bit_exact"] and result["node_removed"]  # every explorer holds the gathered model exactly
    victims = result["on_removed_node"]
    assert victims and sorted(result["lost"]) == sorted(victims)  # declared lost: exactly those on the node
    assert result["explorers_restarted"] == result["rejoined"] == len(victims)
    assert set(result["final_nodes"].values()) == {n[:8] for n in result["surviving_nodes"]}  # restarted elsewhere
    assert result["trainer_max_wait_s"] <= result["sync_timeout"]  # the bound the trainer waits under
    assert result["routes"] == "direct" and result["relayed_bytes"] == 0  # rank 1's shards went straight out
    assert result["rank_sent_bytes"][1] > 0


def test_a_lost_trainer_rank_ends_the_run_with_an_error_naming_it(tmp_path):
    """A sharded trainer cannot go on without a rank: killed mid-run, rank 0 ends its run with
    TrainerRankLostError naming it (Ray's signal, not a timeout; before: a bare error of gloo or
    of a channel, naming no rank)."""
    example = load_example("ray_cluster_sync")
    out = tmp_path / "out.json"
    code = example.main(["--nodes", "2", "--ranks", "2", "--explorers", "1", "--steps", "6", "--kill-rank-at", "2",
                         "--step-pause", "0.1", "--timeout", "60", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 3, result
    assert result["trainer_rank_lost"] == 1, result
    assert result["error"].startswith("TrainerRankLostError: trainer rank 1 is gone"), result
    assert result["rank_lost_end_s"] < 60  # ended before any of its bounds (--timeout) ran out: no hang
