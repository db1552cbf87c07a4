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
built, ``S`` from builds of an encoding alone) and the link's own deliveries (``B``: bytes over
the seconds from send to the explorer's answer, less its apply; ``R``: the explorer's apply
seconds); ``ctx`` is estimated from ``flat`` (:data:`CTX_VS_FLAT`) until it is measured, and the
first build and the first delivery in an encoding (its set-up) are not counted. A link switches only when its bandwidth is clearly on the other side of the
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
    _served_count: dict = field(default_factory=dict)

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
            self._served_count[self.served] = self._served_count.get(self.served, 0) + 1
            if self._served_count[self.served] > 1:  # the first one pays set-up (kernels, pools) once
                self.receiver_s[self.served] = _ewma(self.receiver_s.get(self.served), apply / changed)

    def costs(self, costs: dict[str, Cost]) -> dict[str, Cost]:
        """The lineage's ``costs`` with this link's receiver seconds where it measured them (``ctx``
        estimated from ``flat`` until it was served ``ctx``)."""
        flat_r = self.receiver_s.get("flat")
        if flat_r is None:
            return costs
        ctx_r = self.receiver_s.get("ctx", flat_r * CTX_VS_FLAT.receiver_s_per_changed)
        rs = {"flat": flat_r, "ctx": ctx_r}
        return {e: Cost(c.bytes_per_changed, c.sender_s_per_changed, rs[e]) for e, c in costs.items()}

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


#: Until ``ctx`` is measured, its cost relative to ``flat``'s (``aiosync bench``, 100 M elements:
#: sender build + encode 2.35×, receiver apply 1.6×, bytes 0.72×).
CTX_VS_FLAT = Cost(bytes_per_changed=0.72, sender_s_per_changed=2.35, receiver_s_per_changed=1.6)


def _scaled(flat: Cost) -> Cost:
    r = CTX_VS_FLAT
    return Cost(flat.bytes_per_changed * r.bytes_per_changed, flat.sender_s_per_changed * r.sender_s_per_changed,
                flat.receiver_s_per_changed * r.receiver_s_per_changed)


@dataclass
class LineageCosts:
    """A lineage's running estimate of each encoding's :class:`Cost`: the bytes from every build of
    it, the sender's seconds from builds of it alone (a build in both encodings runs an extra diff
    pass, so it says nothing about either alone), the first build of each left out (set-up).
    Until ``ctx`` is measured it is estimated from ``flat`` (:data:`CTX_VS_FLAT`)."""

    measured: dict = field(default_factory=dict)
    _builds: dict = field(default_factory=dict)

    @property
    def costs(self) -> dict[str, Cost]:
        flat = self.measured.get("flat", DEFAULT_COSTS["flat"])
        ctx = self.measured.get("ctx")
        if ctx is None:
            ctx = _scaled(flat) if "flat" in self.measured else DEFAULT_COSTS["ctx"]
        return {"flat": flat, "ctx": ctx}

    def observe(self, by_encoding: dict[str, Any]) -> None:
        """Take a build's per-encoding statistics (``bytes``, ``changed``, ``build_s``, ``encode_s``)."""
        alone = len(by_encoding) == 1
        for enc, st in by_encoding.items():
            if enc not in ENCODINGS or not st.changed:
                continue
            self._builds[enc] = self._builds.get(enc, 0) + 1
            if self._builds[enc] == 1:
                continue  # the first build of an encoding pays its set-up (statistics, scratch) once
            old = self.measured.get(enc) or self.costs[enc]
            sender = old.sender_s_per_changed
            if alone:
                sender = _ewma(self.measured[enc].sender_s_per_changed if enc in self.measured else None,
                               ((st.build_s or 0.0) + (st.encode_s or 0.0)) / st.changed)
            self.measured[enc] = Cost(_ewma(old.bytes_per_changed, st.bytes / st.changed), sender,
                                      old.receiver_s_per_changed)
