"""Staleness (S10): every sample carries the version that generated it; old ones are filtered.

A sample's version is the version its explorer had *applied* when the rollout ran — what
:meth:`aiosync.PolicySlot.lease` yields — not the version it had asked for. The trainer
compares it with its own current version, AsyncPPO-style: a sample more than
``max_staleness`` versions behind is dropped, or kept with a smaller weight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

S = TypeVar("S")


def version_of(sample: Any) -> int:
    """The generating version of a sample: its ``version`` attribute or ``"version"`` key."""
    if isinstance(sample, Mapping):
        if "version" not in sample:
            raise KeyError("sample has no 'version' key: stamp it with the version its lease yielded")
        return int(sample["version"])
    version = getattr(sample, "version", None)
    if version is None:
        raise AttributeError(
            f"{type(sample).__name__} has no 'version': stamp every sample with the version its lease yielded"
        )
    return int(version)


@dataclass
class FilterResult(Generic[S]):
    """What :meth:`StalenessFilter.filter` kept, with a weight per kept sample."""

    kept: list[S]
    weights: list[float]
    dropped: int
    staleness: list[int]

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0


@dataclass(eq=False)
class StalenessFilter:
    """Drop or down-weight samples generated more than ``max_staleness`` versions ago.

    ``mode="drop"`` drops them; ``mode="downweight"`` keeps them with weight
    ``decay ** (staleness - max_staleness)``. Samples within the bound have weight 1.
    ``max_staleness=None`` keeps everything (staleness is still measured). A sample from a
    version newer than the trainer's (staleness < 0) is a stamping bug and raises ``ValueError``.
    Running totals are kept in ``seen``, ``dropped``, ``histogram`` (staleness → count) and
    ``max_used`` (the most stale sample kept).
    """

    max_staleness: int | None = None
    mode: str = "drop"
    decay: float = 0.5
    get_version: Callable[[Any], int] = version_of
    seen: int = 0
    dropped: int = 0
    histogram: Counter = field(default_factory=Counter)
    max_used: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("drop", "downweight"):
            raise ValueError(f"mode must be 'drop' or 'downweight', got {self.mode!r}")

    def filter(self, samples: Iterable[S], current_version: int) -> FilterResult[S]:
        """Split ``samples`` by their staleness relative to ``current_version``."""
        kept: list[S] = []
        weights: list[float] = []
        staleness: list[int] = []
        dropped = 0
        for sample in samples:
            lag = int(current_version) - self.get_version(sample)
            if lag < 0:
                raise ValueError(
                    f"sample version {self.get_version(sample)} is newer than the trainer's {current_version}"
                )
            staleness.append(lag)
            self.histogram[lag] += 1
            self.seen += 1
            over = self.max_staleness is not None and lag > self.max_staleness
            if over and self.mode == "drop":
                dropped += 1
                continue
            kept.append(sample)
            self.max_used = max(self.max_used, lag)
            weights.append(self.decay ** (lag - self.max_staleness) if over else 1.0)
        self.dropped += dropped
        return FilterResult(kept, weights, dropped, staleness)

    def statistics(self) -> "StalenessStatistics":
        """Totals since creation: samples seen, dropped, mean and max staleness."""
        total = sum(self.histogram.values())
        mean = sum(k * n for k, n in self.histogram.items()) / total if total else 0.0
        return StalenessStatistics(self.max_staleness, self.seen, self.dropped, mean, max(self.histogram, default=0),
                                   self.max_used)


@dataclass(frozen=True)
class StalenessStatistics:
    """What a :class:`StalenessFilter` saw."""

    max_staleness_allowed: int | None
    seen: int
    dropped: int
    mean: float
    max: int
    #: The staleness of the stalest sample that was kept (used for training).
    max_used: int = 0
