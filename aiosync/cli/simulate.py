"""``aiosync simulate``: a what-if run of the async runtime over simulated transports.

A toy policy whose every version is recognisable (the weights of version ``v`` are a
function of ``v``) is trained for ``--steps`` steps by a trainer coroutine while ``--explorers``
explorer coroutines roll out with it. Every rollout checks, under its lease, that the model
equals exactly the weights of the version the lease reports: a mismatch is a torn read.
The trainer loop is first run alone, without any sync, to measure the baseline step time.

Scenarios:

* ``default`` — fast link, FIXED style, blocking syncs after every step.
* ``slow`` — a transport ten times slower than a train step, patch sync with
  ``sync_weight_no_wait`` (trainer-driven): coalescing keeps the trainer at full speed.
* ``faults`` — reserved (injected failures; added with the reliability work).

Prints a summary and, with ``--json PATH``, writes the full report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..coordination import Synchronizer
from ..coordination.metrics import percentile
from ..transports.simulated import simulated_pair


@dataclass
class Scenario:
    """Parameters of one simulated run."""

    name: str
    steps: int = 60
    step_time: float = 0.02
    explore_time: float = 0.01
    latency: float = 0.001
    bandwidth: float | None = 1e9
    jitter: float = 0.0
    method: str = "memory"
    style: str = "fixed"
    sync_interval: int = 1
    no_wait: bool = False
    syncer: str = "patch"
    receiver_dtype: str = "bfloat16"


SCENARIOS = {
    "default": Scenario("default"),
    # Transport latency = 10 x the train step; patch sync in the background, trainer-driven.
    "slow": Scenario("slow", steps=100, step_time=0.05, explore_time=0.02, latency=0.5, bandwidth=1e8,
                     jitter=0.01, style="trainer_driven", no_wait=True),
}


# ------------------------------------------------------------------ the toy policy

class ToyPolicy:
    """Weights that are a pure function of the version.

    Each float element ``i`` changes once every ``period`` versions (at its own phase), by a
    fixed step, so consecutive versions differ in about ``1 / period`` of the elements —
    sparse, like an RL update. The ``stamp`` buffer holds the version itself.
    """

    def __init__(self, seed: int = 0, period: int = 20,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        shapes = shapes or {"embed.weight": (512, 128), "block.w1": (256, 256), "block.w2": (256, 256),
                            "block.bias": (256,), "head.weight": (64, 256)}
        g = torch.Generator().manual_seed(seed)
        self.period = period
        self.base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        self.phase = {k: torch.randint(1, period + 1, s, generator=g) for k, s in shapes.items()}

    def weights(self, version: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        out = {}
        for k, base in self.base.items():
            bumps = torch.div(version + self.period - self.phase[k], self.period, rounding_mode="floor")
            out[k] = (base + bumps.to(torch.float32) * 0.0625).to(dtype)
        out["stamp"] = torch.tensor(version, dtype=torch.int64)
        return out

    def write(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Set ``state`` (in place) to the weights of ``version``."""
        with torch.no_grad():
            for k, v in self.weights(version).items():
                state[k].copy_(v)

    def matches(self, state: dict[str, torch.Tensor], version: int, cache: dict) -> bool:
        """Whether ``state`` holds exactly the weights of ``version`` (in its own dtypes)."""
        if version not in cache:
            dtype = next(t.dtype for k, t in state.items() if k != "stamp")
            cache.clear()
            cache[version] = self.weights(version, dtype)
        expected = cache[version]
        return all(torch.equal(state[k], expected[k]) for k in expected)


# ------------------------------------------------------------------ the run

async def _baseline(policy: ToyPolicy, sc: Scenario) -> list[float]:
    """The trainer loop alone, without any sync: the reference step time."""
    state = policy.weights(0)
    times = []
    for step in range(1, sc.steps + 1):
        t0 = time.perf_counter()
        await run_sync(policy.write, state, step)
        await anyio.sleep(sc.step_time)
        times.append(time.perf_counter() - t0)
    return times


