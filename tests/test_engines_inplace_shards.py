"""A sharded (FSDP2-like) trainer's patches written in place inside an engine (issue 30), without
vLLM: an :class:`~aiosync.engines.inplace.EngineReceiver` on a plain module whose loader fuses,
pads and transposes (a fallback tensor) like an engine's, behind a
:class:`~aiosync.syncers.base.RemoteTarget` that carries each write as vLLM's RPC would
(:func:`~aiosync.engines.vllm_worker.to_wire`). The sender is the real pair: a two-shard
:class:`~aiosync.syncers.patch.shards.ShardSet` (rank 1 a :class:`ShardServer` over an in-process
channel) and a :class:`PatchWeightSyncer` receiver. The engine on vLLM: ``tests/test_engines_inplace_vllm_shards.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import pytest
import torch

from aiosync.engines import index_map
from aiosync.engines.index_map import loaded_image
from aiosync.engines.inplace import EngineReceiver, decode_payload
from aiosync.engines.vllm_worker import from_wire, to_wire
from aiosync.errors import DriftError, PayloadError
from aiosync.messages import unshare
from aiosync.pieces import TensorSlice
from aiosync.syncers import PatchWeightSyncer
from aiosync.syncers.base import RemoteWrite
from aiosync.syncers.common.payloads import ShardedPatch, ShardRef, Stamped
from aiosync.syncers.patch.shards import ShardLink, ShardServer, ShardSet
from aiosync.transports.inproc import inproc_pair
from helpers import HANG_GUARD, PATCH, PATCH_COO, same_bits

#: The checkpoint: ``q`` and ``k`` fused into one parameter, ``emb`` padded, ``t`` transposed
#: (the map falls back to writing it whole through the loader), ``b`` a vector.
SPECS = {"q": (8, 6), "k": (4, 6), "emb": (10, 4), "t": (16, 40), "b": (5,)}
#: Rank 0 holds the first rows of every tensor, rank 1 the rest (uneven).
SPLIT = {"q": 3, "k": 1, "emb": 6, "t": 9, "b": 2}


class Engine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 6), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(16, 4), requires_grad=False)
        self.tr = torch.nn.Parameter(torch.zeros(40, 16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(5), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, w in weights:
            {"q": lambda w: self.qkv[:8].copy_(w), "k": lambda w: self.qkv[8:].copy_(w),
             "emb": lambda w: self.emb[:10].copy_(w), "t": lambda w: self.tr.copy_(w.t()),
             "b": lambda w: self.b.copy_(w)}[name](w)


def full(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SPECS.items()}


def pieces(state: dict[str, torch.Tensor], rank: int) -> dict:
    out = {}
    for key, t in state.items():
        a, b = (0, SPLIT[key]) if rank == 0 else (SPLIT[key], t.shape[0])
        out[key] = TensorSlice(t[a:b], (a,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


def adamw_like(state: dict[str, torch.Tensor], v: int, also: tuple | None = None) -> None:
    """A sparse step: ~5 % of every tensor's elements moved a little (``also``: one more element)."""
    g = torch.Generator().manual_seed(100 + v)
    with torch.no_grad():
        for t in state.values():
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 20)]
            flat[idx] -= 1e-3 * torch.sign(torch.randn(idx.numel(), generator=g)) * (1 + flat[idx].abs())
        if also is not None:
            key, at = also
            state[key].view(-1)[at] += 0.5


class LowerRows(torch.nn.Module):
    """A worker of a tensor-parallel engine that holds only the rows rank 1 of the trainer holds
    (row ``SPLIT[k]`` on) of every tensor: none of rank 0's."""

    def __init__(self) -> None:
        super().__init__()
        for k, s in SPECS.items():
            self.register_parameter(k, torch.nn.Parameter(torch.zeros(s[0] - SPLIT[k], *s[1:]), requires_grad=False))

    def load_weights(self, weights) -> None:
        for name, w in weights:
            getattr(self, name).copy_(w[SPLIT[name]:])


