"""TRL's GRPOTrainer with aiosync doing the weight sync, in colocate or server mode.

A tiny fp32 Llama (32-token vocabulary, a word-level tokenizer: the tokens are the numbers
``0``..``29``) learns to answer with small numbers: the reward of a completion is the share of
its tokens below 10. ``--mode colocate``: TRL's in-process vLLM, patches written in place (only
the changed elements). ``--mode server``: a ``vllm serve`` subprocess with aiosync's backend,
middleware and key; patches over HTTP, signed. After every sync the engine's greedy outputs
(log-probabilities too) are compared with a HF model holding the trainer's weights::

    python examples/trl_grpo.py --mode colocate --steps 8 --json colocate.json
    python examples/trl_grpo.py --mode server --steps 8 --json server.json
    python examples/trl_grpo.py --mode server --processes 2 [--fsdp] --steps 8 --json ranks.json

``--processes N`` (server mode): the trainer runs as N processes under torchrun (gloo on this
host) — data parallel, or with ``--fsdp`` FSDP2 (accelerate's plugin; on a CPU, where accelerate
falls back to DDP, its state is made FSDP2 here: :func:`cpu_fsdp2`) — and the check after each
sync runs on rank 0 (under FSDP2 against a copy gathered for the check only).

The report: ``mode``, ``steps``, ``syncs``, ``initial_mean_reward`` / ``final_mean_reward`` (TRL's
logged reward, mean of the first / last two steps), ``bytes_per_sync`` (what the synchronizer sent
the engine per sync, mean over the syncs after the first; ``full_model_bytes`` for scale),
``changed_elements_per_sync``, ``engine_elements_written`` (colocate: elements the engine wrote
in place, bootstrap excluded), ``pause_s`` (the engine's pause per write: mean and max),
``sample_versions`` (the versions that generated each step's batch), ``engine_matches_trainer``,
``seconds``; ``versions`` (the versions this process synced or learnt), ``gathered_bytes``
(aiosync's count of shard bytes it gathered), ``sharded`` and, under FSDP2, ``shard_patches`` /
``shard_patch_bytes`` (patches of its own shard a rank built) and ``relayed_bytes`` (rank 0: other
ranks' bytes it passed on to the server). With ``--processes``: rank 0's report plus
``processes``, ``fsdp``, ``rank_versions``, ``rank_sample_versions``, ``rank_sharded``,
``rank_shard_patch_bytes`` (each rank's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_server_sync import ServerProcess  # noqa: E402 (the `vllm serve` subprocess of that example)

WORDS = [str(i) for i in range(30)] + ["<pad>", "<eos>"]
PROMPTS = ["3 7 12", "20 4", "15 15 15", "8 29 1", "11 2", "25 26 27", "6", "19 18"]
CHECK_PROMPTS = [[3, 7, 12], [20, 4], [25, 26, 27]]
TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
#: TRL's LLM(...) leaves the dtype "auto" (vLLM runs an fp32 checkpoint in half precision): fp32 here, and a
#: small KV cache for the CPU.
ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 32 << 20, "enforce_eager": True}


def make_model(path: Path, seed: int = 0) -> None:
    """The tiny Llama and a word-level tokenizer for it, saved in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from aiosync.runners.grpo import ModelShape, make_tiny_llama

    make_tiny_llama(path, ModelShape(), seed=seed)
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>").save_pretrained(str(path))


def small_numbers(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The reward: the share of the completion's tokens that are the numbers 0..9."""
    return [sum(t < 10 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_config(mode: str, steps: int, out: Path, server_url: str | None = None, fsdp: bool = False,
                config_class: Any = None) -> Any:
    """The run's TRL config; ``fsdp``: accelerate's FSDP2 plugin (each trainer rank holds a shard).
    ``config_class``: another TRL trainer's config with the same fields (e.g. ``RLOOConfig``)."""
    from trl import GRPOConfig

    config_class = config_class or GRPOConfig
    sharded = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}} if fsdp else {}
    return config_class(output_dir=str(out), max_steps=steps, learning_rate=3e-2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, temperature=1.0, beta=0.0, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=0, disable_tqdm=True,
                      use_vllm=True, vllm_mode=mode, vllm_server_base_url=server_url, vllm_max_model_length=64,
                      vllm_server_timeout=60.0, dataloader_num_workers=0, **sharded)


def dataset(n: int = 64) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    from aiosync.runners.grpo import greedy

    with torch.no_grad():
        return greedy(model, prompt, TOKENS)


def engine_greedy(generation: Any, prompt: list[int]) -> tuple[list[int], list[float], tuple]:
    """The engine's greedy completion of ``prompt``: tokens, log-probabilities, versions."""
    if generation.mode == "colocate":
        from vllm import SamplingParams

        from aiosync.engines.vllm import output_versions

        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=0, ignore_eos=True)
        out = generation.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        return ids, [out.logprobs[i][t].logprob for i, t in enumerate(ids)], output_versions(out)
    from aiosync.engines.vllm_server import first_choice

    server = generation.bridge.model
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "logprobs": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    answer, versions = generation.bridge.call(server.completions, body)
    return *first_choice(answer), versions