async def _simulate(sc: Scenario, n_explorers: int, seed: int) -> dict[str, Any]:
    policy = ToyPolicy(seed)
    baseline = await _baseline(policy, sc)

    recv_dtype = getattr(torch, sc.receiver_dtype)
    trainer_state = policy.weights(0)
    link = dict(latency=sc.latency, bandwidth=sc.bandwidth, jitter=sc.jitter)
    seeds = iter(range(seed * 1000, seed * 1000 + 2 * 64, 2))
    config = dict(method=sc.method, style=sc.style, sync_interval=sc.sync_interval,
                  sync_weight_no_wait=sc.no_wait, sync_timeout=30.0, delivery_timeout=60.0)
    tmp = None
    if sc.method == "checkpoint":
        tmp = tempfile.TemporaryDirectory(prefix="aiosync-sim-")
        config["checkpoint_dir"] = tmp.name
    if sc.syncer == "patch":
        syncer = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                             "init_sync": {"enabled": True}}}
    else:
        syncer = {"type": "bucket"}

    torn = 0
    rollouts = 0
    samples: list[dict[str, int]] = []
    step_times: list[float] = []
    first_sync_s = 0.0
    trainer_done = anyio.Event()

    sync = Synchronizer(config, syncer, transport_factory=lambda name: simulated_pair(**link, seed=next(seeds)))
    async with sync:
        trainer = await sync.attach_trainer(trainer_state)
        explorers = []
        for i in range(n_explorers):
            model = {k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype)
                     for k, v in trainer_state.items()}
            explorers.append(await sync.attach_explorer(f"explorer{i}", model))

        async def explorer_loop(ex) -> None:
            nonlocal torn, rollouts
            cache: dict = {}
            while not trainer_done.is_set():
                async with ex.lease() as (model, version):
                    ok = await run_sync(policy.matches, model, version, cache)
                    await anyio.sleep(sc.explore_time)  # the rest of the rollout
                torn += 0 if ok else 1
                rollouts += 1
                samples.append({"version": version})  # every sample carries its version (S10)
                await ex.step_done()
            await ex.stop()

        async def trainer_loop() -> None:
            nonlocal first_sync_s
            try:
                for step in range(1, sc.steps + 1):
                    t0 = time.perf_counter()
                    await run_sync(policy.write, trainer_state, step)
                    await anyio.sleep(sc.step_time)
                    await trainer.step_done()
                    step_times.append(time.perf_counter() - t0)
                    if step == 1:
                        first_sync_s = step_times[0] - baseline[0]
                        if sync.loop_lag is not None:
                            sync.loop_lag.reset()  # JIT warm-up and the blocking first sync are done
                    batch, samples[:] = list(samples), []
                    trainer.filter_stale(batch)
                await trainer.stop()
            finally:
                trainer_done.set()

        async with anyio.create_task_group() as tg:
            for ex in explorers:
                tg.start_soon(explorer_loop, ex)
            tg.start_soon(trainer_loop)
        lag = sync.loop_lag.summary() if sync.loop_lag is not None else {}
    # Leaving the block drained the synchronizer: check what every explorer holds.
    final = trainer.version
    expected = policy.weights(final)
    bit_exact = all(
        all(torch.equal(ex.slot.model[k], v.to(ex.slot.model[k].dtype)) for k, v in expected.items())
        and ex.version == final
        for ex in explorers
    )
    metrics = sync.metrics()
    if tmp is not None:
        tmp.cleanup()
    # Steady state: the first step holds the always-blocking first sync.
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    ratio = mean(step_times[1:]) / mean(baseline[1:]) if sc.steps > 1 else 0.0
    ex_metrics = metrics["explorers"]
    return {
        "scenario": sc.name,
        "explorers": n_explorers,
        "steps": sc.steps,
        "requests": metrics["totals"]["requests"],
        "delivered": metrics["totals"]["delivered"],
        "coalesced": metrics["totals"]["coalesced"],
        "max_pending": max((m["max_pending"] for m in ex_metrics.values()), default=0),
        "versions_applied": {ex.name: list(ex.link.stats.versions_applied) for ex in explorers},
        "final_version": final,
        "final_bit_exact": bit_exact,
        "torn_reads": torn,
        "rollouts": rollouts,
        "trainer_step_ratio": ratio,
        "trainer_step_ms": mean(step_times[1:]) * 1e3,
        "baseline_step_ms": mean(baseline[1:]) * 1e3,
        "trainer_step_p99_ms": percentile(step_times[1:], 99) * 1e3,
        "first_sync_s": first_sync_s,
        "loop_lag_p50_ms": lag.get("p50_ms", 0.0),
        "loop_lag_p99_ms": lag.get("p99_ms", 0.0),
        "loop_lag_max_ms": lag.get("max_ms", 0.0),
        "bytes_sent": metrics["totals"]["bytes_sent"],
        "changed_elements": metrics["totals"]["changed_elements"],
        "failed": metrics["totals"]["failed"],
        "staleness": metrics["staleness"],
        "transport": {"latency_s": sc.latency, "bandwidth_Bps": sc.bandwidth, "jitter_s": sc.jitter},
        "config": metrics["config"],
        "syncer": sc.syncer,
        "per_explorer": {name: {k: m[k] for k in ("requests", "coalesced", "delivered", "failed", "reinits",
                                                  "bytes_sent", "timeouts")} | {
                             "apply_ms_mean": m["apply_s"]["mean"] * 1e3,
                             "build_ms_mean": m["build_s"]["mean"] * 1e3,
                             "transfer_ms_mean": m["transfer_s"]["mean"] * 1e3}
                         for name, m in ex_metrics.items()},
    }


