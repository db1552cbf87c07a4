"""Patch mode (W6–W15, W17, B1–B3): send only the elements that changed, bit-exact.

* :mod:`.syncer` — :class:`~.syncer.PatchWeightSyncer` (both sides: handshake, bootstrap,
  sync, stage and apply)
* :mod:`.handshake` — receiver metadata, the sender's checks and plan
* :mod:`.format` — the wire format (``flat`` and ``coo`` encodings; docs/wire-format.md)
* :mod:`.bounds` — the most bytes a valid patch's streams can hold (hostile-input bounds)
* :mod:`.codecs` — compression (zstd, lz4 on nvCOMP)
* :mod:`.receiver` — validating and decoding a patch outside the exclusive section, the write
  and its undo
* :mod:`.shards` / :mod:`.shard_layout` — shard-local patches of a sharded trainer
* :mod:`.ctx` — the ``ctx`` coding (sender and receiver)

May import: every other sub-package of :mod:`aiosync.syncers` and the bottom layer.
"""
