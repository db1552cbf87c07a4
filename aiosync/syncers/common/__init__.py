"""What every sync mode shares.

* :mod:`.bits` — tensors as their raw bits (B2)
* :mod:`.payloads` — the payload messages (patches, metadata, hello)
* :mod:`.integrity` — checksums, manifests, drift hashes, sessions
* :mod:`.staging` — writing a received full state as only what changed, with an undo journal;
  committing to a :class:`~aiosync.syncers.base.CommitTarget`
* :mod:`.state_dicts` — which tensors are synced, DTensor gathering, tied tensors
* :mod:`.indexing` — the 2-D COO view and index delta coding (W9, W11)

May import: :mod:`aiosync.syncers.kernels`, the syncers' top level (:mod:`~aiosync.syncers.base`,
:mod:`~aiosync.syncers.config`) and the bottom layer (errors, messages, aio, dtypes, pieces) —
never a mode (snapshot, bucket, patch).
"""
