"""Metrics of the runtime (B6): timings, bytes, coalescing, event-loop lag, staleness.

Everything is available as a plain dict (:meth:`aiosync.Synchronizer.metrics`) and through
:mod:`logging` (:func:`log_metrics`, and one DEBUG line per delivery on ``aiosync.sync``).
"""

from __future__ import annotations

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


@dataclass
class RunningStat:
    """Count, total, last, max and mean of a series (seconds, bytes, ...)."""

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

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "total": self.total, "last": self.last, "max": self.max, "mean": self.mean}


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

    async def run(self) -> None:
        """The ticker: runs until :meth:`stop` is called or the task is cancelled."""
        self._stop = False
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

    def summary(self) -> dict[str, float]:
        """Lag in milliseconds: ``p50_ms``, ``p99_ms``, ``max_ms``, and the sample count."""
        s = list(self.samples)
        return {
            "samples": len(s),
            "p50_ms": percentile(s, 50) * 1e3,
            "p99_ms": percentile(s, 99) * 1e3,
            "max_ms": (max(s) if s else 0.0) * 1e3,
        }


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