def engine_holds(generation: Any, model: Any, version: int) -> bool:
    """The engine generates what ``model`` generates (greedy tokens; log-probabilities within
    1e-4), and says ``version`` generated it."""
    for p in CHECK_PROMPTS:
        ids, lps, versions = engine_greedy(generation, p)
        hf_ids, hf_lps = hf_greedy(model, p)
        if ids != hf_ids or versions != (version,) or max(abs(a - b) for a, b in zip(lps, hf_lps)) > LOGPROB_TOLERANCE:
            return False
    return True


def trainer_weights(generation: Any) -> Any:
    """A model holding the trainer's weights, on the rank that talks to the engine (``None`` on
    the others). An FSDP2 trainer's shards are gathered into a copy here, for this check only (a
    collective: every rank) — aiosync's sync itself gathers nothing."""
    from torch.distributed.tensor import DTensor

    model = generation.model
    main = generation.accelerator.is_main_process
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model if main else None
    with torch.no_grad():
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if not main:
        return None
    from transformers import LlamaForCausalLM

    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(full)
    return copy


def checked_syncs(trainer: Any) -> list[bool]:
    """After each of the trainer's syncs, whether the engine holds the trainer's weights
    (checked on the rank that talks to the engine; every rank takes part)."""
    generation = trainer.vllm_generation
    sync, results = generation.sync_weights, []

    def sync_and_check() -> Any:
        record = sync()
        model = trainer_weights(generation)
        if model is not None:
            results.append(engine_holds(generation, model, record.version))
        return record

    generation.sync_weights = sync_and_check
    return results


def shard_report(generation: Any) -> dict:
    """An FSDP2 trainer's rank: whether its parameters are shards (DTensors), the patches of its
    own shard it built and their bytes, and (rank 0) the other ranks' bytes it relayed to the server."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in generation.model.parameters())
    peer = getattr(generation.shard_rank, "peer", None)
    if peer is not None:
        return {"sharded": sharded, "shard_patches": peer.server.builds, "shard_patch_bytes": peer.server.patch_bytes}
    shards = getattr(getattr(generation.bridge, "sync", None), "shards", None)
    if shards is None:
        return {"sharded": sharded}
    return {"sharded": sharded, "shard_patches": shards.builds, "shard_patch_bytes": shards.patch_bytes,
            "relayed_bytes": shards.relayed_bytes}


def train(mode: str, steps: int, workdir: Path, server_url: str | None = None, key_file: Path | None = None,
          engine_kwargs: dict | None = None, fsdp: bool = False) -> dict:
    """A GRPO run of ``steps`` steps synced by aiosync (this process: one trainer rank of any
    number); the report (see the module docstring)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from aiosync.integrations.trl import AiosyncConfig, AiosyncGRPOTrainer
    from aiosync.syncers.common.state_dicts import gathered_bytes

    model_dir = workdir / "model"
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    config = AiosyncConfig(key_file=None if key_file is None else str(key_file), timeout=120.0,
                           engine_kwargs=engine_kwargs or {})
    trainer = AiosyncGRPOTrainer(model=model, reward_funcs=small_numbers, args=grpo_config(mode, steps,
                                 workdir / "out", server_url, fsdp), train_dataset=dataset(),
                                 processing_class=AutoTokenizer.from_pretrained(str(model_dir)), aiosync=config)
    generation = trainer.vllm_generation
    checks = checked_syncs(trainer)
    sample_versions: list[list[int]] = []
    generate = generation.generate

    def generate_and_record(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs)
        sample_versions.append(sorted({v for vs in generation.sample_versions for v in vs if v is not None}))
        return out

    generation.generate = generate_and_record
    gathered0 = gathered_bytes()
    try:
        trainer.train()
        history = generation.history
        engine = (generation.bridge.call(generation.bridge.model.engine_statistics)
                  if mode == "colocate" and hasattr(generation.bridge.model, "engine_statistics") else {})
        shards = shard_report(generation)
    finally:
        trainer.close_aiosync()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    later = history[1:] or history  # the first sync (step 0) finds the weights of the bootstrap
    pauses = [r.pause_s for r in history]
    main = generation.accelerator.is_main_process
    return {"mode": mode, "steps": steps, "syncs": len(history),
            "initial_mean_reward": round(sum(rewards[:2]) / len(rewards[:2]), 4),
            "final_mean_reward": round(sum(rewards[-2:]) / len(rewards[-2:]), 4),
            "bytes_per_sync": round(sum(r.bytes for r in later) / len(later)),
            "full_model_bytes": full,
            "changed_elements_per_sync": round(sum(r.changed_elements for r in later) / len(later)),
            "engine_elements_written": engine.get("elements"),
            "pause_s": {"mean": round(sum(pauses) / len(pauses), 5), "max": round(max(pauses), 5)},
            "sample_versions": sample_versions,
            "engine_matches_trainer": (bool(checks) and all(checks) and len(checks) == len(history)) if main else None,
            "versions": [r.version for r in history], "gathered_bytes": gathered_bytes() - gathered0, **shards}


