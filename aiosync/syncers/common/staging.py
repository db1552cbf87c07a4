"""Staged writes (F3): everything heavy outside the receiver's exclusive section, only the
write inside it, and a journal that makes the write all-or-nothing (S8).

* :class:`Journal` — undo records of a write in progress (O(changed) bytes: the old bits of
  every position written, or a whole tensor's old value when it was copied whole).
* :class:`FullStateWrite` — a whole-state write (a bootstrap, a bucket-mode sync) planned
  outside: :meth:`FullStateWrite.add` casts the received tensors to the receiver's dtype and
  compares their bits with the model's, chunk by chunk (memory stays bounded), reading the
  model only; it keeps per tensor the changed positions and their new bits, or the whole new
  value when most of the tensor changed. :meth:`FullStateWrite.write`, inside, writes only
  those. A repair's exclusive section then costs about as much as a patch apply.

:func:`commit_write` is the last step of every staged write: a :class:`~.base.CommitTarget`
(an inference engine behind a host mapping) is told what was written, and a failure there
undoes the write through its journal.

The plan is made against the model as it is when staged: nothing else may write the staged
tensors between staging and writing (a synchronizer's slot guarantees it; a write checks that
each tensor is still the one planned against: same storage, shape and dtype).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import torch

from ...aio import finish_cuda_work, run_sync
from ...reclaim import release_off_loop
from ...errors import ApplyError
from ..base import CommitTarget
from ..kernels.warmup import ready as kernels_ready
from .bits import BITS_DTYPES, as_bits

log = logging.getLogger("aiosync.sync")

#: Elements compared per step when planning (bounds the planner's scratch memory).
CHUNK_ELEMS = 1 << 20


class Journal:
    """Undo records of one write: :meth:`rollback` restores, newest first, what was written."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        #: Bytes of the old values kept (as far as the records say: ``record(undo, nbytes)``).
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._undo)

    def record(self, undo: Callable[[], None], nbytes: int = 0) -> None:
        self._undo.append(undo)
        self.nbytes += nbytes

    def record_positions(self, view: torch.Tensor, index, old: torch.Tensor) -> None:
        """``view[index]`` held ``old`` before the write."""
        self._undo.append(lambda: view.__setitem__(index, old))
        self.nbytes += old.numel() * old.element_size()

    def record_whole(self, t: torch.Tensor) -> None:
        """``t`` is about to be overwritten whole: keep a copy of its old value."""
        old = t.clone()
        self._undo.append(lambda: t.copy_(old))
        self.nbytes += old.numel() * old.element_size()

    def rollback(self) -> None:
        with torch.no_grad():
            while self._undo:
                self._undo.pop()()

    def take(self) -> list:
        """Empty the journal (its write committed): the undo records, old values included, for
        :func:`written`."""
        undo, self._undo = self._undo, []
        return undo


@dataclass
class _Entry:
    key: str
    signature: tuple
    #: row-major positions that change (int64, target device), or an index tuple for a
    #: non-contiguous target; ``None`` when the tensor is copied whole.
    index: object | None
    new_bits: torch.Tensor | None
    dense: torch.Tensor | None
    #: elements that change (for a whole copy: counted when planned, else its size)
    count: int = 0


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.stride())


