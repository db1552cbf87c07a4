"""P7 on a GPU: the patch builder's achieved fraction of memory bandwidth.

Run where a CUDA device is available (it exits with a message otherwise; CI does not run it)::

    python examples/gpu_builder_bench.py [--gib 2] [--tensors 400] [--changed 0.01] [--repeat 5]

A model of ``--tensors`` fp32 tensors (``--gib`` GiB in all, a few large and many small, as a
transformer has) is snapshotted in bf16 on the GPU; each round changes a fraction
``--changed`` of the elements and times one build (``Snapshot.diff``, results left on the
GPU) with CUDA events, for each backend: ``fused`` (the Triton kernels, where ``triton``
imports) and ``torch`` (packed torch ops). Printed as one JSON object::

    {"device": ..., "elements": ..., "tensors": ..., "changed_fraction": ...,
     "copy_gbs": <device-to-device copy, read + write, GB/s>,
     "fused": {"seconds": ..., "gbs": ..., "fraction_of_copy": ..., "min_bytes_per_element": 6},
     "torch": {...}}

``gbs`` counts the bytes a build must move at least (4 read from the source + 2 from the
snapshot per element): P7 asks ``fraction_of_copy`` (against the measured copy bandwidth, a
practical peak) to be ≥ 0.5.
"""

from __future__ import annotations

import argparse
import json

import torch

from aiosync.syncers.snapshot import cuda as snapshot_cuda
from aiosync.syncers.snapshot.builder import Snapshot


def copy_bandwidth(nbytes: int) -> float:
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 5 * 2 * a.numel() * 4 / (start.elapsed_time(end) / 1e3) / 1e9


def make_model(total: int, count: int) -> list[torch.Tensor]:
    large = max(1, count // 50)
    small_elems = total // 10
    sizes = [small_elems // (count - large)] * (count - large) + [(total - small_elems) // large] * large
    return [torch.randn(n, device="cuda") for n in sizes]


def bench(backend: str, tensors: list[torch.Tensor], changed: float, repeat: int) -> dict:
    snapshot_cuda.BACKEND = backend
    try:
        snap = Snapshot("cuda")
        snap.load(tensors, [torch.bfloat16] * len(tensors))
        g = torch.Generator(device="cuda").manual_seed(0)
        times = []
        for r in range(repeat + 1):
            for t in tensors:
                t.add_(torch.where(torch.rand(t.shape, device="cuda", generator=g) < changed, 1.0, 0.0))
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            snap.diff(tensors, "cuda")
            end.record()
            end.synchronize()
            if r:  # the first round compiles and warms up
                times.append(start.elapsed_time(end) / 1e3)
        snap.close()
    finally:
        snapshot_cuda.BACKEND = "auto"
    elems = sum(t.numel() for t in tensors)
    best = min(times)
    return {"seconds": round(best, 5), "gbs": round(6 * elems / best / 1e9, 1), "min_bytes_per_element": 6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_builder_bench needs a CUDA device (P7 is measured on a GPU)")
    total = int(args.gib * 2**30 / 4)
    tensors = make_model(total, args.tensors)
    report = {"device": torch.cuda.get_device_name(), "elements": sum(t.numel() for t in tensors),
              "tensors": len(tensors), "changed_fraction": args.changed,
              "copy_gbs": round(copy_bandwidth(min(total * 4, 2**31)), 1)}
    backends = ["torch"]
    if snapshot_cuda.fused_ok(tensors[0].device):
        backends.insert(0, "fused")
    for backend in backends:
        report[backend] = bench(backend, tensors, args.changed, args.repeat)
        report[backend]["fraction_of_copy"] = round(report[backend]["gbs"] / report["copy_gbs"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
