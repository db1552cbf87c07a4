"""The numba kernels: every per-element and per-change loop of patch mode.

* :mod:`.flat` — the shared helpers (block masks, varints, nibbles, the drift hash mix) and
  the ``flat`` builder (diff and encode in one pass)
* :mod:`.write` — the receiver's writers (scatter, the ``flat`` write with its undo log)
* :mod:`.simd` — block masks as LLVM vector compares, software prefetch
* :mod:`.ctx` — the ``ctx`` encoding's classes, its builder and its coding tables
* :mod:`.ctx_coder` — the ``ctx`` rANS lanes of a segment: coding, decoding, the write
* :mod:`.rans` — the rANS entropy coder's primitives and tables
* :mod:`.warmup` — compiling (or loading) the kernels ahead of use

May import: numpy, numba and each other — no syncer, no torch model code, nothing else of
aiosync. Importing :mod:`aiosync.syncers.kernels` itself loads nothing; each module compiles
(or loads from numba's cache) on first use.
"""
