"""``aiosync bench`` (B7): patch and bucket sync compared on a realistic update, in one run.

The model is transformer-shaped (embedding, attention and MLP matrices, norms) with fp32
master weights on the sender and a bf16 copy on the receiver. The update is real AdamW
(betas (0.9, 0.95), an RL learning rate) on random gradients, after a few warm-up steps so
Adam's moments are past their first-step regime. Every mode syncs the same update.

Measured per mode, all in this run: payload bytes, changed elements, bytes per changed
element, patch build time, apply time (staging and writing) and write time (the part that
holds the receiver's model exclusively, F3), end-to-end time (build, encode, transfer, decode,
apply) over the in-process channel and over a simulated 1 Gbit/s link, and whether the
receiver ended bit-exact, and the most bytes the receiver held beyond its model while staging
and writing (``receiver_peak_extra_bytes``: the payloads it still referenced, the planned
changes, the undo records; bucket mode streams a bucket at a time, ``--bucket-size``). One ``clone()`` of the synced tensors into fresh memory (median of five; see
:func:`measure_clone`) is the yardstick for the time ratios. In-process times are the median of ``--rounds`` syncs (one
optimizer step before each), after one untimed warm-up sync per mode.

The machine's read bandwidth is measured in the same run (:func:`measure_read_bandwidth`), and
each mode reports the bytes its build and its apply must move at least (:func:`stage_bytes`)
and the fraction of that bandwidth they achieved: a clone's time swings with the allocator,
memory bandwidth does not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import statistics
import time
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..configs import load_config
from ..messages import payload_nbytes
from ..syncers import WeightSyncer
from ..syncers.kernels.warmup import warm_up
from ..syncers.common.bits import as_bits
from ..transports.inproc import inproc_pair
from .args import integer, number, output_path

GBIT_BYTES_PER_S = 1e9 / 8


def transformer_state(n_elements: int, d_model: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """An fp32 state dict shaped like a decoder-only transformer with about ``n_elements`` values."""
    g = torch.Generator().manual_seed(seed)
    per_layer = 4 * d_model * d_model + 2 * 4 * d_model * d_model + 4 * d_model + 4 * d_model
    n_layers = max(1, round((n_elements - vocab * d_model) / per_layer))
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(vocab, d_model, generator=g) * 0.02}
    for i in range(n_layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"attn.{name}.weight"] = torch.randn(d_model, d_model, generator=g) * 0.02
        sd[p + "mlp.up.weight"] = torch.randn(4 * d_model, d_model, generator=g) * 0.02
        sd[p + "mlp.up.bias"] = torch.zeros(4 * d_model)
        sd[p + "mlp.down.weight"] = torch.randn(d_model, 4 * d_model, generator=g) * 0.02
        for ln in ("ln1", "ln2"):
            sd[p + f"{ln}.weight"] = torch.ones(d_model)
            sd[p + f"{ln}.bias"] = torch.zeros(d_model)
        sd[p + "mlp.down.bias"] = torch.zeros(d_model)
    sd["final_ln.weight"] = torch.ones(d_model)
    return sd


class Trainer:
    """fp32 master weights updated by AdamW on random gradients (the realistic update of SPEC §6)."""

    def __init__(self, state: dict[str, torch.Tensor], lr: float, seed: int) -> None:
        self.params = {k: torch.nn.Parameter(v) for k, v in state.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.opt.step()
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.params.items()}


def measure_clone(tensors: list[torch.Tensor], clones: int = 5) -> tuple[float, list[float], float]:
    """Time ``clone()`` of ``tensors``: the yardstick of the time ratios.

    Returns the median of ``clones`` clones into fresh memory (each kept alive, so none
    reuses pages another freed: page faults and zeroing included, as when a snapshot is
    first taken), their times, and the median of three clones into recycled memory (each
    freed before the next: the allocator hands pages back; reported for reference).

    In a VM the first touch of a page the hypervisor has not backed yet costs several times a
    normal page fault, and grows with how much never-touched memory a run uses; so that the
    figure is what a clone costs on bare metal, as much memory as the clones will take is
    touched and freed first.
    """
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    gc.collect()
    scratch = torch.empty(clones * nbytes + (64 << 20), dtype=torch.uint8)
    scratch.fill_(1)
    del scratch
    times, kept = [], []
    for _ in range(clones):
        t0 = time.perf_counter()
        kept.append([t.clone() for t in tensors])
        times.append(time.perf_counter() - t0)
    del kept
    gc.collect()
    recycled = []
    for _ in range(3):
        t0 = time.perf_counter()
        copy = [t.clone() for t in tensors]
        recycled.append(time.perf_counter() - t0)
        del copy
    return statistics.median(times), times, statistics.median(recycled)


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's read bandwidth in bytes/s: the best of ``repeats`` ``torch.sum`` reductions
    (on torch's thread pool) over a buffer of ``nbytes``, far larger than any cache."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def measure_verify(trainer: "Trainer", receiver_dtype: torch.dtype, repeats: int = 3) -> dict[str, Any]:
    """Whole-state verification's cost on this model (issue 35), medians of ``repeats``: the
    trainer-side reference (the fp32 weights digested as the bf16 explorer holds them), the
    explorer's digest of its bf16 copy, and one AdamW step alone (gradients in place, not timed:
    a lower bound of a real train step, which adds the forward and backward passes); the
    overhead of ``synchronizer.verify_state``'s default schedule is both digests over that many
    such steps."""
    from ..coordination.config import SynchronizerConfig
    from ..syncers.common.integrity import state_digests

    state = trainer.state_dict()
    held = {k: v.to(receiver_dtype) for k, v in state.items()}
    dtypes = {k: receiver_dtype for k in state}

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    reference_s = timed(lambda: state_digests(state, dtypes=dtypes))
    explorer_s = timed(lambda: state_digests(held))
    for p in trainer.params.values():
        p.grad = torch.randn(p.shape, generator=trainer.gen)
    step_s = timed(trainer.opt.step)
    for p in trainer.params.values():
        p.grad = None
    every = SynchronizerConfig().verify_state
    fp32_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    held_gb = sum(t.numel() * t.element_size() for t in held.values()) / 1e9
    return {"reference_s": reference_s, "explorer_s": explorer_s, "optimizer_step_s": step_s,
            "reference_s_per_gb": reference_s / fp32_gb, "explorer_s_per_gb": explorer_s / held_gb,
            "default_every": every, "default_overhead": (reference_s + explorer_s) / (every * step_s)}


def stage_bytes(mode: str, state: dict[str, torch.Tensor], receiver_dtype: torch.dtype, payload: float) -> tuple[int, int]:
    """The bytes a mode's build and apply must move at least, for one sync.

    Build: every mode reads the sender's weights once; a patch build also reads its snapshot (in
    the receiver's dtype), a bucket build writes the cast bucket. Apply: the payload is read,
    and the receiver's model is read once (a ``ctx`` patch classifies every old value, a bucket
    is compared with every value, and the writes of a patch at these densities touch nearly
    every cache line of it).
    """
    src = sum(t.numel() * t.element_size() for t in state.values())
    model = sum(t.numel() for t in state.values()) * receiver_dtype.itemsize
    return src + model, int(round(payload)) + model


class SimulatedLink:
    """A point-to-point channel that delays each payload by its size over ``bandwidth`` bytes/s."""

    def __init__(self, bandwidth: float | None) -> None:
        self.a, self.b = inproc_pair(timeout=600)
        self.bandwidth = bandwidth

    async def send(self, payload: Any) -> None:
        if self.bandwidth:
            await anyio.sleep(payload_nbytes(payload) / self.bandwidth)
        await self.a.send(payload)


MODES = {
    "patch-seed": {"type": "patch", "patch": {"encoding": "coo", "delta_encoding": True, "compression": "none",
                                              "init_sync": {"enabled": True}}},
    "patch": "weight_syncer/patch_syncer",
    "bucket": "weight_syncer/bucket_syncer",
    # the two compact encodings side by side, whichever the shipped config is
    "patch-flat": {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}},
    "patch-ctx": {"type": "patch", "patch": {"encoding": "ctx", "compression": "none", "init_sync": {"enabled": True}}},
}


#: Bucket size of the bench's bucket mode: a fraction of the model, so that buckets stream.
BENCH_BUCKET_SIZE = 64 << 20


def mode_config(name: str, bucket_size: int = BENCH_BUCKET_SIZE) -> dict[str, Any]:
    cfg = MODES[name]
    if isinstance(cfg, str):
        cfg = load_config(cfg)
    cfg = json.loads(json.dumps(cfg))
    if cfg["type"] == "bucket":
        cfg["bucket"]["bucket_dtype"] = "bfloat16"  # the receiver is bf16: send what it holds
        cfg["bucket"]["bucket_size"] = bucket_size
    return cfg


def count_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    """Elements whose bits differ between two states of the receiver."""
    return sum(int((as_bits(before[k]) != as_bits(after[k])).sum()) for k in after)


def bit_exact(sender: dict[str, torch.Tensor], receiver: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(as_bits(sender[k].to(receiver[k].dtype)), as_bits(receiver[k])) for k in sender)


async def _one_sync(syncer_s: WeightSyncer, syncer_r: WeightSyncer, state, receiver, link: SimulatedLink,
                    version: int) -> tuple[float, int, dict]:
    t0 = time.perf_counter()
    await asyncio.gather(syncer_s.sync(state, link.send, version), syncer_r.apply(receiver, link.b.recv))
    sent, applied = syncer_s.statistics(), syncer_r.statistics()
    stats = {k: v or 0.0 for k, v in dataclasses.asdict(sent).items() if k.endswith("_s")}
    stats["apply_s"] = applied.apply_s or 0.0
    stats["write_s"] = applied.write_s or 0.0  # the receiver's exclusive section (F3)
    stats["stage_s"] = applied.stage_s or 0.0
    stats["peak_bytes"] = applied.peak_bytes or 0
    return time.perf_counter() - t0, sent.bytes, stats


async def run_bench(n_elements: int, d_model: int, vocab: int, lr: float, warmup: int, seed: int,
                    modes: list[str], progress, rounds: int = 3, bucket_size: int = BENCH_BUCKET_SIZE) -> dict[str, Any]:
    """Measure every mode on the same updates; see the module docstring.

    In-process figures are the median of ``rounds`` syncs, each after one optimizer step and
    after one untimed warm-up sync per mode (thread pools, scratch buffers and codec
    contexts are set up on first use; a training run pays that once, not per sync). The
    1 Gbit/s figure is one more sync per mode. Payload sizes and changed elements are summed
    over the timed in-process rounds.
    """
    task = progress.add_task("building model and warm-up steps", total=warmup + 1)
    trainer = await run_sync(lambda: Trainer(transformer_state(n_elements, d_model, vocab, seed), lr, seed))
    progress.advance(task)
    for _ in range(warmup):
        await run_sync(trainer.step)
        progress.advance(task)
    state = trainer.state_dict()
    elements = sum(t.numel() for t in state.values())

    clone_s, clone_times, recycled_s = await run_sync(measure_clone, list(state.values()))
    read_bw = await run_sync(measure_read_bandwidth, max(256 << 20, min(1 << 30, 2 * elements * 4)))

    await run_sync(warm_up)
    verify = await run_sync(measure_verify, trainer, torch.bfloat16)
    state = trainer.state_dict()
    pairs = {}
    task = progress.add_task("init sync (bootstrap) per mode", total=len(modes))
    for name in modes:
        cfg = mode_config(name, bucket_size)
        s, r = WeightSyncer.create(cfg), WeightSyncer.create(cfg)
        receiver = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in state.items()}
        link = SimulatedLink(None)
        await asyncio.gather(s.init_sender(state, list(state), link.a.send, link.a.recv),
                             r.init_receiver(receiver, link.b.recv, link.b.send))
        if cfg["type"] == "bucket":
            await asyncio.gather(s.sync(state, link.send, 1), r.apply(receiver, link.b.recv))
        pairs[name] = (s, r, receiver)
        progress.advance(task)

    samples: dict[str, dict[str, list]] = {name: {} for name in modes}
    exact = {name: True for name in modes}
    changed_total = 0
    version = 1
    plan = [("warm-up", None)] + [("e2e_s", None)] * rounds + [("e2e_1gbit_s", GBIT_BYTES_PER_S)]
    task = progress.add_task(f"optimizer step, then one sync per mode ({rounds} timed rounds + warm-up + 1 Gbit/s)",
                             total=len(plan) * len(modes))
    for phase, bandwidth in plan:
        await run_sync(trainer.step)
        version += 1
        counted = False
        for name in modes:
            s, r, receiver = pairs[name]
            before = None
            if phase == "e2e_s" and not counted:  # changed elements, seen at the first mode's receiver
                before = await run_sync(lambda rx=receiver: {k: v.clone() for k, v in rx.items()})
            e2e, nbytes, stats = await _one_sync(s, r, state, receiver, SimulatedLink(bandwidth), version)
            exact[name] = exact[name] and await run_sync(bit_exact, state, receiver)
            row = samples[name]
            if phase == "e2e_s":
                for key, value in (("e2e_s", e2e), ("bytes", nbytes), ("build_s", stats["build_s"]),
                                   ("encode_s", stats["encode_s"]), ("apply_s", stats["apply_s"]),
                                   ("write_s", stats["write_s"])):
                    row.setdefault(key, []).append(value)
                for key in ("send_s", "stage_s", "peak_bytes"):
                    row.setdefault(key, []).append(stats.get(key) or 0)
                if before is not None:
                    changed_total += await run_sync(count_changed, before, receiver)
                    counted = True
                    del before
            elif phase == "e2e_1gbit_s":
                row["e2e_1gbit_s"] = [e2e]
            progress.advance(task)
    changed = changed_total / rounds if rounds else 0
    result_modes = []
    for name in modes:
        row = samples[name]
        total_bytes = sum(row["bytes"])
        times = {k: statistics.median(row[k]) for k in ("build_s", "encode_s", "apply_s", "write_s", "e2e_s",
                                                         "e2e_1gbit_s")}
        build_bytes, apply_bytes = stage_bytes(name, state, torch.bfloat16, total_bytes / rounds)
        result_modes.append({
            "name": name,
            "bytes": round(total_bytes / rounds),
            "bytes_per_changed": total_bytes / changed_total if changed_total else math.inf,
            **times,
            "build_bytes": build_bytes, "apply_bytes": apply_bytes,
            "build_bandwidth_fraction": build_bytes / times["build_s"] / read_bw if times["build_s"] else 0.0,
            "apply_bandwidth_fraction": apply_bytes / times["apply_s"] / read_bw if times["apply_s"] else 0.0,
            "bit_exact": exact[name],
            "e2e_rounds_s": row["e2e_s"], "build_rounds_s": row["build_s"],
            "receiver_peak_extra_bytes": max(row["peak_bytes"]),
            "stages_s": {k: statistics.median(row[k]) for k in ("build_s", "encode_s", "send_s", "stage_s", "write_s")},
        })
    return {
        "elements": elements, "changed": round(changed), "density": changed / elements, "clone_s": clone_s,
        "clone_rounds_s": clone_times, "clone_recycled_s": recycled_s, "read_bandwidth_gbs": read_bw / 1e9,
        "rounds": rounds, "modes": result_modes, "bucket_size": bucket_size, "verify": verify,
        "encoding_break_even": encoding_break_even(result_modes, changed),
    }


def encoding_break_even(modes: list[dict[str, Any]], changed: float) -> dict[str, Any]:
    """The link bandwidth below which ``ctx`` delivers a version sooner than ``flat`` (``encoding:
    auto``'s choice, :mod:`aiosync.coordination.encodings`): as measured here, from the
    ``patch-flat`` and ``patch-ctx`` rows (bytes and build + encode + apply seconds per changed
    element), and the defaults a link starts from before it measures its own."""
    from ..coordination.encodings import DEFAULT_COSTS, Cost, break_even_bps

    out: dict[str, Any] = {"default_bps": break_even_bps(DEFAULT_COSTS)}
    by = {m["name"]: m for m in modes}
    if "patch-flat" in by and "patch-ctx" in by and changed:
        costs = {enc: Cost(by[f"patch-{enc}"]["bytes_per_changed"],
                           (by[f"patch-{enc}"]["build_s"] + by[f"patch-{enc}"]["encode_s"]) / changed,
                           by[f"patch-{enc}"]["apply_s"] / changed) for enc in ("flat", "ctx")}
        out["measured_bps"] = break_even_bps(costs)
        out["measured_costs"] = {enc: dataclasses.asdict(c) for enc, c in costs.items()}
    return out


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    clone = report["clone_s"]
    table = Table(title=(f"aiosync bench: {report['elements'] / 1e6:.1f} M synced elements, "
                         f"{report['changed'] / 1e6:.2f} M changed ({100 * report['density']:.2f} %), "
                         f"clone {clone * 1e3:.1f} ms (into recycled memory {report['clone_recycled_s'] * 1e3:.1f} ms), "
                         f"read bandwidth {report['read_bandwidth_gbs']:.1f} GB/s; times: median of {report['rounds']} syncs"))
    for col in ("mode", "bytes", "B/changed", "build ms", "build/clone", "build bw", "encode ms", "apply ms", "apply bw",
                "write ms", "e2e ms", "e2e/clone", "e2e 1Gbit ms", "bit-exact"):
        table.add_column(col, justify="right")
    for m in report["modes"]:
        table.add_row(m["name"], f"{m['bytes']:,}", f"{m['bytes_per_changed']:.3f}", f"{m['build_s'] * 1e3:.1f}",
                      f"{m['build_s'] / clone:.2f}", f"{m['build_bandwidth_fraction']:.2f}", f"{m['encode_s'] * 1e3:.1f}",
                      f"{m['apply_s'] * 1e3:.1f}", f"{m['apply_bandwidth_fraction']:.2f}", f"{m['write_s'] * 1e3:.1f}",
                      f"{m['e2e_s'] * 1e3:.1f}", f"{m['e2e_s'] / clone:.2f}",
                      f"{m['e2e_1gbit_s'] * 1e3:.1f}", "yes" if m["bit_exact"] else "NO")
    console = Console(width=max(Console().width, 190))
    console.print(table)
    by = {m["name"]: m for m in report["modes"]}
    console.print("receiver's peak bytes beyond its model: " + ", ".join(
        f"{m['name']} {m['receiver_peak_extra_bytes'] / 2**20:.1f} MiB" for m in report["modes"])
        + f" (bucket_size {report['bucket_size'] / 2**20:.0f} MiB)")
    if "patch" in by and "bucket" in by:
        ratio = by["bucket"]["e2e_1gbit_s"] / by["patch"]["e2e_1gbit_s"]
        console.print(f"over 1 Gbit/s, patch is {ratio:.1f}x faster than bucket end to end; in-process, patch takes "
                      f"{by['patch']['e2e_s'] / by['bucket']['e2e_s']:.2f}x bucket's time")
    v = report["verify"]
    console.print(f"whole-state verification: reference {v['reference_s'] * 1e3:.1f} ms "
                  f"({v['reference_s_per_gb']:.3f} s per GB of fp32 weights, cast to bf16), explorer "
                  f"{v['explorer_s'] * 1e3:.1f} ms ({v['explorer_s_per_gb']:.3f} s per GB of bf16); every "
                  f"{v['default_every']} versions (the default) that is {100 * v['default_overhead']:.2f} % of an "
                  f"AdamW step alone ({v['optimizer_step_s'] * 1e3:.0f} ms)")
    console.print("build bw / apply bw: the fraction of the measured read bandwidth the stage achieved on the bytes "
                  "it must move (build_bytes, apply_bytes in the JSON)")
    even = report.get("encoding_break_even") or {}
    if "measured_bps" in even:
        console.print(f"encoding: auto takes ctx on links below {even['measured_bps'] / 1e6:.0f} Mbit/s as measured "
                      f"here (flat above; a link starts from {even['default_bps'] / 1e6:.0f} Mbit/s until it measures)")


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or text!r}; valid: {', '.join(MODES)}")
    return modes


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="compare patch and bucket sync on a realistic update", description=__doc__)
    p.add_argument("--elements", type=number(1), default=100e6, help="synced elements (default 100e6)")
    p.add_argument("--d-model", type=integer(8), default=1024)
    p.add_argument("--vocab", type=integer(1), default=32000)
    p.add_argument("--lr", type=number(0, above=True), default=2e-6, help="AdamW learning rate (RL range 1e-6 to 3e-6)")
    p.add_argument("--warmup", type=integer(0), default=3, help="optimizer steps before the first sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", type=_modes, default="patch-seed,patch,bucket", help="comma-separated subset of patch-seed,patch,bucket,patch-flat,patch-ctx")
    p.add_argument("--rounds", type=integer(1), default=3, help="timed in-process syncs per mode; medians are reported")
    p.add_argument("--quick", action="store_true", help="a small run (about 4 M elements)")
    p.add_argument("--bucket-size", type=integer(1), default=BENCH_BUCKET_SIZE,
                   help=f"bucket mode's bucket_size in bytes (default {BENCH_BUCKET_SIZE})")
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    modes = args.modes
    n, d_model, vocab = int(args.elements), args.d_model, args.vocab
    if args.quick:
        n, d_model, vocab = 4_000_000, 256, 4096
    with Progress(transient=True) as progress:
        report = asyncio.run(run_bench(n, d_model, vocab, args.lr, args.warmup, args.seed, modes, progress,
                                       rounds=args.rounds, bucket_size=args.bucket_size))
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
