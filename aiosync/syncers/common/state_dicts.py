"""State-dict helpers of the syncers: which tensors are synced (W5, W8), how sender tensors
are materialised (W17, FSDP2 DTensors), live tensors of a model, and tied (aliased) tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

import torch

from ...errors import ConfigError, HandshakeError


def collect_param_names_need_sync(module: torch.nn.Module) -> list[str]:
    """State-dict names of trainable parameters and persistent buffers, in state-dict order (W5).

    Parameters with ``requires_grad=False`` are left out. Every name of a tied (aliased)
    parameter is kept, so a receiver that is not tied the same way still gets both.
    """
    wanted: set[str] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            wanted.add(name)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in non_persistent:
                wanted.add(f"{mod_name}.{buf_name}" if mod_name else buf_name)
    return [k for k in module.state_dict(keep_vars=True) if k in wanted]


def match_prefixes(keys: Iterable[str], prefixes: list[str] | None) -> list[str]:
    """Keys selected by ``prefixes`` (W8): ``key == p`` or ``key.startswith(p + ".")``.

    ``None`` selects every key. A prefix that matches nothing raises ``ConfigError``.
    """
    keys = list(keys)
    if prefixes is None:
        return keys
    selected = []
    hits = {p: 0 for p in prefixes}
    for key in keys:
        for p in prefixes:
            if key == p or key.startswith(p + "."):
                hits[p] += 1
                selected.append(key)
                break
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        raise ConfigError(
            f"init_sync.prefixes {missing} match no state-dict key; use null to bootstrap the whole "
            "state dict, or fix the prefix (nested modules such as 'action_head.value_head' need their full path)"
        )
    return selected


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard). Imports nothing: while
    ``torch.distributed.tensor`` has not been imported, no tensor can be a DTensor (importing
    it here cost the event loop ~0.7 s at the first attach)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


_GATHERED = [0]


def gathered_bytes() -> int:
    """Bytes of other ranks' shards this process gathered so far (:func:`materialize` of
    DTensors): what a sharded trainer's syncs cost in memory when they do not stay
    shard-local (:mod:`aiosync.syncers.patch.shards`)."""
    return _GATHERED[0]


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the full value: DTensors are gathered (a collective: every rank
    of the mesh must call this in the same order), plain tensors are returned detached."""
    if is_dtensor(tensor):
        local = tensor.to_local()
        tensor = tensor.full_tensor()
        _GATHERED[0] += (tensor.numel() - local.numel()) * tensor.element_size()
    # a conjugate or negative view is read through its bits by the builders: resolve it (a copy)
    return tensor.detach().resolve_conj().resolve_neg()


def select_sync_names(state_dict: Mapping[str, torch.Tensor], names: Iterable[str] | None) -> list[str]:
    """Validate ``param_names_need_sync`` against the sender's state dict, keeping state-dict order."""
    if names is None:
        return list(state_dict)
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in state_dict]
    if missing:
        raise HandshakeError(f"param_names_need_sync names keys missing from the sender's state dict: {missing[:5]}")
    wanted_set = set(wanted)
    return [k for k in state_dict if k in wanted_set]


