"""Where every element of a checkpoint tensor lives in a model's parameters: :func:`probe_map`,
an index map probed through the model's own weight loader (runs inside an engine worker).

An inference engine does not hold its weights in checkpoint form: vLLM fuses ``q_proj``,
``k_proj`` and ``v_proj`` into one ``qkv_proj`` (and gate/up into ``gate_up_proj``), keeps only
this rank's tensor-parallel shard, pads the vocabulary, stacks MoE experts. No table of these
layouts is written here: the model's own ``load_weights`` is run on *probe values* and the map
is read off where they land.

**How a tensor is probed.** Every parameter of the model is replaced, in every module that
holds it, by a stand-in of the same class with the same attributes (its weight loader, its
shard dimensions) — the live parameters are never written. A first load, with every stand-in
on the meta device (no memory), finds which parameters the tensor's loader writes (a
``TorchDispatchMode`` records the storages written to, and refuses any write into the model's
real tensors). Those parameters then get zeroed float32 stand-ins on the host (float64 for a
tensor with 2**24 rows or columns or more), and the tensor is loaded twice more with its
element indices as values: its row index + 1, then its column index + 1 (the 2-D view of
:func:`~aiosync.syncers.common.indexing.coo_2d_shape`), each an *expanded* tensor of O(rows)
or O(columns) memory. A parameter element that holds a non-zero value after both came from
that checkpoint element. A fourth load with the rows counted backwards checks that the loader
copies values (a loader that transforms them cannot be read back, and is refused).

**Runs.** The map of a tensor is a list of runs: ``checkpoint offset → (parameter, offset,
length)``, both offsets row-major; memory O(runs), not O(elements). A tensor the loader writes
to several places (replicated) has overlapping runs, kept in separate non-overlapping tables.
A tensor whose layout does not compress to runs (a loader that transposes it) is a
*fallback* tensor: a checkpoint-form copy of it is kept, and it is written whole through the
loader.

**Memory.** The probe's transient memory is bounded by one tensor at a time: two host copies,
in float32 (float64 past 2**24 rows or columns), of the parameters it loads into, O(rows +
columns) of probe values, and index arrays of :data:`CHUNK` elements; a tensor whose runs
outgrow ``numel / MIN_MEAN_RUN`` stops counting them and becomes a fallback tensor.

:func:`loaded_image` (checks, tests) answers what the model's loader makes of given weights,
in copies of the parameters, without touching the live ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError
from ..syncers.common.indexing import coo_2d_shape

#: The model's weight loader: takes ``(checkpoint name, tensor)`` pairs (``model.load_weights``).
Load = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
#: Parameter elements turned into runs per step (bounds the probe's index arrays).
CHUNK = 1 << 22
#: A tensor whose runs hold fewer elements than this on average is a fallback tensor.
MIN_MEAN_RUN = 8
_EXACT_F32 = 1 << 24


class ProbeError(ConfigError):
    """The model's loader could not be probed for a tensor (it writes the model's live tensors,
    transforms the values, or fails on probe values): the engine cannot take in-place writes."""


@dataclass(frozen=True)
class RunTable:
    """Non-overlapping runs of one checkpoint tensor, sorted by checkpoint offset (int64)."""

    ckpt: torch.Tensor
    param: torch.Tensor
    offset: torch.Tensor
    length: torch.Tensor

    def __len__(self) -> int:
        return int(self.ckpt.numel())

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For sorted checkpoint ``positions`` (int64, CPU): ``(held, param, offset)`` — which of
        them this table holds, and the parameter index and flat offset of each held one."""
        if len(self) == 1:
            c0, length = int(self.ckpt[0]), int(self.length[0])
            held = (positions >= c0) & (positions < c0 + length)
            pos = positions[held]
            return held, torch.full_like(pos, int(self.param[0])), pos + (int(self.offset[0]) - c0)
        k = torch.searchsorted(self.ckpt, positions, right=True) - 1
        kk = k.clamp(min=0)
        held = (k >= 0) & (positions < self.ckpt[kk] + self.length[kk])
        kk, pos = kk[held], positions[held]
        return held, self.param[kk], self.offset[kk] + (pos - self.ckpt[kk])


