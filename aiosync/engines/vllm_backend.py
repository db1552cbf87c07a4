"""The ``aiosync`` weight-transfer backend of vLLM: the part that runs in each vLLM worker.

An engine started with ``weight_transfer_config={"backend": "aiosync"}`` receives aiosync's
weights through vLLM's own update path, driven by :class:`aiosync.engines.vllm.VLLMTarget` in
the explorer's process (or by any client of vLLM's weight-transfer API). **Every update is a
transaction**: it is written whole, or not at all, and a failure of any kind leaves the engine
computing with its previous weights, ready for the next update.

* ``init_weight_transfer_engine(init_info={"manifest": [[name, shape, dtype], ...]})`` — the
  tensors the client will send, in checkpoint names. Each entry is checked (a malformed one is
  a :class:`~aiosync.errors.PayloadError` naming it), and the whole manifest against the
  engine's own checkpoint layout (names, shapes, dtypes, whole layers; see
  :mod:`aiosync.engines.layout`), before it replaces the previous one.
* ``start_weight_update()`` — opens an update. Nothing in the model changes.
* ``update_weights(update_info={"bucket": {...}, "update_id": id})`` (in-process engines: the
  tensors by reference) or ``{"bucket_bytes": b"...", "update_id": id}`` (another process: the
  bucket as safetensors bytes) — one **aiosync bucket** (version, index and count, the manifest
  in the first; see :class:`~aiosync.syncers.bucket.format.BucketReader`), validated whole and
  *staged*. Nothing in the model changes.
* ``update_weights(update_info={"commit": True, "update_id": id})`` — the commit: every
  announced bucket must have arrived, and every layer the update touches must be whole (vLLM
  rebuilds a fused layer only from all of its checkpoint tensors). Then the staged tensors are
  loaded through vLLM's layerwise reload, all or nothing
  (:func:`aiosync.engines.vllm_reload.load_layers`): the model's own weight loader fuses q/k/v
  and gate/up and takes this rank's tensor-parallel shard, and a load that raises half way
  leaves every layer as it was. The commit returns only when the new weights are in place.
* ``finish_weight_update()`` — closes the update; one that was not committed (a bucket never
  came, the client gave up) is discarded. Never raises: vLLM's worker keeps an update open
  after a finish that raised and refuses every later one.

Any ``update_weights`` that raises has changed nothing (vLLM's worker then closes the update
itself); its message says so. The commit is where another kind of staged payload would be
applied (in-place patches in the engine's own parameters, SPEC E3, with a journal of the old
values at the changed positions for the rollback): the protocol, and the client's transaction
(:meth:`VLLMTarget._send <aiosync.engines.vllm.VLLMTarget>`), stay as they are. A bucket of an update that was already closed (one that arrived
after its client gave up on it) is dropped. Only if putting a layer back after a failed load
fails too does the backend give up: every later update is refused, saying that the engine's
weights are unknown (:data:`UNKNOWN`).

:func:`aiosync.engines.vllm_plugin.register` (this package's ``vllm.general_plugins`` entry
point, which vLLM calls in every process it starts) makes the backend known by this module's
path: it is imported only where an engine selects it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, layerwise_groups)

from ..dtypes import dtype_from_name
from ..errors import ApplyError, PayloadError
from ..syncers.bucket.format import META_PREFIX, BucketReader
from .layout import (TIED_OUTPUT, TensorSpec, checkpoint_layout, incomplete_group, layout_problem, spec_of,
                     tied_aliases)
from .vllm_reload import ReloadRestoreError, load_layers

log = logging.getLogger("aiosync.engines")

#: In an error from this backend: the engine's weights are no longer known (restart the engine).
UNKNOWN = "the engine's weights are unknown"
#: In every other error from an update: nothing was written.
KEPT = "nothing was written: the engine keeps its previous weights"


@dataclass
class AiosyncInitInfo(WeightTransferInitInfo):
    """``[[name, shape, dtype name], ...]`` of every synced tensor, in checkpoint names."""

    manifest: Any = field(default_factory=list)


@dataclass
class AiosyncUpdateInfo(WeightTransferUpdateInfo):
    """One aiosync bucket (the tensors in-process, or their safetensors bytes), or the commit
    of the update ``update_id``."""

    bucket: dict | None = None
    bucket_bytes: bytes | None = None
    update_id: str | None = None
    commit: bool = False


def parse_manifest(manifest: Any) -> dict[str, torch.Tensor]:
    """``{name: meta tensor}`` from an init manifest; :class:`PayloadError` naming the first
    malformed entry."""
    example = "e.g. ['model.norm.weight', [64], 'float32']"
    if not isinstance(manifest, (list, tuple)):
        raise PayloadError(f"aiosync backend: the init manifest must be a list of [name, shape, dtype] entries "
                           f"({example}), got {type(manifest).__name__}")
    layout: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(manifest):
        where = f"aiosync backend: init manifest entry {i} ({entry!r:.80})"
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise PayloadError(f"{where} must be [name, shape, dtype], {example}")
        name, shape, dtype = entry
        if not isinstance(name, str) or not name or name.startswith(META_PREFIX):
            raise PayloadError(f"{where}: the name must be a non-empty string not starting with {META_PREFIX!r}")
        if name in layout:
            raise PayloadError(f"{where}: {name!r} is listed twice")
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
            raise PayloadError(f"{where}: the shape must be a list of non-negative ints")
        dt = dtype_from_name(dtype)
        if dt is None:
            raise PayloadError(f"{where}: unknown dtype {dtype!r} (a torch dtype name such as 'bfloat16')")
        layout[name] = torch.empty(tuple(shape), dtype=dt, device="meta")  # shapes only, no memory
    if not layout:
        raise PayloadError("aiosync backend: the init manifest names no tensor")
    return layout


@dataclass
class _Update:
    """One open update: its buckets, validated and staged until the commit."""

    reader: BucketReader
    update_id: str | None = None
    staged: list[dict[str, torch.Tensor]] = field(default_factory=list)
    committed: bool = False

    def progress(self) -> str:
        count = "?" if self.reader.count is None else self.reader.count
        return f"{self.reader.index} of {count} buckets"


class AiosyncWeightTransferEngine(WeightTransferEngine[AiosyncInitInfo, AiosyncUpdateInfo]):
    """Loads aiosync buckets into the worker's model as one all-or-nothing update (see the
    module docstring for the protocol)."""

    init_info_cls = AiosyncInitInfo
    update_info_cls = AiosyncUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._layout: dict[str, torch.Tensor] | None = None
        self._groups: list[list[str]] = []
        self._update: _Update | None = None
        self._closed: deque[str] = deque(maxlen=64)  # ids of the last updates closed (late buckets are dropped)
        self._checkpoint: dict[str, TensorSpec] | None | bool = False  # False: not read yet
        #: The version of the last committed update.
        self.version: int | None = None
        #: Why this backend gave up (a layer could not be put back), or ``None``.
        self.unknown: str | None = None
        #: The in-place path (:mod:`aiosync.engines.vllm_inplace`, reached through
        #: :mod:`aiosync.engines.vllm_worker`): the receiver that writes patches into this worker's
        #: parameters, probed when the target is made.
        self.receiver: Any = None
        #: The shadow path's verification: the index map :func:`digest_parameters` reads the
        #: parameters through (``False``: none can be probed here; ``None``: not probed yet).
        self.digest_map: Any = None
        #: The in-place write staged (a transaction), and the staging in progress (a future).
        self.staged: Any = None
        self.staging: Any = None
        self.stager: Any = None  # the thread an AsyncLLM's writes are staged on

    # -- the engine's own layout -------------------------------------------------------

    def _checkpoint_layout(self) -> dict[str, TensorSpec] | None:
        if self._checkpoint is False:
            self._checkpoint = checkpoint_layout(self.model_config.model)
            if self._checkpoint is None:
                log.info("aiosync backend: %s has no local *.safetensors; manifests are checked when loaded",
                         self.model_config.model)
        return self._checkpoint

    def _tied_to(self, names: list[str]) -> str | None:
        config = getattr(self.model_config, "hf_text_config", None) or self.model_config.hf_config
        return tied_aliases(names, bool(getattr(config, "tie_word_embeddings", False))).get(TIED_OUTPUT)

    # -- vLLM's weight-transfer API ----------------------------------------------------

    def init_transfer_engine(self, init_info: AiosyncInitInfo) -> None:
        layout = parse_manifest(init_info.manifest)
        relaid = relaid_out_parameters(self.model)
        if relaid:
            raise PayloadError(f"aiosync backend: this engine's MoE experts ({relaid[0][0]!r}, ...) are re-laid out "
                               "by their kernel after loading (vLLM-CPU's grouped GEMM), and vLLM does not re-lay them "
                               "out after a weight update: any update would leave the engine computing with wrong "
                               "weights, so aiosync refuses to write it. Use an engine whose MoE kernel reads its "
                               "weights as loaded (vLLM on a GPU), or a dense model")
        checkpoint = self._checkpoint_layout()
        if checkpoint is not None:
            given = {k: spec_of(t) for k, t in layout.items()}
            problem = layout_problem(checkpoint, given, self._tied_to(list(checkpoint)))
            if problem is None and (gap := incomplete_group(layerwise_groups(list(checkpoint)), layout)):
                problem = (f"it lists {gap[1]!r} but not {gap[0]!r} of the same layer: the engine rebuilds a layer "
                           "only from all of its checkpoint tensors")
            if problem is not None:
                raise PayloadError(f"aiosync backend: the init manifest does not match the engine's checkpoint: "
                                   f"{problem}. The previous manifest stays")
        if self._update is not None:  # staged against the previous manifest: never committed now
            log.warning("aiosync backend: a new manifest discards the open update (%s)", self._update.progress())
            self._close(self._update)
        self._layout, self._groups = layout, layerwise_groups(list(layout))

    def start_weight_update(self) -> None:
        if self.unknown is not None:
            raise ApplyError(f"aiosync backend: {UNKNOWN} since an earlier update ({self.unknown}); restart the engine")
        if self._layout is None:
            raise PayloadError("aiosync backend: init_weight_transfer_engine must come before start_weight_update")
        if self._update is not None:  # left open by a client that never finished it: nothing of it was loaded
            log.warning("aiosync backend: discarding an update left open (%s)", self._update.progress())
        self._update = _Update(BucketReader(self._layout))

    def receive_weights(self, update_info: AiosyncUpdateInfo) -> None:
        update = self._update
        if update is None:
            raise PayloadError(f"aiosync backend: update_weights outside an open update; {KEPT}")
        if update_info.update_id is not None and update_info.update_id in self._closed:
            log.warning("aiosync backend: dropped a bucket of update %s, which was closed before it arrived",
                        update_info.update_id)
            return
        if update.update_id is None:
            update.update_id = update_info.update_id
        try:
            if update_info.update_id != update.update_id:
                raise PayloadError(f"aiosync backend: a bucket of update {update_info.update_id!r} arrived during "
                                   f"update {update.update_id!r} (two clients writing at once?)")
            if update_info.commit:
                self._commit(update)
            else:
                payload = self._payload(update_info)
                if payload is not None:
                    update.staged.append(update.reader.read(payload))  # validated whole; loads nothing
        except BaseException as exc:
            self._close(update)  # vLLM's worker closes the update when update_weights raises
            if isinstance(exc, ReloadRestoreError):
                self.unknown = str(exc)
                raise ApplyError(f"aiosync backend: {exc}; {UNKNOWN}: restart the engine") from exc
            if not isinstance(exc, Exception) or KEPT in str(exc):
                raise
            raise PayloadError(f"aiosync backend: update {update.update_id} refused after {update.progress()} "
                               f"({type(exc).__name__}: {exc}); {KEPT} ({self._held()})") from exc

    def finish_weight_update(self) -> None:
        update = self._update
        if update is not None:
            self._close(update)
            if not update.committed:
                log.warning("aiosync backend: update %s ended uncommitted after %s; discarded, the engine keeps %s",
                            update.update_id, update.progress(), self._held())

    def shutdown(self) -> None:
        self._update = None
        if self.stager is not None:
            self.stager.shutdown(wait=False)

    # -- the update ----------------------------------------------------------------------

    def _held(self) -> str:
        return "the weights it was started with" if self.version is None else f"version {self.version}"

    def _close(self, update: _Update) -> None:
        if update.update_id is not None:
            self._closed.append(update.update_id)
        update.staged.clear()
        if self._update is update:
            self._update = None

    def _payload(self, update_info: AiosyncUpdateInfo) -> dict | None:
        """The bucket an update carries (``None``: nothing to stage)."""
        if update_info.bucket is not None:
            return update_info.bucket
        if update_info.bucket_bytes is None:
            raise PayloadError("an update carries neither `bucket` nor `bucket_bytes`")
        from safetensors.torch import load

        return load(update_info.bucket_bytes)

    def _weights(self, update: _Update) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged tensors, bucket by bucket, in the order they were sent."""
        for tensors in update.staged:
            yield from tensors.items()

    def _commit(self, update: _Update) -> None:
        reader = update.reader
        if not reader.done:
            raise PayloadError(f"aiosync backend: update {update.update_id} was committed after {update.progress()}"
                               f" (bucket {reader.index} never arrived); {KEPT} ({self._held()})")
        gap = incomplete_group(self._groups, (n for tensors in update.staged for n in tensors))
        if gap is not None:
            raise PayloadError(f"aiosync backend: update {update.update_id} holds {gap[1]!r} but not {gap[0]!r} of "
                               f"the same layer: the engine rebuilds a layer only from all of its checkpoint tensors; "
                               f"{KEPT} ({self._held()})")
        try:
            load_layers(self.model, self.model_config, self._weights(update))
        except ReloadRestoreError:
            raise
        except Exception as exc:
            raise ApplyError(f"aiosync backend: the engine's weight loader raised {type(exc).__name__}: {exc} "
                               f"(update {update.update_id}, version {reader.version}); every layer was put back: "
                               f"{KEPT} ({self._held()})") from exc
        update.committed = True
        self.version = reader.version