class FullStateWrite:
    """A planned write of whole tensors into a receiver's model (see the module docstring).

    ``add`` (outside, worker thread) plans received tensors against ``target``; ``write``
    (inside) writes them. Keys are written in the order they were added; a later key that
    aliases an earlier one (tied weights, same view) replaces its plan, and keys that share
    storage in any other way are copied whole, in order, so the result is exactly what
    ``target[k].copy_(v)`` key after key would give.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._storages: dict[tuple, list[str]] = {}  # (device, storage ptr) -> keys planned on it

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def keys(self) -> list[str]:
        return list(self._entries)

    def add(self, target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        """Plan writing ``tensors`` (validated: keys of ``target``, same shapes, compatible
        dtypes) into ``target``. Reads ``target`` only."""
        with torch.no_grad():
            for key, value in tensors.items():
                t = target[key]
                sig = _signature(t)
                home = (t.device, sig[3])
                others = [k for k in self._storages.get(home, []) if k != key]
                same_view = [k for k in others if self._entries[k].signature[:3] + self._entries[k].signature[4:]
                             == sig[:3] + sig[4:]]
                for k in same_view:  # tied: only the last write of the view counts
                    self._drop(k, home)
                    others.remove(k)
                if key in self._entries:
                    self._drop(key, home)
                if others:  # overlapping storage: whole copies, in order
                    for k in others:
                        self._densify(k, target[k])
                    entry = self._dense_entry(key, t, value, sig)
                else:
                    entry = self._plan(key, t, value, sig)
                self._entries[key] = entry
                self._storages.setdefault(home, []).append(key)

    def take(self) -> list:
        """Empty the plan (it was written): its entries, new values included, for :func:`written`."""
        entries, self._entries, self._storages = list(self._entries.values()), {}, {}
        return entries

    @property
    def changed(self) -> int:
        """Elements the write changes."""
        return sum(e.count for e in self._entries.values())

    @property
    def written_keys(self) -> list[str]:
        """The keys whose tensors the write changes (in write order)."""
        return [k for k, e in self._entries.items() if e.dense is not None or e.index is not None]

    @property
    def nbytes(self) -> int:
        """Bytes the plan holds: changed positions and their new bits, or whole new values."""
        return held_bytes([(e.index, e.new_bits, e.dense) for e in self._entries.values()])

    def _drop(self, key: str, home: tuple) -> None:
        del self._entries[key]
        self._storages[home].remove(key)

    def _densify(self, key: str, t: torch.Tensor) -> None:
        entry = self._entries[key]
        if entry.dense is not None:
            return
        dense = t.detach().clone()
        if entry.index is not None:
            as_bits(dense)[entry.index if isinstance(entry.index, tuple) else _unravel(entry.index, dense)] = \
                entry.new_bits
        self._entries[key] = _Entry(key, entry.signature, None, None, dense, entry.count)

    @staticmethod
    def _dense_entry(key: str, t: torch.Tensor, value: torch.Tensor, sig: tuple) -> _Entry:
        dense = value.detach().to(device=t.device, dtype=t.dtype)
        return _Entry(key, sig, None, None, dense, t.numel())

    def _plan(self, key: str, t: torch.Tensor, value: torch.Tensor, sig: tuple) -> _Entry:
        n = t.numel()
        width = t.element_size()
        if n == 0 or t.dim() == 0 or width not in BITS_DTYPES:
            return self._dense_entry(key, t, value, sig)
        rows = t.shape[0]
        per_row = n // rows
        step = max(1, CHUNK_ELEMS // max(per_row, 1))
        # sparse costs (8 + width) bytes per change, a whole copy width bytes per element
        limit = n * width // (8 + width)
        value = value.detach()
        positions, bits, count = [], [], 0
        for a in range(0, rows, step):
            b = min(rows, a + step)
            old = as_bits(t[a:b].reshape(-1))
            new = as_bits(value[a:b].reshape(-1).to(device=t.device, dtype=t.dtype))
            if count > limit:  # copied whole anyway: only count
                count += int((old != new).sum())
                continue
            idx, changed = _diff_chunk(new, old)
            count += idx.numel()
            if count > limit:
                positions, bits = [], []
            elif idx.numel():
                positions.append(idx + a * per_row)
                bits.append(changed)
        if count > limit:
            entry = self._dense_entry(key, t, value, sig)
            entry.count = count
            return entry
        if not positions:
            return _Entry(key, sig, None, None, None)
        pos = positions[0] if len(positions) == 1 else torch.cat(positions)
        new_bits = bits[0] if len(bits) == 1 else torch.cat(bits)
        index = pos if t.is_contiguous() else _unravel(pos, t)
        return _Entry(key, sig, index, new_bits, None, count)

    def check(self, target: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`ApplyError` (writing nothing) if a planned tensor of ``target`` is no
        longer the one the plan was made against."""
        for key, entry in self._entries.items():
            t = target.get(key) if hasattr(target, "get") else target[key]
            if not isinstance(t, torch.Tensor) or _signature(t) != entry.signature:
                raise ApplyError(f"receiver tensor {key!r} was replaced or reshaped after the write was staged; "
                                 "nothing was written")

    def write(self, target: Mapping[str, torch.Tensor], journal: Journal | None,
              after_each: Callable[[int, int], None] | None = None) -> int:
        """Write the plan into ``target`` (call :meth:`check` first); records undo entries in
        ``journal`` (``None``: no rollback possible). Returns the elements written.
        ``after_each(i, n)`` runs after the ``i``-th of ``n`` tensors was written."""
        entries = list(self._entries.values())
        with torch.no_grad():
            for i, entry in enumerate(entries):
                t = target[entry.key]
                if entry.dense is not None:
                    if journal is not None:
                        journal.record_whole(t)
                    t.copy_(entry.dense)
                elif (entry.index is not None and not isinstance(entry.index, tuple) and t.device.type == "cpu"
                      and kernels_ready((t.element_size(),))):
                    _scatter_cpu(t, entry.index, entry.new_bits, journal)
                elif entry.index is not None:
                    view = as_bits(t).view(-1) if not isinstance(entry.index, tuple) else as_bits(t)
                    if journal is not None:
                        journal.record_positions(view, entry.index, view[entry.index])
                    view[entry.index] = entry.new_bits
                if after_each is not None:
                    after_each(i, len(entries))
        finish_cuda_work(target[e.key] for e in entries)  # the writes landed before the version commits
        return self.changed


