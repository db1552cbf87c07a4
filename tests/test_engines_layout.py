"""What the vLLM adapter checks before anything is written, without an engine: the checkpoint
layout read from safetensors headers, the mismatches it names (tensor, both shapes and dtypes,
the fix for a name prefix or a tied output embedding), whole layers, tied pairs; and the
``aiosync`` backend's update protocol (skipped without vLLM): malformed manifests, staged
buckets, the commit, late buckets, a finish that never raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aiosync.engines.layout import (TensorSpec, checkpoint_layout, incomplete_group, layout_problem, spec_of,
                                    tied_aliases)
from aiosync.errors import ApplyError, PayloadError

F32 = torch.float32
LAYOUT = {"model.embed_tokens.weight": TensorSpec((64, 8), F32), "model.norm.weight": TensorSpec((8,), F32),
          "model.layers.0.self_attn.q_proj.weight": TensorSpec((8, 8), F32),
          "model.layers.0.self_attn.v_proj.weight": TensorSpec((4, 8), F32),
          "model.layers.0.step": TensorSpec((1,), torch.int64)}


def test_checkpoint_layout_reads_names_shapes_and_dtypes_from_the_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "c": torch.zeros(1, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    assert checkpoint_layout(tmp_path) == {"a": TensorSpec((2, 3), F32), "b": TensorSpec((4,), torch.bfloat16),
                                          "c": TensorSpec((1,), torch.int64)}
    assert checkpoint_layout(tmp_path / "missing") is None and checkpoint_layout("org/hub-id") is None


def test_a_mismatch_names_the_tensor_and_both_shapes_and_dtypes():
    given = {k: v for k, v in LAYOUT.items()}
    assert layout_problem(LAYOUT, given) is None
    given["model.embed_tokens.weight"] = TensorSpec((72, 8), F32)  # a resized vocabulary
    problem = layout_problem(LAYOUT, given)
    assert "'model.embed_tokens.weight' is [72, 8] float32, the engine's checkpoint has [64, 8] float32" in problem
    assert "start it from the new checkpoint" in problem
    assert layout_problem(LAYOUT, {"model.norm.weight": TensorSpec((8,), torch.bfloat16)}) is None  # cast on loading
    problem = layout_problem(LAYOUT, {"model.layers.0.step": TensorSpec((1,), F32)})
    assert problem == "'model.layers.0.step' is [1] float32, the engine's checkpoint has [1] int64"


def test_unknown_names_are_named_with_the_prefix_that_would_make_them_match():
    prefixed = {"module." + k: v for k, v in LAYOUT.items()}
    problem = layout_problem(LAYOUT, prefixed)
    assert problem.startswith("5 name(s) the engine's checkpoint does not have: 'module.model.embed_tokens.weight'")
    assert "and 2 more; without the prefix 'module.' they match: drop it from the names" in problem
    bare = {k.removeprefix("model."): v for k, v in LAYOUT.items()}
    assert "with the prefix 'model.' they match" in layout_problem(LAYOUT, bare)
    assert "they match" not in layout_problem(LAYOUT, {"x": TensorSpec((1,), F32)})


def test_a_tied_output_embedding_is_named_as_such():
    given = {"lm_head.weight": TensorSpec((64, 8), F32)}
    assert "ties it to 'model.embed_tokens.weight' (tie_word_embeddings); leave it out" in layout_problem(
        LAYOUT, given, tied_to="model.embed_tokens.weight")
    assert tied_aliases(LAYOUT, True) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_aliases(LAYOUT, False) == {}
    assert tied_aliases(["a.wte.weight", "b.wte.weight"], True) == {}  # ambiguous: no alias


def test_an_update_touching_part_of_a_layer_is_named():
    groups = [["e"], ["l0.q", "l0.k", "l0.v"], ["l1.q", "l1.k", "l1.v"], ["norm"]]
    assert incomplete_group(groups, ["e", "l0.q", "l0.k", "l0.v", "norm"]) is None
    assert incomplete_group(groups, ["e", "l0.q", "l0.k"]) == ("l0.v", "l0.q")
    assert spec_of(torch.zeros(3, 2, dtype=torch.int8)) == TensorSpec((3, 2), torch.int8)


# -- the backend's protocol (vLLM needed for the class, no engine) ---------------------------


@pytest.fixture
def backend(monkeypatch, tmp_path):
    backend_module = pytest.importorskip("aiosync.engines.vllm_backend")
    loaded = []
    monkeypatch.setattr(backend_module, "load_layers", lambda model, cfg, weights: loaded.append(dict(weights)))
    model_config = SimpleNamespace(model=str(tmp_path), hf_config=SimpleNamespace(tie_word_embeddings=False))
    engine = backend_module.AiosyncWeightTransferEngine(
        None, SimpleNamespace(parallel_config=None, model_config=model_config), torch.device("cpu"), torch.nn.Module())
    engine.loaded = loaded
    manifest = [["model.layers.0.q.weight", [2, 2], "float32"], ["model.layers.0.v.weight", [2, 2], "float32"],
                ["model.norm.weight", [2], "float32"]]
    engine.init_transfer_engine(backend_module.AiosyncInitInfo(manifest=manifest))
    return engine


def buckets(version: int) -> list[dict]:
    from aiosync.syncers.bucket.format import bucket_manifest, seal_bucket

    groups = [[("model.layers.0.q.weight", torch.full((2, 2), float(version))),
               ("model.layers.0.v.weight", torch.ones(2, 2))], [("model.norm.weight", torch.ones(2))]]
    manifest = bucket_manifest(groups)
    return [seal_bucket(dict(g), index=i, count=2, version=version, manifest=manifest if i == 0 else None)
            for i, g in enumerate(groups)]


def update(engine, **info):
    from aiosync.engines.vllm_backend import AiosyncUpdateInfo

    engine.receive_weights(AiosyncUpdateInfo(**info))


def test_a_malformed_manifest_entry_is_a_payload_error_naming_it():
    parse_manifest = pytest.importorskip("aiosync.engines.vllm_backend").parse_manifest

    cases = {"['x']": [["x"]], "entry 1": [["a", [1], "float32"], ["b", [1], "float33"]],
             "non-negative ints": [["a", [-1], "float32"]], "listed twice": [["a", [1], "float32"]] * 2,
             "non-empty string": [[3, [1], "float32"]], "must be a list": {"a": 1}, "names no tensor": []}
    for needle, manifest in cases.items():
        with pytest.raises(PayloadError, match="aiosync backend") as info:
            parse_manifest(manifest)
        assert needle in str(info.value), (needle, str(info.value))
    assert tuple(parse_manifest([["a", [2, 3], "bfloat16"]])["a"].shape) == (2, 3)


def test_buckets_are_staged_and_loaded_only_by_a_complete_commit(backend):
    backend.start_weight_update()
    b0, b1 = buckets(1)
    update(backend, bucket=b0, update_id="u1")
    with pytest.raises(PayloadError, match=r"committed after 1 of 2 buckets \(bucket 1 never arrived\); nothing "
                                           r"was written: the engine keeps its previous weights"):
        update(backend, commit=True, update_id="u1")
    assert backend.loaded == [] and backend._update is None  # closed, as vLLM's worker does after a raise
    backend.start_weight_update()
    for b in buckets(2):
        update(backend, bucket=b, update_id="u2")
    assert backend.loaded == []  # staged, not loaded
    update(backend, commit=True, update_id="u2")
    backend.finish_weight_update()
    assert backend.version == 2 and [sorted(w) for w in backend.loaded] == [
        ["model.layers.0.q.weight", "model.layers.0.v.weight", "model.norm.weight"]]
    assert torch.equal(backend.loaded[0]["model.layers.0.q.weight"], torch.full((2, 2), 2.0))


def test_an_uncommitted_update_is_discarded_and_its_late_buckets_dropped(backend):
    b0, b1 = buckets(1)
    backend.start_weight_update()
    update(backend, bucket=b0, update_id="u1")
    backend.finish_weight_update()  # the client gave up: never raises, nothing loaded
    backend.finish_weight_update()  # twice is fine too
    backend.start_weight_update()
    update(backend, bucket=b1, update_id="u1")  # u1's late bucket, during u2: dropped
    for b in buckets(2):
        update(backend, bucket=b, update_id="u2")
    update(backend, commit=True, update_id="u2")
    assert backend.version == 2 and len(backend.loaded) == 1
    backend.finish_weight_update()
    backend.start_weight_update()
    update(backend, bucket=buckets(3)[0], update_id="u3")
    with pytest.raises(PayloadError, match="a bucket of update 'u4' arrived during update 'u3'"):
        update(backend, bucket=buckets(4)[0], update_id="u4")


def test_a_part_of_a_layer_or_a_damaged_bucket_is_refused_before_anything_is_loaded(backend):
    from aiosync.syncers.bucket.format import bucket_manifest, seal_bucket

    backend.init_transfer_engine(backend.init_info_cls(manifest=[["model.layers.0.q.weight", [2, 2], "float32"],
                                                                  ["model.layers.0.v.weight", [2, 2], "float32"]]))
    backend.start_weight_update()
    part = [[("model.layers.0.q.weight", torch.ones(2, 2))]]
    update(backend, bucket=seal_bucket(dict(part[0]), index=0, count=1, version=1, manifest=bucket_manifest(part)),
           update_id="p")
    with pytest.raises(PayloadError, match="holds 'model.layers.0.q.weight' but not 'model.layers.0.v.weight' of "
                                           "the same layer"):
        update(backend, commit=True, update_id="p")
    backend.start_weight_update()
    b0 = buckets(1)[0]
    b0["model.layers.0.v.weight"] = torch.ones(1, 2)
    with pytest.raises(PayloadError, match="refused after 0 of"):
        update(backend, bucket=b0, update_id="d")
    assert backend.loaded == []


def test_a_load_that_cannot_be_undone_leaves_the_backend_refusing_every_update(backend, monkeypatch):
    from aiosync.engines import vllm_backend
    from aiosync.engines.vllm_reload import ReloadRestoreError

    def broken(model, cfg, weights):
        raise ReloadRestoreError("a load failed and putting the layers back failed too")

    monkeypatch.setattr(vllm_backend, "load_layers", broken)
    backend.start_weight_update()
    for b in buckets(1):
        update(backend, bucket=b, update_id="u")
    with pytest.raises(ApplyError, match="the engine's weights are unknown: restart the engine"):
        update(backend, commit=True, update_id="u")
    with pytest.raises(ApplyError, match="restart the engine"):
        backend.start_weight_update()


def test_a_load_that_raises_is_refused_saying_the_layers_were_put_back(backend, monkeypatch):
    from aiosync.engines import vllm_backend

    monkeypatch.setattr(vllm_backend, "load_layers", lambda model, cfg, weights: {}["no such parameter"])
    backend.start_weight_update()
    for b in buckets(1):
        update(backend, bucket=b, update_id="u")
    with pytest.raises(ApplyError, match=r"weight loader raised KeyError: 'no such parameter' .*every layer was put "
                                         r"back: nothing was written: the engine keeps its previous weights \(the "
                                         r"weights it was started with\)"):
        update(backend, commit=True, update_id="u")
    backend.finish_weight_update()  # after a refusal: no error, and the next update opens
    backend.start_weight_update()
