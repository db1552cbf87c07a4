"""Fan-out (S12): one payload built once, delivered to every explorer at the same base version.

Without fan-out each explorer's delivery line owns a sender syncer (and, in patch mode, a
snapshot) and builds its own payload for every version. With it, lines share a
:class:`Lineage`: one sender syncer whose snapshot is at ``version``, plus the last few packets
it built (``history``).

* A member at the lineage's version gets the packet built for the next version; the first
  member to ask builds it (under the lineage's lock), the others reuse it — in process by
  reference, across processes the same bytes: a syncer that ``shares_payloads`` gets its
  payloads wrapped as :class:`~aiosync.messages.Shared` (encoded once, however many explorers
  and processes take them) and each member's handshake session travels beside them
  (:class:`~aiosync.syncers.common.payloads.Stamped`, :func:`restamp`).
* A member that lags (its own delivery line coalesced a few versions away) gets the chain of
  cached packets from its version on, each applied atomically; a ``latest`` lineage (bucket
  mode) just sends its newest packet (buckets carry whole tensors).
* Packets no member needs any more (every member holds their version: :meth:`FanOut.applied`)
  are let go, so a lineage whose explorers keep up holds about one packet.
* A member whose version the history no longer reaches, or whose delivery failed, must be
  re-bootstrapped (:meth:`FanOut.serve` returns ``None``); its re-bootstrap starts a new
  lineage (:meth:`FanOut.join`). Lineages of members holding the same version merge at the
  next build (the oldest wins); lineages nobody follows are dropped.

* ``encoding: auto`` (L3): each member's link chooses the patch encoding that delivers soonest
  over it (:mod:`aiosync.coordination.encodings`); a lineage builds each version once per
  encoding its members chose (one diff, two codings: ``PatchWeightSyncer.sync_encodings``) and
  hands each member its own. A member whose encoding a version was not built in gets the other.

* Members whose explorers live in other processes and take the same packet at the same time
  (a version pushed to every explorer) get it in one *multicast round* (:meth:`FanOut.send`):
  each its own header point to point, the shared bodies broadcast once over a process group of
  the ranks involved (:mod:`aiosync.transports.distributed.multicast`); a member that does not
  come within :data:`ROUND_WAIT`, or a round that fails, falls back to point to point.

The fan-out keeps its own membership table and *returns* what it decided; it never changes a
delivery line's fields. Sharing needs identical receivers: lineages are keyed by the receiver
metadata an explorer sent in its init conversation. A syncer shares when its class declares
``fan_out_mode = "chain"`` (incremental payloads: patch mode) or ``"latest"`` (whole tensors:
bucket mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

import anyio

from ..messages import Shared, payload_nbytes
from ..syncers.base import WeightSyncer
from ..syncers.common.payloads import ShardedPatch, Stamped
from .encodings import LineageCosts, LinkChoice
from .protocol import Packet
from .sources import Published, own_bytes

#: Packets a chain lineage keeps for members that lag behind.
DEFAULT_HISTORY = 8
#: Seconds the first member of a multicast round waits, at most, for the others (they come at
#: once when a version is pushed to every explorer; one that leaves is no longer waited for; one
#: that does not come by then is sent to point to point).
ROUND_WAIT = 2.0


def fan_out_mode(sender: WeightSyncer) -> str | None:
    """``"chain"``, ``"latest"`` or ``None`` (not shareable), as the syncer's class declares."""
    mode = getattr(sender, "fan_out_mode", None)
    return mode if mode in ("chain", "latest") else None


def changed_elements(syncer: WeightSyncer) -> int | None:
    """Elements the syncer's last sync changed, when it knows."""
    stats = getattr(syncer, "statistics", None)
    changed = getattr(stats(), "changed", None) if callable(stats) else None
    return changed if isinstance(changed, int) and not isinstance(changed, bool) else None