def simulate(scenario: str = "default", explorers: int = 2, *, steps: int | None = None, seed: int = 0,
             loop: str = "asyncio", **overrides: Any) -> dict[str, Any]:
    """Run a scenario and return its report (the ``--json`` content)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; available: {', '.join(SCENARIOS)}"
                         + (" (faults comes with the reliability work)" if scenario == "faults" else ""))
    base = SCENARIOS[scenario]
    sc = Scenario(**{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    if steps is not None:
        sc.steps = steps
    if explorers < 1:
        raise ValueError("--explorers must be at least 1")
    backend_options = {"use_uvloop": True} if loop == "uvloop" else {}
    return anyio.run(_simulate, sc, explorers, seed, backend="asyncio", backend_options=backend_options)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="what-if run of trainer, explorers and synchronizer over simulated links",
                              description="A what-if run of trainer, explorers and synchronizer over simulated transports.")
    p.add_argument("--scenario", default="default", choices=sorted([*SCENARIOS, "faults"]))
    p.add_argument("--explorers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="train steps (default: the scenario's)")
    p.add_argument("--method", choices=["memory", "checkpoint", "nccl"], default=None)
    p.add_argument("--style", choices=["fixed", "trainer_driven", "explorer_driven"], default=None)
    p.add_argument("--syncer", choices=["patch", "bucket"], default=None)
    p.add_argument("--no-wait", dest="no_wait", action="store_true", default=None,
                   help="sync_weight_no_wait (patch only)")
    p.add_argument("--wait", dest="no_wait", action="store_false", help="blocking syncs")
    p.add_argument("--latency", type=float, default=None, help="seconds, one way")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes per second")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write the report here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        report = simulate(args.scenario, args.explorers, steps=args.steps, seed=args.seed, loop=args.loop,
                          method=args.method, style=args.style, syncer=args.syncer, no_wait=args.no_wait,
                          latency=args.latency, bandwidth=args.bandwidth)
    except ValueError as exc:
        print(f"aiosync simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    keys = ["scenario", "explorers", "steps", "requests", "delivered", "coalesced", "max_pending", "final_version",
            "final_bit_exact", "torn_reads", "rollouts", "trainer_step_ratio", "loop_lag_p99_ms", "loop_lag_max_ms"]
    width = max(map(len, keys))
    for k in keys:
        v = report[k]
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    for name, versions in report["versions_applied"].items():
        shown = versions if len(versions) <= 12 else versions[:5] + ["..."] + versions[-5:]
        print(f"{'versions ' + name:<{width}}  {shown}")
    return 0
