"""Direct routes (issue 30): every rank of a sharded trainer sends its own shard's parts straight to
the explorers; the synchronizer's rank forwards refs only. In one process: the ranks are tasks
holding :class:`~aiosync.checkpoints.TensorSlice` s of one full state, linked to rank 0 and to each
explorer by in-process channels. Real processes: ``examples/sharded_sync.py --ranks`` (and
``tests/test_shards_processes.py``)."""

from __future__ import annotations

import contextlib
from functools import partial

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from aiosync.coordination import Synchronizer
from aiosync.coordination.shards import ShardPeer
from aiosync.errors import ConfigError
from aiosync.messages import Shared
from aiosync.syncers.common.payloads import ShardFetch, ShardPart, ShardRef
from aiosync.syncers.patch.shards_direct import PartCache, ShardRoutes
from aiosync.transports.inproc import inproc_pair
from helpers import HANG_GUARD, PATCH
from test_shards import BOUNDS, NCCL, full, holds, pieces, rollout

pytestmark = pytest.mark.both_loops

async def run(steps: int, *, direct: bool, explorers: int = 2, answer=None):
    """Train ``steps`` versions with two shard peers; ``answer(rank, fetch, answer)`` may replace a
    peer's answers to the explorers' fetches. Returns the synchronizer, explorers, peers, routes."""
    state = full(0)
    pairs = [inproc_pair(timeout=10) for _ in BOUNDS[1:]]
    routes = [{r: inproc_pair(timeout=10) for r in range(1, len(BOUNDS))} for _ in range(explorers)]
    peers = []
    for rank, (_, end) in enumerate(pairs, start=1):
        peer = ShardPeer(pieces(state, rank), end, rank=rank, names=list(state), timeout=10,
                         routes=[rts[rank][0] for rts in routes] if direct else None)
        if answer is not None and direct:
            original = peer.server.cache.answer
            peer.server.cache.answer = lambda fetch, rank=rank, original=original: answer(rank, fetch, original(fetch))
        peers.append(peer)
    gates = {v: anyio.Event() for v in range(1, steps + 1)}
    fetchers = [ShardRoutes({r: pair[1] for r, pair in rts.items()}, timeout=5) for rts in routes]

    async def run_peer(peer: ShardPeer) -> None:
        async with peer:
            for step in range(1, steps + 1):
                await gates[step].wait()
                await peer.step_done()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for peer in peers:
                tg.start_soon(run_peer, peer)
            async with Synchronizer(NCCL, PATCH) as sync:
                trainer = await sync.attach_trainer(pieces(state, 0), param_names=list(state),
                                                    shard_peers=[a for a, _ in pairs])
                found = [await sync.attach_explorer(f"e{i}", rollout(),
                                                    shard_routes=fetchers[i] if direct else None)
                         for i in range(explorers)]
                for v in range(1, steps + 1):
                    for key, t in full(v).items():
                        state[key].copy_(t)
                    gates[v].set()
                    await trainer.step_done()
                await trainer.stop()
            for f in fetchers:  # goodbye on every route: the peers leave
                await f.aclose()
    return sync, found, peers, fetchers


@pytest.mark.parametrize("direct", [False, True])
async def test_each_rank_sends_its_own_parts_and_rank0_relays_none(direct):
    sync, explorers, peers, fetchers = await run(4, direct=direct)
    for ex in explorers:
        assert ex.version == 4 and holds(ex.slot.model, 4), ex.name
    if not direct:  # the relay, for contrast: rank 0 carried the other ranks' bytes
        assert sync.shards.relayed_bytes > 0
        return
    assert sync.shards.relayed_bytes == 0  # rank 0 forwarded refs only: no bytes of another rank
    for peer in peers:
        cache = peer.server.cache
        # every version's part reached both explorers from its own rank, each fetched once (the
        # first explorer's first patch was built before the second joined)
        assert 0 < cache.patch_bytes < cache.sent_patch_bytes <= 2 * cache.patch_bytes
        assert cache.misses == 0 and cache.sent_bytes > cache.sent_patch_bytes  # and the bootstrap buckets
    for f in fetchers:
        assert f.retries_made == 0 and f.missing == 0 and all(n > 0 for n in f.received_bytes.values())


async def test_a_part_refused_once_is_fetched_again_from_its_rank_alone():
    refused: list = []

    def answer(rank, fetch, ans):
        if rank == 2 and fetch.key.endswith(":3") and not refused:
            refused.append(fetch.key)
            return ShardPart(fetch.id, fetch.key, None, "refused once by the test")
        return ans

    sync, (ex,), peers, (fetcher,) = await run(5, direct=True, explorers=1, answer=answer)
    assert refused and fetcher.retries_made == 1 and fetcher.missing == 0
    line = sync.explorers["e0"].line.stats
    assert 3 in line.versions_applied and line.failed == 0 and line.repairs == 0  # committed after the retry
    assert holds(ex.slot.model, 5)
    # the retry went to rank 2 alone: rank 1 answered each version once
    assert peers[0].server.cache.sent_patch_bytes == peers[0].server.cache.patch_bytes


