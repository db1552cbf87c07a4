"""Patches decoded and written inside the engine, in its own parameters: :class:`EngineReceiver`
(runs wherever the model is — a vLLM worker, through the ``aiosync`` backend).

The explorer's process forwards what its syncer received, as it came (a
:class:`~aiosync.syncers.base.RemoteTarget`): the encoded patch, ~1 byte per changed element,
and whole tensors for a bootstrap or a bucket sync. The receiver here holds an
:class:`~aiosync.engines.index_map.IndexMap` of where each checkpoint element lives in the
model's parameters, probed once through the model's own loader, and applies every write as a
transaction::

    receiver = EngineReceiver(model, model.load_weights, manifest)   # probes the map (model idle)
    version = receiver.apply(patch_bytes)                             # one patch, all or nothing

or in steps, so that only the write holds the engine (what the backend does across vLLM's
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``)::

    txn = receiver.begin(handshake)           # a new handshake's state, or None
    receiver.add_tensors(txn, tensors, version)   # whole tensors: validated, kept
    receiver.add_patch(txn, patch_bytes)      # decoded, old values read, drift checked: nothing written
    version = receiver.commit(txn)            # the only write: scatter (and loads), all or nothing

* **Staging** (:meth:`EngineReceiver.add_patch`) runs while the engine generates: the patch is
  decompressed and validated, the old values at its changed positions are read from the
  parameters through the map, checked against the sender's drift hash, and the new values
  computed (bit patterns: exact in the engine's dtype, NaN and -0.0 included). A patch that
  follows whole tensors in the same transaction (a bootstrap) is staged at the commit instead.
* **The commit** writes: whole tensors through the model's loader, then the new values at their
  parameter offsets. The old values are the undo journal: if anything raises — on any worker —
  every worker puts its old values back, and the receiver keeps its version and handshake.
* **Several workers** (tensor parallelism): each holds its own slice of the map and applies its
  own slice of every patch; ``group`` (their process group) sums the drift hashes of the
  elements each answers for and agrees on every commit.

``encoding: ctx`` patches and ``verify_checksums`` read whole tensors (the ctx decoder's
contexts, the checksum of the result): they need each touched tensor whole in one worker.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AiosyncError, ApplyError, ChecksumError, DriftError, PayloadError
from ..messages import payload_nbytes
from ..syncers.common.bits import as_bits, np_bits
from ..syncers.common.integrity import drift_hash, tensor_checksum
from ..syncers.kernels.warmup import ready as kernels_ready
from ..syncers.kernels.warmup import request as request_kernels
from ..syncers.patch.format import unzigzag_apply
from ..syncers.patch.handshake import is_int, is_session, receiver_layouts
from ..syncers.patch.receiver import PreparedPatch, ReceiverState, complete_patch, prepare_patch, sharded_parts
from ..syncers.patch.shard_layout import shard_views
from .index_map import IndexMap, Load, probe_map
from .inplace_shards import Rows, holds_rows, parse_shards, row_elems

_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- payloads as bytes

def encode_payload(payload: Any) -> bytes:
    """A payload (a patch) as one bytes object: the frame of aiosync's wire codec (a JSON header
    and a packed body: no pickle, safe to take from a network)."""
    from ..transports.distributed.wire import encode_message

    frame = encode_message(payload)
    host = b"" if frame.host is None else frame.host.numpy().tobytes()
    return frame.prefix.tensor().numpy().tobytes() + frame.header + host


def decode_payload(data: bytes | bytearray | memoryview | str) -> Any:
    """Invert :func:`encode_payload` (a ``str`` is taken as base64, for JSON transports); a
    malformed frame is a :class:`~aiosync.errors.PayloadError`."""
    from ..transports.distributed.wire import PREFIX_BYTES, Prefix, decode_message

    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise PayloadError(f"a patch given as a string must be base64: {exc}") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected an encoded patch (bytes), got {type(data).__name__}")
    data = memoryview(data)
    if len(data) < PREFIX_BYTES:
        raise PayloadError(f"an encoded patch of {len(data)} bytes is shorter than its prefix")
    words = torch.frombuffer(bytearray(data[:PREFIX_BYTES]), dtype=torch.int64)
    announced = Prefix.parse(words, sender="the patch's sender", device_body=False)
    if announced.nbytes != len(data):
        raise PayloadError(f"an encoded patch of {len(data)} bytes announces {announced.nbytes} (truncated or "
                           "padded)")
    end = PREFIX_BYTES + announced.header_bytes
    host = torch.frombuffer(bytearray(data[end:]), dtype=torch.uint8) if announced.host_bytes else None
    return decode_message(bytes(data[PREFIX_BYTES:end]), host)


def parse_handshake(info: Any, known: Mapping[str, torch.Tensor]) -> ReceiverState:
    """The state of a patch handshake as the explorer forwards it: ``{"keys": [names in the
    explorer's order], "synced": [ordinals patches touch], "session": int or None}``, and for
    a sharded trainer ``"shards"``: each shard's rows, keys and synced ordinals
    (:func:`~aiosync.engines.inplace_shards.parse_shards`)."""
    if not isinstance(info, dict) or set(info) - {"keys", "synced", "session", "shards"}:
        raise PayloadError(f"a handshake must be {{'keys': [...], 'synced': [...], 'session': id}} (and 'shards' from "
                           f"a sharded trainer), got {info!r:.120}")
    keys, synced, session = info.get("keys"), info.get("synced"), info.get("session")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise PayloadError("the handshake's keys must be distinct names")
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise PayloadError(f"the handshake names {len(unknown)} tensor(s) this engine does not hold: {unknown[:3]}")
    if not isinstance(synced, list) or not all(is_int(o) and 0 <= o < len(keys) for o in synced) or any(
            b <= a for a, b in zip(synced, synced[1:])):
        raise PayloadError(f"the handshake's synced ordinals must be increasing, in [0, {len(keys)})")
    if session is not None and not is_session(session):
        raise PayloadError(f"the handshake's session {session!r:.40} is not an id")
    if info.get("shards") is None:
        return ReceiverState(list(keys), receiver_layouts(known, keys, synced), session)
    if synced:
        raise PayloadError("a sharded trainer's handshake names its synced ordinals per shard, not at the top")
    return ReceiverState(list(keys), {}, session, parse_shards(info["shards"], known, session))


# ----------------------------------------------------------------------------- the transaction

@dataclass
class _Place:
    """New values for one parameter: flat offsets (on its device), new and old bits."""

    param: int
    offsets: torch.Tensor
    new: torch.Tensor
    old: torch.Tensor


@dataclass
class _Write:
    """One tensor of a patch, staged: its places, or (a fallback tensor) its whole new value."""

    name: str
    places: list[_Place] = field(default_factory=list)
    whole: torch.Tensor | None = None


@dataclass
class Transaction:
    """One write in progress: nothing of it is in the model before :meth:`EngineReceiver.commit`."""

    state: ReceiverState | None = None  # a new handshake's (committed with the write)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    prepared: PreparedPatch | None = None
    writes: list[_Write] | None = None  # the patch's, once staged
    version: int | None = None
    patch_bytes: int = 0
    #: A sharded patch: ``(shard index, shard, its part prepared)`` of each shard this worker
    #: holds rows of, and what went wrong preparing them (raised once every worker staged).
    parts: list = field(default_factory=list)
    failed: BaseException | None = None


class EngineReceiver:
    """An aiosync receiver inside the engine (see the module docstring).

    ``model``: the engine's model (this worker's part); ``load``: its weight loader
    (``model.load_weights``); ``manifest``: ``{checkpoint name: tensor}`` (meta tensors will do:
    names, shapes, dtypes) of every tensor written here; ``aliases``: names the engine ties to
    another (``{"lm_head.weight": "model.embed_tokens.weight"}``); ``group``: the process group
    of the workers that share the model, if several. Probing the map needs the model idle."""

    def __init__(self, model: torch.nn.Module, load: Load, manifest: Mapping[str, torch.Tensor], *,
                 aliases: Mapping[str, str] | None = None, group: Any = None, index: IndexMap | None = None) -> None:
        self.model, self.load, self.group = model, load, group
        self.aliases = dict(aliases or {})
        specs = {k: (tuple(t.shape), t.dtype) for k, t in manifest.items()}
        self.map = index if index is not None else probe_map(model, load, specs, group=group)
        request_kernels({p.element_size() for p in self.map.params if p.is_cpu})  # the commit's scatter
        self.known = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in specs.items()}
        for alias, source in self.aliases.items():
            self.known[alias] = self.known[source]
        #: The handshake patches are decoded with (``None`` before the first).
        self.state: ReceiverState | None = None
        #: The version the parameters hold (as committed), ``None`` before the first write.
        self.version: int | None = None
        #: Fault injection (tests): called as ``fault(i, n)`` after the ``i``-th of ``n`` writes of a commit.
        self.fault: Callable[[int, int], None] | None = None
        self.stats = {"commits": 0, "patches": 0, "elements": 0, "tensors_loaded": 0, "rollbacks": 0,
                      "parts": 0, "parts_skipped": 0}
        self._held_shards: tuple = (None, [])

    # -- the one-shot entry point --------------------------------------------------------

    def apply(self, patch: Any, handshake: dict | None = None) -> int | None:
        """Apply one encoded patch (bytes, or the payload object) as a transaction; returns the
        version the parameters now hold, or raises (then nothing was written)."""
        txn = self.begin(handshake)
        self.add_patch(txn, patch)
        return self.commit(txn)

    # -- steps -----------------------------------------------------------------------------

    def begin(self, handshake: dict | None = None) -> Transaction:
        """Open a transaction; ``handshake`` (:func:`parse_handshake`) starts a new patch chain."""
        return Transaction(state=None if handshake is None else parse_handshake(handshake, self.known))

    def add_tensors(self, txn: Transaction, tensors: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Whole tensors (a bootstrap or a bucket sync), validated against the manifest and kept
        for the commit, which loads them through the model's loader."""
        for name, t in tensors.items():
            meta = self.known.get(name)
            if name in self.aliases or meta is None:
                raise PayloadError(f"{name!r} is not a tensor this engine holds" + (
                    f" (it ties it to {self.aliases[name]!r}: send that one)" if name in self.aliases else ""))
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(meta.shape):
                raise PayloadError(f"{name!r} arrived as {getattr(t, 'shape', type(t).__name__)}, the engine holds "
                                   f"{tuple(meta.shape)}")
            txn.tensors[name] = t
        if version is not None:
            txn.version = version

    def add_patch(self, txn: Transaction, patch: Any) -> None:
        """Validate and decode a patch (bytes or payload), read the old values it needs and check
        them: raises — writing nothing — on anything wrong (:class:`PayloadError`,
        :class:`~aiosync.errors.PatchChainError`, :class:`DriftError`, ...)."""
        if isinstance(patch, (bytes, bytearray, memoryview, str)):
            txn.patch_bytes = len(patch)
            patch = decode_payload(patch)
        state = txn.state or self.state
        if state is None:
            raise PayloadError("a patch arrived before any handshake: this engine has no patch chain to apply it to")
        version_now = None if txn.state is not None else self.version
        deferred = bool(txn.tensors)  # its old values are those the tensors before it bring
        if state.shards:
            self._prepare_parts(txn, patch, state, version_now)
        else:
            txn.prepared = prepare_patch(patch, state, version_now, self.known, verify_checksums=False, defer_ctx=True)
        txn.version = txn.prepared.version
        if not deferred:
            txn.writes = self._stage(txn, state)

    def _prepare_parts(self, txn: Transaction, patch: Any, state: ReceiverState, version_now: int | None) -> None:
        """A sharded trainer's patch: every part's header checked (every worker alike), then each
        part this worker holds rows of decoded against meta views of its rows; a worker that
        holds none of a part's rows never decodes it. A part that fails is raised at once with
        one worker, else after the staging's collective (no worker is left waiting in it)."""
        inner, parts = sharded_parts(patch, state, version_now)
        holding = self._holding(state)
        for r, (shard, part) in enumerate(zip(state.shards, parts)):
            if not holding[r] or txn.failed is not None:
                continue
            try:
                txn.parts.append((r, shard, prepare_patch(part, shard.state, version_now,
                                                          shard_views(self.known, shard.rows),
                                                          verify_checksums=False, defer_ctx=True)))
            except AiosyncError as exc:
                if self.group is None:
                    raise
                txn.failed = exc
        txn.prepared = PreparedPatch(inner.version, [], [], None, None, payload_nbytes(inner),
                                     parts=[(shard.rows, p, shard.state.layouts) for _, shard, p in txn.parts])

    def _holding(self, state: ReceiverState) -> list[bool]:
        """Per shard of ``state``, whether this worker holds any element of its rows (kept per handshake)."""
        if self._held_shards[0] is not state:
            self._held_shards = (state, [holds_rows(self.map, self.aliases, self.known, s.rows) for s in state.shards])
        return self._held_shards[1]

    def commit(self, txn: Transaction) -> int | None:
        """Write the transaction: whole tensors through the loader, then the patch's values at
        their offsets. All or nothing, on every worker; returns the version now held."""
        undo: list[Callable[[], None]] = []
        error: BaseException | None = None
        try:
            with torch.no_grad():
                if txn.tensors:
                    self._load(txn.tensors, undo)
                if txn.prepared is not None and txn.writes is None:
                    txn.writes = self._stage(txn, txn.state or self.state)
                writes = txn.writes or []
                for i, w in enumerate(writes):
                    self._write(w, undo)
                    if self.fault is not None:
                        self.fault(i, len(writes))
                _sync_devices(self.map)
        except BaseException as exc:
            error = exc
        failed = self._agree(error)
        if failed is not None:
            self._undo(undo)
            self.stats["rollbacks"] += 1
            if error is not None:
                raise error
            raise ApplyError(f"another worker of the engine failed the write ({failed}); every worker put its old "
                             "values back")
        if txn.state is not None:
            self.state = txn.state
        self.version = txn.version
        self.stats["commits"] += 1
        if txn.prepared is not None:
            self.stats["patches"] += 1
            self.stats["elements"] += txn.prepared.changed
        self.stats["tensors_loaded"] += len(txn.tensors)
        return self.version

    # -- staging a patch ---------------------------------------------------------------------

    def _stage(self, txn: Transaction, state: ReceiverState) -> list[_Write]:
        """Decode what is left (``ctx``), read the old values, check the drift hashes (summed
        over the workers), compute the new values and their offsets: the writes, nothing
        written. A sharded patch's parts are staged as one patch, each part's positions shifted
        by its first row into the whole tensor's flat positions, each part's hashes its own."""
        prepared, error = txn.prepared, txn.failed
        if state.shards:  # a slot per (shard, ordinal): the same on every worker, whichever parts it holds
            starts = list(itertools.accumulate((len(s.state.keys) for s in state.shards), initial=0))
            slots, parts = starts[-1], txn.parts
        else:
            parts = [(0, None, prepared)]
            slots = int(prepared.deferred.ordinals.numel()) if prepared.deferred is not None else len(prepared.decoded)
        partial, checks, wholes, writes = [0] * slots, [], {}, []
        try:
            if error is None:
                for r, shard, p in parts:
                    if p.deferred is not None:  # ctx: decoded against the old values, read whole
                        complete_patch(p, state if shard is None else shard.state,
                                       _Whole(self) if shard is None else Rows(_Whole(self), shard.rows))
                    for i, (d, key) in enumerate(zip(p.decoded, p.keys)):
                        slot = i if shard is None else starts[r] + d.ordinal
                        span = None if shard is None else shard.rows.get(key)
                        h = self._stage_tensor(key, d, p, span, i, wholes, writes)
                        if h is not None:
                            partial[slot] = h
                            checks.append((slot, key, d.count, p.old_hashes[i]))
        except Exception as exc:
            error = exc
        if self.group is not None and (state.shards or prepared.old_hashes is not None):
            partial, others = self._sum_hashes(partial, error is not None)
        else:
            others = False
        if error is not None:
            raise error
        if others:
            raise PayloadError("another worker of the engine refused this patch (its part of it was malformed, or "
                               "its old values drifted); nothing was written")
        self._check_drift(checks, partial)
        self.stats["parts"] += len(txn.parts)
        self.stats["parts_skipped"] += len(state.shards) - len(txn.parts)
        return writes + list(wholes.values())

    def _stage_tensor(self, key: str, d, p: PreparedPatch, span: tuple | None, i: int, wholes: dict,
                      writes: list) -> int | None:
        """Stage one tensor of a patch (or of a shard's part: its rows ``span``); its partial drift
        hash (``None``: the patch carries none)."""
        name = self.aliases.get(key, key)
        local = d.positions.to(torch.int64)
        positions = local if span is None else local + span[0] * row_elems(self.known, key)
        located = None if self.map.tensors[name].copy is not None else self.map.locate(name, positions)
        held, old = self.map.gather(name, positions, located)
        new = self._new_bits(d, held, old)
        h = None
        if p.old_hashes is not None:
            owned = self.map.tensors[name].owned_mask(positions)
            mine = held if owned is None else held & owned
            h = drift_hash(local[mine], old[mine[held]])  # the sender hashed its own piece's positions
        if self.map.tensors[name].copy is not None:  # a fallback tensor: its whole new value, every part's
            whole = wholes.get(name)
            if whole is None:
                whole = wholes[name] = _Write(name, whole=self.map.tensors[name].copy.clone())
            as_bits(whole.whole.view(-1))[positions] = new
        else:
            writes.append(self._place(name, held, old, new, located))
        if p.checksums is not None:
            self._check_sum(name, key, positions, new, p.checksums[i], span)
        return h

    @staticmethod
    def _new_bits(d, held: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        if not d.is_delta:
            return d.payload.reshape(-1)[held.to(d.payload.device)].to(old.device)
        return unzigzag_apply(old, d.codes()[held.to(d.payload.device)].to(old.device))

    def _place(self, name: str, held: torch.Tensor, old: torch.Tensor, new: torch.Tensor, located: list) -> _Write:
        """The write of one tensor, ready for the commit: per parameter, its flat offsets, new
        and old bits, on the parameter's device (the commit only scatters them)."""
        rank = torch.cumsum(held, 0) - 1  # where each held position's bits are in new / old
        places = []
        for t, hits in enumerate(located):
            for p, idx, off in hits:
                flat = self.map.flat(p)
                k = rank[idx]
                off = off.to(flat.device)
                was = old[k] if t == 0 else flat[off]  # gather read the first table
                places.append(_Place(p, off, new[k].to(flat.device), was.to(flat.device)))
        return _Write(name, places)

    def _check_sum(self, name: str, key: str, positions: torch.Tensor, new: torch.Tensor, want: int,
                   span: tuple | None = None) -> None:
        if not self.map.tensors[name].complete:
            raise PayloadError(f"verify_checksums needs {key!r} whole in one worker, and this engine splits it "
                               "between workers: turn verify_checksums off for this explorer")
        after = self.map.whole(name)
        as_bits(after.view(-1))[positions] = new
        if tensor_checksum(after if span is None else after.narrow(0, span[0], span[1])) != want:
            raise ChecksumError(f"tensor {key!r} would not match the sender's checksum after the patch (corrupted in "
                                "transit, or the engine's weights had drifted); refused, nothing was written")

    def _check_drift(self, checks: list, sums: list[int]) -> None:
        for slot, key, n, want in checks:
            if (sums[slot] - want) & _MASK64:
                raise DriftError(f"the engine's {key!r} does not hold, at the {n} positions the patch changes, the "
                                 "values the sender built it on (written behind aiosync's back, or a lost delivery); "
                                 "refused, nothing was written")

    # -- the write ---------------------------------------------------------------------------

    def _write(self, w: _Write, undo: list[Callable[[], None]]) -> None:
        if w.whole is not None:
            tmap = self.map.tensors[w.name]
            old = tmap.copy
            undo.append(lambda: self._reload(w.name, old))
            self._reload(w.name, w.whole)
            return
        for place in w.places:
            flat = self.map.flat(place.param)
            undo.append(lambda flat=flat, place=place: _scatter(flat, place.offsets, place.old))
            _scatter(flat, place.offsets, place.new)

    def _reload(self, name: str, value: torch.Tensor) -> None:
        self.load(iter([(name, value)]))
        self.map.tensors[name].copy = value

    def _load(self, tensors: Mapping[str, torch.Tensor], undo: list[Callable[[], None]]) -> None:
        """Whole tensors through the model's loader, their old values saved first."""
        for name in tensors:
            tmap = self.map.tensors[name]
            if tmap.copy is not None:
                old = tmap.copy
                undo.append(lambda name=name, old=old: self._reload(name, old))
            else:  # saved run by run: no per-element index arrays
                saved = [(flat, off, flat[off:off + length].clone()) for flat, off, length in self._runs(name)]
                undo.append(lambda saved=saved: [flat[off:off + v.numel()].copy_(v) for flat, off, v in saved])
        self.load(iter(tensors.items()))
        for name, t in tensors.items():
            tmap = self.map.tensors[name]
            if tmap.copy is not None:
                tmap.copy = t.detach().to("cpu", tmap.dtype).clone()

    def _runs(self, name: str) -> list[tuple[torch.Tensor, int, int]]:
        """``(flat parameter bits, offset, length)`` of every run of ``name``, in every table."""
        return [(self.map.flat(p), off, length) for table in self.map.tensors[name].tables
                for p, off, length in zip(table.param.tolist(), table.offset.tolist(), table.length.tolist())]

    def _undo(self, undo: list[Callable[[], None]]) -> None:
        with torch.no_grad():
            for step in reversed(undo):
                step()
            _sync_devices(self.map)

    # -- several workers -------------------------------------------------------------------

    def _sum_hashes(self, partial: list[int], failed: bool) -> tuple[list[int], bool]:
        """Every worker's partial hashes summed (each answers for the elements it owns), and
        whether another worker's staging failed (every worker joins, whatever happened)."""
        import torch.distributed as dist

        halves = torch.tensor([[h & 0xFFFFFFFF, (h & _MASK64) >> 32] for h in partial] + [[int(failed), 0]],
                              dtype=torch.int64)
        dist.all_reduce(halves, group=self.group)
        sums = [(int(lo) + (int(hi) << 32)) & _MASK64 for lo, hi in halves[:-1].tolist()]
        return sums, int(halves[-1, 0]) > int(failed)

    def _agree(self, error: BaseException | None) -> str | None:
        """Whether every worker's write succeeded: ``None``, or what failed."""
        if self.group is None:
            return None if error is None else str(error)
        import torch.distributed as dist

        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, None if error is None else f"{type(error).__name__}: {error}"[:500],
                               group=self.group)
        failed = [f"worker {r}: {e}" for r, e in enumerate(everyone) if e is not None]
        return "; ".join(failed) or None

    def statistics(self) -> dict:
        """Plain numbers for a report: the map's, and the writes'."""
        return {**self.map.statistics(), **self.stats, "version": self.version}


class _Whole(Mapping):
    """The tensors as a ctx decoder reads them: whole, read from the parameters."""

    def __init__(self, receiver: EngineReceiver) -> None:
        self.receiver = receiver

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self.receiver.aliases.get(key, key)
        if not self.receiver.map.tensors[name].complete:
            raise PayloadError(f"a ctx patch needs {key!r} whole in one worker, and this engine splits it: use the "
                               "flat encoding for this explorer")
        return self.receiver.map.whole(name)

    def __contains__(self, key: object) -> bool:
        return key in self.receiver.known

    def __iter__(self):
        return iter(self.receiver.known)

    def __len__(self) -> int:
        return len(self.receiver.known)


def _scatter(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[offsets] = values`` (bits, offsets sorted): on the CPU the numba kernel once it is
    loaded (one pass in the offsets' order: about half ``index_put_``'s time), else ``index_put_``."""
    if flat.is_cpu and kernels_ready((flat.element_size(),)):
        from ..syncers.kernels.write import scatter

        vals = np_bits(values)
        scatter(np_bits(flat), offsets.numpy(), vals, vals[:0])
    else:
        flat.index_put_((offsets,), values)


def _sync_devices(index: IndexMap) -> None:
    if any(p.is_cuda for p in index.params[:1]) and torch.cuda.is_available():
        torch.cuda.synchronize()


__all__ = ["EngineReceiver", "Transaction", "encode_payload", "decode_payload", "parse_handshake"]
