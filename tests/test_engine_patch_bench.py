"""``examples/engine_patch_bench.py`` at a tiny size (issue 27): it runs as documented, reports the
keys the issue asks for on both paths, and both leave every engine parameter bit-exact (what the
model's own loader makes of the trainer's weights). Timings are the bench's to report, not
asserted here. A subprocess: the bench starts its own in-process vLLM engine (and its
torch.distributed group), which must not meet this process's engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

PATH_KEYS = {"pause_s_mean", "bytes_to_engine", "patch_bytes", "extra_rss_bytes", "bit_exact", "held_bytes", "path",
             "reinits", "failed"}


def test_engine_patch_bench_reports_both_paths_bit_exact(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(root / "examples" / "engine_patch_bench.py"), "--hidden", "64", "--layers", "1",
           "--vocab", "512", "--steps", "1", "--shards", "2", "--json", str(out)]
    env = os.environ | {"PYTHONPATH": str(root), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"params", "model_bytes", "density", "inplace", "shadow"} <= set(report)
    assert report["model_bytes"] == 4 * report["params"] > 0
    for name in ("inplace", "shadow"):
        result = report[name]
        assert PATH_KEYS <= set(result), (name, sorted(result))
        assert result["path"] == name
        assert result["bit_exact"] is True, name
        assert result["reinits"] == 0 and result["failed"] == 0, (name, result)  # no write needed a repair
        assert result["patch_bytes"] > 0 and result["pause_s_mean"] > 0
    # In place the engine is handed the patch itself; the shadow hands it whole changed layers.
    assert report["inplace"]["bytes_to_engine"] == report["inplace"]["patch_bytes"]
    assert report["shadow"]["bytes_to_engine"] > report["shadow"]["patch_bytes"]
    assert report["inplace"]["held_bytes"] < report["shadow"]["held_bytes"]
    # a two-rank sharded trainer, in place: both ranks' parts go into the engine as they came
    sharded = report["sharded"]
    assert sharded["bit_exact"] is True and sharded["path"] == "inplace" and sharded["writes"] == 1
    assert len(sharded["rank_patch_bytes"]) == 2 and all(b > 0 for b in sharded["rank_patch_bytes"])
    assert sharded["patch_bytes"] <= sharded["bytes_to_engine"] <= 1.05 * sharded["patch_bytes"] + 512
