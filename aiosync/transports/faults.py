"""Injected faults of the simulated transport (T4): what can go wrong, how often, and how a
payload is damaged.

:class:`FaultProfile` holds the rates of the quiet faults of a real network and of real
peers, each a probability per message:

* ``fail`` — the send raises :class:`aiosync.errors.TransportError`;
* ``drop`` — the send succeeds but the message never arrives;
* ``delay`` — the message is held back ``U(0, delay_max)`` extra seconds (FIFO kept);
* ``duplicate`` — the message arrives twice;
* ``reorder`` — the message is held back ``U(0, reorder_max)`` seconds and later messages may
  overtake it;
* ``corrupt`` — one byte of one tensor of the message is flipped (in a copy: the sender's
  tensors are never touched);
* ``truncate`` — one tensor of the message is cut short (a copy, flattened to 1-D);
* ``stall`` — the send hangs ``stall_s`` seconds before the message goes out.

:class:`FaultInjector` draws them for one endpoint from that endpoint's seeded RNG (so a run
is reproducible from its seed), honours faults forced with :meth:`FaultInjector.force`, and
counts what it injected. Damage is done on copies: :func:`flip_byte`, :func:`cut_short`, and
:func:`replace_at`, which copies only the containers on the path to the damaged tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..messages import Shared

__all__ = ["FAULT_KINDS", "FaultProfile", "FaultInjector", "tensor_paths", "replace_at", "flip_byte", "cut_short"]

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


# ------------------------------------------------------------------ damaging a payload

def tensor_paths(obj: Any, path: tuple = (), out: list | None = None, depth: int = 0) -> list[tuple]:
    """Paths to every non-empty tensor inside ``obj`` (dataclasses, dicts, lists, tuples)."""
    out = [] if out is None else out
    if depth > 16:
        return out
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 0:
            out.append(path)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensor_paths(v, path + (k,), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensor_paths(v, path + (i,), out, depth + 1)
    elif isinstance(obj, Shared):
        tensor_paths(obj.value, path + ("value",), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensor_paths(getattr(obj, f.name), path + (f.name,), out, depth + 1)
    return out


def replace_at(obj: Any, path: tuple, fn: Callable[[Any], Any]) -> Any:
    """A copy of ``obj`` with the tensor at ``path`` replaced by ``fn(tensor)``; containers on
    the path are copied, everything else is shared."""
    if not path:
        return fn(obj)
    head, rest = path[0], path[1:]
    if isinstance(obj, Shared):  # a new part (the damaged copy must not reuse the original's encoding)
        return Shared(replace_at(obj.value, rest, fn))
    if isinstance(obj, dict):
        out = dict(obj)
        out[head] = replace_at(obj[head], rest, fn)
        return out
    if isinstance(obj, (list, tuple)):
        items = list(obj)
        items[head] = replace_at(obj[head], rest, fn)
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    out = copy.copy(obj)
    object.__setattr__(out, head, replace_at(getattr(obj, head), rest, fn))
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


# ------------------------------------------------------------------ drawing faults

class FaultInjector:
    """Draws the faults of one endpoint.

    ``rng`` is the endpoint's seeded RNG (shared with its jitter, so one seed reproduces the
    whole run); ``counts`` the mapping of injected faults by kind that the endpoint reports
    (updated in place). The profile is passed to every call, so the endpoint may swap it at
    any time.
    """

    __slots__ = ("rng", "counts", "forced")

    def __init__(self, rng: random.Random, counts: dict[str, int] | None = None) -> None:
        self.rng = rng
        self.counts = dict.fromkeys(FAULT_KINDS, 0) if counts is None else counts
        self.forced: dict[str, int] = {}

    def force(self, kind: str, n: int = 1) -> None:
        """Inject ``kind`` into the next ``n`` messages it applies to, whatever the rates."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; valid: {', '.join(FAULT_KINDS)}")
        self.forced[kind] = self.forced.get(kind, 0) + n

    def draw(self, profile: FaultProfile | None, kind: str) -> bool:
        """Whether ``kind`` strikes this message (nothing is counted yet)."""
        if self.forced.get(kind):
            return True
        rate = getattr(profile, kind) if profile is not None else 0.0
        return bool(rate) and self.rng.random() < rate

    def count(self, kind: str) -> None:
        """Record that ``kind`` was injected (consuming a forced one first)."""
        if self.forced.get(kind):
            self.forced[kind] -= 1
        self.counts[kind] += 1

    def roll(self, profile: FaultProfile | None, kind: str) -> bool:
        """Draw ``kind`` and count it when it strikes."""
        if self.draw(profile, kind):
            self.count(kind)
            return True
        return False

    def mangle(self, profile: FaultProfile | None, payload: Any, kind: str) -> Any:
        """``payload`` with one tensor corrupted (``kind="corrupt"``) or truncated
        (``"truncate"``) when that fault strikes; ``payload`` itself otherwise, or when it holds
        no tensor (a forced fault then waits for the next message that does)."""
        if not self.draw(profile, kind):
            return payload
        paths = tensor_paths(payload)
        if not paths:
            return payload
        path = paths[self.rng.randrange(len(paths))]
        self.count(kind)
        damage = flip_byte if kind == "corrupt" else cut_short
        return replace_at(payload, path, lambda t: damage(t, self.rng))