def receiver_key(metadata: Any) -> str | None:
    """A fingerprint of the receiver metadata sent in an init conversation (``None``: none sent).
    The handshake's random ``session`` is left out: it differs for every receiver."""
    if metadata is None:
        return None
    if dataclasses.is_dataclass(metadata):
        metadata = dataclasses.asdict(metadata)
    if isinstance(metadata, dict):
        metadata = {k: v for k, v in metadata.items() if k != "session"}
    text = json.dumps(metadata, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def restamp(packet: Packet, session: int | None) -> Packet:
    """``packet`` for a receiver whose handshake is ``session``. A shared payload that carries a
    ``session`` (a patch), or a sharded patch, gets the receiver's stamp beside it
    (:class:`Stamped`: the patch stays the one object every member shares, encoded once); another payload with a
    ``session`` field becomes a shallow copy stamped with it (tensors shared, encoded again for
    each receiver). The same packet object comes back when nothing changes (so its encoded frame
    is reused)."""
    if session is None:
        return packet
    payloads, changed = [], False
    for p in packet.payloads:
        if isinstance(p, ShardedPatch) or (isinstance(p, Shared) and getattr(p.value, "session", None) is not None):
            p = Stamped(session, p)
            changed = True
        elif (dataclasses.is_dataclass(p) and not isinstance(p, type) and hasattr(p, "session")
                and p.session is not None and p.session != session):
            p = dataclasses.replace(p, session=session)
            changed = True
        payloads.append(p)
    return dataclasses.replace(packet, payloads=payloads) if changed else packet


def shared_packet(packet: Packet, sender: WeightSyncer) -> Packet:
    """``packet`` with its payloads wrapped as :class:`Shared` when ``sender``'s receivers take
    them so (``shares_payloads``); a sharded patch is made of shared parts already."""
    if not getattr(sender, "shares_payloads", False):
        return packet
    return dataclasses.replace(packet, payloads=[p if isinstance(p, (Shared, ShardedPatch)) else Shared(p)
                                                 for p in packet.payloads])


@dataclass(eq=False)
class Built:
    """A packet built once by a lineage, from ``base`` (``None``: right after an init).
    ``encoding``: its patch encoding when the lineage builds per link (``encoding: auto``);
    ``alternates``: the same version in each encoding it was built in (this one included)."""

    packet: Packet
    base: int | None
    nbytes: int
    changed: int | None
    build_s: float
    encoding: str | None = None
    alternates: dict = field(default_factory=dict)

    def as_encoding(self, encoding: str | None) -> "Built":
        """This version in ``encoding`` when it was built so, else as it is."""
        return self.alternates.get(encoding, self)


@dataclass(frozen=True)
class Decision:
    """What :meth:`FanOut.serve` decided for a member: send ``chain`` in order (empty: the member
    is up to date); ``built_here``: this member built the newest packet."""

    chain: list
    built_here: bool


@dataclass(eq=False)
class Lineage:
    """One shared sender syncer at ``version`` and the packets it built."""

    id: int
    key: Any
    mode: str
    sender: WeightSyncer
    version: int
    history: deque
    members: set = field(default_factory=set)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    builds: int = 0
    dropped: bool = False
    #: ``encoding: auto``: what each encoding costs, as this lineage's builds measure it.
    costs: LineageCosts | None = None

    def chain_from(self, base: int | None) -> list[Built] | None:
        """Packets taking a member at ``base`` to ``version``; ``None`` when not reachable."""
        if self.mode == "latest":
            newest = self.history[-1] if self.history else None
            if newest is None:
                return None
            return [newest] if base is None or newest.packet.version > base else []
        if base is None:
            return None
        out, at = [], base
        for built in self.history:
            if built.base is not None and built.base == at:
                out.append(built)
                at = built.packet.version
        return out if at == self.version else None

    def trim(self, floor: int) -> None:
        """Let go of the packets every member holds already (versions up to ``floor``); a
        ``latest`` lineage keeps its newest packet."""
        keep = 1 if self.mode == "latest" else 0
        while len(self.history) > keep and self.history[0].packet.version <= floor:
            self.history.popleft()

    @property
    def held_bytes(self) -> int:
        """Bytes of the packets this lineage keeps."""
        return sum(b.nbytes for b in self.history)

    def reaches(self, base: int | None) -> bool:
        """Whether a member at ``base`` can be served from this lineage (now or after a build)."""
        if self.dropped:
            return False
        if self.mode == "latest":
            return True
        return base is not None and (base == self.version or self.chain_from(base) is not None)


@dataclass(eq=False)
class _Round:
    """One multicast round in the making: the members expected, those that joined, the outcome."""

    router: Any
    expected: set
    joined: dict = field(default_factory=dict)
    complete: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    fired: bool = False
    errors: dict = field(default_factory=dict)


def _router(line: Any) -> Any:
    """The multicast router of a line's wire, when the line can take part in a round now."""
    mux = getattr(line.transport, "mux", None)
    if line.closed or mux is None or mux.error is not None or mux.close_sent or mux.peer_closed.is_set():
        return None
    return getattr(getattr(line, "wire", None), "router", None)


@dataclass(frozen=True)
class FanOutStatistics:
    """Counters of a :class:`FanOut` (B6)."""

    builds: int
    shared: int
    lineages: int
    lineages_created: int
    lineages_dropped: int
    attached: int = 0
    #: Deliveries sent in multicast rounds, and the rounds (one version to several processes).
    multicast: int = 0
    multicast_rounds: int = 0
    #: ``encoding: auto``: per explorer, the encoding its link uses now, its measured bandwidth
    #: (bits per second), deliveries measured and switches made.
    links: dict = field(default_factory=dict)


def per_link(sender: WeightSyncer) -> bool:
    """Whether ``sender`` builds a version in several encodings for links to choose from."""
    config = getattr(sender, "config", None)
    return getattr(config, "encoding", None) == "auto" and callable(getattr(sender, "sync_encodings", None))


@dataclass(eq=False)
class FanOut:
    """The lineages of one synchronizer and who follows which (members are delivery lines)."""

    history: int = DEFAULT_HISTORY
    lineages: list = field(default_factory=list)
    builds: int = 0
    shared: int = 0
    lineages_created: int = 0
    lineages_dropped: int = 0
    #: Members that joined an existing lineage at a (re)bootstrap, instead of starting one.
    attached: int = 0
    multicast: int = 0
    multicast_rounds: int = 0
    _member_of: dict = field(default_factory=dict)
    _rounds: dict = field(default_factory=dict)
    #: The version each member holds, as last reported (:meth:`applied`).
    _holds: dict = field(default_factory=dict)
    _next_id: int = 0
    #: ``encoding: auto``: each explorer's link choice, by name (kept across re-bootstraps and
    #: reconnects of the same explorer).
    _choices: dict = field(default_factory=dict)

    def follows(self, member: Hashable) -> bool:
        """Whether ``member`` follows a lineage (its packets come from :meth:`serve`)."""
        return member in self._member_of

    def join(self, member: Hashable, sender: WeightSyncer, key: Any, packet: Packet, build_s: float) -> bool:
        """After ``member`` (re)bootstrapped with ``sender`` and built ``packet``, make that sender
        a lineage ``member`` follows. Returns ``False`` when the syncer cannot be shared (the
        member keeps its sender to itself)."""
        self.leave(member)
        mode = fan_out_mode(sender)
        if mode is None:
            return False
        self._next_id += 1
        built = Built(packet, None, payload_nbytes(packet.payloads), changed_elements(sender), build_s)
        limit = self.history if mode == "chain" else 1
        lineage = Lineage(self._next_id, key, mode, sender, packet.version, deque([built], maxlen=limit),
                          costs=LineageCosts() if per_link(sender) else None)
        lineage.members.add(member)
        self._member_of[member] = lineage
        self.lineages.append(lineage)
        self.lineages_created += 1
        return True

    def applied(self, member: Hashable, version: int | None) -> None:
        """``member``'s explorer holds ``version`` now: packets every member of its lineage
        holds are let go."""
        lineage = self._member_of.get(member)
        if lineage is None or version is None:
            return
        self._holds[member] = version
        held = [self._holds.get(m) for m in lineage.members]
        if all(v is not None for v in held):
            lineage.trim(min(held))

    @property
    def held_bytes(self) -> int:
        """Bytes of every packet the lineages keep."""
        return sum(lin.held_bytes for lin in self.lineages)

    def leave(self, member: Hashable) -> None:
        """``member`` no longer follows its lineage (re-bootstrap, close); lineages nobody
        follows are dropped, and rounds waiting for it stop waiting."""
        self._holds.pop(member, None)
        for rnd in self._rounds.values():
            if member in rnd.expected and member not in rnd.joined:
                rnd.expected.discard(member)
                if len(rnd.joined) >= len(rnd.expected):
                    rnd.complete.set()
        lineage = self._member_of.pop(member, None)
        if lineage is None:
            return
        lineage.members.discard(member)
        if not lineage.members:
            self._drop(lineage)

    def _drop(self, lineage: Lineage) -> None:
        if lineage.dropped:
            return
        lineage.dropped = True
        lineage.sender.close()  # its snapshot (a sharded trainer: on every rank) is freed
        if lineage in self.lineages:
            self.lineages.remove(lineage)
        self.lineages_dropped += 1

    def _move(self, member: Hashable, lineage: Lineage) -> None:
        old = self._member_of.get(member)
        if old is lineage:
            return
        lineage.members.add(member)
        self._member_of[member] = lineage
        if old is not None:
            old.members.discard(member)
            if not old.members:
                self._drop(old)

    async def attach(self, member: Hashable, key: Any, meta: Any, pub: Published, send: Any,
                     like: WeightSyncer) -> Any | None:
        """``member`` (re)bootstraps with receiver metadata ``meta``: put it onto the oldest
        lineage of its layout (``key``) whose sender takes more receivers, at ``pub.version``
        (built first if the lineage is behind it) — its hello and bootstrap are its own, every
        later packet is shared, and no second snapshot is taken. ``like``: the sender the member
        would have had (what its bootstrap holds). Returns its first payload, or ``None`` when no
        lineage can take it (the member then uses ``like``)."""
        candidates = [lin for lin in self.lineages if lin.key == key and lin.mode == "chain" and not lin.dropped
                      and getattr(lin.sender, "accepts_receivers", False) and type(lin.sender) is type(like)]
        if not candidates:
            return None
        lineage = min(candidates, key=lambda lin: lin.id)
        async with lineage.lock:  # no build moves the lineage on while the member joins
            if not lineage.dropped and pub.version > lineage.version:
                await self._build(lineage, pub, self._wanted(lineage))
            if lineage.dropped or pub.version != lineage.version:
                return None
            first = await lineage.sender.accept(pub.state, meta, send, like=like)
        self._move(member, lineage)
        self.attached += 1
        return first

    async def serve(self, member: Hashable, base: int | None, pub: Published) -> Decision | None:
        """The packets taking ``member`` from its applied version ``base`` to ``pub.version`` (or
        newer), building the next one if no member did yet; ``None`` when no lineage reaches
        ``base`` (the member must be re-bootstrapped, and has left its lineage).

        Call it inside the source's ``borrow`` (NCCL: the handshake window is open).
        """
        own = self._member_of.get(member)
        if own is None:
            return None
        candidates = [lin for lin in self.lineages if lin.key == own.key and lin.mode == own.mode and lin.reaches(base)]
        if not candidates:
            self.leave(member)
            return None
        lineage = min(candidates, key=lambda lin: lin.id)
        self._move(member, lineage)
        choice = self._choose(member, lineage)
        async with lineage.lock:
            built_here = False
            if not lineage.dropped and pub.version > lineage.version and lineage.reaches(base):
                await self._build(lineage, pub, self._wanted(lineage))
                built_here = True
            chain = None if lineage.dropped else lineage.chain_from(base)
        if chain is None:
            self.leave(member)
            return None
        if choice is not None and chain:
            chain = [b.as_encoding(choice.encoding) for b in chain]
            choice.served = chain[-1].encoding
        if not built_here and chain:
            self.shared += 1
        return Decision(chain, built_here)

    def _choose(self, member: Hashable, lineage: Lineage) -> LinkChoice | None:
        """``encoding: auto``: update ``member``'s link measurements and choice."""
        if lineage.costs is None:
            return None
        name = getattr(member, "name", str(member))
        choice = self._choices.get(name)
        if choice is None:
            choice = self._choices[name] = LinkChoice(name)
        stats = getattr(member, "stats", None)
        if stats is not None:
            choice.observe(stats)
        choice.decide(lineage.costs.costs)
        return choice

    def _wanted(self, lineage: Lineage) -> tuple[str, ...]:
        """The encodings the next version is built in: those its members' links chose (``flat``
        first: every sender can build it)."""
        if lineage.costs is None:
            return ()
        names = (getattr(m, "name", str(m)) for m in lineage.members)
        chosen = {self._choices[n].encoding for n in names if n in self._choices} or {"flat"}
        if "ctx" in chosen and not lineage.sender.ctx_ready():
            lineage.sender.request_ctx()  # its kernels load in the background; flat meanwhile
        return tuple(e for e in ("flat", "ctx") if e in chosen)

    async def send(self, line: Any, built: Built, packet: Packet) -> None:
        """Send ``packet`` (``built``, restamped for ``line``) on ``line``'s wire: in one
        multicast round with the other members of its lineage that take ``built`` now — at its
        base and busy, their wires routed by the same multicast — or point to point."""
        router = _router(line)
        rnd = self._rounds.get(built)
        if rnd is not None and (rnd.fired or line not in rnd.expected or rnd.router is not router):
            rnd = None
            router = None
        leader = False
        if router is not None and rnd is None:
            lineage = self._member_of.get(line)
            peers = set() if lineage is None else {
                m for m in lineage.members if m is not line and m.busy and m.applied_version == built.base
                and not m.needs_reinit and m not in m.source.waiting and _router(m) is router}
            if peers:
                rnd = self._rounds[built] = _Round(router, {line, *peers})
                leader = True
        if rnd is None:
            await line.transport.send(packet)
            return
        rnd.joined[line] = (line.wire, packet)
        if len(rnd.joined) == len(rnd.expected):
            rnd.complete.set()
        if leader:
            try:
                with anyio.move_on_after(ROUND_WAIT):
                    await rnd.complete.wait()
                rnd.fired = True
                self._rounds.pop(built, None)
                members = list(rnd.joined.items())
                errors = await rnd.router.send([wire_packet for _, wire_packet in members])
                rnd.errors.update({m: e for (m, _), e in zip(members, errors)})
                if len(members) > 1:
                    self.multicast += len(members)
                    self.multicast_rounds += 1
            finally:
                rnd.fired = True
                self._rounds.pop(built, None)
                rnd.done.set()
        else:
            await rnd.done.wait()
        if line not in rnd.errors:  # the leader gave up before sending (cancelled): send it ourselves
            await line.transport.send(packet)
        elif rnd.errors[line] is not None:
            raise rnd.errors[line]

    async def _build(self, lineage: Lineage, pub: Published, encodings: tuple[str, ...] = ()) -> None:
        payloads: list = []

        async def collect(payload: Any) -> None:
            payloads.append(payload)

        t0 = time.perf_counter()
        try:
            if encodings:
                by_encoding = await lineage.sender.sync_encodings(pub.state, pub.version, encodings)
            else:
                await lineage.sender.sync(pub.state, collect, pub.version)
        except BaseException:
            # The sender's snapshot may be half advanced: nobody can build from it any more.
            self._drop(lineage)
            raise
        build_s = time.perf_counter() - t0
        if not encodings:
            packet = shared_packet(own_bytes(Packet(pub.version, payloads), pub), lineage.sender)
            lineage.history.append(Built(packet, lineage.version, payload_nbytes(payloads),
                                         changed_elements(lineage.sender), build_s))
        else:
            stats = lineage.sender.encoding_statistics()
            lineage.costs.observe(stats)
            alternates: dict = {}
            for enc, payload in by_encoding.items():
                packet = shared_packet(own_bytes(Packet(pub.version, [payload]), pub), lineage.sender)
                alternates[enc] = Built(packet, lineage.version, payload_nbytes([payload]), stats[enc].changed, build_s,
                                        enc, alternates)
            lineage.history.append(next(iter(alternates.values())))
        lineage.version = pub.version
        lineage.builds += 1
        self.builds += 1

    def statistics(self) -> FanOutStatistics:
        return FanOutStatistics(self.builds, self.shared, len(self.lineages), self.lineages_created,
                                self.lineages_dropped, self.attached, self.multicast, self.multicast_rounds,
                                {c.name: c.statistics() for c in self._choices.values()})
