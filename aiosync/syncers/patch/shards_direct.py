"""Direct routes for a sharded trainer: every rank sends its own shard's parts straight to the explorers.

With relayed routes (the default) a shard rank sends its patch of each version, and its bootstrap
buckets, to the synchronizer's rank, which sends them on to every explorer: that rank's link carries
the whole model's update. With direct routes a rank keeps its parts (:class:`PartCache`) and sends
the synchronizer's rank only a :class:`~aiosync.syncers.common.payloads.ShardRef` (where the part
is, a few bytes) in its place; the synchronizer's rank forwards the refs as it forwarded the parts,
and each explorer fetches every part from the rank that built it (:class:`ShardRoutes`), all ranks
at once. No rank sends another rank's bytes.

The version is still one atomic write at each explorer: the receiver validates every shard and
writes them in one exclusive section (:mod:`aiosync.syncers.patch.receiver`). A part that cannot
be fetched is asked for again from that rank alone (``retries``); one that still does not come
stays a :class:`ShardRef`, which the receiver refuses — the version is not applied, and the
synchronizer repairs that explorer as for any failed delivery.

* A rank's side: ``ShardPeer(model, transport, routes=[transport to each explorer])`` — its
  :class:`~aiosync.syncers.patch.shards.ShardServer` puts patches in a :class:`PartCache` (the
  last ``keep`` versions of each lineage, like the synchronizer's packet cache) and answers each
  explorer's :class:`ShardFetch` from it (:meth:`PartCache.serve`). A bootstrap bucket waits in
  the cache until its explorer fetched it (bounded), so a rank holds about one bucket at a time.
* An explorer's side: ``Explorer(..., shard_routes=routes)`` inside ``async with
  ShardRoutes({rank: transport to that rank}) as routes`` — leaving it tells every rank this
  process is done, so that no receive is left posted on either side (gloo aborts a process that
  exits with one).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from ...errors import ClosedResourceError, EndOfStream, PayloadError, PeerTimeoutError, TransportError
from ...messages import RecvFn, SendFn, payload_nbytes, unshare
from ..common.payloads import ShardedPatch, ShardFetch, ShardPart, ShardRef, Stamped

log = logging.getLogger("aiosync.sync")

_GONE = (EndOfStream, TransportError, ClosedResourceError)
#: The key of the fetch an explorer's process sends last on each route (:meth:`ShardRoutes.aclose`).
BYE = ""
#: Seconds a multicast round of a rank's patch waits, at most, for a due explorer's fetch after
#: the first one came (:class:`PartCache`): the due explorers ask at about the same time (they
#: got the version's packet from the synchronizer's rank together); a late one gets its part
#: point to point.
ROUND_GRACE = 0.2


@dataclass(frozen=True)
class _Fresh:
    """What a route holds after a bootstrap bucket of lineage ``sender``: it is due that lineage's
    next patch after ``after`` (the lineage's newest patch then; ``None``: none yet)."""

    sender: int
    after: int | None


@dataclass(eq=False)
class PartCache:
    """Shard rank ``rank``'s parts, kept for the explorers to fetch (see the module docstring).

    Counters: ``patch_bytes`` (patches put, one per version and lineage), ``sent_patch_bytes``
    (patch bytes served, every explorer's fetch counted), ``sent_bytes`` (everything served,
    bootstrap buckets too), ``fetches`` and ``misses`` (fetches of a part it did not hold).

    **Multicast per rank.** Routes whose transports share a multicast router (the transports of
    one :class:`~aiosync.transports.distributed.WeightSyncGroup`: explorers in processes of that
    group) are answered together: the fetches of one patch from the routes *due* it are answered
    in one multicast round — each explorer its own header, the patch's bytes broadcast once over
    a group of this rank and those explorers (:mod:`aiosync.transports.distributed.multicast`; a
    member that fails falls back to point to point there). A route is due a patch when it is
    being served and holds the version the patch starts from (its last patch fetched from this
    rank was that version's, of any lineage), or it was just bootstrapped from this rank (its
    last fetch was a bootstrap bucket) and the patch is the next of that bootstrap's lineage.
    The round goes out as soon as every due route has asked — at once when the first fetch is
    the only one due — and at the latest ``round_grace`` seconds after the first fetch: a due
    explorer that is late is not waited for longer, and is then no longer due the next patch
    (it missed this one's round: it is behind), so a stalled explorer costs the others one
    grace period, not one per version. A route that leaves (its channel ends) is not waited for
    at all. A fetch that comes after its round went out is answered at once, point to point;
    one of a round still gathering joins it. Counters:
    ``multicast_rounds`` and ``multicast_answers``, ``round_wait_s`` (seconds the rounds' first
    fetches waited for the others, in all) and ``round_late`` (rounds that went out at
    ``round_grace`` with a due route missing); ``sent_patch_bytes`` still counts every answer."""

    rank: int
    keep: int = 8
    timeout: float = 600.0
    round_grace: float = ROUND_GRACE
    parts: dict = field(default_factory=dict)
    order: dict = field(default_factory=dict)
    patch_bytes: int = 0
    sent_patch_bytes: int = 0
    sent_bytes: int = 0
    fetches: int = 0
    misses: int = 0
    multicast_rounds: int = 0
    multicast_answers: int = 0
    round_wait_s: float = 0.0
    round_late: int = 0
    _fetched: dict = field(default_factory=dict)
    _buckets: itertools.count = field(default_factory=itertools.count)
    #: Multicast: the routes being served, per router; the round being gathered for each patch
    #: key; the keys whose round went out (a later fetch is answered at once).
    _members: dict = field(default_factory=dict)
    _rounds: dict = field(default_factory=dict)
    _sent: dict = field(default_factory=dict)
    #: Each patch key's lineage, version and the version it starts from (the lineage's patch
    #: before it; ``None``: the first since that lineage's bootstrap), and what each route holds
    #: as far as this rank knows: the version of the last patch it fetched here, or
    #: :class:`_Fresh` after a bootstrap bucket.
    _versions: dict = field(default_factory=dict)
    _holds: dict = field(default_factory=dict)

    def patch(self, sender: int, version: int, part: Any) -> ShardRef:
        """Keep ``part`` (sender ``sender``'s patch of ``version``); its ref for the synchronizer's rank."""
        key = f"p{sender}:{version}"
        self.parts[key] = part
        keys = self.order.setdefault(sender, [])
        self._versions[key] = (sender, version, self._versions[keys[-1]][1] if keys else None)
        keys.append(key)
        while len(keys) > self.keep:
            self._forget(keys.pop(0))
        n = payload_nbytes(part)
        self.patch_bytes += n
        return ShardRef(self.rank, key, n)

    async def bucket(self, sender: int, part: Any, send: SendFn) -> None:
        """Send the synchronizer's rank the ref of bootstrap bucket ``part``, then wait (at most
        ``timeout``) until its explorer fetched it; it is let go either way."""
        key = f"b{sender}:{next(self._buckets)}"
        self.parts[key] = part
        done = self._fetched[key] = anyio.Event()
        try:
            await send(ShardRef(self.rank, key, payload_nbytes(part)))
            with anyio.move_on_after(self.timeout):
                await done.wait()
            if not done.is_set():
                log.warning("aiosync: shard rank %d: bootstrap bucket %s was not fetched within %ss", self.rank, key,
                            self.timeout)
        finally:
            self.parts.pop(key, None)
            self._fetched.pop(key, None)

    def drop(self, sender: int) -> None:
        """Lineage ``sender`` is gone: its patches are let go."""
        for key in self.order.pop(sender, []):
            self._forget(key)

    def _forget(self, key: str) -> None:
        self.parts.pop(key, None)
        self._sent.pop(key, None)
        self._versions.pop(key, None)

    def _due(self, route: Any, key: str) -> bool:
        """Whether ``route`` is expected to fetch patch ``key`` now (see the class docstring)."""
        held = self._holds.get(route)
        sender, version, base = self._versions.get(key, (None, None, None))
        if isinstance(held, _Fresh):
            return sender == held.sender and (held.after is None or version > held.after)
        return held is not None and held == base

    def _fetched_by(self, route: Any, key: str) -> None:
        """``route`` was answered ``key``: what it holds now, as far as this rank knows."""
        if route is None:
            return
        if key.startswith("b"):
            sender = int(key[1:].split(":")[0])
            keys = self.order.get(sender)
            self._holds[route] = _Fresh(sender, self._versions[keys[-1]][1] if keys else None)
        elif key in self._versions:
            self._holds[route] = self._versions[key][1]

    def _wake(self) -> None:
        for rnd in self._rounds.values():
            rnd.changed.set()

    def answer(self, fetch: Any) -> ShardPart:
        """The answer to one :class:`ShardFetch` (counted)."""
        if not isinstance(fetch, ShardFetch):
            return ShardPart(-1, "", None, f"shard rank {self.rank} expected a ShardFetch, got {type(fetch).__name__}")
        self.fetches += 1
        part = self.parts.get(fetch.key)
        if part is None:
            self.misses += 1
            return ShardPart(fetch.id, fetch.key, None, f"shard rank {self.rank} no longer holds {fetch.key} (evicted "
                                                        f"after {self.keep} versions, or its lineage was dropped)")
        n = payload_nbytes(part)
        self.sent_bytes += n
        if fetch.key.startswith("p"):
            self.sent_patch_bytes += n
        event = self._fetched.get(fetch.key)
        if event is not None:
            event.set()
        return ShardPart(fetch.id, fetch.key, part)

    async def serve(self, send: SendFn, recv: RecvFn, *, transport: Any = None) -> None:
        """Answer one explorer's fetches until it says it is done (:data:`BYE`) or its channel ends
        (an explorer that dies ends only this). Nothing is left posted after a goodbye.
        ``transport``: the route itself, when it may take part in multicast rounds (it has a
        ``router``; see the class docstring)."""
        router = getattr(transport, "router", None)
        if router is not None:
            self._members.setdefault(router, set()).add(transport)
        try:
            while True:
                try:
                    fetch = await recv()
                except PeerTimeoutError:
                    continue  # idle
                except _GONE:
                    return
                if isinstance(fetch, ShardFetch) and fetch.key == BYE:  # answered: it consumes the receive
                    with contextlib.suppress(*_GONE, PeerTimeoutError):  # the explorer's multicast may have left posted
                        await send(ShardPart(fetch.id, BYE, None))
                    return
                answer = self.answer(fetch)
                try:
                    if router is not None and answer.payload is not None and answer.key.startswith("p"):
                        error = await self._together(router, transport, answer)
                        if error is not None:
                            raise error
                    else:
                        await send(answer)
                except _GONE:
                    return
                except PeerTimeoutError as exc:
                    log.warning("aiosync: shard rank %d: an answer to an explorer timed out: %s", self.rank, exc)
                else:
                    if answer.payload is not None:
                        self._fetched_by(transport, answer.key)
                        self._wake()  # a round gathering may be due this route now, or no longer
        finally:
            self._holds.pop(transport, None)
            if router is not None:
                self._members[router].discard(transport)
                self._wake()  # a round waiting for this route stops waiting

    async def _together(self, router: Any, transport: Any, answer: ShardPart) -> BaseException | None:
        """Answer ``answer`` (a patch) in the multicast round of its key: the first fetch of it
        gathers the fetches of the other routes due it (bounded by ``round_grace``) and sends the
        round; the rest wait for it. Returns the error this route's answer met, or ``None``."""
        key = answer.key
        if key in self._sent:  # its round went out: this one came late
            return (await router.send([(transport, answer)]))[0]
        rnd = self._rounds.get(key)
        if rnd is not None:
            i = len(rnd.members)
            rnd.members.append((transport, answer))
            rnd.changed.set()
            await rnd.done.wait()  # the first fetch's round: bounded by round_grace and the router's timeout
            return rnd.errors[i] if i < len(rnd.errors) else TransportError("its multicast round failed")
        rnd = self._rounds[key] = _Round([(transport, answer)])
        t0 = time.monotonic()
        try:
            with anyio.move_on_after(self.round_grace) as grace:
                while self._missing(router, rnd, key):
                    rnd.changed = anyio.Event()
                    await rnd.changed.wait()
            if grace.cancelled_caught:
                self.round_late += 1
                log.debug("aiosync: shard rank %d: the round of %s went out without %d due route(s) after %ss",
                          self.rank, key, self._missing(router, rnd, key), self.round_grace)
            self.round_wait_s += time.monotonic() - t0
            del self._rounds[key]
            self._sent[key] = True
            rnd.errors = await router.send(rnd.members)
            if len(rnd.members) > 1:
                self.multicast_rounds += 1
                self.multicast_answers += len(rnd.members)
        finally:
            self._rounds.pop(key, None)
            rnd.done.set()
        return rnd.errors[0] if rnd.errors else TransportError("its multicast round failed")

    def _missing(self, router: Any, rnd: "_Round", key: str) -> int:
        """How many routes of ``router`` are due ``key`` but have not asked for it yet."""
        joined = {t for t, _ in rnd.members}
        return sum(1 for t in self._members.get(router, ()) if t not in joined and self._due(t, key))


@dataclass(eq=False)
class _Round:
    """The fetches of one patch answered together (:meth:`PartCache._together`)."""

    members: list
    changed: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    errors: list = field(default_factory=list)


@dataclass(eq=False)
class _Route:
    send: SendFn
    recv: RecvFn
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: A fetch went out on it (then its goodbye is answered: see :meth:`ShardRoutes.aclose`).
    used: bool = False


class ShardRoutes:
    """An explorer's process's channels to every shard rank but the synchronizer's: ``{rank:
    transport}`` (anything with ``send`` / ``recv``), shared by every explorer of the process.
    :meth:`resolve` puts the parts in place of the refs of a payload, fetched from their ranks
    at once; ``timeout`` bounds one fetch, ``retries`` more are made of that rank alone.

    Counters: ``received_bytes[rank]`` (parts fetched from each rank), ``packet_bytes`` (sync
    packets as they came from the synchronizer's rank, refs in place of fetched parts),
    ``retries_made``, ``missing`` (parts that did not come: their versions were refused). With no
    channels at all it only counts (relayed routes)."""

    def __init__(self, transports: Mapping[int, Any], *, timeout: float = 60.0, retries: int = 1) -> None:
        self.routes = {int(r): _Route(t.send, t.recv) for r, t in transports.items()}
        self.timeout, self.retries = timeout, retries
        self.received_bytes: dict[int, int] = {r: 0 for r in self.routes}
        self.packet_bytes = 0
        self.retries_made = 0
        self.missing = 0
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "ShardRoutes":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Tell every rank this process fetches no more, and — on a route it fetched on — take
        the rank's answer to it: nothing is left posted on either side (a multicast round's
        receive may have left one; bounded by ``timeout``, quiet)."""
        with anyio.move_on_after(self.timeout, shield=True):
            for rank, route in self.routes.items():
                try:
                    async with route.lock:
                        await route.send(ShardFetch(0, BYE))
                        while route.used:  # stale answers (an earlier fetch timed out) skipped
                            answer = await route.recv()
                            if isinstance(answer, ShardPart) and answer.key == BYE:
                                break
                except (*_GONE, PeerTimeoutError) as exc:
                    log.debug("aiosync: could not tell shard rank %d goodbye: %s", rank, exc)

    async def fetch(self, ref: ShardRef) -> Any:
        """The part ``ref`` names, from its rank alone; :class:`PayloadError` naming the rank
        when it does not come after ``retries`` more tries."""
        route = self.routes.get(ref.rank)
        if route is None:
            raise PayloadError(f"a part of shard rank {ref.rank} is sent directly, but this explorer has no route to "
                               f"that rank: pass shard_routes=ShardRoutes({{rank: transport}}) for every rank > 0")
        why = ""
        for attempt in range(1 + self.retries):
            if attempt:
                self.retries_made += 1
            try:
                answer = await self._ask(route, ref)
            except (PeerTimeoutError, TimeoutError) as exc:
                why = f"no answer within {self.timeout}s ({exc})"
                continue
            except _GONE as exc:
                why = f"its channel is gone ({exc})"
                break
            if answer.payload is not None:
                self.received_bytes[ref.rank] += payload_nbytes(answer.payload)
                return answer.payload
            why = answer.error or "no part"
        self.missing += 1
        raise PayloadError(f"the part {ref.key} of shard rank {ref.rank} did not arrive: {why}")

    async def _ask(self, route: _Route, ref: ShardRef) -> ShardPart:
        async with route.lock:  # one conversation per channel; stale answers (an earlier timeout) skipped
            fetch_id = next(self._ids)
            route.used = True
            with anyio.fail_after(self.timeout):
                await route.send(ShardFetch(fetch_id, ref.key))
                while True:
                    answer = await route.recv()
                    if isinstance(answer, ShardPart) and answer.id == fetch_id:
                        return answer

    async def resolve(self, payload: Any) -> Any:
        """``payload`` with every part fetched in place of its ref: a bare ref (a bootstrap bucket;
        :class:`PayloadError` when it does not come), or the refs among a sharded patch's shards
        (a part that does not come stays a ref: the receiver refuses that version)."""
        if isinstance(payload, ShardRef):
            return await self.fetch(payload)
        if isinstance(payload, Stamped):
            inner = await self.resolve(payload.payload)
            return payload if inner is payload.payload else replace(payload, payload=inner)
        inner = unshare(payload)
        if not isinstance(inner, ShardedPatch) or not any(isinstance(p, ShardRef) for p in inner.shards):
            return payload
        shards = list(inner.shards)  # a new patch: the one received may be shared by other explorers

        async def one(i: int, ref: ShardRef) -> None:
            try:
                shards[i] = await self.fetch(ref)
            except PayloadError as exc:
                log.warning("aiosync: %s; version %d will be refused", exc, inner.version)

        async with anyio.create_task_group() as tg:
            for i, part in enumerate(inner.shards):
                if isinstance(part, ShardRef):
                    tg.start_soon(one, i, part)
        return ShardedPatch(inner.version, inner.base_version, shards)


def is_ref(part: Any) -> bool:
    """Whether ``part`` is a ref of a direct route (not the part itself)."""
    return isinstance(unshare(part), ShardRef)


__all__ = ["PartCache", "ShardRoutes", "is_ref"]
