"""The sender's snapshot of the synced tensors (in the receiver's dtypes) and the patch builders.

* :mod:`.builder` — :class:`~.builder.Snapshot`: one builder for every placement, the CPU
  compare (numba kernels over chunks in a small thread pool)
* :mod:`.cuda` — the CUDA / torch-ops compare: packed groups of tensors, a constant number of
  kernels and host syncs per group
* :mod:`.triton` — the fused cast-and-compare kernels used there when ``triton`` imports

May import: :mod:`aiosync.syncers.kernels`, :mod:`aiosync.syncers.common` and the bottom layer.
"""
