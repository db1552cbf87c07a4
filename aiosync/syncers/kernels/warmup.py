"""Compiling the numba kernels ahead of use (or loading them from numba's on-disk cache).

Nothing waits for a compile (L2): a syncer pair being set up asks for the kernels of its dtypes
(:func:`request`, non-blocking) and goes on; until they are ready (:func:`ready`) the syncers take
their torch paths — vectorised, bit for bit the same payloads and writes. In the background, one
thread makes the kernels ready: a cold cache is compiled by a child process (numba holds the GIL
for much of a compile: in this process it would stall the event loop for a minute), then the
cached kernels are loaded here. numba caches next to the package, or — where that directory is
read-only — in the user's cache (``NUMBA_CACHE_DIR``, else numba's user-wide cache directory).

``aiosync warm-up`` (:func:`warm_up`) compiles them ahead, for images and CI; ``aiosync.warm_up()``
before the event loop starts loads them there (loading still holds the GIL for a few tenths of a
second, once per process).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

import numpy as np

log = logging.getLogger("aiosync.sync")

_WARM: set[int] = set()
_WARM_CTX: set[int] = set()
_DIGEST_WARM = False
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def warm_up(widths: tuple[int, ...] = (1, 2, 4, 8), ctx: bool = True) -> None:
    """Compile (or load from numba's on-disk cache) the kernels for these element widths
    (bytes per element; the default covers every dtype), and with ``ctx`` those of the ``ctx``
    encoding too, blocking until they are loaded in this process. Public as ``aiosync.warm_up()``
    and ``aiosync warm-up``.

    Syncers never wait for it (they :func:`request` the kernels and take their torch paths until
    they are ready). Loading holds the GIL for a few tenths of a second in all (numba's and
    LLVM's initialisation, and the garbage collections the imports set off), once per process:
    call this before the event loop starts to keep that off the loop too. Idempotent and cheap
    once done.
    """
    new = _warm_digest()
    for w in widths:
        new |= w not in _WARM
        _warm_base(w)
        if ctx and w not in _WARM_CTX:
            _warm_ctx(w)
            _WARM_CTX.add(w)
            new = True
    if new:
        _mark_cached()


def _warm_digest() -> bool:
    """The state digest's kernels (whole-state verification; width-free: loaded with any width's).
    Returns whether they were loaded now."""
    global _DIGEST_WARM
    if _DIGEST_WARM:
        return False
    from .digest import digest_fp32_as_bf16, digest_words

    digest_words(np.zeros(4, np.uint64), 0)
    digest_fp32_as_bf16(np.zeros(4, np.uint32), 0)
    _DIGEST_WARM = True
    return True


def digest_ready() -> bool:
    """Whether the state digest's kernels are loaded in this process (until then
    :func:`aiosync.syncers.common.integrity.state_digest` takes its torch path, same digests)."""
    return _DIGEST_WARM and os.environ.get("AIOSYNC_KERNELS") != "torch"


def _warm_base(w: int) -> None:
    """The kernels of every encoding but ``ctx``, for element width ``w``."""
    if w in _WARM:
        return
    from . import write as kw
    from .flat import count_escapes, decode_gaps, diff_encode_flat, diff_update, encode_flat, pack_nibbles

    dt = _DTYPES[w]
    n = 130
    new, snap = np.ones(n, dt), np.zeros(n, dt)
    pos, nv, ov = np.empty(n, np.int64), np.empty(n, dt), np.empty(n, dt)
    diff_update(new, snap.copy(), False, pos, nv, ov, 0)
    k0 = kw.diff_positions(new, snap, pos, nv, 0)
    kw.scatter(snap.copy(), pos[:k0], nv[:k0], ov[:k0])
    kw.scatter(snap.copy(), pos[:k0], nv[:k0], ov[:0])
    gaps, nibs, exc = np.empty(n * 10, np.uint8), np.empty(n, np.uint8), np.empty((w, n), np.uint8)
    k, g, _, _, _, _, _ = diff_encode_flat(new, snap.copy(), False, gaps, nibs, exc, 0)
    encode_flat(pos, nv, ov, 0, -1, gaps, nibs, exc)
    packed = np.zeros((k + 1) // 2, np.uint8)
    pack_nibbles(nibs[:k], packed)
    count_escapes(packed, np.array([k], np.int64), np.empty(1, np.int64))
    out = np.empty(k, np.int64)
    decode_gaps(gaps, 0, g, k, n, out, True)
    decode_gaps(gaps, 0, g, k, n, out, False)
    old = np.empty(k, dt)
    kw.apply_flat_gaps_logged(np.zeros(n, dt), gaps, 0, k, packed, 0, exc, 0, old)
    kw.restore_gaps(np.zeros(n, dt), gaps, 0, k, old)
    if w == 2:
        src = np.ones(n, np.uint32)
        diff_update(src, snap.copy(), True, pos, nv, ov, 0)
        diff_encode_flat(src, snap.copy(), True, gaps, nibs, exc, 0)
    _WARM.add(w)


def _warm_ctx(w: int) -> None:
    """The ``ctx`` encoding's kernels: a tiny patch built, coded, decoded, written and undone."""
    from . import ctx as kc
    from . import ctx_coder as kcc
    from .ctx import N_CONTEXTS, WIDTH_SLOT, build_tables
    from .rans import NSYM, decoder_tables, encoder_tables

    n, dt = 130, _DTYPES[w]
    new, snap = np.ones(n, dt), np.zeros(n, dt)
    thr, mm, stat = np.zeros(3, dt), np.array([np.iinfo(dt).max], dt), np.array([w * 8 - 1, 0, 0], np.int64)
    gap, ctx, z = np.empty((kc.N_CLASSES, n), np.uint32), np.empty(n, np.uint8), np.empty(n, dt)
    counts, hc, hd = np.zeros(4, np.int64), np.zeros(kc.BINS, np.int64), np.zeros(kc.BINS, np.int64)
    sources = [(new, False)] + ([(np.ones(n, np.uint32), True)] if w == 2 else [])
    for src, fused in reversed(sources):  # the plain source last: its records are coded below
        hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
        k, _ = kc.diff_ctx(src, snap.copy(), fused, thr, mm, stat, gap, ctx, z, counts, hc, hd, 0, hist, WIDTH_SLOT[w], 1)
    kc.exp_histogram(snap, mm, stat[0], stat[1], hc)
    gap, ctx, z = kc.class_major(gap, counts), ctx[:k], z[:k]
    kc.count_symbols(gap, counts, ctx, z, WIDTH_SLOT[w], np.zeros((N_CONTEXTS, NSYM), np.int64))
    _, freqs, tmap = build_tables([hist])
    cat, lens = kcc.encode_streams(gap, ctx, z, counts, encoder_tables(freqs), tmap, WIDTH_SLOT[w])
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    pos, codes = np.empty(k, np.int64), np.empty(k, dt)
    kcc.decode_segment(snap, cat, bounds, thr, mm, stat, counts, *decoder_tables(freqs), tmap,
                       WIDTH_SLOT[w], pos, codes, 0)
    target, old = snap.copy(), np.empty(k, dt)
    kcc.write_codes(target, pos, codes, old)
    kcc.restore_codes(target, pos, old)
    kc.best_split(np.ones(4), np.ones(4) / 2)


