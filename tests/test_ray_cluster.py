"""A Ray cluster that loses a node (issue 30): ``examples/ray_cluster_sync.py`` on a 3-node
``ray.cluster_utils.Cluster`` — a sharded trainer (two rank actors) and explorer actors spread
over two nodes; the node of the first explorer is removed mid-run. One cluster, started and shut
down by the example itself."""

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
    assert result["final_version"] == 8 and result["bit_exact"] and result["node_removed"]
    victims = result["on_removed_node"]
    assert victims and sorted(result["lost"]) == sorted(victims)  # declared lost: exactly those on the node
    assert result["explorers_restarted"] == result["rejoined"] == len(victims)
    assert set(result["final_nodes"].values()) == {n[:8] for n in result["surviving_nodes"]}  # restarted elsewhere
    assert result["trainer_max_wait_s"] <= result["sync_timeout"]  # the bound the trainer waits under
    assert result["routes"] == "direct" and result["relayed_bytes"] == 0  # rank 1's parts went straight out
    assert result["rank_sent_bytes"][1] > 0