async def written(*parts: Any) -> None:
    """A staged write committed: release what its plans and journals (``parts``; ``None`` and
    objects without ``take()`` are skipped) still hold — a bootstrap's new values, a repair's old
    ones, a model's worth — in a worker thread, in bounded pieces (:mod:`aiosync.reclaim`). Their
    last references would otherwise go on the event loop, with the coroutine that wrote them."""
    box = [p.take() for p in parts if callable(getattr(p, "take", None))]
    await release_off_loop(box)


async def commit_write(model: Any, keys: Sequence[str], version: int | None, journal: Journal | None) -> None:
    """The end of a staged write whose tensors are written: tell a :class:`CommitTarget` model.

    A plain model or dict of tensors has nothing to commit. For a target, ``commit_write(keys,
    version)`` runs; if it raises (or is cancelled) and the write has a ``journal``, the journal
    is rolled back (a worker thread) and ``commit_write(keys, None)`` puts the old values back
    into the real weights; then the error propagates. Call it shielded from cancellation, like
    the write itself.
    """
    if not isinstance(model, CommitTarget):
        return
    try:
        await model.commit_write(list(keys), version)
    except BaseException as exc:
        if journal is None:  # nothing to protect (no version was held): the target re-sends next time
            raise
        with anyio.CancelScope(shield=True):
            await run_sync(journal.rollback)
            try:
                await model.commit_write(list(keys), None)
            except Exception as again:  # the target marks itself broken; the first error is the one to see
                log.warning("aiosync: putting the old weights back after a failed commit failed too: %s", again)
                if isinstance(exc, Exception):
                    exc.add_note(f"putting the old weights back failed too: {type(again).__name__}: {again}")
        raise
def held_bytes(obj: Any) -> int:
    """Bytes of the distinct tensors and numpy arrays inside ``obj`` (containers, dataclasses,
    shared parts; a buffer referenced twice counts once): what a receiver holds for it."""
    from ...messages import Shared

    seen: dict = {}

    def walk(o: Any, depth: int) -> None:
        if depth > 12 or o is None:
            return
        if isinstance(o, torch.Tensor):
            if o.numel() and o.device.type != "meta":
                storage = o.untyped_storage()
                seen[("t", storage.data_ptr())] = max(seen.get(("t", storage.data_ptr()), 0), storage.nbytes())
        elif isinstance(o, np.ndarray):
            base = o
            while isinstance(base.base, np.ndarray):
                base = base.base
            seen[("n", id(base))] = base.nbytes
        elif isinstance(o, Shared):
            walk(o.value, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name), depth + 1)

    walk(obj, 0)
    return sum(seen.values())


def _scatter_cpu(t: torch.Tensor, pos: torch.Tensor, new_bits: torch.Tensor, journal: Journal | None) -> None:
    """Write ``new_bits`` at ``pos`` of a contiguous CPU tensor (numba; keeps the old bits for
    ``journal``)."""
    from ..kernels.write import scatter
    from .bits import np_bits

    target, positions, values = np_bits(t.view(-1)), pos.numpy(), np_bits(new_bits)
    old = np.empty(positions.shape[0] if journal is not None else 0, values.dtype)
    if journal is not None:
        journal.record(lambda: scatter(target, positions, old, old[:0]), old.nbytes)
    scatter(target, positions, values, old)


def _diff_chunk(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int64) where two 1-D bit tensors differ, and ``new``'s bits there. Reads only.
    The numba kernel on CPU (``torch.nonzero`` costs several times more) once it is loaded, torch
    ops elsewhere and until then."""
    if (new.device.type != "cpu" or not (new.is_contiguous() and old.is_contiguous())
            or not kernels_ready((new.element_size(),))):
        idx = torch.nonzero(old != new).reshape(-1)
        return idx, new[idx]
    from ..kernels.write import diff_positions
    from .bits import np_bits

    n = old.numel()
    pos, bits = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=new.dtype)  # pages touched: k only
    k = diff_positions(np_bits(new), np_bits(old), pos.numpy(), np_bits(bits), 0)
    return pos[:k].clone(), bits[:k].clone()


def _unravel(pos: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.unravel_index(pos, tuple(t.shape)))

