"""One message to several peers at once: headers point to point, shared bodies broadcast once.

A fan-out sends the same version to several explorers: each gets a message of its own (its
session stamp, a few hundred bytes) around the same shared parts (the patch: encoded once,
:class:`aiosync.messages.Shared`). :meth:`Multicast.send` sends each peer its message point to
point with a ``route`` in the header, then broadcasts the detached bodies of the shared parts
*once* over a process group of exactly the ranks involved — a gloo group made on first use by
those ranks only (the others know nothing of it) and kept for the next round with the same
ranks.

A round, from the sender::

    every member:  prefix, header (route: ranks, round), host body   point to point, in rank order
    all at once:   broadcast of each shared body over the ranks' group      (one send of the bytes)
    on a failure:  MulticastFallback(round) + the bodies, to every member   point to point

and from a member (:meth:`Multicast.receive`, called by its transport when a routed header
arrives): make the group if it has none for these ranks and take part in the broadcasts while
listening for the fallback — whichever comes first (a member that died makes the sender fall
back as soon as its own broadcast fails; the survivors take the bodies then, not after their
broadcast's bound). Every wait is bounded by ``timeout`` (the groups get it
as their gloo timeout too, so no broadcast waits longer; a member waits twice that for a
fallback, the sender's broadcast bound and the fallback's own); a group that failed once is never
used again (gloo tears a group down when one of its waits fails), later rounds to those ranks go
point to point. A member that is gone (its header cannot be sent) makes the round fall back at
once (a group that was not made yet is not waited for); a member that never joins costs the
others at most ``timeout``. A fallback that reaches a
member whose broadcast did succeed is dropped by its transport.

Rounds are numbered per sender; a member checks it takes them in order. Only one round runs
at a time per process. This package knows no protocol above it: which messages share a round
is the caller's choice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from ...aio import hold_all, run_sync
from ...errors import PayloadError, PeerTimeoutError, TransportError
from ...messages import message
from .ops import _Op
from .wire import Frame, encode_message

__all__ = ["Multicast", "MulticastFallback", "MulticastStatistics"]

log = logging.getLogger("aiosync.transport")


@message
@dataclass(eq=False)
class MulticastFallback:
    """The bodies of round ``round`` (from rank ``src``), point to point: its broadcast failed."""

    src: int
    round: int
    bodies: list


@dataclass(frozen=True)
class MulticastStatistics:
    """``rounds``: messages sent as one round; ``broadcasts`` / ``bytes_broadcast``: shared
    bodies broadcast (each once for every member); ``fallbacks``: rounds whose bodies went point
    to point after all; ``groups``: process groups made; ``broken``: groups given up."""

    rounds: int = 0
    broadcasts: int = 0
    bytes_broadcast: int = 0
    fallbacks: int = 0
    groups: int = 0
    broken: int = 0


@dataclass(eq=False)
class _Sub:
    ranks: tuple
    group: Any = None
    broken: BaseException | None = None


@dataclass(eq=False)
class Multicast:
    """The multicast rounds of this process (one per :class:`~.group.WeightSyncGroup`: its
    transports receive routed messages through it). ``timeout``: the bound of every wait of a
    round, and the gloo timeout of the groups it makes."""

    timeout: float = 60.0
    stats: dict = field(default_factory=lambda: dict(rounds=0, broadcasts=0, bytes_broadcast=0, fallbacks=0,
                                                     groups=0, broken=0))
    _subs: dict = field(default_factory=dict)
    _next_round: int = 0
    #: The last round taken from each sender (a member's view).
    _taken: dict = field(default_factory=dict)
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    def statistics(self) -> MulticastStatistics:
        return MulticastStatistics(**self.stats)

    def usable(self, ranks) -> bool:
        """Whether a round to ``ranks`` (the sender's included) would broadcast (its group is
        not known to be broken)."""
        sub = self._subs.get(tuple(sorted(ranks)))
        return sub is None or sub.broken is None

    # -- groups ----------------------------------------------------------------------

    async def _group(self, ranks: tuple) -> _Sub:
        sub = self._subs.get(ranks)
        if sub is None:
            sub = self._subs[ranks] = _Sub(ranks)
            try:  # abandoned when its caller gives up (a member is gone: the fallback came first)
                sub.group = await anyio.to_thread.run_sync(_make_group, ranks, self.timeout, abandon_on_cancel=True)
                self.stats["groups"] += 1
            except Exception as exc:  # a member never came: the ranks' group cannot be made
                self._break(sub, exc)
            except BaseException:
                self._break(sub, TransportError(f"making the multicast group of ranks {list(ranks)} was abandoned"))
                raise
        return sub

    def _break(self, sub: _Sub, exc: BaseException) -> None:
        if sub.broken is None:
            sub.broken = exc
            self.stats["broken"] += 1
            log.warning("aiosync: multicast group of ranks %s given up: %s", list(sub.ranks), exc)

    async def _broadcast(self, sub: _Sub, bodies: list, src: int, deadline: float) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = sub.ranks.index(src), 0
        for body in bodies:
            try:
                work = sub.group.broadcast([body], opts)
            except RuntimeError as exc:
                raise TransportError(f"multicast broadcast to ranks {list(sub.ranks)} failed: {exc}") from exc
            op = _Op(work, body, f"multicast broadcast from rank {src}", threaded=True)
            await op.wait(deadline)

    # -- the sender --------------------------------------------------------------------

    async def send(self, deliveries: list[tuple[Any, Any]]) -> list[BaseException | None]:
        """Send each ``(transport, payload)`` (distributed transports of this group, to distinct
        peers) as one round; returns per delivery ``None`` or the error it met. The payloads'
        shared parts must be the same objects (their bodies are broadcast once); when they are
        not, or fewer than two peers take part, or the bodies are on a device, or their group
        failed before, each payload is sent point to point as usual."""
        if len(deliveries) < 2:
            return [await _plain(t, p) for t, p in deliveries]
        me = dist.get_rank()
        ranks = tuple(sorted([me] + [t.peer for t, _ in deliveries]))
        async with self._lock:
            n = self._next_round
            route = {"mc": list(ranks), "round": n, "src": me}
            frames = [await run_sync(lambda p=p: encode_message(p, t.device, detach_shared=True, route=route))
                      for t, p in deliveries]
            bodies = frames[0].detached
            same = all(len(f.detached) == len(bodies) and all(a is b for a, b in zip(f.detached, bodies))
                       for f in frames)
            on_host = all(b.device.type == "cpu" for b in bodies)  # device bodies: point to point (NCCL)
            if not bodies or not same or not on_host or not self.usable(ranks):
                return [await _plain(t, p) for t, p in deliveries]
            self._next_round += 1
            self.stats["rounds"] += 1
            return await self._round(deliveries, frames, bodies, ranks, n)

    async def _round(self, deliveries, frames: list[Frame], bodies: list, ranks: tuple, n: int) -> list:
        me = dist.get_rank()
        errors: list[BaseException | None] = [None] * len(deliveries)
        order = sorted(range(len(deliveries)), key=lambda i: deliveries[i][0].peer)
        deadline = time.monotonic() + self.timeout
        async with hold_all(deliveries[i][0].send_lock for i in order):  # nothing else between header and bodies
            for i in order:
                t = deliveries[i][0]
                try:
                    await t.send_frame(frames[i], detached=False)
                except Exception as exc:  # gone: its session learns it from its own channel
                    errors[i] = exc
            # Broadcast even when a member's header could not go (it is gone): the others wait in
            # the broadcast already; it fails at once (or when gloo gives up) and falls back.
            failed: BaseException | None = next((e for e in errors if e is not None), None)
            sub = self._subs.get(ranks)
            if failed is not None and sub is None:  # a member is gone before these ranks made a group:
                sub = self._subs[ranks] = _Sub(ranks)  # it never will be; the others take the fallback
                self._break(sub, failed)
            else:
                sub = await self._group(ranks)
            if sub.broken is not None:
                failed = failed or sub.broken
            else:
                try:
                    await self._broadcast(sub, bodies, me, deadline)
                    self.stats["broadcasts"] += len(bodies)
                    self.stats["bytes_broadcast"] += sum(b.numel() for b in bodies)
                except Exception as exc:
                    self._break(sub, exc)
                    failed = exc
                if failed is not None:
                    self._break(sub, failed)  # a member is gone: these ranks never broadcast again
            if failed is not None:  # the bodies go point to point to everyone whose header went
                self.stats["fallbacks"] += 1
                log.info("aiosync: multicast round %d to ranks %s falls back to point to point: %s", n, list(ranks),
                         failed)
                for i in order:
                    if errors[i] is None:
                        t = deliveries[i][0]
                        try:
                            with anyio.fail_after(self.timeout):
                                await t.send_frame(encode_message(MulticastFallback(me, n, list(bodies)), t.device))
                        except Exception as exc:
                            errors[i] = exc
        return errors

    # -- a member ----------------------------------------------------------------------

    async def receive(self, transport: Any, doc: dict) -> list | None:
        """The bodies of a routed message that ``transport`` received (called by it): take part
        in the round's broadcasts, or wait for its fallback. Raises :class:`PayloadError` for a
        round out of order or a route that does not fit."""
        route = doc["route"]
        try:
            ranks, n, src = tuple(sorted(int(r) for r in route["mc"])), int(route["round"]), int(route["src"])
        except (KeyError, TypeError, ValueError):
            raise PayloadError(f"a multicast route {route!r} is malformed") from None
        me = dist.get_rank()
        if me not in ranks or src != transport.peer or src not in ranks:
            raise PayloadError(f"a multicast round from rank {src} names ranks {list(ranks)}, which do not fit "
                               f"rank {me} receiving from rank {transport.peer}")
        last = self._taken.get(src)
        if last is not None and n <= last:
            raise PayloadError(f"multicast round {n} from rank {src} arrived after round {last} (out of order)")
        self._taken[src] = n
        bodies = [torch.empty(nbytes, dtype=torch.uint8) for nbytes, _ in doc["ext"]]
        got: list = []
        state = {"listening": True, "broadcast_failed": False}

        def wanted(p: Any) -> bool:
            return isinstance(p, MulticastFallback) and p.src == src and p.round == n

        # The broadcast and the sender's fallback are awaited together: when a member dies, the
        # sender falls back as soon as its own broadcast fails, and this member takes the bodies
        # then — not after its broadcast's bound (which a survivor would otherwise wait out).
        async with anyio.create_task_group() as tg:
            async def broadcast() -> None:
                sub = await self._group(ranks)
                if sub.broken is None:
                    try:
                        await self._broadcast(sub, bodies, src, time.monotonic() + self.timeout)
                        self.stats["broadcasts"] += len(bodies)
                        got.append(bodies)
                        tg.cancel_scope.cancel()
                        return
                    except Exception as exc:
                        self._break(sub, exc)
                    except BaseException:  # the fallback came first: the sender gave this group up
                        self._break(sub, TransportError(f"multicast round {n} from rank {src} fell back while "
                                                        "this member's broadcast was still waiting"))
                        raise
                state["broadcast_failed"] = True
                if not state["listening"]:
                    tg.cancel_scope.cancel()

            async def fallback() -> None:
                # The sender gives its broadcast up to ``timeout`` before it falls back: wait for both.
                with anyio.move_on_after(2 * self.timeout):
                    payload = await transport.recv_direct(wanted)
                state["listening"] = False
                if payload is not None:
                    self.stats["fallbacks"] += 1
                    got.append(payload.bodies)
                if payload is not None or state["broadcast_failed"]:
                    tg.cancel_scope.cancel()

            tg.start_soon(broadcast)
            tg.start_soon(fallback)
        if got:
            return got[0]
        # Lost (or another message came first, which stays for the next receive): the caller's
        # delivery fails on its own bound and is repaired; the channel stays usable.
        raise PeerTimeoutError(f"multicast round {n} from rank {src}: neither its broadcast nor its fallback arrived")

    def stale(self, payload: Any) -> bool:
        """Whether ``payload`` is a fallback of a round this member already has the bodies of."""
        return isinstance(payload, MulticastFallback) and self._taken.get(payload.src, -1) >= payload.round


def _make_group(ranks: tuple, timeout: float) -> Any:
    """A gloo group of exactly ``ranks``, made by those ranks only (blocking until all came, at
    most ``timeout``), over the default group's store under a name of its own. Not
    ``new_group(..., use_local_synchronization=True)``: that names a group after how many
    groups the process made before, which differs between a trainer rank and an explorer."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore("aiosync/multicast/" + "-".join(map(str, ranks)), _get_default_store())
    return dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), timedelta(seconds=timeout))


async def _plain(transport: Any, payload: Any) -> BaseException | None:
    try:
        await transport.send(payload)
        return None
    except Exception as exc:
        return exc
