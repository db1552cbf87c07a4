"""Fan-out (S12): one payload built once, delivered to every explorer at the same base version.

Without fan-out each explorer's link owns a sender syncer (and, in patch mode, a snapshot) and
builds its own payload for every version. With it, links share a :class:`Lineage`: one sender
syncer whose snapshot is at ``version``, plus the last few packets it built (``history``).

* An explorer at the lineage's version gets the packet built for the next version; the first
  link to ask builds it (under the lineage's lock), the others reuse it — in process by
  reference, across processes the encoded frame is reused too.
* An explorer that lags (its own delivery line coalesced a few versions away) gets the chain
  of cached packets from its version on, each applied atomically; a bucket lineage just sends
  its newest packet (buckets carry whole tensors, so any older version can take it).
* An explorer whose version the history no longer reaches, or whose delivery failed, is
  re-bootstrapped, which starts a new lineage; lineages of explorers holding the same
  version merge at the next build (the oldest lineage wins), lineages nobody uses are dropped.

Coalescing stays per explorer (:class:`aiosync.coordination.link.SenderLink`). Sharing needs
identical receivers: lineages are keyed by the receiver metadata the explorer sent during its
init conversation (keys, shapes, dtypes, aliases). Only :class:`PatchWeightSyncer` (``chain``)
and :class:`BucketWeightSyncer` (``latest``) lineages are shared; a custom syncer may declare
``fan_out_mode = "chain" | "latest"``; anything else keeps one private sender per explorer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..syncers.base import WeightSyncer
from ..transports.base import payload_nbytes

#: Packets a chain lineage keeps for explorers that lag behind.
DEFAULT_HISTORY = 8


def fan_out_mode(sender: WeightSyncer) -> str | None:
    """``"chain"`` (incremental payloads: patch mode), ``"latest"`` (whole tensors: bucket mode)
    or ``None`` (not shareable)."""
    mode = getattr(sender, "fan_out_mode", None)
    if mode in ("chain", "latest"):
        return mode
    from ..syncers.bucket import BucketWeightSyncer
    from ..syncers.patch import PatchWeightSyncer

    if isinstance(sender, PatchWeightSyncer):
        return "chain"
    if isinstance(sender, BucketWeightSyncer):
        return "latest"
    return None


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


def restamp(packet: Any, session: int | None) -> Any:
    """``packet`` for a receiver whose handshake is ``session``: payloads that carry a
    ``session`` field (patches) are shallow copies stamped with it, tensors shared. The same
    packet object comes back when nothing changes (so its encoded frame is reused)."""
    if session is None:
        return packet
    payloads, changed = [], False
    for p in packet.payloads:
        if (dataclasses.is_dataclass(p) and not isinstance(p, type) and hasattr(p, "session")
                and p.session is not None and p.session != session):
            p = dataclasses.replace(p, session=session)
            changed = True
        payloads.append(p)
    return dataclasses.replace(packet, payloads=payloads) if changed else packet


@dataclass(eq=False)
class Built:
    """A packet built once by a lineage, from ``base`` (``None``: right after an init)."""

    packet: Any
    base: int | None
    nbytes: int
    changed: int | None
    build_s: float


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

    def chain_from(self, base: int | None) -> list[Built] | None:
        """Packets taking an explorer at ``base`` to ``version``; ``None`` when not reachable."""
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

    def reaches(self, base: int | None) -> bool:
        """Whether an explorer at ``base`` can be served from this lineage (now or after a build)."""
        if self.dropped:
            return False
        if self.mode == "latest":
            return True
        return base is not None and (base == self.version or self.chain_from(base) is not None)


@dataclass
class FanOutStats:
    """Counters of a :class:`FanOut` (B6)."""

    builds: int = 0
    shared: int = 0
    lineages_created: int = 0
    lineages_dropped: int = 0


@dataclass(eq=False)
class FanOut:
    """The lineages of one synchronizer, shared by its explorers' links."""

    history: int = DEFAULT_HISTORY
    stats: FanOutStats = field(default_factory=FanOutStats)
    lineages: list = field(default_factory=list)
    _next_id: int = 0

    def adopt(self, link: Any, sender: WeightSyncer, key: Any, packet: Any, build_s: float) -> Lineage | None:
        """After ``link`` (re)bootstrapped with ``sender`` and built ``packet``, make that sender a
        lineage (``None`` when the syncer cannot be shared)."""
        self.leave(link)
        mode = fan_out_mode(sender)
        if mode is None:
            return None
        self._next_id += 1
        limit = self.history if mode == "chain" else 1
        changed = (sender.last_stats or {}).get("changed")
        built = Built(packet, None, payload_nbytes(packet.payloads), changed if isinstance(changed, int) else None,
                      build_s)
        lineage = Lineage(self._next_id, key, mode, sender, packet.version, deque([built], maxlen=limit))
        lineage.members.add(link)
        link.lineage, link.sender = lineage, sender
        self.lineages.append(lineage)
        self.stats.lineages_created += 1
        return lineage

    def leave(self, link: Any) -> None:
        """``link`` no longer follows its lineage (re-bootstrap, close); drop lineages nobody uses."""
        lineage = getattr(link, "lineage", None)
        if lineage is None:
            return
        lineage.members.discard(link)
        # The shared sender is no longer this link's: it must never build from it on its own.
        link.lineage, link.sender, link.needs_reinit = None, None, True
        if not lineage.members:
            self._drop(lineage)

    def _drop(self, lineage: Lineage) -> None:
        if lineage.dropped:
            return
        lineage.dropped = True
        if lineage in self.lineages:
            self.lineages.remove(lineage)
        self.stats.lineages_dropped += 1

    def _move(self, link: Any, lineage: Lineage) -> None:
        if link.lineage is lineage:
            return
        old = link.lineage
        lineage.members.add(link)
        link.lineage = lineage
        link.sender = lineage.sender
        if old is not None:
            old.members.discard(link)
            if not old.members:
                self._drop(old)

    async def packets(self, link: Any, pub: Any) -> tuple[list[Built], bool] | None:
        """The packets taking ``link``'s explorer from its applied version to ``pub.version`` (or
        newer), building the next one if nobody did yet; ``None`` when no lineage reaches the
        explorer's version (it must be re-bootstrapped). Returns ``(packets, built_here)``.

        Call it inside the source's ``borrow`` (NCCL: the handshake window is open).
        """
        own = link.lineage
        if own is None:
            return None
        base = link.applied_version
        candidates = [lin for lin in self.lineages
                      if lin.key == own.key and lin.mode == own.mode and lin.reaches(base)]
        if not candidates:
            return None
        lineage = min(candidates, key=lambda lin: lin.id)
        self._move(link, lineage)
        async with lineage.lock:
            if lineage.dropped:
                return None
            built_here = False
            if pub.version > lineage.version:
                if not lineage.reaches(base):
                    return None
                await self._build(lineage, pub)
                built_here = True
            chain = lineage.chain_from(base)
        if chain is None:
            return None
        if not built_here and chain:
            self.stats.shared += 1
        return chain, built_here

    async def _build(self, lineage: Lineage, pub: Any) -> None:
        from .link import Packet

        payloads: list = []

        async def collect(payload: Any) -> None:
            payloads.append(payload)

        t0 = time.perf_counter()
        try:
            await lineage.sender.sync(pub.state, collect, pub.version)
        except BaseException:
            # The sender's snapshot may be half advanced: nobody can build from it any more.
            self._drop(lineage)
            raise
        build_s = time.perf_counter() - t0
        changed = (lineage.sender.last_stats or {}).get("changed")
        lineage.history.append(Built(Packet(pub.version, payloads), lineage.version, payload_nbytes(payloads),
                                     changed if isinstance(changed, int) else None, build_s))
        lineage.version = pub.version
        lineage.builds += 1
        self.stats.builds += 1

    def summary(self) -> dict[str, Any]:
        """Plain counters for :meth:`aiosync.Synchronizer.metrics`."""
        return {"builds": self.stats.builds, "shared": self.stats.shared, "lineages": len(self.lineages),
                "lineages_created": self.stats.lineages_created, "lineages_dropped": self.stats.lineages_dropped}
