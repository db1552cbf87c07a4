"""A simulated network link (T4): latency, bandwidth, jitter and injected faults, seeded.

Built on the in-process transport, so payloads still travel by reference; only time is
simulated, with ``anyio.sleep`` (the event loop keeps running). The model:

* a message occupies the sender's link for ``payload_nbytes / bandwidth`` seconds (messages of
  one endpoint go out one after another, so a big payload delays the next one);
* it then arrives ``latency + U(0, jitter)`` seconds later, never before an earlier message
  (the link stays FIFO) unless a *reorder* fault lets later messages overtake it;
* with probability ``failure_rate`` (or for the next ``n`` sends after :meth:`fail_next`) a send
  raises :class:`aiosync.errors.TransportError` and the payload is lost (a loud failure).

:class:`~aiosync.transports.faults.FaultProfile` adds the quiet faults of a real network and of
real peers (drop, delay, duplicate, reorder, corrupt, truncate, stall, and ``fail`` like
``failure_rate``), each with its own rate, all drawn from the endpoint's seeded RNG; they are
described and drawn in :mod:`aiosync.transports.faults`. A ``stall`` hangs the send (a stuck
link: a sender with a shorter timeout is cancelled in the middle of its sync).

``statistics()`` reports what went through and what was injected, by kind. For tests,
benchmarks and what-if runs (``aiosync simulate``, ``--scenario faults``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import anyio

from ..errors import EndOfStream, TransportError
from .base import Transport, TransportStatistics, payload_nbytes
from .faults import FAULT_KINDS, FaultInjector, FaultProfile, cut_short, flip_byte
from .inproc import InProcTransport, inproc_pair

__all__ = ["SimulatedTransport", "SimulatedTransportStatistics", "simulated_pair", "FaultProfile", "FAULT_KINDS",
           "flip_byte", "cut_short"]


@dataclass(frozen=True)
class SimulatedTransportStatistics(TransportStatistics):
    """A snapshot of one simulated endpoint's counters."""

    #: loud failures (``failure_rate``, :meth:`SimulatedTransport.fail_next`)
    failures_injected: int = 0
    #: seconds its messages occupied the link (bandwidth)
    wire_seconds: float = 0.0
    #: quiet faults injected, by kind (a read-only copy)
    faults: Mapping[str, int] = field(default_factory=lambda: MappingProxyType(dict.fromkeys(FAULT_KINDS, 0)))

    @property
    def faults_injected(self) -> int:
        """Every fault injected: loud failures and quiet faults."""
        return self.failures_injected + sum(self.faults.values())