class EngineTarget(Mapping):
    """A RemoteTarget over an EngineReceiver: each write crosses as wire values (the patch as its
    encoded bytes), staged, then committed — what the vLLM backend does in its worker."""

    def __init__(self, engine: torch.nn.Module) -> None:
        self.engine = engine
        self.meta = {k: torch.empty(s, device="meta") for k, s in SPECS.items()}
        index = None
        if isinstance(engine, LowerRows):  # one worker of several: its map holds part of each tensor
            specs = {k: (s, torch.float32) for k, s in SPECS.items()}
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(index_map, "assign_owners", lambda index, group: None)  # it answers for all it holds
                index = index_map.probe_map(engine, engine.load_weights, specs, group=object())
        self.receiver = EngineReceiver(engine, engine.load_weights, self.meta, index=index)
        self.writes: list[dict] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.meta[key]

    def __iter__(self):
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)

    async def write_remote(self, write: RemoteWrite) -> int | None:
        wire = to_wire(write)
        self.writes.append(wire)
        write = from_wire(wire)
        txn = self.receiver.begin(write.handshake)
        for bucket in write.tensors:
            self.receiver.add_tensors(txn, bucket, write.version)
        if write.patch is not None:
            self.receiver.add_patch(txn, write.patch)
        elif write.version is not None:
            txn.version = write.version
        return self.receiver.commit(txn)

    async def state_digests(self, keys):
        raise NotImplementedError

    def parameters_now(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.engine.named_parameters()}


def engine_holds(target: EngineTarget, state: dict[str, torch.Tensor]) -> bool:
    """The engine's parameters are what its loader makes of ``state``, and read back as ``state``."""
    image = loaded_image(target.engine, target.engine.load_weights, state)
    params = dict(target.engine.named_parameters())
    return all(same_bits(params[n].detach(), image[n]) for n in image) and all(
        same_bits(target.receiver.map.whole(k), state[k]) for k in state)


async def _serve(server: ShardServer, end) -> None:
    while True:
        await server.handle(await end.recv())


async def run(versions, check, tamper=None, engine=Engine, config=PATCH) -> None:
    """A two-shard trainer's bootstrap, then one sync per version into the engine; ``check(v,
    target, receiver, state, apply)`` after each; ``tamper(send)`` may wrap what the sender sends."""
    state, step = full(), [0]
    names = list(state)
    target = EngineTarget(engine())
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            a, b = inproc_pair(max_buffer_size=1, timeout=5)
            server = ShardServer(1, lambda: pieces(state, 1), names, b.send, lambda: step[0])
            tg.start_soon(_serve, server, b)
            shards = ShardSet(lambda: pieces(state, 0), names, [ShardLink(1, a.send, a.recv, server.hello().pieces)],
                              config, lambda: step[0], timeout=5)
            sender, receiver = shards.make(bootstrap=True), PatchWeightSyncer()
            x, y = inproc_pair(timeout=5)
            async with anyio.create_task_group() as pair:
                pair.start_soon(sender.init_sender, pieces(state, 0), names, x.send, x.recv)
                await receiver.init_receiver(target, y.recv, y.send)
            assert engine is not Engine or engine_holds(target, state)
            assert target.receiver.version is None
            send = x.send if tamper is None else tamper(x.send)
            for v in versions:
                step[0] = v
                await check(v, target, receiver, state, lambda v=v: _sync(sender, receiver, target, state, send, y, v))
            tg.cancel_scope.cancel()


async def _sync(sender, receiver, target, state, send, y, v) -> int:
    await sender.sync(pieces(state, 0), send, v)
    return await receiver.apply(target, y.recv)


CTX = {"type": "patch", "patch": {"encoding": "ctx", "compression": "none", "init_sync": {"enabled": True}}}


@pytest.mark.parametrize("config", [PATCH, CTX], ids=["flat", "ctx"])
async def test_a_sharded_trainers_patches_land_in_place_bit_exact(config):
    """``ctx`` parts are decoded, in the engine, against their rows read from the parameters."""
    sizes = []

    async def check(v, target, receiver, state, apply):
        adamw_like(state, v)
        assert await apply() == v
        assert engine_holds(target, state) and target.receiver.version == v and receiver.version == v
        wire = target.writes[-1]
        sizes.append(len(wire["patch"]))

    await run(range(1, 5), check, config=config)
    assert len(sizes) == 4 and all(0 < n < 4 * sum(torch.Size(s).numel() for s in SPECS.values()) for n in sizes)


async def test_the_bootstrap_reaches_the_engine_as_whole_tensors_and_patches_as_shards():
    async def check(v, target, receiver, state, apply):
        boot = target.writes[0]
        assert boot["handshake"]["shards"][1]["rows"]["q"] == [3, 5] and boot["patch"] is None
        tensors = from_wire(boot).tensors
        assert {k: tuple(t.shape) for b in tensors for k, t in b.items()} == SPECS  # whole, from both shards' rows
        adamw_like(state, v)
        assert await apply() == v
        patch = decode_payload(from_wire(target.writes[-1]).patch)  # each rank's part as it came
        assert isinstance(patch, ShardedPatch) and len(patch.shards) == 2
        stats = target.receiver.statistics()
        assert stats["parts"] == 2 and stats["parts_skipped"] == 0 and stats["fallback"] == ["t"]

    await run([1], check)


