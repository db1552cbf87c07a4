"""``aiosync simulate``: a what-if run of the async runtime over simulated transports.

A toy policy whose every version is recognisable (the weights of version ``v`` are a
function of ``v``) is trained for ``--steps`` steps by a trainer coroutine while ``--explorers``
explorer coroutines roll out with it. Every rollout checks, under its lease, that the model
equals exactly the weights of the version the lease reports: a mismatch is a torn read.
The trainer loop is first run alone, without any sync, to measure the baseline step time.

Scenarios:

* ``default`` — fast link, FIXED style, blocking syncs after every step.
* ``slow`` — a transport ten times slower than a train step, patch sync with
  ``sync_weight_no_wait`` (trainer-driven): coalescing keeps the trainer at full speed, and the
  samples explorers make on old weights are dropped by the staleness filter (``max_staleness``
  2: ``rollouts_wasted``). ``--max-ahead K`` turns on admission control instead: the trainer
  trains on what the explorers produce (one usable sample per step, ``--batch``), and explorers
  start a rollout only within K versions of the trainer, so nothing is wasted.
* ``faults`` — every kind of fault at once: the links drop, delay, duplicate, reorder,
  corrupt and truncate messages and sometimes hang (the sender's delivery timeout then cancels
  it in the middle of a sync), and the explorers' applies sometimes raise half way. Checksums
  are on. Every rollout still checks its weights bit for bit against the version it was
  stamped with; the faults stop with the training, the synchronizer drains, and every explorer
  must then hold the trainer's final weights. ``--minutes M`` turns it into a soak of M minutes.
* ``verify`` — whole-state verification, methods × styles, late joiners, one bit flipped behind
  aiosync's back per run: :mod:`aiosync.cli.simulate_verify`.
* ``links`` — ``encoding: auto`` with explorers behind a 50 Mbit/s and a 1 Gbit/s link side by
  side (:mod:`aiosync.cli.simulate_links`, a run of its own: each link picks its encoding).
* ``chaos`` — explorers that go silent past ``liveness_timeout``, call in late, drop in the
  middle of a request and are attached again (``max_ahead`` 1, FIXED interval 2):
  :mod:`aiosync.cli.simulate_chaos`.
* ``scale`` — R trainer ranks × E engines: seconds per version with relayed vs direct routes,
  from patch sizes measured on real builds at a density (:mod:`aiosync.cli.simulate_scale`).
* ``cancel`` — random cancellations of every public await, each made again at once (attach
  cancels included): :mod:`aiosync.cli.simulate_cancel`.

Prints a summary and, with ``--json PATH``, writes the full report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
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
from ..coordination.protocol import Control
from ..errors import PeerTimeoutError
from ..syncers.faults import ApplyFaults, flaky_syncer_factory
from ..transports.faults import FaultProfile
from ..transports.simulated import simulated_pair
from .args import integer, number, output_path
from .toy import ToyPolicy, warm_up_syncer


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
    #: faults the links inject while the trainer runs (``None``: none)
    faults: FaultProfile | None = None
    #: probability that an explorer's apply raises half way through writing
    apply_failure_rate: float = 0.0
    verify_checksums: bool = False
    sync_timeout: float = 30.0
    delivery_timeout: float = 60.0
    #: run the trainer for this many minutes instead of ``steps`` steps (a soak)
    minutes: float | None = None
    #: the trainer's staleness filter (``synchronizer.max_staleness``)
    max_staleness: int | None = None
    #: admission control (``synchronizer.max_ahead``); implies ``batch`` 1 unless it is set
    max_ahead: int | None = None
    #: usable samples the trainer needs per step (it waits for them, at most ``sync_timeout``,
    #: serving explorers' requests meanwhile); 0: it trains regardless
    batch: int | None = None
    #: ``synchronizer.liveness_timeout``
    liveness_timeout: float = 60.0
    #: the cancel scenario: the longest budget a call is given (half the calls get none at all)
    cancel_max_s: float = 0.004


# Rates per message; each explorer's link carries ~4 messages per version in each direction.
FAULTS = FaultProfile(fail=0.01, drop=0.02, delay=0.1, delay_max=0.3, duplicate=0.03, reorder=0.05, reorder_max=0.03,
                      corrupt=0.03, truncate=0.03, stall=0.01, stall_s=1.0)

SCENARIOS = {
    "default": Scenario("default"),
    # Transport latency = 10 x the train step; patch sync in the background, trainer-driven.
    "slow": Scenario("slow", steps=100, step_time=0.05, explore_time=0.02, latency=0.5, bandwidth=1e8,
                     jitter=0.01, style="trainer_driven", no_wait=True, max_staleness=2),
    # Everything that can go wrong, at once; the delivery timeout is short so repairs are quick.
    "faults": Scenario("faults", steps=600, step_time=0.01, explore_time=0.004, latency=0.002, bandwidth=1e9,
                       jitter=0.004, style="trainer_driven", no_wait=True, faults=FAULTS, apply_failure_rate=0.03,
                       verify_checksums=True, sync_timeout=2.0, delivery_timeout=0.5),
    # Explorers that go silent, call in late, drop mid-request and come back (simulate_chaos.py).
    "chaos": Scenario("chaos", steps=80, step_time=0.02, explore_time=0.004, latency=0.005, bandwidth=1e9,
                      jitter=0.002, style="fixed", sync_interval=2, max_ahead=1, sync_timeout=5.0,
                      delivery_timeout=5.0, liveness_timeout=1.0),
    # Random cancellations of every public await, made again at once (simulate_cancel.py).
    "cancel": Scenario("cancel", steps=400, step_time=0.01, explore_time=0.002, latency=0.002, bandwidth=1e9,
                       jitter=0.001, style="fixed", sync_timeout=5.0, delivery_timeout=5.0),
}


#: Scenarios that run a simulation of their own: name -> module with ``simulate(explorers, *, steps,
#: seed, loop, **overrides) -> report`` and ``summary(report) -> lines`` (imported when chosen).
MODULES = {"links": "aiosync.cli.simulate_links", "verify": "aiosync.cli.simulate_verify",
           "scale": "aiosync.cli.simulate_scale"}
#: What ``aiosync simulate`` prints for the scenarios whose runs live in a module of their own
#: but share the Scenario set-up (chaos: simulate_chaos.py, cancel: simulate_cancel.py).
SUMMARY_KEYS = {
    "cancel": ("scenario", "method", "cancellations", "retries", "attach_cancels", "wrong_leases", "leases",
               "failed_after_cancel", "longest_stale_s", "exit_s", "steps", "final_bit_exact"),
    "chaos": ("scenario", "method", "synchronizer_errors", "lost", "reattached", "late_calls", "late_call_errors",
              "dropped", "hold_back_timeouts", "max_ahead_exceeded", "steps", "torn_reads", "final_bit_exact"),
}


def is_delivery(msg: Any) -> bool:
    """Messages of the delivery line (payloads, Packets, Acks), which faults may strike."""
    return not isinstance(msg, Control)


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
                  sync_weight_no_wait=sc.no_wait, sync_timeout=sc.sync_timeout, delivery_timeout=sc.delivery_timeout,
                  max_staleness=sc.max_staleness, max_ahead=sc.max_ahead)
    batch = sc.batch if sc.batch is not None else (1 if sc.max_ahead is not None else 0)
    tmp = None
    if sc.method == "checkpoint":
        tmp = tempfile.TemporaryDirectory(prefix="aiosync-sim-")
        config["checkpoint_dir"] = tmp.name
    if sc.syncer == "patch":
        syncer: Any = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                                  "verify_checksums": sc.verify_checksums,
                                                  "init_sync": {"enabled": True}}}
    else:
        syncer = {"type": "bucket", "bucket": {"bucket_size": 1 << 18, "verify_checksums": sc.verify_checksums}}
    apply_faults = ApplyFaults(sc.apply_failure_rate, seed * 7919 + 1)
    if sc.apply_failure_rate:
        syncer = flaky_syncer_factory(syncer, apply_faults)
    if sc.faults is not None or sc.apply_failure_rate:
        await warm_up_syncer(policy, syncer, recv_dtype)
    transports: list = []

    def make_link(name: str):
        pair = simulated_pair(**link, seed=next(seeds), timeout=max(60.0, 4 * sc.delivery_timeout))
        for end in pair:  # the network's faults strike the delivery line; control messages assume TCP-like links
            end.faults_where = is_delivery
        transports.extend(pair)
        return pair

    def set_faults(on: bool) -> None:
        for t in transports:
            t.faults = dataclasses.replace(sc.faults) if (on and sc.faults is not None) else None
        apply_faults.enabled = on

    torn = 0
    rollouts = 0
    samples: list[dict[str, int]] = []
    step_times: list[float] = []
    first_sync_s = 0.0
    sync_timeouts = 0
    sample_wait_s = 0.0
    trainer_done = anyio.Event()
    sampled = [anyio.Event()]  # set when a sample arrives (replaced after each wake-up)

    sync = Synchronizer(config, syncer, transport_factory=make_link)
    async with sync:
        trainer = await sync.attach_trainer(trainer_state)
        explorers = []
        for i in range(n_explorers):
            model = {k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype)
                     for k, v in trainer_state.items()}
            explorers.append(await sync.attach_explorer(f"explorer{i}", model))
        set_faults(True)  # attached (the first sync always succeeds or raises): now things go wrong

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
                sampled[0].set()
                await ex.step_done()
            await ex.stop()

        async def take_batch() -> None:
            """Filter the samples that came in; with ``batch``, wait (at most ``sync_timeout``)
            until that many usable ones were taken, serving explorers' requests meanwhile as
            the reference trainer does while it samples."""
            nonlocal sample_wait_s
            kept, t0 = 0, time.perf_counter()
            deadline = time.monotonic() + sc.sync_timeout
            while True:
                got, samples[:] = list(samples), []
                kept += len(trainer.filter_stale(got).kept)
                if kept >= batch or time.monotonic() >= deadline:
                    break
                sampled[0] = anyio.Event()
                with anyio.move_on_after(sc.step_time):
                    await sampled[0].wait()
                if trainer.need_sync():
                    await trainer.sync_weight()
            sample_wait_s += time.perf_counter() - t0

        async def trainer_loop() -> None:
            nonlocal first_sync_s, sync_timeouts
            deadline = None if sc.minutes is None else time.monotonic() + 60.0 * sc.minutes
            try:
                step = 0
                while (step < sc.steps) if deadline is None else (time.monotonic() < deadline):
                    step += 1
                    t0 = time.perf_counter()
                    await run_sync(policy.write, trainer_state, step)
                    await anyio.sleep(sc.step_time)
                    try:
                        await trainer.step_done()
                    except PeerTimeoutError:
                        sync_timeouts += 1  # a blocking sync outlived its bound under faults; the next one repairs
                    step_times.append(time.perf_counter() - t0)
                    if step == 1:
                        first_sync_s = step_times[0] - baseline[0]
                        if sync.loop_lag is not None:
                            sync.loop_lag.reset()  # JIT warm-up and the blocking first sync are done
                    await take_batch()
                set_faults(False)  # the network heals; the drain on exit must repair every explorer
                await trainer.stop()
            finally:
                trainer_done.set()

        async with anyio.create_task_group() as tg:
            for ex in explorers:
                tg.start_soon(explorer_loop, ex)
            tg.start_soon(trainer_loop)
        lag = dataclasses.asdict(sync.loop_lag.statistics()) if sync.loop_lag is not None else {}
    # Leaving the block drained the synchronizer: check what every explorer holds.
    final = trainer.version
    expected = policy.weights(final)
    final_state = {ex.name: {"version": ex.version,
                             "differs": [k for k, v in expected.items()
                                         if not torch.equal(ex.slot.model[k], v.to(ex.slot.model[k].dtype))]}
                   for ex in explorers}
    lines = {ex.name: sync.explorers[ex.name].line for ex in explorers}
    bit_exact = all(st["version"] == final and not st["differs"] for st in final_state.values())
    metrics = sync.metrics()
    faults_by_kind: dict[str, int] = {"fail": 0}
    for t in transports:
        for kind, n in t.stats.faults.items():
            faults_by_kind[kind] = faults_by_kind.get(kind, 0) + n
        faults_by_kind["fail"] += t.stats.failures_injected
    faults_by_kind["apply_raised"] = apply_faults.fired
    if tmp is not None:
        tmp.cleanup()
    # Steady state: the first step holds the always-blocking first sync.
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    ratio = mean(step_times[1:]) / mean(baseline[1:]) if sc.steps > 1 else 0.0
    ex_metrics = metrics["explorers"]
    return {
        "scenario": sc.name,
        "explorers": n_explorers,
        "steps": trainer.step,
        "requests": metrics["totals"]["requests"],
        "delivered": metrics["totals"]["delivered"],
        "coalesced": metrics["totals"]["coalesced"],
        "max_pending": max((m["max_pending"] for m in ex_metrics.values()), default=0),
        "versions_applied": {name: list(line.stats.versions_applied) for name, line in lines.items()},
        "final_version": final,
        "final_bit_exact": bit_exact,
        "final_state": final_state,
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
        "faults_injected": sum(faults_by_kind.values()),
        "faults": faults_by_kind,
        "repairs": sum(line.stats.repairs for line in lines.values()),
        "lease_wait_max_ms": max((ex.slot.stats.max_lease_wait_s for ex in explorers), default=0.0) * 1e3,
        "exclusive_max_ms": max((ex.slot.stats.max_exclusive_s for ex in explorers), default=0.0) * 1e3,
        "sync_timeouts": sync_timeouts,
        "minutes": sc.minutes,
        "staleness": metrics["staleness"],
        "max_staleness_used": metrics["staleness"]["max_used"],
        "rollouts_wasted": metrics["staleness"]["dropped"],
        "trainer_batch": batch,
        "trainer_sample_wait_s": sample_wait_s,
        "admission": {"max_ahead": sc.max_ahead,
                      "trainer_waits": trainer.statistics().hold_back_s.count,
                      "trainer_wait_s": trainer.statistics().hold_back_s.total,
                      "trainer_timeouts": trainer.statistics().hold_back_timeouts,
                      "explorer_waits": sum(ex.statistics().admission_wait_s.count for ex in explorers),
                      "explorer_wait_s": sum(ex.statistics().admission_wait_s.total for ex in explorers),
                      "explorer_timeouts": sum(ex.statistics().admission_timeouts for ex in explorers)},
        "transport": {"latency_s": sc.latency, "bandwidth_Bps": sc.bandwidth, "jitter_s": sc.jitter},
        "config": metrics["config"],
        "syncer": sc.syncer,
        "per_explorer": {name: {k: m[k] for k in ("requests", "coalesced", "delivered", "failed", "reinits",
                                                  "bytes_sent", "timeouts")} | {
                             "repairs": lines[name].stats.repairs,
                             "last_error": m["last_error"],
                             "apply_ms_mean": m["apply_s"]["mean"] * 1e3,
                             "build_ms_mean": m["build_s"]["mean"] * 1e3,
                             "transfer_ms_mean": m["transfer_s"]["mean"] * 1e3}
                         for name, m in ex_metrics.items()},
    }


def simulate(scenario: str = "default", explorers: int = 2, *, steps: int | None = None, seed: int = 0,
             loop: str = "asyncio", **overrides: Any) -> dict[str, Any]:
    """Run a scenario and return its report (the ``--json`` content)."""
    if scenario in MODULES:
        return importlib.import_module(MODULES[scenario]).simulate(explorers, steps=steps, seed=seed, loop=loop,
                                                                   **overrides)
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; available: {', '.join([*SCENARIOS, *MODULES])}")
    base = SCENARIOS[scenario]
    sc = Scenario(**{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    if steps is not None:
        sc.steps = steps
    if explorers < 1:
        raise ValueError("--explorers must be at least 1")
    backend_options = {"use_uvloop": True} if loop == "uvloop" else {}
    logger = logging.getLogger("aiosync")
    level = logger.level
    if sc.faults is not None or sc.apply_failure_rate:
        logger.setLevel(logging.ERROR)  # one warning per injected fault: the report counts them instead
    if sc.name == "chaos":
        from .simulate_chaos import run_chaos as main
        explorers = max(explorers, 3)
        logger.setLevel(logging.ERROR)  # one warning per lost explorer: the report counts them instead
    elif sc.name == "cancel":
        from .simulate_cancel import run_cancel as main
    else:
        main = _simulate
    t0 = time.perf_counter()
    try:
        report = anyio.run(main, sc, explorers, seed, backend="asyncio", backend_options=backend_options)
    finally:
        logger.setLevel(level)
    report["wall_s"] = time.perf_counter() - t0
    return report


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="what-if run of trainer, explorers and synchronizer over simulated links",
                              description="A what-if run of trainer, explorers and synchronizer over simulated transports.")
    p.add_argument("--scenario", default="default", choices=sorted([*SCENARIOS, *MODULES]))
    p.add_argument("--explorers", type=integer(1, 64), default=2)
    p.add_argument("--steps", type=integer(1), default=None, help="train steps (default: the scenario's)")
    p.add_argument("--method", choices=["memory", "checkpoint", "nccl"], default=None)
    p.add_argument("--style", choices=["fixed", "trainer_driven", "explorer_driven"], default=None)
    p.add_argument("--syncer", choices=["patch", "bucket"], default=None)
    p.add_argument("--no-wait", dest="no_wait", action="store_true", default=None,
                   help="sync_weight_no_wait (patch only)")
    p.add_argument("--wait", dest="no_wait", action="store_false", help="blocking syncs")
    p.add_argument("--latency", type=number(0), default=None, help="seconds, one way")
    p.add_argument("--bandwidth", type=number(0, above=True), default=None, help="bytes per second")
    p.add_argument("--minutes", type=number(0, above=True), default=None,
                   help="run the trainer this many minutes instead of --steps steps (a soak; e.g. with --scenario faults)")
    p.add_argument("--max-staleness", dest="max_staleness", type=integer(0), default=None,
                   help="the trainer's staleness filter (versions); dropped samples are rollouts_wasted")
    p.add_argument("--max-ahead", dest="max_ahead", type=integer(0), default=None,
                   help="admission control: explorers start a rollout only within this many versions of the trainer "
                        "(the trainer then trains on what explorers produce, --batch 1)")
    p.add_argument("--batch", type=integer(0), default=None,
                   help="usable samples the trainer needs per step (default 0, or 1 with --max-ahead)")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_path, default=None, help="write the report here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        report = simulate(args.scenario, args.explorers, steps=args.steps, seed=args.seed, loop=args.loop,
                          method=args.method, style=args.style, syncer=args.syncer, no_wait=args.no_wait,
                          latency=args.latency, bandwidth=args.bandwidth, minutes=args.minutes,
                          max_staleness=args.max_staleness, max_ahead=args.max_ahead, batch=args.batch)
    except ValueError as exc:
        print(f"aiosync simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if args.scenario in MODULES:
        module = importlib.import_module(MODULES[args.scenario])
        print("\n".join(module.summary(report)))
        return 0 if getattr(module, "ok", lambda _: True)(report) else 1
    if args.scenario in SUMMARY_KEYS:
        for k in SUMMARY_KEYS[args.scenario]:
            print(f"{k:<20}  {report[k]}")
        return 0
    keys = ["scenario", "explorers", "steps", "requests", "delivered", "coalesced", "max_pending", "final_version",
            "final_bit_exact", "torn_reads", "rollouts", "rollouts_wasted", "max_staleness_used", "trainer_step_ratio",
            "loop_lag_p99_ms", "loop_lag_max_ms"]
    if report["faults_injected"] or report["scenario"] == "faults":
        keys += ["faults_injected", "repairs", "failed"]
    width = max(map(len, keys))
    for k in keys:
        v = report[k]
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if report["faults_injected"]:
        shown = ", ".join(f"{k} {v}" for k, v in report["faults"].items() if v)
        print(f"{'faults':<{width}}  {shown}")
    for name, versions in report["versions_applied"].items():
        shown = versions if len(versions) <= 12 else versions[:5] + ["..."] + versions[-5:]
        print(f"{'versions ' + name:<{width}}  {shown}")
    return 0