@dataclass
class SimulatedStats:
    """The live counters of one simulated endpoint (read them through ``statistics()``)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    #: loud failures (``failure_rate``, :meth:`SimulatedTransport.fail_next`)
    failures_injected: int = 0
    wire_seconds: float = 0.0
    #: quiet faults injected, by kind (see :class:`FaultProfile`)
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))

    @property
    def faults_injected(self) -> int:
        """Every fault injected: loud failures and quiet faults."""
        return self.failures_injected + sum(self.faults.values())


@dataclass
class _Envelope:
    payload: Any
    nbytes: int
    arrival: float
    seq: int = 0

    def __lt__(self, other: "_Envelope") -> bool:
        return (self.arrival, self.seq) < (other.arrival, other.seq)


@dataclass(eq=False)
class SimulatedTransport(Transport):
    """One endpoint of a simulated link; make pairs with :func:`simulated_pair`.

    ``latency`` and ``jitter`` are seconds, ``bandwidth`` bytes per second (``None``: unlimited),
    ``failure_rate`` a probability per send, ``faults`` the quiet faults injected into what this
    endpoint sends (assign a new :class:`FaultProfile`, or ``None``, at any time), ``seed`` makes
    jitter and faults reproducible.
    """

    inner: InProcTransport
    latency: float = 0.0
    bandwidth: float | None = None
    jitter: float = 0.0
    failure_rate: float = 0.0
    seed: int | None = 0
    faults: FaultProfile | None = None
    #: Which messages faults may strike (``None``: every one); e.g. only a protocol's data
    #: messages, when its control messages assume a reliable link. Failures and quiet faults alike.
    faults_where: Callable[[Any], bool] | None = None
    stats: SimulatedStats = field(default_factory=SimulatedStats)
    _rng: random.Random = field(init=False, repr=False)
    _wire: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    _last_arrival: float = field(default=0.0, repr=False)
    _fail_next: int = field(default=0, repr=False)
    _heap: list = field(default_factory=list, repr=False)
    _injector: FaultInjector = field(init=False, repr=False)
    _seq: Any = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0:
            raise ValueError("latency and jitter must be >= 0 seconds")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be None (unlimited) or > 0 bytes per second")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be a probability in [0, 1]")
        self._rng = random.Random(self.seed)
        self._injector = FaultInjector(self._rng, self.stats.faults)

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` sends fail (deterministic failure injection)."""
        self._fail_next += n

    def inject(self, kind: str, n: int = 1) -> None:
        """Inject fault ``kind`` (one of :data:`FAULT_KINDS`) into the next ``n`` messages it
        applies to (``corrupt`` and ``truncate``: the next ``n`` that hold a tensor), whatever
        the rates. Deterministic fault injection for tests."""
        self._injector.force(kind, n)
        if self.faults is None:
            self.faults = FaultProfile()

    def wire_time(self, nbytes: int) -> float:
        """Seconds a payload of ``nbytes`` occupies the link (without latency)."""
        return 0.0 if self.bandwidth is None else nbytes / self.bandwidth

    def statistics(self) -> SimulatedTransportStatistics:
        """A frozen snapshot of this end's counters."""
        s = self.stats
        return SimulatedTransportStatistics(s.messages_sent, s.bytes_sent, s.messages_received, s.bytes_received,
                                            s.failures_injected, s.wire_seconds, MappingProxyType(dict(s.faults)))

    def _roll(self, kind: str) -> bool:
        return self._injector.roll(self.faults, kind)

    async def send(self, payload: Any) -> None:
        if self.faults_where is not None and not self.faults_where(payload):
            return await self._send_clean(payload)
        if self._fail_next > 0 or (self.failure_rate and self._rng.random() < self.failure_rate):
            self._fail_next = max(0, self._fail_next - 1)
            self.stats.failures_injected += 1
            raise TransportError("simulated transport failure: the payload was lost")
        if self.faults is not None and self._roll("fail"):
            raise TransportError("simulated transport failure (injected fault): the payload was lost")
        if self.faults is not None and self._roll("stall"):
            await anyio.sleep(self.faults.stall_s)  # a hung link; a cancelled sender loses the message
        nbytes = payload_nbytes(payload)
        async with self._wire:
            busy = self.wire_time(nbytes)
            if busy > 0:
                await anyio.sleep(busy)
            self.stats.wire_seconds += busy
            if self.faults is not None and self._roll("drop"):
                self.stats.messages_sent += 1  # it went out; the network lost it
                self.stats.bytes_sent += nbytes
                return
            delay = self.latency + (self._rng.random() * self.jitter if self.jitter else 0.0)
            if self.faults is not None:
                payload = self._injector.mangle(self.faults, payload, "corrupt")
                payload = self._injector.mangle(self.faults, payload, "truncate")
                if self._roll("delay"):
                    delay += self._rng.random() * self.faults.delay_max
            arrival = max(time.monotonic() + delay, self._last_arrival)
            if self.faults is not None and self._roll("reorder"):
                # held back without holding back the messages sent after it
                arrival += self._rng.random() * self.faults.reorder_max
            else:
                self._last_arrival = arrival
            copies = 2 if (self.faults is not None and self._roll("duplicate")) else 1
            for i in range(copies):
                await self.inner.send(_Envelope(payload, nbytes, arrival + 1e-6 * i, next(self._seq)))
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    async def _send_clean(self, payload: Any) -> None:
        """A message faults may not strike: latency, jitter and bandwidth only."""
        nbytes = payload_nbytes(payload)
        async with self._wire:
            busy = self.wire_time(nbytes)
            if busy > 0:
                await anyio.sleep(busy)
            self.stats.wire_seconds += busy
            delay = self.latency + (self._rng.random() * self.jitter if self.jitter else 0.0)
            arrival = max(time.monotonic() + delay, self._last_arrival)
            self._last_arrival = arrival
            await self.inner.send(_Envelope(payload, nbytes, arrival, next(self._seq)))
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    async def recv(self) -> Any:
        # Envelopes wait in a heap ordered by arrival time, so a reordered message can be
        # overtaken; a cancelled wait keeps them all for the next call, so nothing is lost.
        while True:
            self._pull_ready()
            if self._heap:
                wait = self._heap[0].arrival - time.monotonic()
                if wait <= 0:
                    return self._deliver(heapq.heappop(self._heap))
                with anyio.move_on_after(wait):
                    try:
                        heapq.heappush(self._heap, await self.inner.recv())
                    except EndOfStream:
                        await anyio.sleep(wait)  # the peer closed: deliver what is still in flight
                continue
            heapq.heappush(self._heap, await self.inner.recv())

    def _pull_ready(self) -> None:
        rx = self.inner._rx
        while True:
            try:
                heapq.heappush(self._heap, rx.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    def _deliver(self, envelope: _Envelope) -> Any:
        self.stats.messages_received += 1
        self.stats.bytes_received += envelope.nbytes
        return envelope.payload

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        """Close this endpoint without waiting."""
        self.inner.close()


def simulated_pair(
    *,
    latency: float = 0.0,
    bandwidth: float | None = None,
    jitter: float = 0.0,
    failure_rate: float = 0.0,
    seed: int | None = 0,
    timeout: float | None = 600.0,
    faults: FaultProfile | None = None,
) -> tuple[SimulatedTransport, SimulatedTransport]:
    """Two connected simulated endpoints with the same link profile (independent seeded RNGs).

    ``faults`` applies to both directions (each endpoint gets its own copy, so they can be
    changed independently later).
    """
    a, b = inproc_pair(timeout=timeout)
    a.count_bytes = b.count_bytes = False
    kw = dict(latency=latency, bandwidth=bandwidth, jitter=jitter, failure_rate=failure_rate)
    seed_b = None if seed is None else seed + 1
    fa = dataclasses.replace(faults) if faults is not None else None
    fb = dataclasses.replace(faults) if faults is not None else None
    return SimulatedTransport(a, seed=seed, faults=fa, **kw), SimulatedTransport(b, seed=seed_b, faults=fb, **kw)