async def test_a_worker_that_holds_none_of_a_parts_rows_skips_it_and_writes_its_own():
    """A part none of whose rows a worker holds is not decoded there (header checked only); the
    rows it does hold end bit-exact. (``coo`` patches: no drift hashes, which a worker holding part
    of a tensor can only check summed with the other workers'.)"""
    async def check(v, target, receiver, state, apply):
        adamw_like(state, v)
        assert await apply() == v
        assert all(same_bits(getattr(target.engine, k).detach(), state[k][SPLIT[k]:]) for k in SPECS)
        stats = target.receiver.statistics()
        assert stats["parts"] == v and stats["parts_skipped"] == v  # rank 1's part decoded, rank 0's skipped

    await run([1, 2], check, engine=LowerRows, config=PATCH_COO)


async def test_a_drifted_value_in_one_shards_rows_is_refused_with_nothing_written():
    # "k"'s element 13 is in rank 1's rows (rows 1.. of 4x6): changed inside the engine, then by the trainer
    async def check(v, target, receiver, state, apply):
        if v == 1:
            adamw_like(state, v)
            assert await apply() == 1
            return
        with torch.no_grad():
            target.engine.qkv.view(-1)[8 * 6 + 13] += 1.0  # behind aiosync's back
        before = target.parameters_now()
        adamw_like(state, v, also=("k", 13))
        with pytest.raises(DriftError, match="'k' does not hold"):
            await apply()
        after = target.parameters_now()
        assert all(same_bits(before[n], after[n]) for n in before)  # nothing of either shard written
        assert target.receiver.version == 1 and receiver.version == 1

    await run([1, 2], check)


async def test_a_missing_part_refuses_the_whole_version():
    def tamper(send):
        async def dropping(payload):  # rank 1's part of version 2 never arrived
            inner = unshare(payload.payload if isinstance(payload, Stamped) else payload)
            if isinstance(inner, ShardedPatch) and inner.version == 2:
                inner = ShardedPatch(inner.version, inner.base_version, [inner.shards[0], ShardRef(1, "lost", 10)])
                payload = Stamped(payload.session, inner) if isinstance(payload, Stamped) else inner
            await send(payload)
        return dropping

    async def check(v, target, receiver, state, apply):
        adamw_like(state, v)
        if v == 1:
            assert await apply() == 1
            return
        before = target.parameters_now()
        with pytest.raises(PayloadError, match="shard 1 of sharded patch 2 did not arrive from shard rank 1; "
                                               "refused whole"):
            await apply()
        assert all(same_bits(before[n], p) for n, p in target.parameters_now().items())
        assert target.receiver.version == 1
        # the engine's side refuses such a patch too, whole
        part = ShardedPatch(2, 1, [ShardRef(0, "a"), ShardRef(1, "b")])
        with pytest.raises(PayloadError, match="refused whole"):
            target.receiver.apply(part)

    await run([1, 2], check, tamper)


def test_a_malformed_shard_table_is_refused_naming_what_is_wrong():
    target = EngineTarget(Engine())
    base = {"keys": list(SPECS), "synced": [], "session": 5}
    good = [{"rows": {"q": [0, 3], "b": None}, "keys": ["q", "b"], "synced": [0]},
            {"rows": {"q": [3, 5]}, "keys": ["q"], "synced": [0]}]
    assert len(target.receiver.begin({**base, "shards": good}).state.shards) == 2
    cases = [([{"rows": {"q": [0, 3]}, "keys": ["q"], "synced": [0]}], "cover 3 of the 8 rows of 'q'"),
             ([{"rows": {"nope": None}, "keys": ["nope"], "synced": []}], "does not hold"),
             ([good[0], {"rows": {"q": [3, 5]}, "keys": ["q", "q"], "synced": [0]}], "each of its 1 keys once"),
             ([good[0], {"rows": {"q": [3, 5]}, "keys": ["q"], "synced": [1]}], "synced ordinals outside"),
             ([{"rows": {"q": None}}], "must be {'rows'")]
    for shards, match in cases:
        with pytest.raises(PayloadError, match=match):
            target.receiver.begin({**base, "shards": shards})
