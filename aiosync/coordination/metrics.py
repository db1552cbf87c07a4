"""Metrics of the runtime (B6): timings, bytes, coalescing, event-loop lag, staleness.

One shape throughout, anyio style: every component keeps mutable counters and hands out a
frozen snapshot from ``statistics()``. :meth:`aiosync.Synchronizer.statistics` gathers them;
:meth:`aiosync.Synchronizer.metrics` is the same as plain dicts (:func:`as_plain`), and
:func:`log_metrics` logs it as one line (plus one DEBUG line per delivery on ``aiosync.sync``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio

logger = logging.getLogger("aiosync.sync")


def percentile(values: "list[float] | deque[float]", q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


@dataclass(frozen=True)
class Series:
    """A snapshot of a :class:`RunningStat`: count, total, last, max and mean of a series."""

    count: int = 0
    total: float = 0.0
    last: float = 0.0
    max: float = 0.0
    mean: float = 0.0


@dataclass
class RunningStat:
    """Count, total, last and max of a series (seconds, bytes, ...); :meth:`snapshot` freezes it."""

    count: int = 0
    total: float = 0.0
    last: float = 0.0
    max: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.last = value
        self.max = max(self.max, value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def snapshot(self) -> Series:
        return Series(self.count, self.total, self.last, self.max, self.mean)


@dataclass(frozen=True)
class LoopLagStatistics:
    """Event-loop lag in milliseconds (:class:`LoopLagMonitor`)."""

    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(eq=False)
class LoopLagMonitor:
    """Measures event-loop responsiveness with a ticker task (P4).

    The ticker sleeps ``interval`` seconds at a time; how much later than asked it wakes up is
    the lag: time the loop spent running something else without yielding. Run it with
    ``tg.start_soon(monitor.run)`` and stop it with :meth:`stop`; read :meth:`summary`.
    """

    interval: float = 0.002
    window: int = 100_000
    samples: deque = field(default_factory=deque)
    _stop: bool = False

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The ticker: runs until :meth:`stop` is called or the task is cancelled (``start()``-able)."""
        self._stop = False
        task_status.started()
        while not self._stop:
            start = time.perf_counter()
            await anyio.sleep(self.interval)
            lag = time.perf_counter() - start - self.interval
            if len(self.samples) >= self.window:
                self.samples.popleft()
            self.samples.append(max(0.0, lag))

    def stop(self) -> None:
        self._stop = True

    def reset(self) -> None:
        self.samples.clear()

    def statistics(self) -> LoopLagStatistics:
        """Lag in milliseconds: p50, p99, max, and the sample count."""
        s = list(self.samples)
        return LoopLagStatistics(len(s), percentile(s, 50) * 1e3, percentile(s, 99) * 1e3,
                                 (max(s) if s else 0.0) * 1e3)


def as_plain(stats: Any) -> Any:
    """A statistics dataclass (nested, possibly in dicts) as plain dicts, lists and values."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return {f.name: as_plain(getattr(stats, f.name)) for f in dataclasses.fields(stats)}
    if isinstance(stats, dict):
        return {k: as_plain(v) for k, v in stats.items()}
    if isinstance(stats, (list, tuple)):
        return [as_plain(v) for v in stats]
    return stats


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a/b": 1}``, the shape most experiment loggers want."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def log_metrics(metrics: dict[str, Any], log: logging.Logger | None = None, level: int = logging.INFO) -> None:
    """Log a metrics dict as one line of ``key=value`` pairs (flattened)."""
    log = log or logger
    if not log.isEnabledFor(level):
        return
    parts = []
    for key, value in flatten(metrics).items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.6g}")
        elif isinstance(value, (int, str, bool)) or value is None:
            parts.append(f"{key}={value}")
    log.log(level, "aiosync metrics: %s", " ".join(parts))