#: Bound on a multi-process run (torchrun, its ranks' imports, the training).
RANKS_TIMEOUT = 900.0


def torchrun() -> str:
    """The ``torchrun`` next to this Python."""
    return os.path.join(os.path.dirname(sys.executable), "torchrun")


def launch(processes: int, steps: int, workdir: Path, server_url: str, key_file: Path, fsdp: bool = False,
           timeout: float = RANKS_TIMEOUT) -> list[dict]:
    """Run the trainer as ``processes`` processes (torchrun, gloo on this host) against the server
    at ``server_url``; every rank's report, rank 0's first. Bounded by ``timeout``: past it the
    whole process group is killed and the error quotes the ranks' output."""
    import signal
    import subprocess

    cmd = [torchrun(), "--standalone", "--nproc-per-node", str(processes), __file__, "--worker", "--mode", "server",
           "--steps", str(steps), "--workdir", str(workdir), "--server-url", server_url, "--key-file", str(key_file)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    log = workdir / "ranks.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd + (["--fsdp"] if fsdp else []), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise TimeoutError(f"the {processes} trainer processes did not finish within {timeout}s; their output "
                               f"ends with:\n{log.read_text()[-4000:]}") from None
    if code != 0:
        raise RuntimeError(f"torchrun exited with {code}; the ranks' output ends with:\n{log.read_text()[-6000:]}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(processes)]


def run(mode: str, steps: int, workdir: Path, processes: int = 1, fsdp: bool = False) -> dict:
    make_model(workdir / "model")
    if mode == "colocate":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return train(mode, steps, workdir, engine_kwargs=ENGINE_KWARGS)
    import anyio

    key_file = workdir / "key"
    key_file.write_text(os.urandom(32).hex())
    server = ServerProcess(workdir / "model", key_file, workdir / "server.log")  # in place, FSDP2 or not
    anyio.run(server.start)
    try:
        if processes == 1:
            return train(mode, steps, workdir, server_url=server.url, key_file=key_file)
        ranks = launch(processes, steps, workdir, server.url, key_file, fsdp)
        return {**ranks[0], "processes": processes, "fsdp": fsdp, "rank_versions": [r["versions"] for r in ranks],
                "rank_sample_versions": [r["sample_versions"] for r in ranks],
                "gathered_bytes": sum(r["gathered_bytes"] for r in ranks),
                "rank_sharded": [r["sharded"] for r in ranks],
                "rank_shard_patch_bytes": [r.get("shard_patch_bytes") for r in ranks]}
    finally:
        anyio.run(server.stop)


def cpu_fsdp2() -> None:
    """accelerate turns its FSDP plugin on for GPU-like devices only (on a CPU it falls back to
    DDP, silently); for this example on a CPU, the state the trainer's ``Accelerator`` makes is
    made FSDP2 as on a GPU (its ``prepare`` then shards the model with ``fully_shard``)."""
    if torch.cuda.is_available():
        return
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def fsdp_on_cpu(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)  # (each call resets distributed_type)
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, plugin

    AcceleratorState.__init__ = fsdp_on_cpu


def worker(args: argparse.Namespace) -> None:
    """One trainer rank under torchrun: trains, writes its report to ``workdir/rank<r>.json``."""
    if args.fsdp:
        cpu_fsdp2()
    report = train("server", args.steps, args.workdir, server_url=args.server_url, key_file=args.key_file,
                   fsdp=args.fsdp)
    (args.workdir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["colocate", "server"], default="colocate")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--processes", type=int, default=1, help="trainer processes (server mode; torchrun, gloo)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (accelerate's plugin): each rank holds a shard")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--server-url", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the reward is compared between the first and the last steps)")
    if args.worker:
        return worker(args)
    if args.processes < 1 or (args.processes > 1 and args.mode != "server") or (args.fsdp and args.processes < 2):
        parser.error("--processes N > 1 needs --mode server; --fsdp needs --processes >= 2")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = {**run(args.mode, args.steps, Path(tmp), args.processes, args.fsdp),
                  "seconds": round(time.perf_counter() - t0, 1)}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