@dataclass
class TensorMap:
    """Where one checkpoint tensor's elements live in this worker's parameters."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: Non-overlapping run tables; ``tables[0]`` is read, every table is written.
    tables: list[RunTable] = field(default_factory=list)
    #: The checkpoint-form copy of a fallback tensor (written whole through the loader), else ``None``.
    copy: torch.Tensor | None = None
    #: Elements of the tensor this worker holds (the first table's).
    held: int = 0
    #: Sorted ``[start, end)`` intervals of the elements this worker answers for in drift hashes
    #: (every element belongs to one worker); ``None``: all of them.
    owned: np.ndarray | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def runs(self) -> int:
        return sum(len(t) for t in self.tables)

    @property
    def complete(self) -> bool:
        """Whether this worker holds every element (its values can be read whole)."""
        return self.copy is not None or self.held == self.numel

    def owned_mask(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Which of ``positions`` this worker answers for (``None``: all)."""
        if self.owned is None:
            return None
        starts = torch.from_numpy(np.ascontiguousarray(self.owned[:, 0]))
        ends = torch.from_numpy(np.ascontiguousarray(self.owned[:, 1]))
        k = torch.searchsorted(starts, positions, right=True) - 1  # a worker owning none: all False
        return (k >= 0) & (positions < (ends[k.clamp(min=0)] if len(ends) else -1))


