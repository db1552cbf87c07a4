"""``encoding: auto`` (L3): each explorer link picks the patch encoding that delivers a version
soonest over it, from what it measures as versions flow.

Delivering one version over a link of ``B`` bytes per second in encoding ``e`` takes about::

    T(e) = S(e) + R(e) + bytes(e) / B

``S`` the sender's coding seconds, ``R`` the receiver's (decoding and writing), ``bytes`` the
patch. ``flat`` is the cheaper to code, ``ctx`` the smaller (about 30 % fewer bytes on RL
updates), so ``ctx`` pays below the *break-even* bandwidth ``(bytes(flat) - bytes(ctx)) /
(S(ctx) + R(ctx) - S(flat) - R(flat))`` and ``flat`` above it. Before a link has measured anything
the estimates come from :data:`DEFAULT_COSTS` (per changed element, as ``aiosync bench`` measured
them: ``docs/performance.md``); then from the lineage's builds (``bytes`` of each encoding it
built; ``S`` of both, from a version built in both) and the link's own deliveries (``B``: bytes
over the seconds from send to the explorer's answer, less its apply; ``R`` of both, once it was
served in both). Only differences decide, so both encodings' seconds are always taken under the
same conditions. A link switches only when its bandwidth is clearly on the other side of the
break-even (:data:`HYSTERESIS`) and it has measured :data:`MIN_DELIVERIES` deliveries.

:class:`~aiosync.coordination.fanout.FanOut` builds each version once per encoding its links chose
and hands each link its own; ``Synchronizer.metrics()["fanout"]["links"]`` says what each chose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENCODINGS = ("flat", "ctx")


@dataclass(frozen=True)
class Cost:
    """What coding one changed element costs in an encoding: payload bytes, and seconds of
    coding on the sender and of decoding plus writing on the receiver."""

    bytes_per_changed: float
    sender_s_per_changed: float
    receiver_s_per_changed: float

    @property
    def seconds_per_changed(self) -> float:
        return self.sender_s_per_changed + self.receiver_s_per_changed


#: The estimates a link starts from (2-core CPU, bf16 receiver, the bench's RL update; measured by
#: ``aiosync bench``, which prints the break-even they give: ``break_even_bps``).
DEFAULT_COSTS = {
    "flat": Cost(bytes_per_changed=1.10, sender_s_per_changed=20e-9, receiver_s_per_changed=15e-9),
    "ctx": Cost(bytes_per_changed=0.78, sender_s_per_changed=45e-9, receiver_s_per_changed=25e-9),
}
#: A link takes ``ctx`` below this fraction of the break-even, and ``flat`` again above its inverse.
HYSTERESIS = 0.8
#: Deliveries a link measures before its first switch.
MIN_DELIVERIES = 2
#: Weight of the newest measurement in the running estimates.
SMOOTHING = 0.3


def break_even_bps(costs: dict[str, Cost] | None = None) -> float:
    """The link bandwidth (bits per second) below which ``ctx`` delivers sooner than ``flat``."""
    costs = costs or DEFAULT_COSTS
    flat, ctx = costs["flat"], costs["ctx"]
    extra = ctx.seconds_per_changed - flat.seconds_per_changed
    saved = flat.bytes_per_changed - ctx.bytes_per_changed
    if saved <= 0:
        return 0.0
    return float("inf") if extra <= 0 else 8 * saved / extra


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class LinkChoice:
    """One explorer link's measurements and the encoding it uses now."""

    name: str
    encoding: str = "flat"
    #: Bytes per second the link delivers (running estimate; ``None``: not measured yet).
    bandwidth: float | None = None
    #: Receiver seconds per changed element, per encoding it was served in.
    receiver_s: dict = field(default_factory=dict)
    deliveries: int = 0
    switches: int = 0
    #: The encoding it was served last (what the next measurement is about).
    served: str | None = None
    _seen: tuple = (0, 0.0, 0.0, 0, 0)

    def observe(self, stats: Any) -> None:
        """Take the deliveries finished since the last look from a delivery line's ``stats``
        (``bytes_sent``, ``changed_elements``, ``transfer_s``, ``apply_s``, ``delivered``)."""
        now = (stats.bytes_sent, stats.transfer_s.total, stats.apply_s.total, stats.changed_elements, stats.delivered)
        nbytes, transfer, apply, changed, delivered = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        if delivered <= 0:
            return
        self.deliveries += delivered
        if transfer > 0 and nbytes > 0:
            self.bandwidth = _ewma(self.bandwidth, nbytes / transfer)
        if self.served is not None and changed > 0 and apply >= 0:
            self.receiver_s[self.served] = _ewma(self.receiver_s.get(self.served), apply / changed)

    def costs(self, costs: dict[str, Cost]) -> dict[str, Cost]:
        """The lineage's ``costs`` with this link's receiver seconds, once it measured both."""
        if not all(e in self.receiver_s for e in ENCODINGS):
            return costs
        return {e: Cost(c.bytes_per_changed, c.sender_s_per_changed, self.receiver_s[e]) for e, c in costs.items()}

    def decide(self, costs: dict[str, Cost]) -> str:
        """The encoding for the next version (and remember it): ``ctx`` once the link's bandwidth
        is below the break-even by :data:`HYSTERESIS`, ``flat`` once above it by as much."""
        if self.deliveries >= MIN_DELIVERIES and self.bandwidth is not None:
            edge = break_even_bps(self.costs(costs)) / 8
            bandwidth = self.bandwidth
            if self.encoding == "flat" and bandwidth < HYSTERESIS * edge:
                self.encoding = "ctx"
                self.switches += 1
            elif self.encoding == "ctx" and bandwidth * HYSTERESIS > edge:
                self.encoding = "flat"
                self.switches += 1
        return self.encoding

    def statistics(self) -> dict[str, Any]:
        return {"encoding": self.encoding, "bandwidth_bps": None if self.bandwidth is None else 8 * self.bandwidth,
                "deliveries": self.deliveries, "switches": self.switches, "served": self.served,
                "receiver_s_per_changed": dict(self.receiver_s)}


@dataclass
class LineageCosts:
    """A lineage's running estimate of each encoding's :class:`Cost` (its builds measure the
    sender's part and the bytes; links measure the receiver's part themselves)."""

    costs: dict = field(default_factory=lambda: dict(DEFAULT_COSTS))

    def observe(self, by_encoding: dict[str, Any]) -> None:
        """Take a build's per-encoding statistics (``bytes``, ``changed``, ``build_s``,
        ``encode_s``): the bytes of each encoding built; the sender's seconds only from a
        version built in both (one diff, two codings: comparable)."""
        both = all(e in by_encoding for e in ENCODINGS)
        for enc, st in by_encoding.items():
            if enc not in self.costs or not st.changed:
                continue
            old = self.costs[enc]
            sender = old.sender_s_per_changed
            if both:
                sender = _ewma(sender, ((st.build_s or 0.0) + (st.encode_s or 0.0)) / st.changed)
            self.costs[enc] = Cost(_ewma(old.bytes_per_changed, st.bytes / st.changed), sender,
                                   old.receiver_s_per_changed)
