"""The ``aiosync`` weight-transfer backend of vLLM: the part that runs in each vLLM worker.

An engine started with ``weight_transfer_config={"backend": "aiosync"}`` receives aiosync's
weights through vLLM's own update path (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), driven by
:class:`aiosync.engines.vllm.VLLMTarget` in the explorer's process:

* ``init_weight_transfer_engine(init_info={"manifest": [[name, shape, dtype], ...]})`` — the
  checkpoint layout of the synced tensors, against which every bucket is validated;
* ``start_weight_update()`` — vLLM's layerwise reload starts: a layer is rebuilt from its
  checkpoint tensors once all of them arrived, and its processed weights are copied into the
  engine's own storage. This is what makes writes work where the engine re-packs its linear
  weights after loading (the CPU build: ``layer.weight`` is empty there, a plain
  ``load_weights`` fails);
* ``update_weights(update_info={"bucket": {...}})`` (in-process engines: the tensors by
  reference) or ``{"bucket_bytes": b"..."}`` (an engine in another process: the bucket as
  safetensors bytes) — one **aiosync bucket** (the bucket format of bucket mode and of the
  patch bootstrap: version, index and count, the manifest in the first one) of whole tensors
  in checkpoint names. :class:`~aiosync.syncers.bucket.format.BucketReader` validates it
  (order, manifest, shapes, dtypes) before the model's own ``load_weights`` — which fuses
  q/k/v and gate/up and takes this rank's tensor-parallel shard — sees anything;
* ``finish_weight_update()`` — every announced bucket must have arrived; the layerwise reload
  is finalized either way (layers that received nothing keep their weights).

Why buckets of whole tensors and not aiosync's patches: a patch is coded against the values
the receiver holds (XOR of old and new bits, a drift hash of the old values), and a vLLM
worker on CPU cannot read its linear weights back once they are re-packed; vLLM's layerwise
reload also rebuilds a layer only from *all* of its checkpoint tensors. So the explorer's
process decodes patches into a host copy of the weights (:class:`~aiosync.engines.vllm.VLLMTarget`)
and sends the changed layers, whole, through this backend.

:func:`aiosync.engines.vllm_plugin.register` (this package's ``vllm.general_plugins`` entry
point, which vLLM calls in every process it starts) makes the backend known by this module's
path: it is imported only where an engine selects it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ..dtypes import dtype_from_name
from ..errors import PayloadError
from ..syncers.bucket.format import BucketReader


@dataclass
class AiosyncInitInfo(WeightTransferInitInfo):
    """``[[name, shape, dtype name], ...]`` of every synced tensor, in checkpoint names."""

    manifest: list = field(default_factory=list)


@dataclass
class AiosyncUpdateInfo(WeightTransferUpdateInfo):
    """One aiosync bucket: the tensors themselves (in-process) or their safetensors bytes."""

    bucket: dict | None = None
    bucket_bytes: bytes | None = None


class AiosyncWeightTransferEngine(WeightTransferEngine[AiosyncInitInfo, AiosyncUpdateInfo]):
    """Loads aiosync buckets into the worker's model through vLLM's layerwise reload."""

    init_info_cls = AiosyncInitInfo
    update_info_cls = AiosyncUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._layout: dict[str, torch.Tensor] | None = None
        self._reader: BucketReader | None = None
        #: The version of the last complete update.
        self.version: int | None = None

    def init_transfer_engine(self, init_info: AiosyncInitInfo) -> None:
        layout = {}
        for entry in init_info.manifest:
            name, shape, dtype = entry
            dt = dtype_from_name(dtype)
            if dt is None:
                raise PayloadError(f"aiosync backend: unknown dtype {dtype!r} for {name!r} in the init manifest")
            layout[name] = torch.empty(tuple(shape), dtype=dt, device="meta")  # shapes only, no memory
        if not layout:
            raise PayloadError("aiosync backend: the init manifest names no tensor")
        self._layout = layout

    def start_weight_update(self) -> None:
        if self._layout is None:
            raise RuntimeError("aiosync backend: init_weight_transfer_engine must come before start_weight_update")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._reader = BucketReader(self._layout)
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: AiosyncUpdateInfo) -> None:
        if self._reader is None:
            raise RuntimeError("aiosync backend: update_weights outside start_weight_update / finish_weight_update")
        payload = update_info.bucket
        if payload is None:
            if update_info.bucket_bytes is None:
                raise PayloadError("aiosync backend: an update carries neither `bucket` nor `bucket_bytes`")
            from safetensors.torch import load

            payload = load(update_info.bucket_bytes)
        tensors = self._reader.read(payload)  # validated whole before the model sees any of it
        self.model.load_weights(list(tensors.items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        reader, self._reader = self._reader, None
        finalize_layerwise_reload(self.model, self.model_config)  # always: layers left unloaded get theirs back
        if reader is None or not reader.done:
            got = 0 if reader is None else reader.index
            want = "?" if reader is None or reader.count is None else reader.count
            raise PayloadError(f"aiosync backend: the update ended after {got} of {want} buckets; "
                               "the layers of the missing ones kept their weights")
        self.version = reader.version

    def shutdown(self) -> None:
        self._reader = None


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
