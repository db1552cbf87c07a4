"""The sender's snapshot and the patch builder (W6, W13, B2, P2).

One builder for every placement; only the compare step is device specific:

* CPU source, CPU snapshot — the numba kernel of :mod:`aiosync.syncers.kernels.flat`, run over
  cache-sized chunks by a small thread pool (numba and torch release the GIL).
* CUDA source (snapshot on CUDA, or on CPU in pinned memory: W13) — the same algorithm shape
  in torch ops: compare 64-bit words, refine only the words that differ. With a CPU
  snapshot, the next tensor's snapshot is prefetched to the GPU on a side copy stream, the
  results are staged to pinned CPU buffers whose completion is a CUDA event, and the snapshot
  write-back runs in a background thread that the next build waits for.

Comparisons are on raw bits (B2): NaN equal to itself bit for bit counts as unchanged,
0.0 → -0.0 counts as a change.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...aio import resolve_device
from ...reclaim import release, release_later
from ..kernels.warmup import ready as kernels_ready
from ..common.bits import NP_UINT, as_bits, np_bits

_FUSED: list[bool] = []


def _fused_cast_ok() -> bool:
    """Whether the fused fp32 → bf16 kernel matches torch's cast here (checked once)."""
    if not _FUSED:
        from ..kernels.flat import fused_cast_matches_torch

        _FUSED.append(fused_cast_matches_torch())
    return _FUSED[0]


@dataclass
class TensorDiff:
    """Changed elements of one synced tensor, in ascending row-major position."""

    slot: int
    positions: torch.Tensor  # int64
    new_bits: torch.Tensor  # bits dtype of the receiver's dtype
    old_bits: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.positions.numel())


@dataclass
class FlatDiff:
    """One tensor's changes already in the ``flat`` wire encoding."""

    slot: int
    nnz: int
    gaps: np.ndarray  # uint8 LEB128 varints, first gap from -1
    nibbles: np.ndarray  # uint8, one value nibble per change (packed two per byte on the wire)
    exceptions: np.ndarray  # uint8 (width, escaped changes): whole zig-zag codes, byte-plane-wise
    old_hash: int = 0  # the drift hash of the old bits at the changed positions (unsigned 64-bit)


def _cat(parts: list[np.ndarray], axis: int = 0) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