def relaid_out_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter of ``model`` whose MoE experts kernel re-lays its
    values out after loading, in the same shape (vLLM-CPU's grouped GEMM prepacks ``w13_weight`` /
    ``w2_weight``): what a loader writes there is not what the kernel reads, and vLLM's weight
    update does not run the re-layout again. Empty where vLLM has no such kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:
        return []
    no_op = FusedMoEExperts.process_weights_after_loading
    out = []
    for prefix, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).process_weights_after_loading is not no_op:
            out.extend((f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False))
    return out


def read_parameters(worker: Any, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """``collective_rpc`` helper (in-process engines): copies of the worker's parameters that
    exist in checkpoint form, keyed like ``layout`` (``{name: checkpoint shape}``): the same name
    and shape, or a vocabulary embedding padded with extra rows (vLLM pads the vocabulary; the
    first rows are the checkpoint's, with one tensor-parallel rank). A re-packed or fused
    parameter (the empty ``weight`` of a CPU linear layer, ``qkv_proj``) is not in checkpoint form."""
    out = {}
    model = worker.get_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = layout.get(name)
            if shape is None or not p.numel() or p.dim() != len(shape):
                continue
            if tuple(p.shape) == tuple(shape):
                out[name] = p.detach().to("cpu", copy=True)
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            padded = getattr(module, "org_vocab_size", None) == shape[0] and getattr(module, "tp_size", 1) == 1
            if padded and p.shape[0] > shape[0] and tuple(p.shape[1:]) == tuple(shape[1:]):
                out[name] = p.detach()[: shape[0]].to("cpu", copy=True)
    return out


def digest_parameters(worker: Any, specs: dict[str, tuple]) -> dict[str, int]:
    """``collective_rpc`` helper (in-process engines; whole-state verification of the shadow
    path): the :func:`~aiosync.syncers.common.integrity.state_digest` of each checkpoint tensor
    of ``specs`` (``{name: (shape, dtype)}``) as the worker's parameters hold it, one tensor at a
    time. Where every parameter is a plain tensor (none re-packed for a kernel) and this worker
    holds them whole, through an index map probed once through the model's own ``load_weights``
    (:mod:`aiosync.engines.index_map`; kept on the backend, re-bound to the model's current
    parameters by name each time, since a reload may replace them): every tensor, fused
    ``qkv_proj`` / ``gate_up_proj`` and padded vocabularies included. Otherwise only those in
    checkpoint form (:func:`read_parameters`); the answer leaves the others out."""
    from ..syncers.common.integrity import state_digest
    from .index_map import ProbeError, probe_map

    backend = worker.weight_transfer_engine
    model = worker.get_model()
    named = dict(model.named_parameters())
    index = getattr(backend, "digest_map", None)
    if index is None:
        try:  # the model is idle: this runs on the engine's thread, between two steps
            index = probe_map(model, model.load_weights, specs)
        except ProbeError as exc:  # re-packed parameters, split between workers, a layout the map cannot hold
            log.info("aiosync: the engine's weights are verified where they are in checkpoint form only: %s", exc)
            index = False
        backend.digest_map = index
    if index and all(n in named and named[n].shape == p.shape for n, p in zip(index.param_names, index.params)):
        index.params = [named[n] for n in index.param_names]
        with torch.no_grad():
            return {n: state_digest(index.whole(n)) for n in specs if n in index.tensors}
    layout = {n: tuple(shape) for n, (shape, _) in specs.items()}
    return {n: state_digest(t) for n, t in read_parameters(worker, layout).items()}