@dataclass
class IndexMap:
    """The map of every synced checkpoint tensor of one worker (see the module docstring)."""

    params: list[torch.nn.Parameter]
    param_names: list[str]
    tensors: dict[str, TensorMap]
    #: The most bytes the probe held at once beyond the model (its transient memory).
    probe_peak_bytes: int = 0

    @property
    def fallback(self) -> list[str]:
        """The tensors written whole through the loader (their layout does not compress to runs)."""
        return [n for n, t in self.tensors.items() if t.copy is not None]

    @property
    def nbytes(self) -> int:
        """Bytes the map keeps: its runs, and the copies of fallback tensors."""
        runs = sum(4 * 8 * t.runs for t in self.tensors.values())
        return runs + sum(t.copy.numel() * t.copy.element_size() for t in self.tensors.values() if t.copy is not None)

    def flat(self, index: int) -> torch.Tensor:
        """Parameter ``index`` as a flat tensor of its bits (writes land in the parameter)."""
        from ..syncers.common.bits import as_bits

        return as_bits(self.params[index].data.view(-1))

    def locate(self, name: str, positions: torch.Tensor) -> list[list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """Where the sorted ``positions`` (int64, CPU) of ``name`` live, per run table (a
        replicated element is in several): ``[(parameter index, indices into positions, flat
        offsets in the parameter)]``, all on the CPU. One search per table: :meth:`gather` and
        :meth:`places` take its answer instead of searching again."""
        out = []
        for table in self.tensors[name].tables:
            found, pid, off = table.locate(positions)
            idx = torch.nonzero(found).reshape(-1)
            if not idx.numel():
                out.append([])
            elif bool((pid == pid[0]).all()):  # the common case: one parameter
                out.append([(int(pid[0]), idx, off)])
            else:
                out.append([(p, idx[pid == p], off[pid == p]) for p in torch.unique(pid).tolist()])
        return out

    def gather(self, name: str, positions: torch.Tensor,
               located: list[list[tuple[int, torch.Tensor, torch.Tensor]]] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(held, old bits)``: which of the sorted ``positions`` of ``name`` this worker holds,
        and their bits, read from the parameters (or from the copy of a fallback tensor);
        ``located``: :meth:`locate`'s answer for these positions, if known."""
        from ..syncers.common.bits import as_bits

        tmap = self.tensors[name]
        if tmap.copy is not None:
            return torch.ones_like(positions, dtype=torch.bool), as_bits(tmap.copy.view(-1))[positions]
        held = torch.zeros_like(positions, dtype=torch.bool)
        out = torch.empty(positions.numel(), dtype=_bits_dtype(tmap.dtype))
        for hits in self.locate(name, positions) if located is None else located:
            for p, idx, off in hits:
                fresh = ~held[idx]
                idx, off = idx[fresh], off[fresh]
                flat = self.flat(p)
                out[idx] = flat[off.to(flat.device)].cpu()
                held[idx] = True
        return held, out[held]

    def whole(self, name: str) -> torch.Tensor:
        """The tensor's current values in checkpoint form (this worker must hold all of it)."""
        tmap = self.tensors[name]
        if tmap.copy is not None:
            return tmap.copy.clone()
        if not tmap.complete:
            raise ConfigError(f"{name!r} is split between workers: no one worker can read it whole")
        from ..syncers.common.bits import as_bits

        out = torch.empty(tmap.shape, dtype=tmap.dtype)
        bits = as_bits(out.view(-1))
        for table in tmap.tables:  # run by run: no per-element index arrays
            for c, p, off, length in zip(table.ckpt.tolist(), table.param.tolist(), table.offset.tolist(),
                                         table.length.tolist()):
                bits[c:c + length].copy_(self.flat(p)[off:off + length])
        return out

    def places(self, name: str, positions: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Every place the sorted ``positions`` of ``name`` are written to, per parameter of every
        table (a replicated element has several): ``(parameter index, flat offsets on its
        device, indices into positions)``."""
        return [(p, off.to(self.params[p].device), idx) for hits in self.locate(name, positions) for p, idx, off in hits]

    def statistics(self) -> dict:
        """Plain numbers for a report: tensors, runs, bytes, fallback tensors, probe memory."""
        return {"tensors": len(self.tensors), "runs": sum(t.runs for t in self.tensors.values()),
                "map_bytes": self.nbytes, "fallback": self.fallback, "probe_peak_bytes": self.probe_peak_bytes}


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    from ..syncers.common.bits import BITS_DTYPES

    return BITS_DTYPES[torch.empty((), dtype=dtype).element_size()]


# ----------------------------------------------------------------------------- stand-ins

def _stand_in(p: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    s = torch.Tensor._make_subclass(type(p), data, False)
    s.__dict__.update(p.__dict__)
    return s


@contextlib.contextmanager
def swapped(model: torch.nn.Module, data_of: Callable[[torch.nn.Parameter], torch.Tensor]) -> Iterator[dict]:
    """Every parameter of ``model`` replaced, in every module that holds it, by a stand-in of
    the same class and attributes whose data is ``data_of(parameter)``; put back on exit.
    Yields ``{id(original): stand-in}`` (a parameter shared by two modules has one stand-in)."""
    stand: dict[int, torch.nn.Parameter] = {}
    originals: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in stand:
                    stand[id(p)] = _stand_in(p, data_of(p))
                originals.append((module, name, p))
                module._parameters[name] = stand[id(p)]
        yield stand
    finally:
        for module, name, p in originals:
            module._parameters[name] = p


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return ("meta", s._cdata) if t.is_meta else (t.device.type, s.data_ptr())


class _Writes(TorchDispatchMode):
    """Records the storages that in-place ops write to; refuses writes into ``protected`` ones."""

    def __init__(self, protected: set[tuple]) -> None:
        super().__init__()
        self.protected, self.written = protected, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(a.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor) and t.numel():
                        key = _storage_key(t)
                        if key in self.protected:
                            raise ProbeError(f"the loader wrote into a live tensor of the model ({func.__name__})")
                        self.written.add(key)
        return func(*args, **kwargs)


def _protected(model: torch.nn.Module) -> set[tuple]:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return {_storage_key(t) for t in tensors if t.numel()}


def _load_guarded(model: torch.nn.Module, load: Load, weights: list[tuple[str, torch.Tensor]],
                  protected: set[tuple]) -> set[tuple]:
    with torch.no_grad(), _Writes(protected) as w:
        load(iter(weights))
    return w.written


def loaded_image(model: torch.nn.Module, load: Load, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``load`` (the model's weight loader) makes of ``tensors``: every parameter of
    ``model``, by name, as a copy of its current value into which ``tensors`` were loaded. The
    live parameters are not touched (the model must not run meanwhile: its parameters are
    swapped for the copies while the loader runs)."""
    named = dict(model.named_parameters())
    copies = {id(p): p.detach().clone() for p in named.values()}
    protected = _protected(model)
    with swapped(model, lambda p: copies[id(p)]):
        _load_guarded(model, load, list(tensors.items()), protected)
    return {n: copies[id(p)] for n, p in named.items()}


# ----------------------------------------------------------------------------- probing

def _probe_values(shape: tuple[int, ...], axis: str, dtype: torch.dtype, reverse: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` whose elements are their row (``axis="row"``) or column index + 1
    in the 2-D view (rows counted backwards with ``reverse``), as an expanded view: O(rows)
    or O(columns) memory."""
    rows, cols = coo_2d_shape(shape)
    if not shape:
        return torch.ones((), dtype=dtype)
    if axis == "row" and len(shape) >= 2:
        v = torch.arange(rows, dtype=dtype)
        v = (rows - v) if reverse else v + 1
        return v.reshape(rows, *[1] * (len(shape) - 1)).expand(shape)
    if axis == "row":
        return torch.ones(1, dtype=dtype).expand(shape)
    v = torch.arange(cols, dtype=dtype)
    v = (cols - v) if reverse else v + 1
    return v.reshape(1, *shape[1:]).expand(shape) if len(shape) >= 2 else v


class _RunBuilder:
    """Runs of one parameter from increasing parameter offsets and their checkpoint indices."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.ckpt: list[np.ndarray] = []
        self.off: list[np.ndarray] = []
        self.length: list[np.ndarray] = []
        self.count = 0
        self._last: tuple[int, int] | None = None  # (checkpoint end, offset end) of the last run

    def add(self, offsets: np.ndarray, idx: np.ndarray) -> bool:
        """Add a chunk; ``False`` once the runs exceed the limit (a fallback tensor)."""
        if not offsets.size:
            return True
        brk = np.flatnonzero((np.diff(offsets) != 1) | (np.diff(idx) != 1)) + 1
        starts = np.concatenate([[0], brk])
        lengths = np.diff(np.concatenate([starts, [offsets.size]]))
        ck, off = idx[starts], offsets[starts]
        if self._last is not None and self._last == (int(ck[0]), int(off[0])):  # continues the previous run
            self.length[-1][-1] += lengths[0]
            ck, off, lengths = ck[1:], off[1:], lengths[1:]
        if ck.size:
            self.ckpt.append(ck.copy())
            self.off.append(off.copy())
            self.length.append(lengths.copy())
            self.count += ck.size
        last_len = int(self.length[-1][-1])
        self._last = (int(self.ckpt[-1][-1]) + last_len, int(self.off[-1][-1]) + last_len)
        return self.count <= self.limit

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cat = (lambda xs: np.concatenate(xs) if xs else np.empty(0, np.int64))
        return cat(self.ckpt), cat(self.off), cat(self.length)


def _tables(ck: np.ndarray, param: np.ndarray, off: np.ndarray, length: np.ndarray) -> list[RunTable]:
    """Runs sorted by checkpoint offset, split into non-overlapping tables (a replicated element
    has a run in more than one)."""
    order = np.lexsort((off, param, ck))
    ck, param, off, length = ck[order], param[order], off[order], length[order]
    as_t = (lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)))
    if ck.size < 2 or bool(np.all(ck[1:] >= ck[:-1] + length[:-1])):  # no element twice: one table
        return [RunTable(as_t(ck), as_t(param), as_t(off), as_t(length))] if ck.size else []
    ends: list[int] = []
    members: list[list[int]] = []
    for i in range(ck.size):
        for t, end in enumerate(ends):
            if ck[i] >= end:
                ends[t] = ck[i] + length[i]
                members[t].append(i)
                break
        else:
            ends.append(ck[i] + length[i])
            members.append([i])
    return [RunTable(as_t(ck[m]), as_t(param[m]), as_t(off[m]), as_t(length[m])) for m in members]


@dataclass
class _Probe:
    """One tensor's probe: the model, its loader and what is protected."""

    model: torch.nn.Module
    load: Load
    protected: set[tuple]
    index: dict[int, int]  # id(parameter) -> its index in the map
    peak: int = 0

    def _load(self, name: str, values: torch.Tensor) -> set[tuple]:
        try:
            return _load_guarded(self.model, self.load, [(name, values)], self.protected)
        except ProbeError:
            raise
        except Exception as exc:  # e.g. a loader that views its input: try it once more, materialized
            if values.is_contiguous():
                raise ProbeError(f"the loader failed on probe values of {name!r}: {type(exc).__name__}: {exc}") from exc
            return self._load(name, values.contiguous())

    def targets(self, name: str, shape: tuple[int, ...]) -> list[torch.nn.Parameter]:
        """The parameters the loader of ``name`` writes (found with every parameter on meta)."""
        originals = list(self.model.parameters())
        with swapped(self.model, lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta")) as stand:
            written = self._load(name, _probe_values(shape, "col", torch.float32))
            return [p for p in originals if ("meta", stand[id(p)].untyped_storage()._cdata) in written]

    def run(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorMap:
        rows, cols = coo_2d_shape(shape)
        tmap = TensorMap(name, tuple(shape), dtype)
        targets = self.targets(name, shape)
        if not targets:
            raise ProbeError(f"the loader writes {name!r} into no parameter of the model")
        wide = torch.float32 if max(rows, cols) < _EXACT_F32 else torch.float64
        scratch = {id(p): torch.zeros(p.shape, dtype=wide) for p in targets}
        self.peak = max(self.peak, 2 * sum(s.numel() * s.element_size() for s in scratch.values()))

        def load(axis: str, reverse: bool = False) -> dict[int, torch.Tensor]:
            for s in scratch.values():
                s.zero_()
            with swapped(self.model, lambda p: scratch.get(id(p), torch.empty(p.shape, dtype=p.dtype, device="meta"))):
                self._load(name, _probe_values(shape, axis, wide, reverse))
            return scratch

        row_of = {k: v.clone() for k, v in load("row").items()} if rows > 1 else None
        col_of = load("col")
        limit = max(16, tmap.numel // MIN_MEAN_RUN)
        ck_all, pid_all, off_all, len_all, fallback = [], [], [], [], False
        for p in targets:
            builder = _RunBuilder(limit)
            for offsets, idx in _hits(None if row_of is None else row_of[id(p)], col_of[id(p)], rows, cols,
                                      lambda: self._transforms(name, p)):
                if not builder.add(offsets, idx):
                    fallback = True
                    break
            if fallback:
                break
            for out, a in zip((ck_all, off_all, len_all), builder.arrays()):
                out.append(a)
            pid_all.append(np.full(ck_all[-1].size, self.index[id(p)], np.int64))
        if not fallback:  # the loader copies the values: indices counted backwards agree
            axis, n = ("row", rows) if rows > 1 else ("col", cols)
            fwd_of = {k: v.clone() for k, v in col_of.items()} if rows == 1 else row_of
            back = load(axis, reverse=True)
            for p in targets:
                fwd, rev = fwd_of[id(p)].view(-1), back[id(p)].view(-1)
                hit = fwd > 0
                if not torch.equal(fwd[hit], (n + 1) - rev[hit]):
                    raise self._transforms(name, p)
        if fallback:
            tmap.copy = self._copy(name, shape, dtype, targets, row_of, col_of, cols)
            tmap.held = tmap.numel
        else:
            cat = (lambda xs: np.concatenate(xs) if xs else np.empty(0, np.int64))
            tmap.tables = _tables(cat(ck_all), cat(pid_all), cat(off_all), cat(len_all))
            cover = _cover(tmap)
            tmap.held = int((cover[:, 1] - cover[:, 0]).sum())
        return tmap

    def _transforms(self, name: str, p: torch.nn.Parameter) -> ProbeError:
        return ProbeError(f"the loader of {name!r} does not copy its values into {self._name(p)!r} (it transforms "
                          "them): the engine's parameters cannot be read back as checkpoint values")

    def _name(self, p: torch.nn.Parameter) -> str:
        return next((n for n, q in self.model.named_parameters() if q is p), "?")

    def _copy(self, name: str, shape, dtype, targets, row_of, col_of, cols: int) -> torch.Tensor:
        """A fallback tensor's checkpoint-form copy, read from the live parameters."""
        rows = coo_2d_shape(shape)[0]
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out = torch.empty(numel, dtype=dtype)
        seen = torch.zeros(numel, dtype=torch.bool)
        for p in targets:
            flat = p.detach().reshape(-1)
            for offsets, idx in _hits(None if row_of is None else row_of[id(p)], col_of[id(p)], rows, cols,
                                      lambda: self._transforms(name, p)):
                o, i = torch.from_numpy(offsets), torch.from_numpy(idx)
                out[i] = flat[o.to(flat.device)].to("cpu", dtype)
                seen[i] = True
        if not bool(seen.all()):
            raise ProbeError(f"{name!r} does not compress to runs (a loader that transposes it?) and this worker "
                             "holds only part of it: it cannot be written whole through the loader")
        return out.view(shape)


def _hits(row_vals: torch.Tensor | None, col_vals: torch.Tensor, rows: int, cols: int,
          refuse: Callable[[], Exception]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(parameter offsets, checkpoint indices)`` of the probed elements, a chunk at a time;
    ``refuse()`` is raised for a probe value that is no row or column index (a loader that
    transforms the values)."""
    flat_c = col_vals.view(-1)
    flat_r = None if row_vals is None else row_vals.view(-1)
    for a in range(0, flat_c.numel(), CHUNK):
        c = flat_c[a:a + CHUNK]
        hit = c > 0
        offsets = torch.nonzero(hit).reshape(-1)
        if not offsets.numel():
            continue
        vals = [(c[hit], cols)] + ([] if flat_r is None else [(flat_r[a:a + CHUNK][hit], rows)])
        if any(bool((v > n).any()) or bool((v != v.floor()).any()) or bool((v < 1).any()) for v, n in vals):
            raise refuse()
        idx = vals[0][0].to(torch.int64) - 1
        if flat_r is not None:
            idx += (vals[1][0].to(torch.int64) - 1) * cols
        yield (offsets + a).numpy(), idx.numpy()


def probe_map(model: torch.nn.Module, load: Load, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
              group=None) -> IndexMap:
    """Probe where every checkpoint tensor of ``specs`` (name → (shape, dtype)) lives in
    ``model``'s parameters, through ``load`` (its ``load_weights``); see the module docstring.
    The model must not run meanwhile. ``group``: the process group of the workers that share
    the model (tensor parallelism): the map then says which worker answers for each element,
    and every element must be held by one of them. :class:`ProbeError` names a tensor that
    cannot be mapped."""
    named = [(n, p) for n, p in model.named_parameters()]
    bad = [n for n, p in named if not p.is_contiguous() or p.numel() == 0]
    if bad:
        raise ProbeError(f"parameter {bad[0]!r} is empty or not contiguous (re-packed, or laid out for a kernel): "
                         "the engine's parameters cannot be written in place")
    probe = _Probe(model, load, _protected(model), {id(p): i for i, (_, p) in enumerate(named)})
    maps = {}
    for name, (shape, dtype) in specs.items():
        maps[name] = tmap = probe.run(name, tuple(shape), dtype)
        if group is None and not tmap.complete:
            raise ProbeError(f"the loader writes only {tmap.held} of the {tmap.numel} elements of {name!r} into this "
                             "model (and no other worker holds the rest)")
    index = IndexMap([p for _, p in named], [n for n, _ in named], maps, probe.peak)
    if group is not None:
        assign_owners(index, group)
    return index


def _cover(tmap: TensorMap) -> np.ndarray:
    """Sorted, merged ``[start, end)`` intervals of the elements this worker holds."""
    if tmap.copy is not None:
        return np.array([[0, tmap.numel]], np.int64)
    iv = [np.stack([t.ckpt.numpy(), (t.ckpt + t.length).numpy()], axis=1) for t in tmap.tables if len(t)]
    return _merge(np.concatenate(iv)) if iv else np.empty((0, 2), np.int64)


def _merge(iv: np.ndarray) -> np.ndarray:
    if not len(iv):
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    out = [list(iv[0])]
    for a, b in iv[1:]:
        if a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return np.array(out, np.int64)


def _subtract(iv: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Intervals ``iv`` less ``minus`` (both sorted and merged)."""
    out = []
    for a, b in iv:
        cur = a
        for c, d in minus:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append([cur, c])
            cur = max(cur, d)
        if cur < b:
            out.append([cur, b])
    return np.array(out, np.int64).reshape(-1, 2)


def assign_owners(index: IndexMap, group) -> None:
    """Agree, across the workers of ``group``, which one answers for each element of every
    tensor (the lowest rank that holds it), and check that together they hold all of it."""
    import torch.distributed as dist

    mine = {n: _cover(t).tolist() for n, t in index.tensors.items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    rank = dist.get_rank(group)
    for name, tmap in index.tensors.items():
        below = _merge(np.array([iv for r in range(rank) for iv in everyone[r][name]], np.int64).reshape(-1, 2))
        tmap.owned = _subtract(_cover(tmap), below)
        union = _merge(np.array([iv for cover in everyone for iv in cover[name]], np.int64).reshape(-1, 2))
        if not (len(union) == 1 and union[0, 0] == 0 and union[0, 1] == tmap.numel):
            raise ProbeError(f"the workers together hold only part of {name!r}: its loader drops elements")
