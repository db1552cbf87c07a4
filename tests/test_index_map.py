"""The index map (:mod:`aiosync.engines.index_map`) probed through hand-written loaders that do
what engines do — fuse, pad, replicate, transpose — without vLLM (the vLLM model's own loader is
in ``tests/test_engines_inplace.py``)."""

from __future__ import annotations

import pytest
import torch

from aiosync.engines.index_map import ProbeError, loaded_image, probe_map
from aiosync.syncers.common.bits import as_bits


class Engine(torch.nn.Module):
    """``qkv`` fuses ``q`` (4x3) and ``k`` (2x3); ``emb`` pads ``embed`` (5x3) to 8 rows;
    ``head`` and ``head2`` both hold ``out`` (replicated); ``tr`` holds ``t`` (16x40) transposed: 640 runs of one element, more than a fallback allows."""

    def __init__(self, transform: bool = False, write_live: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 3), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(8, 3), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.head2 = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.tr = torch.nn.Parameter(torch.zeros(40, 16), requires_grad=False)
        self.register_buffer("seen", torch.zeros(1))
        self.transform, self.write_live = transform, write_live

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "q":
                self.qkv[:4].copy_(w * 2 if self.transform else w)
            elif name == "k":
                self.qkv[4:].copy_(w)
            elif name == "embed":
                self.emb[:5].copy_(w)
            elif name == "out":
                self.head.copy_(w)
                self.head2.copy_(w)
            elif name == "t":
                self.tr.copy_(w.t())
            if self.write_live:
                self.seen.add_(1)


SPECS = {"q": ((4, 3), torch.float32), "k": ((2, 3), torch.float32), "embed": ((5, 3), torch.float32),
         "out": ((2, 2), torch.float32), "t": ((16, 40), torch.float32)}


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, (s, _) in SPECS.items()}


def test_runs_fuse_pad_and_replicate_and_a_transposed_tensor_falls_back():
    engine = Engine()
    engine.load_weights(checkpoint(0).items())
    index = probe_map(engine, engine.load_weights, SPECS)
    assert index.fallback == ["t"]  # a transposing loader does not compress to runs
    runs = {n: [(t.ckpt.tolist(), t.param.tolist(), t.offset.tolist(), t.length.tolist()) for t in m.tables]
            for n, m in index.tensors.items() if m.copy is None}
    qkv, emb, head, head2 = (index.param_names.index(n) for n in ("qkv", "emb", "head", "head2"))
    assert runs["q"] == [([0], [qkv], [0], [12])] and runs["k"] == [([0], [qkv], [12], [6])]
    assert runs["embed"] == [([0], [emb], [0], [15])]
    assert runs["out"] == [([0], [head], [0], [4]), ([0], [head2], [0], [4])]  # two tables: replicated
    assert torch.equal(index.tensors["t"].copy, checkpoint(0)["t"])  # read back from the parameter
    for name, want in checkpoint(0).items():  # every tensor reads back whole
        assert torch.equal(index.whole(name), want)
    # new values written through the map give what the loader gives
    new = checkpoint(1)
    image = loaded_image(engine, engine.load_weights, new)
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    flat = [as_bits(params[n].view(-1)) for n in index.param_names]
    for name, t in new.items():
        if name == "t":
            continue
        positions = torch.arange(t.numel())
        for p, offsets, idx in index.places(name, positions):
            flat[p][offsets] = as_bits(t.reshape(-1))[positions[idx]]
    assert [n for n in image if n != "tr" and not torch.equal(image[n], params[n])] == []
    assert torch.equal(engine.qkv[:4], checkpoint(0)["q"])  # the probe and the image left the live model alone


def test_a_loader_that_transforms_values_is_refused_by_name():
    engine = Engine(transform=True)
    with pytest.raises(ProbeError, match=r"loader of 'q' does not copy its values into 'qkv'"):
        probe_map(engine, engine.load_weights, {"q": SPECS["q"]})


def test_a_loader_that_writes_the_models_live_tensors_is_refused():
    engine = Engine(write_live=True)
    with pytest.raises(ProbeError, match="wrote into a live tensor"):
        probe_map(engine, engine.load_weights, {"k": SPECS["k"]})
    assert float(engine.seen) == 0.0


def test_a_tensor_the_loader_drops_is_refused():
    engine = Engine()
    with pytest.raises(ProbeError, match="'nope' into no parameter"):
        probe_map(engine, engine.load_weights, {"nope": ((2,), torch.float32)})


def test_a_worker_that_answers_for_none_of_a_tensor_owns_no_position():
    """Tensor parallelism: a replicated tensor is answered for by one worker; the others own an
    empty interval list, and their drift hashes and read-backs must count none of its elements
    (this raised IndexError on the second worker of a tensor_parallel_size=2 engine)."""
    import numpy as np

    from aiosync.engines.index_map import TensorMap

    positions = torch.tensor([0, 3, 7])
    none = TensorMap("w", (8,), torch.float32, owned=np.zeros((0, 2), np.int64))
    assert none.owned_mask(positions).tolist() == [False, False, False]
    some = TensorMap("w", (8,), torch.float32, owned=np.array([[2, 5]], np.int64))
    assert some.owned_mask(positions).tolist() == [False, True, False]