def module_state_dict(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The live tensors of ``model``: its ``state_dict()`` for a module, the mapping itself otherwise."""
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if isinstance(model, Mapping):
        return model
    raise TypeError(f"expected an nn.Module or a mapping of tensors, got {type(model).__name__}")


def alias_groups(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Map every key whose tensor aliases an earlier key's tensor (same storage, offset, shape,
    strides and dtype) to that earlier key. Tied weights are written once through the first.
    A DTensor is compared by its local shard (FSDP2 ties a parameter as one DTensor)."""
    seen: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if is_dtensor(t) else t
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()  # a meta tensor has no address: its storage object names it
        where = storage._cdata if t.is_meta else storage.data_ptr()
        ident = (t.device, where, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            out[key] = seen[ident]
        else:
            seen[ident] = key
    return out


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last)`` bytes of ``t``'s elements in its storage (``None``: no storage to share)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    last = t.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    first = t.storage_offset() - sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if s < 0)
    return first * t.element_size(), (last + 1) * t.element_size()


def shared_memory(state_dict: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None) -> list[list]:
    """Every pair of ``keys`` (default: all) whose tensors share memory — tied weights, a
    buffer viewing rows of another tensor — as ``[a, b, offset, stride_a, stride_b]`` with
    ``a < b`` (by name): ``offset`` is ``b``'s storage offset minus ``a``'s, in elements.

    Two state dicts whose tensors are laid out alike give the same pairs, whatever their
    dtypes: the patch handshake and the bucket manifest compare the sender's pairs with the
    receiver's (a receiver that shares memory where the sender does not cannot hold the
    sender's values of both). Tensors of one storage whose byte spans intersect count as
    sharing (a strided pair that interleaves without touching counts too)."""
    by_storage: dict[tuple, list[tuple[int, int, str, torch.Tensor]]] = {}
    for key in (state_dict if keys is None else keys):
        t = state_dict[key]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if is_dtensor(t) else t
        span = _span(t)
        if span is not None:
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((*span, key, t))
    pairs = []
    for spans in by_storage.values():
        if len(spans) < 2:
            continue
        spans.sort(key=lambda s: s[0])
        for i, (_, end, key, t) in enumerate(spans):
            for first2, _, key2, t2 in spans[i + 1:]:
                if first2 >= end:
                    break
                (a, ta), (b, tb) = sorted([(key, t), (key2, t2)], key=lambda kt: kt[0])
                pairs.append([a, b, tb.storage_offset() - ta.storage_offset(), list(ta.stride()), list(tb.stride())])
    return sorted(pairs)


def copy_shared(tensors: Mapping[str, torch.Tensor], keys: Iterable[str], *,
                like: Mapping[str, torch.Tensor] | None = None, clone: bool = True) -> dict[str, torch.Tensor]:
    """Copies of ``tensors[k]`` for ``keys`` that share memory as ``like[k]`` do (default:
    ``tensors`` itself): tensors that overlap there (tied weights, views of one buffer) become
    views of one new buffer, so a copy of a trainer's state keeps its tying (what the patch
    handshake and the bucket manifest compare, :func:`shared_memory`). ``clone=False`` keeps
    the tensors that share nothing as they are (already private copies, e.g. loaded from a
    file). Every other tensor is cloned."""
    keys = list(keys)
    like = tensors if like is None else like
    parent = {k: k for k in keys}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for a, b, *_ in shared_memory(like, [k for k in keys if k in like]):
        parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(root(k), []).append(k)
    out = {}
    with torch.no_grad():
        for members in groups.values():
            views = [like[k] for k in members] if len(members) > 1 else []
            if views and len({(v.dtype, v.device) for v in views}) == 1 and not any(map(is_dtensor, views)):
                base = min(v.storage_offset() - sum((n - 1) * abs(s) for n, s in zip(v.shape, v.stride()) if s < 0)
                           for v in views)
                end = max(_span(v)[1] // v.element_size() for v in views)
                buf = torch.empty(end - base, dtype=views[0].dtype, device=views[0].device)
                for k, v in zip(members, views):
                    view = buf.as_strided(v.shape, v.stride(), v.storage_offset() - base)
                    view.copy_(tensors[k])
                    out[k] = view
            else:
                for k in members:
                    out[k] = tensors[k].detach().clone() if clone else tensors[k]
    return out


def gather_full_state(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with DTensors (FSDP2 shards) gathered into plain tensors.

    A collective when the model is sharded: call it on every rank of the model's mesh, in the
    same order. Use it on the trainer ranks after each step and attach the result (a mapping
    updated in place) to the synchronizer on one of them.
    """
    state = model.state_dict()
    keys = list(state) if names is None else list(names)
    with torch.no_grad():
        return {k: materialize(state[k]).detach() for k in keys}
