"""A simulated network link (T4): latency, bandwidth, jitter and injected failures, seeded.

Built on the in-process transport, so payloads still travel by reference; only time is
simulated, with ``anyio.sleep`` (the event loop keeps running). The model:

* a message occupies the sender's link for ``payload_nbytes / bandwidth`` seconds (messages of
  one endpoint go out one after another, so a big payload delays the next one);
* it then arrives ``latency + U(0, jitter)`` seconds later, never before an earlier message
  (the link stays FIFO);
* with probability ``failure_rate`` (or for the next ``n`` sends after :meth:`fail_next`) a send
  raises :class:`aiosync.errors.TransportError` and the payload is lost.

For tests, benchmarks and what-if runs (``aiosync simulate``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import TransportError
from .base import Transport, payload_nbytes
from .inproc import InProcTransport, inproc_pair


@dataclass
class SimulatedStats:
    """Counters of one simulated endpoint."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    failures_injected: int = 0
    wire_seconds: float = 0.0


@dataclass
class _Envelope:
    payload: Any
    nbytes: int
    arrival: float


@dataclass(eq=False)
class SimulatedTransport(Transport):
    """One endpoint of a simulated link; make pairs with :func:`simulated_pair`.

    ``latency`` and ``jitter`` are seconds, ``bandwidth`` bytes per second (``None``: unlimited),
    ``failure_rate`` a probability per send, ``seed`` makes jitter and failures reproducible.
    """

    inner: InProcTransport
    latency: float = 0.0
    bandwidth: float | None = None
    jitter: float = 0.0
    failure_rate: float = 0.0
    seed: int | None = 0
    stats: SimulatedStats = field(default_factory=SimulatedStats)
    _rng: random.Random = field(init=False, repr=False)
    _wire: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    _last_arrival: float = field(default=0.0, repr=False)
    _fail_next: int = field(default=0, repr=False)
    _held: _Envelope | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0:
            raise ValueError("latency and jitter must be >= 0 seconds")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be None (unlimited) or > 0 bytes per second")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be a probability in [0, 1]")
        self._rng = random.Random(self.seed)

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` sends fail (deterministic failure injection)."""
        self._fail_next += n

    def wire_time(self, nbytes: int) -> float:
        """Seconds a payload of ``nbytes`` occupies the link (without latency)."""
        return 0.0 if self.bandwidth is None else nbytes / self.bandwidth

    async def send(self, payload: Any) -> None:
        if self._fail_next > 0 or (self.failure_rate and self._rng.random() < self.failure_rate):
            self._fail_next = max(0, self._fail_next - 1)
            self.stats.failures_injected += 1
            raise TransportError("simulated transport failure: the payload was lost")
        nbytes = payload_nbytes(payload)
        async with self._wire:
            busy = self.wire_time(nbytes)
            if busy > 0:
                await anyio.sleep(busy)
            self.stats.wire_seconds += busy
            delay = self.latency + (self._rng.random() * self.jitter if self.jitter else 0.0)
            arrival = max(time.monotonic() + delay, self._last_arrival)
            self._last_arrival = arrival
            await self.inner.send(_Envelope(payload, nbytes, arrival))
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    async def recv(self) -> Any:
        # A cancelled wait keeps the envelope for the next call, so nothing is lost.
        if self._held is None:
            self._held = await self.inner.recv()
        envelope = self._held
        delay = envelope.arrival - time.monotonic()
        if delay > 0:
            await anyio.sleep(delay)
        self._held = None
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
) -> tuple[SimulatedTransport, SimulatedTransport]:
    """Two connected simulated endpoints with the same link profile (independent seeded RNGs)."""
    a, b = inproc_pair(timeout=timeout)
    a.count_bytes = b.count_bytes = False
    kw = dict(latency=latency, bandwidth=bandwidth, jitter=jitter, failure_rate=failure_rate)
    seed_b = None if seed is None else seed + 1
    return SimulatedTransport(a, seed=seed, **kw), SimulatedTransport(b, seed=seed_b, **kw)