class Snapshot:
    """Sender-side copy of the synced tensors, in the receiver's dtypes, and the diff builder.

    ``device`` is where the snapshot lives (``cpu`` or ``cuda``). ``kernel`` forces the
    compare step: ``"auto"`` (numba on CPU, torch ops on CUDA) or ``"torch"`` (torch ops
    everywhere; used by tests to exercise the GPU algorithm on CPU).
    """

    def __init__(self, device: str | torch.device = "cpu", *, chunk_elems: int = 1 << 22,
                 workers: int | None = None, kernel: str = "auto") -> None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("snapshot_device is cuda but CUDA is not available; use snapshot_device: cpu")
        self.device = resolve_device(device)  # made on the caller's side: "cuda" is its device, not device 0
        if kernel not in ("auto", "torch"):
            raise ValueError(f"kernel must be 'auto' or 'torch', got {kernel!r}")
        self.kernel = kernel
        self.chunk_elems = int(chunk_elems)
        self.workers = workers or max(1, min(os.cpu_count() or 1, torch.get_num_threads()))
        self._snaps: list[torch.Tensor] = []  # flat, contiguous, receiver dtype
        self._blocks: dict = {}  # dtype -> the one buffer the slots of that dtype are slices of
        self._shapes: list[torch.Size] = []
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._inline = types.SimpleNamespace()
        self._writeback: list[Future] = []
        self.staged_event = None  # CUDA event marking staged results (W13), else None
        self._copy_streams: dict = {}  # device -> the one prefetch stream (a new one per build piles up blocks)
        self._pinned: PinnedBlock | None = None  # the CPU snapshot of CUDA tensors, pinned in one exact block
        self._scratch_lock = threading.Lock()
        #: Bytes of the builder's scratch buffers (per worker thread, kept between builds).
        self.scratch_bytes = 0

    # ----------------------------------------------------------------- state
    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._snaps)

    def __len__(self) -> int:
        return len(self._snaps)

    def tensor(self, slot: int) -> torch.Tensor:
        """The snapshot of ``slot`` in its original shape (a view)."""
        self.wait_writeback()
        return self._snaps[slot].view(self._shapes[slot])

    def bits(self, slot: int) -> np.ndarray:
        """A numpy view of ``slot``'s snapshot bits (CPU snapshots; shares storage)."""
        return np_bits(self._snaps[slot])

    def pool(self) -> ThreadPoolExecutor:
        """The builder's thread pool (``workers`` threads)."""
        return self._pool_get()

    def map_pieces(self, pieces: list[tuple[int, int, int]], fn: Callable[[int, int, int], Any]) -> list:
        """``fn(slot, start, end)`` for every piece of the CPU builders, results in piece order.

        Consecutive pieces share a task of about ``chunk_elems`` elements (per-task Python costs
        about as much as a kernel spends on a few hundred thousand elements); tasks run on the
        builder's pool when there are several, largest first, so that the last tasks to run are
        small and the workers finish together (in slot order, a model's large output layer came
        last and one worker ran it alone: a millisecond of a 35 ms build on two cores).
        """
        tasks: list[list[tuple[int, int, int]]] = [[]]
        filled = 0
        for piece in pieces:
            size = piece[2] - piece[1]
            if filled and filled + size > self.chunk_elems:
                tasks.append([])
                filled = 0
            tasks[-1].append(piece)
            filled += size

        def run(task):
            return [fn(*piece) for piece in task]

        if len(tasks) > 1 and self.workers > 1:
            order = sorted(range(len(tasks)), key=lambda n: -sum(e - s for _, s, e in tasks[n]))
            done = dict(zip(order, self._pool_get().map(run, [tasks[n] for n in order])))
            return [out for n in range(len(tasks)) for out in done[n]]
        return [out for task in tasks for out in run(task)]

    def kernel_source(self, flat: torch.Tensor, slot: int) -> tuple[np.ndarray | None, bool]:
        """See :meth:`_kernel_source`: the kernels' view of a whole source tensor of ``slot``."""
        return self._kernel_source(flat, self._snaps[slot])

    def cast_source(self, piece: torch.Tensor, slot: int) -> tuple[np.ndarray, bool]:
        """A source piece of ``slot`` cast by torch to the snapshot's dtype into this thread's
        scratch buffer (valid until the thread's next cast)."""
        snap = self._snaps[slot]
        casts = getattr(self._local, "casts", None)
        if casts is None:
            casts = self._local.casts = {}
        if casts.get(snap.dtype) is None or casts[snap.dtype].numel() < piece.numel():
            casts[snap.dtype] = torch.empty(max(self.chunk_elems, piece.numel()), dtype=snap.dtype)
        return self._source(piece, snap, casts[snap.dtype])

    def load(self, tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> None:
        """(Re)take the snapshot: each tensor cast to its receiver dtype, copied to ``device``."""
        self.wait_writeback()
        pin = self.device.type == "cpu" and torch.cuda.is_available() and any(t.is_cuda for t in tensors)
        old_block, self._pinned = self._pinned, None
        # One buffer per dtype, slots back to back in slot order: a group of tensors of one dtype
        # is one contiguous slice (the packed builder, one prefetch copy per group).
        kinds = list(dict.fromkeys(dtypes))
        totals = {dt: sum(t.numel() for t, d in zip(tensors, dtypes) if d == dt) for dt in kinds}
        if pin:  # one pageable block of exactly the snapshot's size, registered with CUDA (W13)
            self._pinned = PinnedBlock([totals[dt] * dt.itemsize for dt in kinds])
            buffers = {dt: self._pinned.view(k, dt) for k, dt in enumerate(kinds)}
        else:
            buffers = {dt: torch.empty(totals[dt], dtype=dt, device=self.device) for dt in kinds}
        snaps, at = [], dict.fromkeys(kinds, 0)
        for t, dt in zip(tensors, dtypes):
            snaps.append(buffers[dt][at[dt]:at[dt] + t.numel()])
            at[dt] += t.numel()
        for s, t in zip(snaps, tensors):
            s.copy_(t.detach().reshape(-1))
        self._snaps = snaps
        old_blocks, self._blocks = self._blocks, ({} if pin else buffers)
        release([old_blocks])
        if old_block is not None:
            old_block.release()
        self._shapes = [t.shape for t in tensors]
        self._widest: dict[int, int] = {}  # element size -> most elements of one tensor of it
        for s in snaps:
            self._widest[s.element_size()] = max(self._widest.get(s.element_size(), 0), s.numel())

    # ------------------------------------------------------------------ diff
    def diff(self, tensors: list[torch.Tensor], out_device: str | torch.device = "cpu",
             slots: list[int] | None = None) -> list[TensorDiff]:
        """Compare ``tensors`` with the snapshot, update it, return the changes.

        ``tensors[i]`` belongs to slot ``slots[i]`` (default: one tensor per slot, in order).
        Tensors without changes are left out. Results live on ``out_device``; when they are
        staged from a GPU, :attr:`staged_event` is the CUDA event marking their completion.
        """
        if slots is None:
            if len(tensors) != len(self._snaps):
                raise ValueError(f"expected {len(self._snaps)} tensors, got {len(tensors)}")
            slots = list(range(len(tensors)))
        by_slot = dict(zip(slots, tensors))
        for i, t in by_slot.items():
            if t.numel() != self._snaps[i].numel():
                raise ValueError(f"slot {i}: tensor has {t.numel()} elements, snapshot has {self._snaps[i].numel()}")
        self.wait_writeback()
        self.staged_event = None
        out_device = torch.device(out_device)
        results: list[TensorDiff] = []
        cpu_slots = [i for i, t in by_slot.items() if not (t.is_cuda or self._snaps[i].is_cuda)]
        gpu_slots = [i for i in by_slot if i not in set(cpu_slots)]
        if cpu_slots:
            if self.kernel == "torch" or not kernels_ready({self._snaps[i].element_size() for i in cpu_slots}):
                # the CUDA builder's algorithm, on CPU (also until the numba kernels are loaded)
                from .cuda import diff_groups

                pairs = [(by_slot[i].detach().reshape(-1), self._snaps[i]) for i in cpu_slots]
                for i, (pos, nv, ov) in zip(cpu_slots, diff_groups(pairs)):
                    results.append(TensorDiff(i, pos, nv, ov))
            else:
                results.extend(self._diff_cpu_numba(by_slot, cpu_slots))
        if gpu_slots:
            results.extend(self._diff_cuda(by_slot, gpu_slots, out_device))
        results.sort(key=lambda d: d.slot)
        return [d for d in results if d.nnz]

    @staticmethod
    def _flat(src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``src`` flat, on ``device`` (a copy only where it lives elsewhere or is not contiguous);
        the cast to the snapshot's dtype is the builder's (fused or packed per group)."""
        flat = src.detach().reshape(-1)
        return flat if flat.device == device else flat.to(device, non_blocking=True)

    # CPU: numba kernel over chunks on a thread pool ----------------------------
    def _pool_get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="aiosync-diff")
        return self._pool

    def _cache(self, name: str) -> dict:
        """Scratch buffers kept between builds: per thread of this snapshot's pool, and one set
        for builds run in the caller's thread (a build runs in one thread at a time, but not
        always the same one: a worker thread of the event loop's pool)."""
        holder = self._local if threading.current_thread().name.startswith("aiosync-diff") else self._inline
        cache = getattr(holder, name, None)
        if cache is None:
            cache = {}
            setattr(holder, name, cache)
        return cache

    def _scratch_elems(self, width: int) -> int:
        """Elements of a scratch buffer for tensors of ``width`` bytes: a chunk, or fewer when no
        such tensor is that long."""
        return self.scratch_elems(width, self.chunk_elems)

    def scratch_elems(self, width: int, most: int) -> int:
        """Elements of a builder's scratch buffer for tensors of ``width`` bytes: ``most``, or
        fewer when no such tensor of the snapshot is that long."""
        return max(1, min(most, getattr(self, "_widest", {}).get(width, most)))

    def _buffers(self, dtype: torch.dtype, np_dtype) -> tuple:
        cache = self._cache("bufs")
        key = (dtype, np_dtype)
        if key not in cache:
            n = self._scratch_elems(np.dtype(np_dtype).itemsize)
            cache[key] = (
                torch.empty(n, dtype=dtype),
                np.empty(n, np.int64),
                np.empty(n, np_dtype),
                np.empty(n, np_dtype),
            )
            self.count_scratch(n * (dtype.itemsize + 8 + 2 * np.dtype(np_dtype).itemsize))
        return cache[key]

    def count_scratch(self, nbytes: int) -> None:
        """Add a builder's scratch buffer to :attr:`scratch_bytes` (the sender's memory reports)."""
        with self._scratch_lock:
            self.scratch_bytes += nbytes

    def _chunk(self, src_flat: torch.Tensor, slot: int, start: int, end: int):
        from ..kernels.flat import diff_update

        snap = self._snaps[slot]
        np_dtype = NP_UINT[snap.element_size()]
        cast_buf, out_pos, out_new, out_old = self._buffers(snap.dtype, np_dtype)
        src, fused = self._source(src_flat[start:end], snap, cast_buf)
        k = diff_update(src, np_bits(snap)[start:end], fused, out_pos, out_new, out_old, start)
        if k == 0:
            return None
        return out_pos[:k].copy(), out_new[:k].copy(), out_old[:k].copy()

    @staticmethod
    def _source(piece: torch.Tensor, snap: torch.Tensor, cast_buf: torch.Tensor) -> tuple[np.ndarray, bool]:
        """The kernel's view of a source chunk and whether the kernel casts it (fp32 → bf16).

        Other dtype pairs are cast by torch into ``cast_buf`` first.
        """
        src, fused = Snapshot._kernel_source(piece, snap)
        if src is None:
            buf = cast_buf[: piece.numel()]
            buf.copy_(piece)
            src = np_bits(buf)
        return src, fused

    def _diff_cpu_numba(self, tensors: dict[int, torch.Tensor], slots: list[int]) -> list[TensorDiff]:
        pieces = []
        flats = {}
        for i in slots:
            flats[i] = tensors[i].detach().reshape(-1)
            n = flats[i].numel()
            pieces += [(i, s, min(n, s + self.chunk_elems)) for s in range(0, n, self.chunk_elems)]
        outs = self.map_pieces(pieces, lambda i, s, e: self._chunk(flats[i], i, s, e))
        per_slot: dict[int, list] = {}
        for (i, _, _), out in zip(pieces, outs):
            if out is not None:
                per_slot.setdefault(i, []).append(out)
        diffs = []
        bdt = {i: as_bits(self._snaps[i]).dtype for i in per_slot}
        for i, parts in per_slot.items():
            pos = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            nv = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            ov = np.concatenate([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
            diffs.append(TensorDiff(i, torch.from_numpy(pos), torch.from_numpy(nv).view(bdt[i]),
                                    torch.from_numpy(ov).view(bdt[i])))
        return diffs

    # CPU: diff and ``flat`` encoding fused in one pass ------------------------
    def diff_flat(self, tensors: list[torch.Tensor], slots: list[int] | None = None) -> list["FlatDiff"]:
        """Like :meth:`diff` for CPU tensors, but emit the ``flat`` wire encoding directly.

        Work is cut into tasks of about ``chunk_elems`` elements (:meth:`map_pieces`): large
        tensors are split, small consecutive ones share a task.
        """
        slots = list(range(len(tensors))) if slots is None else slots
        self.wait_writeback()
        sources: dict[int, tuple] = {}
        pieces: list[tuple[int, int, int]] = []
        for i, t in zip(slots, tensors):
            if t.is_cuda or self._snaps[i].is_cuda:
                raise ValueError("diff_flat works on CPU tensors and snapshots; use diff() for CUDA")
            flat = t.detach().reshape(-1)
            snap = self._snaps[i]
            if flat.numel() != snap.numel():
                raise ValueError(f"slot {i}: tensor has {flat.numel()} elements, snapshot has {snap.numel()}")
            sources[i] = (flat, np_bits(snap), *self._kernel_source(flat, snap))
            n = flat.numel()
            pieces += [(i, start, min(n, start + self.chunk_elems)) for start in range(0, n, self.chunk_elems)]
        outs = self.map_pieces(pieces, lambda i, start, end: self._flat_segment(sources[i], i, start, end))
        per_slot: dict[int, list] = {}
        for (i, start, _), out in zip(pieces, outs):
            if out is not None:
                per_slot.setdefault(i, []).append((start, out))
        from ..kernels.flat import varint_bytes

        diffs = []
        for i in sorted(per_slot):
            parts = per_slot[i]
            prev = -1
            gap_parts, nib_parts, exc_parts, nnz, old_hash = [], [], [], 0, 0
            for start, (k, gaps, first_len, first_pos, last_pos, nibs, exc, h) in parts:
                if start == 0:  # the chunk's first gap is already relative to -1
                    gap_parts.append(gaps)
                else:
                    gap_parts.append(np.frombuffer(varint_bytes(start + first_pos - prev - 1), np.uint8))
                    gap_parts.append(gaps[first_len:])
                nib_parts.append(nibs)
                exc_parts.append(exc)
                prev = start + last_pos
                nnz += k
                old_hash = (old_hash + h) & 0xFFFFFFFFFFFFFFFF
            diffs.append(FlatDiff(i, nnz, _cat(gap_parts), _cat(nib_parts), _cat(exc_parts, axis=1), old_hash))
        return diffs

    @staticmethod
    def _kernel_source(flat: torch.Tensor, snap: torch.Tensor) -> tuple[np.ndarray | None, bool]:
        """The kernel's view of a whole source tensor and whether the kernel casts it
        (fp32 → bf16); ``None`` when torch must cast it chunk by chunk first."""
        if flat.dtype == torch.float32 and snap.dtype == torch.bfloat16 and flat.is_contiguous() and _fused_cast_ok():
            return np_bits(flat), True
        if flat.dtype == snap.dtype and flat.is_contiguous():
            return np_bits(flat), False
        return None, False

    def _flat_segment(self, source: tuple, slot: int, start: int, end: int):
        """Diff and encode elements ``[start, end)`` of one tensor (in a worker thread)."""
        from ..kernels.flat import diff_encode_flat

        flat, snap_np, src_np, fused = source
        width = snap_np.itemsize
        cache = self._cache("flat")
        if width not in cache:
            n = self._scratch_elems(width)
            # varint bytes of a chunk <= changes + (sum of gaps) / 128 + 9 <= n + n // 128 + 9
            cache[width] = (np.empty(n + n // 64 + 16, np.uint8), np.empty(n, np.uint8), np.empty((width, n), np.uint8),
                            {})
            self.count_scratch(n + n // 64 + 16 + n + width * n)
        gaps, nibs, exc, casts = cache[width]
        if src_np is None:  # torch casts this chunk into a scratch buffer first
            snap = self._snaps[slot]
            if snap.dtype not in casts:
                n = self._scratch_elems(width)
                casts[snap.dtype] = torch.empty(n, dtype=snap.dtype)
                self.count_scratch(n * snap.element_size())
            src, fused = self._source(flat[start:end], snap, casts[snap.dtype])
        else:
            src = src_np[start:end]
        k, g, e, first_len, first_pos, last_pos, h = diff_encode_flat(src, snap_np[start:end], fused, gaps, nibs, exc,
                                                                      start)
        if k == 0:
            return None
        return k, gaps[:g].copy(), first_len, first_pos, last_pos, nibs[:k].copy(), exc[:, :e].copy(), int(h)

    # CUDA: torch ops, prefetch / staging / background write-back (W13) ------------
    def _diff_cuda(self, tensors: dict[int, torch.Tensor], slots: list[int], out_device: torch.device) -> list[TensorDiff]:
        """Packed groups of tensors (:mod:`aiosync.syncers.snapshot.cuda`) on the caller's stream; a CPU
        snapshot's next group is prefetched (one copy per contiguous run) on one side copy stream
        per device; results are staged to pinned memory once per group."""
        from .cuda import contiguous_run, diff_group, plan, split

        dev = next((t.device for t in tensors.values() if t.is_cuda), None) or next(
            s.device for s in self._snaps if s.is_cuda)
        compute = torch.cuda.current_stream(dev)  # the caller's stream (run_sync carries it here)
        copy_stream = self._copy_streams.get(dev)
        if copy_stream is None:
            copy_stream = self._copy_streams[dev] = torch.cuda.Stream(dev)
        pairs = [(self._flat(tensors[s], dev), self._snaps[s]) for s in slots]
        groups = plan(pairs)

        def prefetch(group):
            pieces = [pairs[p.pair][1][p.start:p.end] for p in group]
            if pieces[0].is_cuda:
                return pieces, None
            with torch.cuda.stream(copy_stream):
                run = contiguous_run(pieces)
                if run is not None:
                    on_gpu = run.to(dev, non_blocking=True)
                    pieces, at = [], 0
                    for p in group:
                        pieces.append(on_gpu[at:at + p.end - p.start])
                        at += p.end - p.start
                else:
                    pieces = [x.to(dev, non_blocking=True) for x in pieces]
                ev = torch.cuda.Event()
                ev.record(copy_stream)
            return pieces, ev

        found = []
        nxt = prefetch(groups[0]) if groups else None
        for k, group in enumerate(groups):
            snaps, ev = nxt
            if k + 1 < len(groups):
                nxt = prefetch(groups[k + 1])
            if ev is not None:
                compute.wait_event(ev)
                for t in snaps:
                    t.record_stream(compute)
            d = diff_group(pairs, group, snaps=snaps)
            if d is not None:
                found.append(d)
        if out_device.type == "cpu":  # three pinned copies per group; a large tensor's pieces staged joined
            staged = [dataclasses.replace(d, positions=_stage(d.positions), new_bits=_stage(d.new_bits),
                                          old_bits=_stage(d.old_bits)) for d in found]
            results = split(pairs, staged, join=lambda parts: None)
            if any(r is None for r in results):
                results = [r or tuple(_stage(x) for x in j) for r, j in zip(results, split(pairs, found))]
        else:
            results = split(pairs, found)
        diffs: list[TensorDiff] = []
        writebacks: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for slot, (pos, nv, ov) in zip(slots, results):
            if pos.numel() == 0:
                continue
            diffs.append(TensorDiff(slot, pos, nv, ov))
            if not self._snaps[slot].is_cuda:
                writebacks.append((slot, pos, nv))
        event = torch.cuda.Event()
        event.record(compute)
        self.staged_event = event if out_device.type == "cpu" else None
        if writebacks:
            self._writeback.append(self._pool_get().submit(self._write_back, event, writebacks))
        return diffs

    def _write_back(self, event, writebacks) -> None:
        event.synchronize()
        for slot, pos, nv in writebacks:
            as_bits(self._snaps[slot])[pos.to("cpu")] = nv.to("cpu")

    def wait_writeback(self) -> None:
        """Block until background snapshot write-backs of the previous build have finished."""
        pending, self._writeback = self._writeback, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        """Free the snapshot: its buffers go to :func:`aiosync.reclaim.release_later` (freeing a
        model's worth of memory must not stall an event loop that closes a sender), its builder
        threads end once idle."""
        self.wait_writeback()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._snaps = []  # views of the buffers below
        blocks, self._blocks = self._blocks, {}
        if self._pinned is not None:
            self._pinned.release()
            self._pinned = None
        release_later([blocks])


class PinnedBlock:
    """Page-locked host memory of exactly ``sum(sizes)`` bytes (each piece 64-byte aligned): one
    pageable allocation registered with ``cudaHostRegister``. torch's pinned allocator rounds
    every block up to a power of two (up to twice the memory); this takes what it needs. Falls
    back to torch's pinned allocator when registration fails."""

    ALIGN = 64

    def __init__(self, sizes: list[int]) -> None:
        self.offsets, total = [], 0
        for n in sizes:
            self.offsets.append(total)
            total += -(-n // self.ALIGN) * self.ALIGN
        self.sizes = list(sizes)
        self.buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        self.registered = int(_cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)) == 0
        if not self.registered:
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
        else:  # unregistered when the block goes, if release() was not called
            self._finalizer = weakref.finalize(self, _unregister, self.buffer.data_ptr())

    def view(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        a = self.offsets[i]
        return self.buffer[a:a + self.sizes[i]].view(dtype)

    def release(self) -> None:
        """Unregister the block (its views must no longer be used by the GPU)."""
        if self.registered:
            torch.cuda.synchronize()  # no copy in flight may still read or write it
            self._finalizer()
            self.registered = False


def _stage(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to pinned CPU memory without waiting (valid once the stream reaches here)."""
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)


def _cudart():
    return torch.cuda.cudart()


def _unregister(ptr: int) -> None:
    _cudart().cudaHostUnregister(ptr)