async def test_a_missing_part_never_commits_its_version():
    def answer(rank, fetch, ans):
        if rank == 1 and fetch.key.endswith(":3"):
            return ShardPart(fetch.id, fetch.key, None, "lost by the test")
        return ans

    sync, (ex,), _, (fetcher,) = await run(6, direct=True, explorers=1, answer=answer)
    line = sync.explorers["e0"].line.stats
    assert fetcher.missing == 1 and fetcher.retries_made == 1
    assert 3 not in line.versions_applied, line.versions_applied  # rank 2's part of 3 arrived; 3 did not commit
    assert line.failed == 1 and line.repairs == 1  # repaired, then patches again
    assert ex.version == 6 and holds(ex.slot.model, 6)


async def test_an_explorer_without_routes_refuses_refs_by_name():
    routes = ShardRoutes({1: inproc_pair()[0]})
    with pytest.raises(Exception, match="no route to that rank"):
        await routes.fetch(ShardRef(2, "p1:1", 10))


# -- multicast rounds of a rank's patch (PartCache.serve with routes sharing a router) -----------------


class _Router:
    """A multicast router that records its rounds (the names of their routes) and answers each
    route point to point."""

    def __init__(self) -> None:
        self.rounds: list[list[str]] = []
        self.changed = anyio.Event()

    async def send(self, deliveries: list) -> list:
        self.rounds.append(sorted(t.name for t, _ in deliveries))
        self.changed.set()
        self.changed = anyio.Event()
        for t, payload in deliveries:
            await t.end.send(payload)
        return [None] * len(deliveries)


class _Route:
    """A rank's end of one explorer's route, taking part in ``router``'s rounds."""

    def __init__(self, name: str, router: _Router) -> None:
        self.name, self.router = name, router
        self.end, self.explorer = inproc_pair(timeout=10)

    async def send(self, payload) -> None:
        await self.end.send(payload)

    async def recv(self):
        return await self.end.recv()

    async def fetch(self, key: str):
        await self.explorer.send(ShardFetch(1, key))
        answer = await self.explorer.recv()
        assert answer.key == key and answer.payload is not None, answer
        return answer.payload


@contextlib.asynccontextmanager
async def _served(names: str, grace: float, bootstrapped: str):
    """A rank's cache (``round_grace`` ``grace``) serving one route per name in ``names``, all
    sharing one router; the explorers in ``bootstrapped`` fetched a bucket of lineage 7 from it
    (the others joined but were not bootstrapped yet); then patch 1 of lineage 7 is put."""
    cache, router = PartCache(1, round_grace=grace, timeout=10), _Router()
    routes = {n: _Route(n, router) for n in names}
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for route in routes.values():
                tg.start_soon(partial(cache.serve, route.send, route.recv, transport=route))
            for n in bootstrapped:
                refs: list = []
                tg.start_soon(cache.bucket, 7, Shared(torch.zeros(4)), partial(_append, refs))
                await wait_all_tasks_blocked()
                await routes[n].fetch(refs[0].key)
            cache.patch(7, 1, Shared(torch.ones(8)))
            yield cache, router, routes
            tg.cancel_scope.cancel()


async def _append(to: list, item) -> None:
    to.append(item)


async def _c_held_back(router: _Router, routes: dict, key: str) -> list:
    """Explorers a and b fetch ``key`` while c waits behind a gate, opened once the first round
    went out; returns the rounds sent before the gate opened."""
    gate = anyio.Event()

    async def late() -> None:
        await gate.wait()
        await routes["c"].fetch(key)

    async with anyio.create_task_group() as fetches:
        for n in "ab":
            fetches.start_soon(routes[n].fetch, key)
        fetches.start_soon(late)
        while not router.rounds:
            await router.changed.wait()
        before = list(router.rounds)
        gate.set()
    return before


async def test_a_round_goes_out_once_every_due_explorer_asked_not_waiting_for_one_not_due():
    """Issue 30: a rank's multicast round of a patch starts as soon as the explorers due it asked
    — an explorer connected over the group but not due it (it joined and was not bootstrapped
    yet) is not waited for (before: every connected route was, up to a fixed window; here the
    grace is longer than the test's bound, so that waiting at all fails it)."""
    async with _served("abc", 10 * HANG_GUARD, bootstrapped="ab") as (cache, router, routes):
        assert await _c_held_back(router, routes, "p7:1") == [["a", "b"]]
        assert router.rounds == [["a", "b"], ["c"]]  # c came after its round: point to point
        assert cache.multicast_rounds == 1 and cache.multicast_answers == 2 and cache.round_late == 0


async def test_a_late_explorer_costs_one_grace_period_then_rounds_are_whole_again():
    """A due explorer held back by a gate: the others' round goes out after the grace period
    without it, its part follows point to point; at the next version it is due again and the
    round of all three goes out as soon as they asked (no grace spent)."""
    async with _served("abc", 0.05, bootstrapped="abc") as (cache, router, routes):
        assert await _c_held_back(router, routes, "p7:1") == [["a", "b"]] and cache.round_late == 1
        cache.patch(7, 2, Shared(torch.full((8,), 2.0)))
        async with anyio.create_task_group() as fetches:
            for route in routes.values():
                fetches.start_soon(route.fetch, "p7:2")
        assert router.rounds == [["a", "b"], ["c"], ["a", "b", "c"]] and cache.round_late == 1


@pytest.mark.parametrize("grace", [-1, "0.2", None])
def test_a_bad_round_grace_is_refused_by_name(grace):
    with pytest.raises(ConfigError, match="round_grace must be a number of seconds >= 0"):
        ShardPeer({}, inproc_pair()[0], rank=1, names=[], routes=[], round_grace=grace)
