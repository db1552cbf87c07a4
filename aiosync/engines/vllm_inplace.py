"""A vLLM engine whose parameters are written in place: :class:`VLLMInPlaceTarget`.

``VLLMTarget(engine, inplace=True)`` (opt-in; the default is the shadow target,
:class:`~aiosync.engines.vllm.VLLMTarget`: a host copy, whole layers through the reload)
returns one of these when aiosync's calls reach the engine's workers
(:mod:`aiosync.engines.vllm_worker`: an offline ``LLM`` in this process, or an ``AsyncLLM`` —
engine core and workers in other processes, so ``vllm serve`` — started with aiosync's
``worker_extension_cls``) and its parameters can be read and written as they are (a CPU build
whose linear layers are not re-packed into oneDNN handles; vLLM on a GPU, not tested), and
refuses with a ``ConfigError`` otherwise. The index map is probed when the target is made (the
model must be idle): a model whose loader cannot be mapped is refused then, with a
:class:`~aiosync.engines.index_map.ProbeError` naming the tensor
(``inplace="auto"`` takes the shadow path instead, and logs why).

The target holds no weights. It is a :class:`~aiosync.syncers.base.RemoteTarget`: a mapping of
*meta* tensors (the checkpoint's names, shapes and the engine's dtype) with
:meth:`write_remote`, to which the syncers hand what they received, as it came — the encoded
patch (~1 byte per changed element), or whole tensors for a bootstrap or a bucket sync. In the
engine's worker an :class:`~aiosync.engines.inplace.EngineReceiver` (kept on the ``aiosync``
backend) decodes it against the engine's own parameters, through an index map probed once
through the model's own ``load_weights`` (:mod:`aiosync.engines.index_map`), and writes it:

* **staged, the engine generating**: the patch is decoded, the old values at its positions
  read from the parameters and checked against the sender's drift hash, the new values and
  their parameter offsets computed — on a thread in the worker, beside the engine's steps (it
  only reads the parameters; the engine is not held);
* **the pause**: the scatter of the new values (whole tensors through the loader), the label,
  the prefix-cache reset. Old values are journaled: a write that raises puts them back, the
  engine keeps its version and the syncer its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from ..errors import ApplyError, ConfigError, PeerTimeoutError
from ..messages import payload_nbytes
from ..syncers.base import RemoteWrite
from .index_map import ProbeError
from .layout import checkpoint_layout, tied_aliases
from .vllm_calls import Late, ResumeFailed, make_calls
from .vllm_common import EngineStats, EngineTarget, _engine_kind, check_target_args

log = logging.getLogger("aiosync.sync")


# ----------------------------------------------------------------------------- the target

def fall_back(error: BaseException) -> None:
    """``VLLMTarget(llm, inplace="auto")`` takes the shadow path: say why, once, in the log."""
    log.warning("VLLMTarget(inplace='auto'): the shadow path (a host copy of the weights), as the in-place path "
                "cannot run on this engine: %s", error)


def unreadable(engine: Any) -> str | None:
    """The first parameter of the engine's workers that cannot be written in place (re-packed
    for a kernel), or ``None``: asked through the route writes take
    (:mod:`aiosync.engines.vllm_worker`); a :class:`ConfigError` if there is none (an
    ``AsyncLLM`` started without aiosync's ``worker_extension_cls``)."""
    calls = make_calls(engine, "keep", False, 60.0)
    try:
        return next((name for name in calls.rpc_now("unreadable_parameter") if name is not None), None)
    finally:
        calls.close()


class VLLMInPlaceTarget(EngineTarget):
    """A vLLM engine (offline ``LLM`` or ``AsyncLLM``) whose parameters receive aiosync's writes
    in place (see the module docstring). Made by ``VLLMTarget(llm, inplace=True)`` when the engine's parameters
    are readable; the arguments are that class's (``bucket_size`` unused).
    ``tensors``: only their names, shapes and dtypes are used (default: the checkpoint's)."""

    path = "inplace"

    def __init__(self, engine: Any, *, tensors: Mapping[str, torch.Tensor] | None = None, pause_mode: str = "keep",
                 clear_cache: bool = True, bucket_size: int = 256 << 20, timeout: float = 300.0) -> None:
        self.engine, self.kind = engine, _engine_kind(engine)
        vllm_config = check_target_args(engine, self.kind, pause_mode, bucket_size, timeout)
        model_config = vllm_config.model_config
        self.dtype: torch.dtype = model_config.dtype
        if tensors is not None:
            specs = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        else:
            layout = checkpoint_layout(model_config.model)
            if layout is None:
                raise ConfigError(f"VLLMTarget: {model_config.model} holds no *.safetensors files to read the layout "
                                  "from; pass tensors= (the checkpoint's tensors; meta tensors will do)")
            specs = {k: (s.shape, s.dtype) for k, s in layout.items()}
        specs = {k: (s, self.dtype if d is not None and d.is_floating_point else d) for k, (s, d) in specs.items()}
        text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        self._aliases = tied_aliases(specs, bool(getattr(text_config, "tie_word_embeddings", False)))
        meta = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in specs.items()}
        for alias, source in self._aliases.items():
            meta[alias] = meta[source]  # one tensor: the syncers write it once
        self._tensors = meta  # the layout
        self._specs = {k: v for k, v in specs.items() if k not in self._aliases}
        self.pause_mode, self.clear_cache = pause_mode, clear_cache
        self.version: int | None = None
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._calls = make_calls(engine, pause_mode, clear_cache, timeout)
        self._writing = anyio.Lock()  # one write at a time: the worker keeps one staged write
        try:  # the map, probed now (the model idle): a loader it cannot read is refused here
            self._calls.rpc_now("probe_receiver", self._specs, self._aliases)
        except ProbeError as exc:
            self.close()
            raise ProbeError(f"VLLMTarget: inplace=True, but this model's loader cannot be mapped for in-place writes "
                             f"({exc}); use inplace=False (the shadow path: a host copy, whole layers through the "
                             "reload) or inplace='auto' (the shadow path wherever in place cannot run)") from exc

    def __repr__(self) -> str:
        return f"VLLMInPlaceTarget({len(self)} tensors, version={self.version}, pause_mode={self.pause_mode!r})"

    # -- writes (RemoteTarget) -------------------------------------------------------------

    async def write_remote(self, write: RemoteWrite) -> int | None:
        """Make the engine's parameters hold what ``write`` brings, labelled ``write.version``,
        all or nothing (see the module docstring); called by the syncers' staged writes."""
        if self.error is not None:
            raise ApplyError(f"the vLLM engine target gave up after an earlier failure ({self.error}); the engine's "
                             "weights are unknown: make a new engine")
        async with self._writing:
            return await self._write(write)

    async def _stage(self, write: RemoteWrite) -> None:
        """Stage ``write`` in every worker while the engine steps, bounded by ``timeout``: an
        offline ``LLM``'s worker is in this process, staged from the calls' second thread; an
        ``AsyncLLM``'s engine core runs calls between two steps, so on a thread in the worker
        (started, then waited for). (Staged on a thread of the worker's own, an in-process
        engine kept ~1 model of transient memory resident: ``engine_patch_bench``.)"""
        if self.kind == "llm":
            await self._calls.worker("stage_write", write, beside=True)
            return
        await self._calls.worker("stage_begin", write, beside=True)
        await self._calls.worker("stage_wait", self.timeout, beside=True)

    async def _write(self, write: RemoteWrite) -> int | None:
        calls = self._calls
        with anyio.CancelScope(shield=True):
            try:  # staged beside the engine's steps: generation goes on
                await self._stage(write)
            except PeerTimeoutError:
                raise
            except Exception as exc:
                self.stats.refused += 1
                raise ApplyError(f"the vLLM engine refused the write to version {write.version}: {exc}; nothing was "
                                 f"written, it keeps version {self.version}") from exc
            label = None if write.version is None else str(write.version)
            t0 = time.perf_counter()
            try:
                async with calls.paused():
                    await calls.answer(f"the in-place write of version {write.version}", calls.commit(label),
                                       patience=2)
            except ResumeFailed as exc:
                self.error = exc
                raise ApplyError(f"{exc}: generation may stay paused") from exc
            except Late as late:
                late.drop()
                self.error = PeerTimeoutError(f"{late}: it may have written or not")
                raise self.error from None
            except TimeoutError as exc:  # a "wait" drain
                raise PeerTimeoutError(f"requests in flight did not finish within {self.timeout}s for the write "
                                       "(pause_mode='wait'); nothing was written") from exc
            except Exception as exc:
                self.stats.refused += 1
                raise ApplyError(f"the vLLM engine's in-place write of version {write.version} failed ({exc}); "
                                 f"every old value was put back: it keeps version {self.version}") from exc
            self._count(write, time.perf_counter() - t0)
            self.version = write.version
            return write.version

    def _count(self, write: RemoteWrite, pause_s: float) -> None:
        s = self.stats
        s.commits += 1
        s.writes += 1
        s.tensors_sent += sum(len(b) for b in write.tensors)
        s.bytes_sent += payload_nbytes(write.tensors) + (payload_nbytes(write.patch) if write.patch is not None else 0)
        s.last_pause_s = pause_s
        s.max_pause_s = max(s.max_pause_s, pause_s)
        s.total_pause_s += pause_s

    # -- read-back ----------------------------------------------------------

    async def read_engine(self) -> dict[str, torch.Tensor]:
        """Every synced tensor in checkpoint form, read from the engine's own parameters through
        the index map (fused ``qkv_proj`` / ``gate_up_proj`` and padded vocabularies included)."""
        return (await self._calls.worker("read_checkpoint", list(self._specs)))[0]

    async def state_digests(self, keys: list[str]) -> dict[str, int]:
        """The digest of each tensor ``keys`` as the engine's parameters hold it (whole-state
        verification; :class:`~aiosync.syncers.base.RemoteTarget`), computed in the engine,
        between two steps."""
        return (await self._calls.worker("digest_checkpoint", list(keys)))[0]

    async def engine_statistics(self) -> dict:
        """The engine worker's receiver: the map (tensors, runs, bytes, fallback tensors, the
        probe's transient memory) and its writes (commits, elements, rollbacks)."""
        return (await self._calls.worker("receiver_statistics"))[0]
