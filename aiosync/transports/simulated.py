"""A simulated network link (T4): latency, bandwidth, jitter and injected faults, seeded.

Built on the in-process transport, so payloads still travel by reference; only time is
simulated, with ``anyio.sleep`` (the event loop keeps running). The model:

* a message occupies the sender's link for ``payload_nbytes / bandwidth`` seconds (messages of
  one endpoint go out one after another, so a big payload delays the next one);
* it then arrives ``latency + U(0, jitter)`` seconds later, never before an earlier message
  (the link stays FIFO) unless a *reorder* fault lets later messages overtake it;
* with probability ``failure_rate`` (or for the next ``n`` sends after :meth:`fail_next`) a send
  raises :class:`aiosync.errors.TransportError` and the payload is lost (a loud failure).

:class:`FaultProfile` adds the quiet faults of a real network and of real peers, each with its
own rate (a probability per message), all drawn from the endpoint's seeded RNG:

* ``fail`` — the send raises :class:`aiosync.errors.TransportError` (like ``failure_rate``);
* ``drop`` — the send succeeds but the message never arrives;
* ``delay`` — the message is held back ``U(0, delay_max)`` extra seconds (FIFO kept);
* ``duplicate`` — the message arrives twice;
* ``reorder`` — the message is held back ``U(0, reorder_max)`` seconds and later messages may
  overtake it;
* ``corrupt`` — one byte of one tensor of the message is flipped (in a copy: the sender's
  tensors are never touched);
* ``truncate`` — one tensor of the message is cut short (a copy, flattened to 1-D);
* ``stall`` — the send hangs ``stall_s`` seconds before the message goes out (a stuck link: a
  sender with a shorter timeout is cancelled in the middle of its sync).

``stats.faults`` counts what was injected, by kind. For tests, benchmarks and what-if runs
(``aiosync simulate``, ``--scenario faults``).
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..errors import EndOfStream, TransportError
from .base import Transport, payload_nbytes
from .inproc import InProcTransport, inproc_pair

FAULT_KINDS = ("fail", "drop", "delay", "duplicate", "reorder", "corrupt", "truncate", "stall")


@dataclass
class FaultProfile:
    """Rates (probability per message, in [0, 1]) of the faults a simulated endpoint injects
    into what it sends, and their sizes in seconds. All zero: no faults."""

    fail: float = 0.0
    drop: float = 0.0
    delay: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    truncate: float = 0.0
    stall: float = 0.0
    #: extra seconds of a delayed message: ``U(0, delay_max)``
    delay_max: float = 0.05
    #: extra seconds of a reordered message: ``U(0, reorder_max)``
    reorder_max: float = 0.05
    #: seconds a stalled send hangs
    stall_s: float = 1.0

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            rate = getattr(self, kind)
            if not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
                raise ValueError(f"fault rate {kind} must be a probability in [0, 1], got {rate!r}")
        for name in ("delay_max", "reorder_max", "stall_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds")

    @classmethod
    def uniform(cls, rate: float, **sizes: float) -> "FaultProfile":
        """Every kind of fault at the same ``rate``."""
        return cls(**{kind: rate for kind in FAULT_KINDS}, **sizes)

    @property
    def active(self) -> bool:
        return any(getattr(self, kind) for kind in FAULT_KINDS)


@dataclass
class SimulatedStats:
    """Counters of one simulated endpoint."""

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


# ------------------------------------------------------------------ tensor faults
def _tensor_paths(obj: Any, path: tuple = (), out: list | None = None, depth: int = 0) -> list[tuple]:
    """Paths to every non-empty tensor inside ``obj`` (dataclasses, dicts, lists, tuples)."""
    out = [] if out is None else out
    if depth > 16:
        return out
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 0:
            out.append(path)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensor_paths(v, path + (k,), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensor_paths(v, path + (i,), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensor_paths(getattr(obj, f.name), path + (f.name,), out, depth + 1)
    return out


def _replace_at(obj: Any, path: tuple, fn) -> Any:
    """A copy of ``obj`` with the tensor at ``path`` replaced by ``fn(tensor)``; containers on
    the path are copied, everything else is shared."""
    if not path:
        return fn(obj)
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        out[head] = _replace_at(obj[head], rest, fn)
        return out
    if isinstance(obj, (list, tuple)):
        items = list(obj)
        items[head] = _replace_at(obj[head], rest, fn)
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    out = copy.copy(obj)
    object.__setattr__(out, head, _replace_at(getattr(obj, head), rest, fn))
    return out


def flip_byte(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A copy of ``t`` with one byte XOR-ed with a random non-zero mask."""
    out = t.detach().clone().contiguous()
    raw = out.reshape(-1).view(torch.uint8)
    i = rng.randrange(raw.numel())
    raw[i] ^= rng.randrange(1, 256)
    return out


def cut_short(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A flattened copy of ``t`` without its last ``1 … numel`` elements."""
    flat = t.detach().reshape(-1)
    keep = rng.randrange(flat.numel())
    return flat[:keep].clone()


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
    stats: SimulatedStats = field(default_factory=SimulatedStats)
    _rng: random.Random = field(init=False, repr=False)
    _wire: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    _last_arrival: float = field(default=0.0, repr=False)
    _fail_next: int = field(default=0, repr=False)
    _heap: list = field(default_factory=list, repr=False)
    _forced: dict = field(default_factory=dict, repr=False)
    _seq: Any = field(default_factory=itertools.count, repr=False)

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

    def inject(self, kind: str, n: int = 1) -> None:
        """Inject fault ``kind`` (one of :data:`FAULT_KINDS`) into the next ``n`` messages it
        applies to (``corrupt`` and ``truncate``: the next ``n`` that hold a tensor), whatever
        the rates. Deterministic fault injection for tests."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; valid: {', '.join(FAULT_KINDS)}")
        self._forced[kind] = self._forced.get(kind, 0) + n
        if self.faults is None:
            self.faults = FaultProfile()

    def wire_time(self, nbytes: int) -> float:
        """Seconds a payload of ``nbytes`` occupies the link (without latency)."""
        return 0.0 if self.bandwidth is None else nbytes / self.bandwidth

    def _draw(self, kind: str) -> bool:
        if self._forced.get(kind):
            return True
        f = self.faults
        rate = getattr(f, kind) if f is not None else 0.0
        return bool(rate) and self._rng.random() < rate

    def _count(self, kind: str) -> None:
        if self._forced.get(kind):
            self._forced[kind] -= 1
        self.stats.faults[kind] += 1

    def _roll(self, kind: str) -> bool:
        if self._draw(kind):
            self._count(kind)
            return True
        return False

    def _mangle(self, payload: Any, kind: str) -> Any:
        """``payload`` with one tensor corrupted or truncated (``payload`` itself if it holds none)."""
        if not self._draw(kind):
            return payload
        paths = _tensor_paths(payload)
        if not paths:
            return payload
        path = paths[self._rng.randrange(len(paths))]
        self._count(kind)
        return _replace_at(payload, path, lambda t: (flip_byte if kind == "corrupt" else cut_short)(t, self._rng))

    async def send(self, payload: Any) -> None:
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
                payload = self._mangle(payload, "corrupt")
                payload = self._mangle(payload, "truncate")
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