def widths_of(tensors) -> tuple[int, ...]:
    """The element widths of ``tensors`` the kernels exist for."""
    return tuple(sorted({t.element_size() for t in tensors if t.element_size() in _DTYPES}))


def warm_up_kernels(tensors, ctx: bool = False) -> None:
    """Compile (or load) the numba kernels for these tensors' element widths (with ``ctx``, the
    ``ctx`` encoding's too), blocking: numba holds the GIL while compiling, so this belongs in a
    worker thread, or before the event loop starts. Syncers use :func:`request` instead."""
    warm_up(widths_of(tensors), ctx)


# ------------------------------------------------------------------ in the background (L2)

def ready(widths: Iterable[int], ctx: bool = False) -> bool:
    """Whether the kernels of these element widths (with ``ctx``: the ``ctx`` encoding's too) are
    loaded in this process. Until they are, callers take their torch paths."""
    if os.environ.get("AIOSYNC_KERNELS") == "torch":  # tests: the torch paths only
        return False
    return all(w in _WARM and (not ctx or w in _WARM_CTX) for w in widths if w in _DTYPES)


class _Loader:
    """The one background thread making requested kernels ready (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.wanted: set[tuple[int, bool]] = set()
        self.thread: threading.Thread | None = None
        #: What each batch did (diagnostics): widths, ctx, whether a child compiled them, seconds
        #: the child and the load here took, why the child failed (``None``: it did not).
        self.batches: list[dict] = []

    def request(self, widths: tuple[int, ...], ctx: bool) -> None:
        with self.lock:
            new = {(w, ctx) for w in widths if w in _DTYPES} - self.wanted
            if not new:
                return
            self.wanted |= new
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="aiosync-kernels", daemon=True)
                self.thread.start()

    def _todo(self) -> tuple[tuple[int, ...], bool]:
        todo = [(w, c) for w, c in self.wanted if not ready((w,), c)]
        return tuple(sorted({w for w, _ in todo})), any(c for _, c in todo)

    def _run(self) -> None:
        from ...aio import lower_priority

        lower_priority()  # this thread and the compiling child it starts yield to the event loop
        while True:
            with self.lock:
                widths, ctx = self._todo()
                if not widths:
                    self.thread = None
                    self.lock.notify_all()
                    return
            t0 = time.perf_counter()
            child = os.environ.get("AIOSYNC_COMPILE_IN_PROCESS") != "1" and not _cached(widths, ctx)
            failed = _compile_in_child(widths, ctx) if child else None
            t1 = time.perf_counter()
            try:
                warm_up(widths, ctx)  # loads what the child compiled (compiles here if it could not)
            except Exception as exc:  # pragma: no cover - a broken numba install: the torch paths serve
                log.warning("aiosync: the numba kernels could not be loaded (%s); the torch paths serve", exc)
                with self.lock:
                    self.wanted -= {(w, c) for w in widths for c in (False, True)}
            self.batches.append({"widths": widths, "ctx": ctx, "child": child, "child_s": round(t1 - t0, 2),
                                 "load_s": round(time.perf_counter() - t1, 2), "child_failed": failed})
            with self.lock:
                self.lock.notify_all()

    def wait(self, widths: tuple[int, ...], ctx: bool, timeout: float | None) -> bool:
        self.request(widths, ctx)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not ready(widths, ctx) and self.thread is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.lock.wait(left)
        return ready(widths, ctx)


_LOADER = _Loader()


def request(widths: Iterable[int], ctx: bool = False) -> None:
    """Ask for the kernels of these element widths (and the ``ctx`` ones) without waiting: one
    background thread compiles them in a child process when numba's cache lacks them, then loads
    them here. Cheap when they are ready or asked for already."""
    widths = tuple(sorted(set(widths)))
    if not ready(widths, ctx):
        _LOADER.request(widths, ctx)


def request_for(tensors, ctx: bool = False) -> None:
    """:func:`request` the kernels of these tensors' element widths."""
    request(widths_of(tensors), ctx)


