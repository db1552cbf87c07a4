"""The ``ctx`` patch encoding: changes coded against the receiver's own old values (for slow
links; docs/wire-format.md).

* :mod:`.encode` — the sender: statistics, class thresholds, the build and the coding
* :mod:`.decode` — the receiver: the model header, decoding

Its kernels live in :mod:`aiosync.syncers.kernels.ctx` and :mod:`aiosync.syncers.kernels.ctx_coder`.
May import what :mod:`aiosync.syncers.patch` may, and patch's format and bounds.
"""
