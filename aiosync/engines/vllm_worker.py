"""What aiosync runs inside a vLLM worker, and how a call reaches it: :data:`CALLS`, :func:`call`
and :class:`AiosyncWorkerExtension`.

The in-place path (:mod:`aiosync.engines.vllm_inplace`) and the shadow path's verification run
code in each vLLM worker: probe the index map and keep an
:class:`~aiosync.engines.inplace.EngineReceiver` on the ``aiosync`` backend, stage a write,
commit it, read or digest the parameters, report statistics. Each is a function
``fn(worker, *args)`` of :data:`CALLS`, named, and :func:`call` runs one by name and returns
its answer — or the error it raised, as a value, so that the client re-raises the same aiosync
error class with the same message (vLLM reduces a worker's exception to a bare message).

How a call reaches the worker is the only thing that differs between engines
(:mod:`aiosync.engines.vllm_calls`):

* an offline ``LLM`` in this process: ``llm.collective_rpc(call, args=(name, *args))`` — the
  function itself, the arguments by reference;
* an ``AsyncLLM`` (its engine core and workers in other processes; so ``vllm serve``):
  ``collective_rpc("aiosync_call", args=(name, *to_wire(args)))`` — a *string-named* worker
  method, which vLLM's RPC carries without ``VLLM_ALLOW_INSECURE_SERIALIZATION``. The method is
  :meth:`AiosyncWorkerExtension.aiosync_call`, mixed into vLLM's worker class by vLLM's own
  extension point: start the engine with ``worker_extension_cls=WORKER_EXTENSION``
  (``--worker-extension-cls aiosync.engines.vllm_worker.AiosyncWorkerExtension`` for ``vllm
  serve``). Arguments and answers travel as msgpack-able values (:func:`to_wire`): a write's
  patch as the bytes it was encoded in (~1 byte per changed element), whole tensors as
  safetensors bytes, dtypes by name.

A write is staged on a thread of the worker (:func:`stage_begin`: the call returns at once, the
engine keeps stepping while the patch is decoded and the old values read), waited for
(:func:`stage_wait`) before the client pauses the engine, and written by :func:`commit_write`
during the pause.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from .. import errors
from ..dtypes import dtype_from_name, dtype_name
from ..errors import ApplyError, ConfigError
from ..syncers.base import RemoteWrite

#: The ``worker_extension_cls`` an ``AsyncLLM`` (or ``vllm serve``) needs for the in-place path.
WORKER_EXTENSION = "aiosync.engines.vllm_worker.AiosyncWorkerExtension"
_TAG = "__aiosync__"


# ----------------------------------------------------------------------------- the calls

def _backend(worker: Any) -> Any:
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        raise ConfigError("the vLLM worker has no weight-transfer engine: start it with "
                          "weight_transfer_config={'backend': 'aiosync'}")
    return engine


def _receiver(worker: Any) -> Any:
    """The worker's receiver, its map bound to the model's current parameters (by name: a
    reload through vLLM's own update path may have replaced them). The binding is kept, with
    the module and attribute holding each parameter, and checked by identity on each call (one
    dict look-up per parameter, inside the pause for the commit): rebuilt only when a
    parameter was replaced."""
    receiver = getattr(_backend(worker), "receiver", None)
    if receiver is None:
        raise ApplyError("this worker has no in-place receiver (the probe never ran here)")
    index = receiver.map
    model = worker.get_model()
    bound = getattr(receiver, "bound", None)
    if bound is not None and bound[0] is model and all(
            owner._parameters.get(attr) is p for (owner, attr), p in zip(bound[1], index.params)):
        return receiver
    named = dict(model.named_parameters())
    now = [named.get(n) for n in index.param_names]
    if any(p is None or p.shape != q.shape or p.dtype != q.dtype for p, q in zip(now, index.params)):
        raise ApplyError("the engine's parameters no longer have the layout the index map was probed on (re-packed "
                         "or re-shaped by a reload): make a new target")
    index.params = now
    owners = []
    for n in index.param_names:
        prefix, _, attr = n.rpartition(".")
        owners.append((model.get_submodule(prefix), attr))
    receiver.bound = (model, owners)
    return receiver


def unreadable_parameter(worker: Any) -> str | None:
    """The first parameter of the worker's model that cannot be written in place (empty:
    re-packed into a kernel's handle; not contiguous; re-laid out by an MoE kernel), or ``None``."""
    model = worker.get_model()
    from .vllm_backend import relaid_out_parameters

    relaid = {id(p) for _, p in relaid_out_parameters(model)}
    for name, p in model.named_parameters():
        if p.numel() == 0 or not p.is_contiguous() or id(p) in relaid:
            return name
    return None


def _group(worker: Any) -> Any:
    """A gloo group of this engine's tensor-parallel workers for the receiver's own collectives
    (drift hashes, the commit's agreement; run from the staging thread too, so never vLLM's
    groups), or ``None`` with one worker. Made collectively: every worker runs the probe."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    if tp.world_size == 1:
        return None
    import torch.distributed as dist

    from datetime import timedelta

    return dist.new_group(ranks=list(tp.ranks), backend="gloo", timeout=timedelta(seconds=300))


def probe_receiver(worker: Any, specs: dict[str, tuple], aliases: dict[str, str]) -> dict:
    """Probe the index map (the model must be idle) and keep an
    :class:`~aiosync.engines.inplace.EngineReceiver` on the worker's backend; its statistics."""
    from .inplace import EngineReceiver

    model = worker.get_model()
    manifest = {k: torch.empty(tuple(s), dtype=d, device="meta") for k, (s, d) in specs.items()}
    backend = _backend(worker)
    backend.receiver = EngineReceiver(model, model.load_weights, manifest, aliases=aliases, group=_group(worker))
    backend.staged = backend.staging = None
    return backend.receiver.statistics()


def _stage(receiver: Any, write: RemoteWrite) -> Any:
    """``write`` staged on ``receiver``: its transaction (decoded, old values read, drift
    checked; nothing written). Raises what is wrong with it."""
    txn = receiver.begin(write.handshake)
    for bucket in write.tensors:
        receiver.add_tensors(txn, bucket, write.version)
    if write.patch is not None:
        receiver.add_patch(txn, write.patch)
    elif write.version is not None:
        txn.version = write.version
    return txn


def stage_write(worker: Any, write: RemoteWrite) -> None:
    """Stage ``write`` here and now (:func:`stage_begin` does it beside the engine's steps)."""
    backend = _backend(worker)
    backend.staging = backend.staged = None
    backend.staged = _stage(_receiver(worker), write)


def stage_begin(worker: Any, write: RemoteWrite) -> None:
    """Start staging ``write`` on a thread of the worker and return: the engine keeps stepping
    (staging only reads the parameters). :func:`stage_wait` answers how it went; the commit
    takes the transaction from this staging only (one left behind by a client that gave up
    waiting is never committed)."""
    receiver = _receiver(worker)
    backend = _backend(worker)
    stager = getattr(backend, "stager", None)
    if stager is None:  # one staging thread per backend, kept (a thread per write costs memory arenas)
        stager = backend.stager = concurrent.futures.ThreadPoolExecutor(1, "aiosync-stage")
    backend.staged = None
    backend.staging = stager.submit(_stage, receiver, write)  # its error goes to stage_wait / commit_write


def stage_wait(worker: Any, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) for the staging :func:`stage_begin` started; raises
    what it raised."""
    staging = getattr(_backend(worker), "staging", None)
    if staging is None:
        raise ApplyError("no write is being staged on this worker")
    try:
        staging.result(timeout)
    except concurrent.futures.TimeoutError:
        raise errors.PeerTimeoutError(f"the worker did not stage the write within {timeout:g}s") from None


def commit_write(worker: Any) -> int | None:
    """Write the staged transaction (all or nothing, on every worker)."""
    backend = _backend(worker)
    staging, backend.staging = getattr(backend, "staging", None), None
    txn, backend.staged = backend.staged, None
    if staging is not None:
        if not staging.done():
            raise ApplyError("the commit came before the staging finished (stage_wait first)")
        txn = staging.result()  # raises what the staging raised
    if txn is None:
        raise ApplyError("no staged write to commit (a stage failed, or another client staged one meanwhile)")
    receiver = _receiver(worker)
    arm = getattr(backend, "arm_commit", None)  # the aiosync-faults backend (aiosync.engines.vllm_faults)
    if arm is not None:
        arm(receiver, txn.version)
    return receiver.commit(txn)


def _whole(receiver: Any, name: str) -> torch.Tensor:
    """The checkpoint tensor ``name`` read from the parameters through the index map; with
    several tensor-parallel workers, assembled from the elements each answers for (every worker
    runs this for the same names in the same order: a collective over the receiver's group)."""
    index = receiver.map
    name = receiver.aliases.get(name, name)
    if receiver.group is None:
        return index.whole(name)
    import torch.distributed as dist

    from ..syncers.common.bits import as_bits

    tmap = index.tensors[name]
    try:  # this worker's part; whatever happens, it joins the collective (no peer is left waiting)
        positions = torch.arange(tmap.numel)
        held, bits = index.gather(name, positions)
        owned = tmap.owned_mask(positions)
        mine = held if owned is None else held & owned
        part: Any = (positions[mine], bits[mine[held]])
    except Exception as exc:
        part = f"{type(exc).__name__}: {exc}"
    parts: list = [None] * dist.get_world_size(receiver.group)
    dist.all_gather_object(parts, part, group=receiver.group)
    failed = [f"worker {r}: {p}" for r, p in enumerate(parts) if isinstance(p, str)]
    if failed:
        raise ApplyError(f"reading {name!r} from the workers failed ({'; '.join(failed)})")
    out = torch.empty(tmap.shape, dtype=tmap.dtype)
    flat = as_bits(out.view(-1))
    for where, values in parts:
        flat[where] = values
    return out


def read_checkpoint(worker: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` in checkpoint form, read from the engine's parameters through the
    index map (fused, padded, tensor-parallel-split parameters included)."""
    receiver = _receiver(worker)
    return {n: _whole(receiver, n) for n in names}


def digest_checkpoint(worker: Any, names: list[str]) -> dict[str, int]:
    """The state digest of each tensor ``names`` in checkpoint form, read from the engine's
    parameters through the index map, one tensor at a time."""
    from ..syncers.common.integrity import state_digest

    receiver = _receiver(worker)
    with torch.no_grad():
        return {n: state_digest(_whole(receiver, n)) for n in names}


def receiver_statistics(worker: Any) -> dict:
    """The worker's receiver's statistics."""
    return _receiver(worker).statistics()


def digest_parameters(worker: Any, specs: dict[str, tuple]) -> dict[str, int]:
    """The shadow path's verification (:func:`aiosync.engines.vllm_backend.digest_parameters`)."""
    from .vllm_backend import digest_parameters as digest

    return digest(worker, specs)


#: Every call a client may make, by name.
CALLS = {fn.__name__: fn for fn in (unreadable_parameter, probe_receiver, stage_write, stage_begin, stage_wait,
                                    commit_write, read_checkpoint, digest_checkpoint, receiver_statistics,
                                    digest_parameters)}


def call(worker: Any, name: str, *args: Any, wire: bool = False) -> Any:
    """Run :data:`CALLS` ``[name](worker, *args)``; its answer, or the error it raised as a value
    (:func:`answer` re-raises it in the client). ``wire``: the arguments and the answer travel
    as :func:`to_wire` values."""
    try:
        fn = CALLS.get(name)
        if fn is None:
            raise ConfigError(f"aiosync worker: unknown call {name!r} (the engine runs another aiosync version?)")
        if wire:
            args = tuple(from_wire(a) for a in args)
        result = fn(worker, *args)
        return to_wire(result) if wire else result
    except Exception as exc:
        return {_TAG: "error", "type": type(exc).__name__, "message": str(exc)}


def answer(replies: list[Any], wire: bool = False) -> list[Any]:
    """Every worker's answer to :func:`call` (from wire values if ``wire``); the first error a
    worker answered with, raised as the aiosync error it was (another kind as an
    :class:`~aiosync.errors.ApplyError` naming it)."""
    for r in replies:
        if isinstance(r, dict) and r.get(_TAG) == "error":
            from .index_map import ProbeError

            kind = {"ProbeError": ProbeError}.get(r["type"], getattr(errors, r["type"], None))
            if isinstance(kind, type) and issubclass(kind, errors.AiosyncError):
                raise kind(r["message"])
            raise ApplyError(f"{r['type']}: {r['message']}")
    return [from_wire(r) for r in replies] if wire else list(replies)


class AiosyncWorkerExtension:
    """vLLM's ``worker_extension_cls`` for aiosync (:data:`WORKER_EXTENSION`): one method,
    reached by name through ``collective_rpc``, that runs :data:`CALLS` in the worker."""

    def aiosync_call(self, name: str, *args: Any) -> Any:
        return call(self, name, *args, wire=True)


# ----------------------------------------------------------------------------- wire values

def to_wire(value: Any) -> Any:
    """``value`` as something vLLM's msgpack RPC carries: a :class:`RemoteWrite` (its patch as
    the bytes of :func:`~aiosync.engines.inplace.encode_payload`, each bucket as safetensors
    bytes), a ``{name: tensor}`` dict as safetensors bytes, a dtype by name; containers
    recursively."""
    from safetensors.torch import save

    if isinstance(value, RemoteWrite):
        from .inplace import encode_payload

        return {_TAG: "write", "version": value.version, "handshake": value.handshake,
                "tensors": [save({k: t.contiguous() for k, t in b.items()}) for b in value.tensors],
                "patch": None if value.patch is None else encode_payload(value.patch)}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": dtype_name(value)}
    if isinstance(value, dict):
        if value and all(isinstance(t, torch.Tensor) for t in value.values()):
            return {_TAG: "tensors", "data": save({k: t.detach().cpu().contiguous() for k, t in value.items()})}
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    return value


def from_wire(value: Any) -> Any:
    """Invert :func:`to_wire`."""
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag == "write":
            from safetensors.torch import load

            return RemoteWrite(value["version"], value["handshake"], [load(bytes(b)) for b in value["tensors"]],
                               value["patch"])
        if tag == "dtype":
            dtype = dtype_from_name(value["name"])
            if dtype is None:
                raise errors.PayloadError(f"unknown dtype {value['name']!r}")
            return dtype
        if tag == "tensors":
            from safetensors.torch import load

            return load(bytes(value["data"]))
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value
