"""vLLM's layerwise reload made all-or-nothing: :func:`load_layers` (runs in a vLLM worker).

vLLM's layerwise reload (what ``reload_weights`` and checkpoint-format weight transfer use)
moves every layer to the meta device, buffers the checkpoint tensors each layer receives, and
once a layer has all of them, rebuilds it, runs its post-load processing (the CPU build re-packs
linear weights into a oneDNN handle there) and copies the result into the layer's own storage.
A failure half way leaves layers on the meta device, some with new weights and some with old:
the engine cannot generate, and nothing puts the old weights back.

:func:`load_layers` runs the same reload as one transaction:

* **nothing old is overwritten until every layer is processed**: the step that copies a
  processed layer into its storage (vLLM's ``_copy_and_restore_kernel_tensors``) is deferred
  for the duration of the load: the layer gets its own (old) tensors back, and the processed
  ones wait beside them;
* **a failure restores every module** as it was before the load (its parameters, buffers and
  attributes — the CPU build's packed-weight handle is an attribute — and, copied before the
  load, the few tensors vLLM writes in place rather than through the meta device, such as a
  ``bias``): the engine computes exactly as before;
* **success** copies the processed tensors into the layers' storage (CUDA-graph references
  stay valid), which cannot fail half way for a reason the load did not already hit.

It also lifts vLLM's limitation 2 (``reload/__init__.py``): a module that shares a parameter
with a reloaded one without being loaded itself — a tied ``lm_head`` — is processed again from
the new values (on the CPU build it would otherwise keep a packed copy of the old embedding).

The cost of the transaction: the processed tensors of the reloaded layers exist beside the old
ones until the end (on a GPU: device memory for the layers of one update). Written against
vLLM 0.32's reload package; the deferred step is swapped in under a lock, for this call only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

_SWAP_LOCK = threading.Lock()


class ReloadRestoreError(RuntimeError):
    """A load failed and putting the model back as it was failed too: its weights are unknown."""


@dataclass
class _ModuleState:
    """What one module held before the load: enough to put it back exactly."""

    attrs: dict[str, Any]
    params: dict[str, Any]
    buffers: dict[str, Any]
    non_persistent: set[str]
    # tensors vLLM never moves to meta (SKIP_TENSORS, e.g. ``bias``): written in place by a load
    in_place: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, module: torch.nn.Module) -> "_ModuleState":
        state = cls(dict(module.__dict__), dict(module._parameters), dict(module._buffers),
                    set(module._non_persistent_buffers_set))
        for name, t in {**module._parameters, **module._buffers}.items():
            if t is not None and name in SKIP_TENSORS and not t.is_meta:
                state.in_place.append((t, t.data, t.detach().clone()))
        return state

    def restore(self, module: torch.nn.Module) -> None:
        for key in [k for k in module.__dict__ if k not in self.attrs]:
            del module.__dict__[key]
        module.__dict__.update(self.attrs)
        module._parameters.clear()
        module._parameters.update(self.params)
        module._buffers.clear()
        module._buffers.update(self.buffers)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(self.non_persistent)
        with torch.no_grad():
            for t, data, saved in self.in_place:
                t.data = data
                data.copy_(saved)


@dataclass
class _Processed:
    """A layer processed from the new weights, waiting for its copy into the old storage."""

    layer: torch.nn.Module
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (the layer's own tensor, its processed value)
    new: dict[str, torch.Tensor]  # the processed parameters by name (for tied modules)

    def copy_in(self) -> None:
        for dst, src in self.copies:
            dst.data.copy_(src)


def _deferred_copy(processed: list[_Processed]):
    """Stand-in for vLLM's ``_copy_and_restore_kernel_tensors``: the same choice of what to
    copy, but the copy waits; the layer gets its own tensors back at once."""

    def copy_and_restore_later(layer: torch.nn.Module, info: Any) -> None:
        params, buffers = info.kernel_tensors
        loaded = {name for name, _ in info.loaded_weights}
        copies = [(param, getattr(layer, name)) for name, param in params.items()]
        for name, buffer in buffers.items():
            if name not in layer._buffers:
                continue
            if name in info.kernel_non_persistent_buffers and name not in loaded:
                continue
            copies.append((buffer, getattr(layer, name)))
        processed.append(_Processed(layer, copies, dict(layer._parameters)))
        layerwise._place_kernel_tensors(layer, info)

    return copy_and_restore_later


@contextmanager
def _deferring_copies(processed: list[_Processed]) -> Iterator[None]:
    with _SWAP_LOCK:
        original = layerwise._copy_and_restore_kernel_tensors
        layerwise._copy_and_restore_kernel_tensors = _deferred_copy(processed)
        try:
            yield
        finally:
            layerwise._copy_and_restore_kernel_tensors = original


def _reset_reload_state(model: torch.nn.Module) -> None:
    for module in model.modules():
        layerwise.get_layerwise_info(module).reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


def _reprocess_tied(states: dict[torch.nn.Module, _ModuleState], processed: list[_Processed]) -> None:
    """Process again, from the new values, every module that shares a parameter with a
    reloaded layer but was not reloaded itself (a tied ``lm_head``)."""
    done = {p.layer for p in processed}
    new_of: dict[int, torch.Tensor] = {}
    for p in processed:
        for name, old in states[p.layer].params.items():
            if old is not None and name in p.new:
                new_of[id(old)] = p.new[name]
    for module, state in states.items():
        method = getattr(module, "quant_method", None)
        if module in done or not isinstance(method, QuantizeMethodBase):
            continue
        shared = {name: new_of[id(t)] for name, t in state.params.items() if t is not None and id(t) in new_of}
        if not shared:
            continue
        own = dict(module._parameters)
        module._parameters.update(shared)  # the new values, for its processing to read
        try:
            method.process_weights_after_loading(module)
        finally:
            module._parameters.update({k: own[k] for k in shared})  # the shared (old) storage, updated at the end


@torch.no_grad()
def load_layers(model: torch.nn.Module, model_config: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format ``weights`` into ``model`` through vLLM's layerwise reload, all
    or nothing: if anything raises, every module is as it was and the error propagates."""
    states = {m: _ModuleState.of(m) for m in model.modules()}
    processed: list[_Processed] = []
    try:
        with _deferring_copies(processed):
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, model_config)
        _reprocess_tied(states, processed)
    except BaseException as exc:
        try:
            _reset_reload_state(model)
            for module, state in states.items():
                state.restore(module)
        except BaseException as again:
            raise ReloadRestoreError(f"a load failed ({type(exc).__name__}: {exc}) and putting the layers back "
                                     f"failed too ({type(again).__name__}: {again})") from again
        raise
    for p in processed:
        p.copy_in()
