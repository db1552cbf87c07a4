"""TRL's GRPOTrainer with aiosync doing the weight sync, in colocate or server mode.

A tiny fp32 Llama (32-token vocabulary, a word-level tokenizer: the tokens are the numbers
``0``..``29``) learns to answer with small numbers: the reward of a completion is the share of
its tokens below 10. ``--mode colocate``: TRL's in-process vLLM, patches written in place (only
the changed elements). ``--mode server``: a ``vllm serve`` subprocess with aiosync's backend,
middleware and key; patches over HTTP, signed. After every sync the engine's greedy outputs
(log-probabilities too) are compared with a HF model holding the trainer's weights::

    python examples/trl_grpo.py --mode colocate --steps 8 --json colocate.json
    python examples/trl_grpo.py --mode server --steps 8 --json server.json

The report: ``mode``, ``steps``, ``syncs``, ``initial_mean_reward`` / ``final_mean_reward`` (TRL's
logged reward, mean of the first / last two steps), ``bytes_per_sync`` (what the synchronizer sent
the engine per sync, mean over the syncs after the first; ``full_model_bytes`` for scale),
``changed_elements_per_sync``, ``engine_elements_written`` (colocate: elements the engine wrote
in place, bootstrap excluded), ``pause_s`` (the engine's pause per write: mean and max),
``sample_versions`` (the versions that generated each step's batch), ``engine_matches_trainer``,
``seconds``.
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


def grpo_config(mode: str, steps: int, out: Path, server_url: str | None = None) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), max_steps=steps, learning_rate=3e-2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, temperature=1.0, beta=0.0, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=0, disable_tqdm=True,
                      use_vllm=True, vllm_mode=mode, vllm_server_base_url=server_url, vllm_max_model_length=64,
                      vllm_server_timeout=60.0, dataloader_num_workers=0)


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


def checked_syncs(trainer: Any) -> list[bool]:
    """After each of the trainer's syncs, whether the engine holds the trainer's weights."""
    generation = trainer.vllm_generation
    sync, results = generation.sync_weights, []

    def sync_and_check() -> Any:
        record = sync()
        results.append(engine_holds(generation, trainer.model, record.version))
        return record

    generation.sync_weights = sync_and_check
    return results


def train(mode: str, steps: int, workdir: Path, server_url: str | None = None, key_file: Path | None = None,
          engine_kwargs: dict | None = None) -> dict:
    """A GRPO run of ``steps`` steps synced by aiosync; the report (see the module docstring)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from aiosync.integrations.trl import AiosyncConfig, AiosyncGRPOTrainer

    model_dir = workdir / "model"
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    config = AiosyncConfig(key_file=None if key_file is None else str(key_file), timeout=120.0,
                           engine_kwargs=engine_kwargs or {})
    trainer = AiosyncGRPOTrainer(model=model, reward_funcs=small_numbers, args=grpo_config(mode, steps,
                                 workdir / "out", server_url), train_dataset=dataset(),
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
    try:
        trainer.train()
        history = generation.history
        engine = (generation.bridge.call(generation.bridge.model.engine_statistics)
                  if mode == "colocate" and hasattr(generation.bridge.model, "engine_statistics") else {})
    finally:
        trainer.close_aiosync()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    later = history[1:] or history  # the first sync (step 0) finds the weights of the bootstrap
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    pauses = [r.pause_s for r in history]
    return {"mode": mode, "steps": steps, "syncs": len(history),
            "initial_mean_reward": round(sum(rewards[:2]) / len(rewards[:2]), 4),
            "final_mean_reward": round(sum(rewards[-2:]) / len(rewards[-2:]), 4),
            "bytes_per_sync": round(sum(r.bytes for r in later) / len(later)),
            "full_model_bytes": full,
            "changed_elements_per_sync": round(sum(r.changed_elements for r in later) / len(later)),
            "engine_elements_written": engine.get("elements"),
            "pause_s": {"mean": round(sum(pauses) / len(pauses), 5), "max": round(max(pauses), 5)},
            "sample_versions": sample_versions,
            "engine_matches_trainer": bool(checks) and all(checks) and len(checks) == len(history)}


def run(mode: str, steps: int, workdir: Path) -> dict:
    make_model(workdir / "model")
    if mode == "colocate":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return train(mode, steps, workdir, engine_kwargs=ENGINE_KWARGS)
    import anyio

    key_file = workdir / "key"
    key_file.write_text(os.urandom(32).hex())
    server = ServerProcess(workdir / "model", key_file, workdir / "server.log")
    anyio.run(server.start)
    try:
        return train(mode, steps, workdir, server_url=server.url, key_file=key_file)
    finally:
        anyio.run(server.stop)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["colocate", "server"], default="colocate")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the reward is compared between the first and the last steps)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = {**run(args.mode, args.steps, Path(tmp)), "seconds": round(time.perf_counter() - t0, 1)}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