def wait_ready(widths: Iterable[int], ctx: bool = False, timeout: float | None = None) -> bool:
    """Request the kernels and block (a worker thread, never the event loop) until they are ready
    or ``timeout`` seconds passed; returns whether they are ready."""
    return _LOADER.wait(tuple(sorted(set(widths))), ctx, timeout)


def _compile_in_child(widths: tuple[int, ...], ctx: bool) -> str | None:
    """Compile the kernels into numba's cache in a child Python process (this process keeps its
    GIL); returns why that failed, or ``None``. The child sees this process's environment and the
    same ``aiosync`` (its directory first on ``PYTHONPATH``)."""
    here = os.path.abspath(__file__)  # <root>/aiosync/syncers/kernels/warmup.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "aiosync.syncers.kernels.warmup", "--widths", ",".join(map(str, widths))]
    if ctx:
        cmd.append("--ctx")
    try:
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=1800, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        log.info("aiosync: compiling the kernels in a child process failed (%s); compiling here", tail[0])
        return tail[0] or f"exit code {proc.returncode}"
    return None


_MODULES = ("flat", "write", "simd", "ctx", "ctx_coder", "rans", "digest")


def _marker() -> tuple[str | None, dict]:
    """The marker file that says which widths are compiled in numba's cache (next to the kernels'
    cache files), and the stamp it must carry: the kernels' sources (numba's own cache key is
    their modification time and size), numba's and Python's versions, the machine."""
    import platform

    import numba

    here = os.path.dirname(os.path.abspath(__file__))
    stamp = {"numba": numba.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
             "sources": {m: list(_stat(os.path.join(here, m + ".py"))) for m in _MODULES}}
    path = cache_locations().get("flat")
    return (None if path is None else os.path.join(path, "aiosync-kernels.json")), stamp


