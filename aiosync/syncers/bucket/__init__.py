"""Bucket mode (W16): whole tensors in size-bounded buckets.

* :mod:`.syncer` — :class:`~.syncer.BucketWeightSyncer`
* :mod:`.format` — the bucket format (flat buffers plus a manifest; also what the patch
  bootstrap sends), version checks, reserved keys

May import: :mod:`aiosync.syncers.kernels`, :mod:`aiosync.syncers.common`, the syncers' top
level and the bottom layer — never :mod:`aiosync.syncers.patch`.
"""
