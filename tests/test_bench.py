"""``aiosync bench`` (B7): a small run end to end, its JSON schema, and its checks.

Figures are not asserted against time (these machines are noisy); the run's own outputs are:
every mode bit-exact, the payload sizes in the right order, and the report well formed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from aiosync.cli import bench
from aiosync.cli.main import main

SMALL = ["--elements", "300000", "--d-model", "64", "--vocab", "512", "--rounds", "2"]
BUCKET = 256 << 10  # bytes: the small model (about 600 KB in bf16) streams in three buckets


def test_bench_cli_small_run_writes_the_issue_schema(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", *SMALL, "--bucket-size", str(BUCKET), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert isinstance(report["elements"], int) and report["elements"] > 250_000
    assert isinstance(report["changed"], int) and 0 < report["changed"] < report["elements"]
    assert report["density"] == pytest.approx(report["changed"] / report["elements"], rel=1e-3)
    assert 0.005 < report["density"] < 0.2  # the realistic update: a few percent of bf16 values move
    assert report["clone_s"] > 0 and report["clone_recycled_s"] > 0 and report["rounds"] == 2
    bw = report["read_bandwidth_gbs"]
    assert isinstance(bw, float) and 0.05 < bw < 10_000  # measured in this run, GB/s
    assert len(report["clone_rounds_s"]) == 5
    modes = {m["name"]: m for m in report["modes"]}
    assert list(modes) == ["patch-seed", "patch", "bucket"]
    for m in modes.values():
        for key, kind in (("bytes", int), ("bytes_per_changed", float), ("build_s", float), ("e2e_s", float),
                          ("e2e_1gbit_s", float), ("bit_exact", bool)):
            assert isinstance(m[key], kind), (m["name"], key)
        assert m["bit_exact"] is True, m["name"]
        assert m["e2e_s"] > 0 and m["e2e_1gbit_s"] > 0 and len(m["e2e_rounds_s"]) == 2
        assert m["bytes_per_changed"] == pytest.approx(m["bytes"] / report["changed"], rel=0.02)
        # bytes each stage must move: the fp32 weights plus one bf16 copy (a patch's snapshot, a
        # bucket's cast) for the build; the payload plus the bf16 model for the apply
        assert m["build_bytes"] == report["elements"] * (4 + 2)
        assert m["apply_bytes"] == m["bytes"] + report["elements"] * 2
        for stage in ("build", "apply"):
            frac = m[f"{stage}_bandwidth_fraction"]
            assert frac == pytest.approx(m[f"{stage}_bytes"] / m[f"{stage}_s"] / (bw * 1e9), rel=1e-6)
    # the seed's format: uint8 columns here (d_model 64 < 256), uint8 row deltas, bf16 values
    # = 4 bytes per change (7 with int32 columns at full size); the shipped config is several
    # times smaller; bucket sends every bf16 value
    assert modes["patch-seed"]["bytes_per_changed"] == pytest.approx(4.0, abs=0.2)
    assert modes["patch"]["bytes_per_changed"] < 1.5  # P1 (the ctx tables weigh on so small a model; 0.78 at full size)
    assert modes["bucket"]["bytes"] >= 2 * report["elements"]
    # the receiver's peak beyond its model: bucket mode with load_instant holds about one bucket
    # (and the changes planned), a patch receiver about its patch
    assert report["bucket_size"] == BUCKET
    for m in modes.values():
        assert isinstance(m["receiver_peak_extra_bytes"], int) and m["receiver_peak_extra_bytes"] > 0, m["name"]
        assert set(m["stages_s"]) == {"build_s", "encode_s", "send_s", "stage_s", "write_s"}
    assert modes["bucket"]["receiver_peak_extra_bytes"] <= 2 * BUCKET
    assert modes["patch"]["receiver_peak_extra_bytes"] < modes["bucket"]["receiver_peak_extra_bytes"]
    # whole-state verification's cost (issue 35): both digests measured, the default schedule's share
    v = report["verify"]
    assert v["default_every"] == 16 and v["reference_s"] > 0 and v["explorer_s"] > 0 and v["optimizer_step_s"] > 0
    assert v["default_overhead"] == pytest.approx((v["reference_s"] + v["explorer_s"]) / (16 * v["optimizer_step_s"]))
    assert v["reference_s_per_gb"] == pytest.approx(v["reference_s"] / (report["elements"] * 4 / 1e9), rel=0.05)
    printed = capsys.readouterr().out
    assert "patch-seed" in printed and "bucket" in printed and "bit-exact" in printed and "read bandwidth" in printed
    assert "whole-state verification" in printed


def test_bench_rejects_unknown_modes_and_bad_rounds(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *SMALL, "--modes", "patch,zip"])
    assert info.value.code == 2 and "unknown mode" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--elements", "1000", "--rounds", "0"])
    assert info.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_bit_exact_catches_one_flipped_bit():
    sender = {"w": torch.randn(50, 7), "b": torch.randn(7)}
    receiver = {k: v.to(torch.bfloat16) for k, v in sender.items()}
    assert bench.bit_exact(sender, receiver)
    receiver["w"].view(torch.int16)[13, 2] ^= 1
    assert not bench.bit_exact(sender, receiver)


def test_transformer_state_has_about_the_requested_size():
    sd = bench.transformer_state(2_000_000, 64, 512, seed=0)
    n = sum(t.numel() for t in sd.values())
    assert math.isclose(n, 2_000_000, rel_tol=0.1)
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert any(k.endswith("attn.q.weight") for k in sd) and "embed.weight" in sd


def test_bench_counts_changes_with_bucket_mode_alone(tmp_path):
    out = tmp_path / "bucket.json"
    assert main(["bench", *SMALL, "--modes", "bucket", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (bucket,) = report["modes"]
    assert report["changed"] > 0 and bucket["bit_exact"] is True
    assert math.isfinite(bucket["bytes_per_changed"]) and bucket["bytes_per_changed"] > 2 / report["density"] * 0.9


def test_read_bandwidth_is_a_positive_rate_of_the_buffer_read():
    bw = bench.measure_read_bandwidth(8 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 1e7  # bytes per second: any machine reads 8 MiB faster than 10 MB/s


def test_stage_bytes_count_weights_copies_and_payload():
    state = {"w": torch.zeros(10, 3), "b": torch.zeros(5)}
    build, apply = bench.stage_bytes("patch", state, torch.bfloat16, payload=123.4)
    assert build == 35 * 4 + 35 * 2 and apply == 123 + 35 * 2