def _stat(path: str) -> tuple[float, int]:
    st = os.stat(path)
    return st.st_mtime, st.st_size


def _cached(widths: tuple[int, ...], ctx: bool) -> bool:
    """Whether the marker says numba's cache holds these kernels (then they load here in a few
    tenths of a second, and no child process is needed)."""
    import json

    try:
        path, stamp = _marker()
        with open(path) as fh:
            mark = json.load(fh)
    except (OSError, ValueError, TypeError):
        return False
    if mark.get("stamp") != json.loads(json.dumps(stamp)):
        return False
    return all(w in mark.get("widths", []) and (not ctx or w in mark.get("ctx", [])) for w in widths)


def _mark_cached() -> None:
    """Record in the marker the widths compiled in this process (after :func:`warm_up`)."""
    import json

    try:
        path, stamp = _marker()
        if path is None:
            return
        try:
            with open(path) as fh:
                mark = json.load(fh)
            if mark.get("stamp") != json.loads(json.dumps(stamp)):
                mark = {}
        except (OSError, ValueError):
            mark = {}
        mark = {"stamp": stamp, "widths": sorted(set(mark.get("widths", [])) | _WARM),
                "ctx": sorted(set(mark.get("ctx", [])) | _WARM_CTX)}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(mark, fh)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the next process compiles in a child again
        pass


def cache_locations() -> dict[str, str]:
    """Where numba caches the kernels of each module (the package's ``__pycache__`` when it is
    writable, else ``NUMBA_CACHE_DIR`` or numba's user-wide cache)."""
    from . import ctx, ctx_coder, flat, write

    out = {}
    for mod, fn in ((flat, flat.diff_encode_flat), (write, write.scatter), (ctx, ctx.diff_ctx),
                    (ctx_coder, ctx_coder.decode_segment)):
        cache = getattr(fn, "_cache", None)
        path = getattr(cache, "_cache_path", None)
        if path is not None:
            out[mod.__name__.rsplit(".", 1)[-1]] = path
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m aiosync.syncers.kernels.warmup --widths 2,4 [--ctx]``: compile into the cache."""
    import argparse

    parser = argparse.ArgumentParser(description="compile aiosync's numba kernels into numba's cache")
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--ctx", action="store_true")
    args = parser.parse_args(argv)
    warm_up(tuple(int(w) for w in args.widths.split(",") if w), args.ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
