"""The patch-mode handshake (W7, W8): the receiver's metadata, the sender's answer, their
structural checks, and the sender's plan of what it will patch.

``ReceiverMetadata`` (receiver → sender) names the receiver's keys (sorted by name: the
ordinals patches use), their shapes, dtypes, tied keys (aliases), whether each can be written
through a 2-D view, and a random session id; ``SenderHello`` (sender → receiver) accepts or refuses, says whether a bootstrap
follows and which ordinals patches will touch. Everything malformed is a
:class:`~aiosync.errors.HandshakeError` naming what is wrong. See docs/wire-format.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...dtypes import dtype_from_name, dtype_name
from ...errors import HandshakeError
from ..common.indexing import as_coo_2d_view, coo_2d_shape
from .format import TensorLayout
from ..common.payloads import ReceiverMetadata, SenderHello
from ..common.state_dicts import alias_groups, shared_memory


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_session(x: Any) -> bool:
    """A handshake id: a plain int that travels as an int64 (bootstrap buckets carry it as a tensor)."""
    return is_int(x) and 0 <= x < 1 << 63


def metadata_dtype(name: Any) -> torch.dtype:
    """A dtype named in receiver metadata; an unknown name is a :class:`HandshakeError`."""
    dt = dtype_from_name(name)
    if dt is None:
        raise HandshakeError(f"unknown dtype {name!r} in receiver metadata")
    return dt


def receiver_metadata(state_dict: Mapping[str, torch.Tensor], session: int) -> ReceiverMetadata:
    """What a receiver tells the sender about ``state_dict`` (read only), its keys in canonical
    order — sorted by name, whatever order ``state_dict`` iterates in (a vLLM engine's
    checkpoint order, a module's registration order): patches name tensors by their ordinal in
    this list, so receivers holding the same tensors announce the same metadata and a
    synchronizer's fan-out serves them from one snapshot and one encode per version. Tied keys
    alias the first of their group in that order; memory-sharing pairs are listed sorted."""
    keys = sorted(state_dict.keys())
    state_dict = {k: state_dict[k] for k in keys}
    viewable = []
    for k in keys:
        try:
            as_coo_2d_view(state_dict[k], k)
            viewable.append(True)
        except ValueError:
            viewable.append(False)
    return ReceiverMetadata(
        ordered_keys=keys, original_shapes=[tuple(state_dict[k].shape) for k in keys],
        dtypes=[dtype_name(state_dict[k].dtype) for k in keys], aliases=alias_groups(state_dict),
        viewable=viewable, session=session, shares=sorted(shared_memory(state_dict), key=lambda p: (p[0], p[1])),
    )


def check_metadata(meta: ReceiverMetadata) -> None:
    """Structure of the receiver's metadata: anything malformed is a :class:`HandshakeError`."""
    keys, shapes, dtypes = meta.ordered_keys, meta.original_shapes, meta.dtypes
    if not all(isinstance(x, (list, tuple)) for x in (keys, shapes, dtypes)):
        raise HandshakeError("receiver metadata is malformed: keys, shapes and dtypes must be lists")
    if len(shapes) != len(keys) or len(dtypes) != len(keys):
        raise HandshakeError("receiver metadata is inconsistent: keys, shapes and dtypes differ in length")
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise HandshakeError("receiver metadata is malformed: keys must be distinct strings")
    for k, shape in zip(keys, shapes):
        if not isinstance(shape, (list, tuple, torch.Size)) or not all(is_int(d) and 0 <= d < 1 << 63 for d in shape):
            raise HandshakeError(f"receiver metadata gives {k!r} the malformed shape {str(shape)[:80]!r}")
    for d in dtypes:
        metadata_dtype(d)
    if not isinstance(meta.aliases, dict) or not all(
            isinstance(a, str) and isinstance(b, str) and a in keys and b in keys for a, b in meta.aliases.items()):
        raise HandshakeError("receiver metadata is malformed: aliases must map keys to keys")
    viewable = meta.viewable
    if not isinstance(viewable, (list, tuple)) or (viewable and len(viewable) != len(keys)) or not all(
            isinstance(v, bool) for v in viewable):
        raise HandshakeError("receiver metadata is malformed: viewable must be empty or one bool per key")
    shares = meta.shares
    if not isinstance(shares, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 5 and p[0] in keys and p[1] in keys and is_int(p[2])
            and all(isinstance(st, (list, tuple)) and all(is_int(x) for x in st) for st in p[3:]) for p in shares):
        raise HandshakeError("receiver metadata is malformed: shares must list [key, key, offset, strides, strides]")
    if meta.session is not None and not is_session(meta.session):
        raise HandshakeError(f"receiver metadata has a malformed session {str(meta.session)[:40]!r} (an int in "
                             "[0, 2**63) or null)")


def check_hello(hello: Any, n_keys: int, session: int | None) -> None:
    """Structure of the sender's answer: anything malformed is a :class:`HandshakeError`."""
    if not isinstance(hello, SenderHello):
        raise HandshakeError(f"expected SenderHello from the sender, got {type(hello).__name__}")
    if not isinstance(hello.ok, bool) or not isinstance(hello.init_sync, bool):
        raise HandshakeError("the sender's answer is malformed: ok and init_sync must be bools")
    if not hello.ok:
        raise HandshakeError(f"the sender refused this receiver: {str(hello.error)[:2000]}")
    if hello.session is not None and (not is_session(hello.session) or hello.session != session):
        raise HandshakeError("the sender's answer belongs to another handshake (a stale or duplicated message)")
    ords = hello.synced_ordinals
    if not isinstance(ords, (list, tuple)) or not all(is_int(o) and 0 <= o < n_keys for o in ords):
        raise HandshakeError(f"the sender's answer names synced ordinals outside [0, {n_keys})")
    if any(b <= a for a, b in zip(ords, ords[1:])):
        raise HandshakeError("the sender's answer lists synced ordinals that are not strictly increasing")


def same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Floating ↔ floating casts are allowed; integer and bool tensors must match exactly."""
    return (a.is_floating_point and b.is_floating_point) or a == b


def plan_slots(state_dict: Mapping[str, torch.Tensor], names: list[str], boot: list[str],
               meta: ReceiverMetadata) -> tuple[list[str], dict[str, torch.dtype]]:
    """Check keys, shapes and dtypes against the receiver's metadata; return the synced keys
    ordered by receiver ordinal, one per alias group, and the receiver's dtype of every key."""
    ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
    recv_dtypes = {k: metadata_dtype(d) for k, d in zip(meta.ordered_keys, meta.dtypes)}
    viewable = dict(zip(meta.ordered_keys, meta.viewable)) if meta.viewable else {}
    for key in list(dict.fromkeys(names + boot)):
        if key not in ordinal:
            raise HandshakeError(f"sender key {key!r} is missing on the receiver")
        want = tuple(meta.original_shapes[ordinal[key]])
        have = tuple(state_dict[key].shape)
        if want != have:
            raise HandshakeError(f"shape mismatch for {key!r}: sender {have}, receiver {want}")
        if not same_kind(state_dict[key].dtype, recv_dtypes[key]):
            raise HandshakeError(
                f"dtype mismatch for {key!r}: sender {state_dict[key].dtype}, receiver {recv_dtypes[key]} "
                "(only floating-point tensors may change dtype)")
    for key in names:
        if viewable and not viewable.get(key, True):
            raise HandshakeError(
                f"receiver tensor {key!r} of shape {tuple(meta.original_shapes[ordinal[key]])} cannot be viewed "
                "as 2-D without a copy, so patch mode cannot write it; make it contiguous or use bucket mode")
    for key in names:
        width = recv_dtypes[key].itemsize
        if width not in (1, 2, 4, 8):
            raise HandshakeError(
                f"patch mode cannot patch {key!r}: its {dtype_name(recv_dtypes[key])} elements are {width} bytes wide "
                "(patches carry elements of 1, 2, 4 or 8 bytes); sync a real view of it (torch.view_as_real), or use "
                "bucket mode")
    check_shares(state_dict, list(dict.fromkeys(names + boot)), meta)
    canonical = {k: meta.aliases.get(k, k) for k in names}
    seen: set[str] = set()
    slots = []
    for key in sorted(names, key=ordinal.__getitem__):
        if canonical[key] in seen:
            continue
        seen.add(canonical[key])
        slots.append(key)
    return slots, recv_dtypes


def _share_key(pair) -> tuple:
    return (pair[0], pair[1], pair[2], tuple(pair[3]), tuple(pair[4]))


def check_shares(state_dict: Mapping[str, torch.Tensor], keys: list[str], meta: ReceiverMetadata) -> None:
    """The receiver shares memory between two of ``keys`` (tied weights, a buffer viewing rows of
    another tensor) only where the sender shares it alike: otherwise writing one key writes the
    other, and the receiver cannot hold the sender's values of both (:class:`HandshakeError`
    naming them). Sharing on the sender's side only is fine: the receiver holds equal values."""
    wanted = set(keys)
    sender = {_share_key(p) for p in shared_memory(state_dict, keys)}
    for pair in meta.shares:
        if pair[0] in wanted and pair[1] in wanted and _share_key(pair) not in sender:
            raise HandshakeError(
                f"the receiver's {pair[0]!r} and {pair[1]!r} share memory (tied weights, or one views the other) but "
                "the sender keeps them apart: the receiver cannot hold the sender's values of both. Build the "
                "explorer's model as the trainer's (untie them there too), or leave one of them out of param_names")


def check_planned(state_dict: Mapping[str, torch.Tensor], keys: list[str], planned: Mapping[str, tuple]) -> None:
    """Every sync: the sender's ``keys`` still have the shape and dtype the handshake planned
    them with (``planned``: key -> (shape, dtype)). A patch is built against that plan (the
    receiver's 2-D views, the snapshot's element widths); a tensor replaced by one of another
    shape or dtype would be diffed and written reinterpreted. :class:`HandshakeError` naming
    the key otherwise: nothing is built, and the next delivery re-handshakes (which refuses a
    receiver that cannot hold the new structure)."""
    for key in keys:
        if key not in state_dict:
            raise HandshakeError(f"state dict passed to sync lacks synced key {key!r}")
        t = state_dict[key]
        shape, dtype = planned.get(key, (tuple(t.shape), t.dtype))
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise HandshakeError(
                f"synced key {key!r} changed since the handshake: it was {shape} {dtype}, it is now {tuple(t.shape)} "
                f"{t.dtype}; nothing was built (the next delivery re-handshakes, and refuses a receiver that cannot "
                "hold the new structure)")


def sender_layouts(slots: list[str], meta: ReceiverMetadata, dtypes: Mapping[str, torch.dtype]) -> list[TensorLayout]:
    """The layout of every slot as the receiver holds it (its ordinal, 2-D shape and width)."""
    ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
    out = []
    for k in slots:
        rows, cols = coo_2d_shape(meta.original_shapes[ordinal[k]])
        out.append(TensorLayout(ordinal[k], rows, cols, dtypes[k].itemsize, dtypes[k]))
    return out


def receiver_layouts(state_dict: Mapping[str, torch.Tensor], keys: list[str],
                     ordinals: list[int]) -> dict[int, TensorLayout]:
    """The receiver's layouts of the ordinals the sender will patch."""
    out = {}
    for o in ordinals:
        t = state_dict[keys[o]]
        rows, cols = coo_2d_shape(t.shape)
        out[o] = TensorLayout(o, rows, cols, t.element_size(), t.dtype)
    return out
