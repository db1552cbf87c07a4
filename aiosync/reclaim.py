"""Giving large memory back without stalling the event loop (L1).

Freeing a gigabyte is not free: the kernel tears down a quarter of a million page mappings. Done
on the event loop's thread it stalls the loop; done in a worker thread it stalls the loop too
whenever the free runs with the GIL held (a tensor whose memory belongs to a Python object — a
memory-mapped checkpoint — or numpy, or a torch build that keeps the GIL while deallocating).
So aiosync lets go of large buffers here, in bounded pieces:

* :func:`release` (in a worker thread): the pages of every large CPU tensor or numpy array that
  only the given container holds are returned to the kernel ``PIECE`` bytes at a time with
  ``madvise(MADV_DONTNEED)`` — a foreign call that runs without the GIL, so the loop runs between
  pieces — and only then is the last reference dropped (unmapping what is left costs little).
  A buffer someone else still holds is only dropped (its other holder frees it).
* :func:`release_off_loop` (awaitable): :func:`release` in a worker thread, shielded.
* :func:`hand_over` (awaitable): send a large payload built for one send (a bootstrap bucket),
  then release it off the loop if nothing else holds it (:func:`release_if_only_here`) — its last
  reference would otherwise go on the loop's thread.
* :func:`release_later` (from synchronous code on the loop thread, e.g. a ``close()``): the
  container is handed to one reclaimer thread that releases it; nothing is done on the caller's
  thread.
* :func:`drop_file_cache` (in a worker thread, before deleting a large file): its page cache is
  dropped ``PIECE`` bytes at a time. Deleting a file frees all of its cached pages in one kernel
  call — 800 MB of a superseded checkpoint delayed every other thread's wake-up by 30 ms.

A container is a list, tuple, dict or dataclass of tensors, arrays and further containers; the
caller hands over its last reference (``release(box)`` empties the list ``box``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

#: Bytes given back per foreign call: a few milliseconds of kernel work at most.
PIECE = 32 << 20
#: Buffers below this are just dropped (giving them back in pieces would cost more than it saves).
LARGE = 4 << 20
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - an unusual libc
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


@dataclasses.dataclass
class ReclaimStatistics:
    """What :func:`release` did so far in this process (tests and benchmarks read it)."""

    #: Buffers whose pages were given back in pieces, and the bytes.
    released: int = 0
    released_bytes: int = 0
    #: Large buffers only dropped: someone else still held them (or no ``madvise`` here).
    shared: int = 0
    #: ``madvise`` calls (each at most :data:`PIECE` bytes).
    pieces: int = 0


statistics = ReclaimStatistics()
_lock = threading.Lock()


def give_back_pages(address: int, nbytes: int, piece: int = PIECE) -> int:
    """``madvise(MADV_DONTNEED)`` the whole pages inside ``[address, address + nbytes)``, ``piece``
    bytes per call (each call runs without the GIL). The memory reads as zeros afterwards (or as
    the file it maps): call it only on memory nobody will read again. Returns the calls made."""
    if _madvise is None:
        return 0
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    calls = 0
    for at in range(start, end, piece):
        _madvise(at, min(piece, end - at), _MADV_DONTNEED)
        calls += 1
    return calls


def _collect(obj: Any, out: list, depth: int = 0) -> None:
    """Move every tensor and array in ``obj`` to ``out``, emptying the mutable containers on the
    way (so that ``out`` ends up holding the references the containers held)."""
    if depth > 16 or obj is None:
        return
    mod = type(obj).__module__
    if mod.startswith("torch") or mod.startswith("numpy"):
        out.append(obj)
    elif isinstance(obj, dict):
        while obj:
            _collect(obj.popitem()[1], out, depth + 1)
    elif isinstance(obj, list):
        while obj:
            _collect(obj.pop(), out, depth + 1)
    elif isinstance(obj, tuple):
        for item in obj:
            _collect(item, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name, None), out, depth + 1)
    elif type(obj).__name__ == "Shared" and hasattr(obj, "value"):
        _collect(obj.value, out, depth + 1)


def _exclusive_span(item: Any, refs: int) -> tuple[int, int] | None:
    """``(address, nbytes)`` of the memory ``item`` owns when nothing but the caller's ``refs``
    references holds it (and it is large, on the CPU); ``None`` otherwise."""
    if sys.getrefcount(item) - 2 > refs:  # less this function's and getrefcount's own arguments
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(item, torch.Tensor):
        if item.device.type != "cpu" or item.is_sparse or getattr(item, "is_nested", False):
            return None
        if torch.cuda.is_initialized() and item.is_pinned():  # registered with CUDA: leave it to its owner
            return None
        try:
            storage = item.untyped_storage()
            # the tensor and this storage object: nothing else (views, numpy arrays, other tensors)
            if torch._C._storage_Use_Count(storage._cdata) != 2:
                return None
            return storage.data_ptr(), storage.nbytes()
        except (AttributeError, RuntimeError, NotImplementedError):  # a torch without it, a tensor subclass
            return None
    np = sys.modules.get("numpy")
    if np is not None and isinstance(item, np.ndarray):
        if item.base is not None or not item.flags.owndata:
            return None
        return item.ctypes.data, item.nbytes
    return None


def held_only_here(item: Any, refs: int = 1) -> bool:
    """Whether the CPU tensor (or numpy array) ``item`` and its memory are referenced only by the
    caller's ``refs`` references (no view, array or other holder): then the caller may reuse or
    release its memory."""
    return _exclusive_span(item, refs + 1) is not None  # + this function's own argument


def release(obj: Any, piece: int = PIECE) -> None:
    """Let go of ``obj``'s large buffers in bounded pieces (call it in a worker thread; see the
    module docstring). Mutable containers inside ``obj`` are emptied."""
    items: list = []
    _collect(obj, items)
    del obj
    while items:
        item = items.pop()
        span = _exclusive_span(item, refs=1)
        if span is not None and span[1] >= LARGE:
            calls = give_back_pages(*span, piece=piece)
            with _lock:
                statistics.released += 1
                statistics.released_bytes += span[1]
                statistics.pieces += calls
        elif span is None and _nbytes(item) >= LARGE:
            with _lock:
                statistics.shared += 1
        del item


def _nbytes(item: Any) -> int:
    try:
        return int(item.nbytes)
    except (AttributeError, TypeError, RuntimeError):
        return 0


def drop_file_cache(path: str | os.PathLike, piece: int = PIECE) -> None:
    """Drop the (clean) page cache of the file at ``path`` in pieces of ``piece`` bytes, each a
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` call without the GIL; readers are unaffected (pages
    come back from the disk). Call it before deleting a large file that was flushed to disk.
    Does nothing where ``posix_fadvise`` does not exist, or the file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        for at in range(0, size, piece):
            os.posix_fadvise(fd, at, min(piece, size - at), os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


async def release_off_loop(box: list) -> None:
    """:func:`release` ``box``'s contents in a worker thread, shielded from cancellation (a
    cancelled caller still hands them over). The caller keeps no other reference: it hands over
    the box, not its contents."""
    if box:
        from .aio import run_sync

        with anyio.CancelScope(shield=True):
            await run_sync(release, box)


async def hand_over(send: Callable[[Any], Awaitable[Any]], box: list) -> None:
    """``await send(box[0])``, then let go of it. For a large payload made for one send (a
    bootstrap or sync bucket): once sent, if nothing but ``box`` holds it any more, its buffers
    are given back in pieces off the loop (:func:`release_off_loop`) instead of being freed, GIL
    held, wherever its last reference happens to go (the coroutine that sent it, on the event
    loop's thread). If something else still holds it — a receiver in the same process, handed
    the very object — only the caller's reference is dropped: it is the holder's, and nothing in
    it is touched. A send that fails or is cancelled only drops it too: a transport may still be
    reading its bytes (a posted send whose wait timed out)."""
    try:
        await send(box[0])
    except BaseException:
        box.clear()
        raise
    await release_if_only_here(box)


async def release_if_only_here(box: list) -> None:
    """:func:`release_off_loop` ``box`` if its one item is referenced by ``box`` alone; else just
    empty ``box`` (:func:`release` empties the containers it walks: never one someone else holds)."""
    if box and sys.getrefcount(box[0]) <= 2:  # box's slot and getrefcount's own argument
        await release_off_loop(box)
    box.clear()


_queue: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None


def _reclaimer() -> None:
    from .aio import lower_priority

    lower_priority()
    while True:
        box = _queue.get()
        try:
            release(box)
        except Exception:  # pragma: no cover - releasing must never kill the reclaimer
            pass
        del box


def release_later(obj: Any) -> None:
    """Hand ``obj`` (a container; the caller keeps no other reference to its buffers) to the
    reclaimer thread, which releases it. For synchronous code on the event loop's thread."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_reclaimer, name="aiosync-reclaim", daemon=True)
            _thread.start()
    _queue.put(obj)
