"""TRL's online trainers with aiosync doing the weight sync (needs ``pip install 'aiosync[trl]'``).

TRL (``GRPOTrainer``, ``RLOOTrainer``, …) moves the trainer's weights into vLLM in one place,
``VLLMGeneration.sync_weights()``. :class:`AiosyncVLLMGeneration` is that class with aiosync's
sync in place of TRL's; :func:`with_aiosync` (or the ready-made :class:`AiosyncGRPOTrainer` /
:class:`AiosyncRLOOTrainer`) makes a trainer build it. The switch is one line::

    from aiosync.integrations.trl import AiosyncGRPOTrainer as GRPOTrainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, vllm_mode=...),
                          aiosync=AiosyncConfig(...))   # optional: the defaults sync by patch

* ``vllm_mode="colocate"``: TRL's in-process ``vllm.LLM`` is started with aiosync's weight-transfer
  backend and attached as an explorer through :class:`~aiosync.engines.vllm.VLLMTarget`
  (``inplace=True`` by default: only the changed elements are written, in the engine's own
  parameters; ``AiosyncConfig(inplace=False)``: the shadow path, whole changed layers).
* ``vllm_mode="server"``: a ``vllm serve`` started with aiosync's backend, middleware and key
  (docs/engines.md) is attached through :class:`~aiosync.engines.vllm_server.VLLMServer`: each sync
  sends the encoded patch over HTTP, signed. Generation goes through TRL's own ``VLLMClient``
  (``/v1/completions``); no NCCL group, so it works on any device.

Every output's weight versions are recorded (:attr:`AiosyncVLLMGeneration.sample_versions`) and the
trainer's logs get ``aiosync/*`` metrics (version, bytes and pause of the last sync, the versions
that generated the last batch). aiosync's coroutines run on an event loop of their own (a daemon
thread); TRL's synchronous code waits on them, each wait bounded by ``AiosyncConfig.timeout``.

Several trainer processes (``torchrun`` / ``accelerate launch``, server mode): rank 0 talks to the
server; the other ranks of a data-parallel trainer learn each sync's record and each batch's
versions from it, those of an FSDP2 trainer send their own shards (:mod:`.trl_sync`).

Limits: colocate mode runs one trainer process; no DeepSpeed ZeRO-3 or FSDP1, no PEFT, no vLLM
sleep mode, no tensor parallelism in colocate mode. What a TRL minor release could break: the names this
module relies on — ``VLLMGeneration`` imported by name into each trainer's module, its ``_init_vllm``
/ ``sync_weights`` / ``generate`` methods and ``mode``/``llm``/``vllm_client`` attributes, ``LLM``
looked up in ``trl.generation.vllm_generation``, ``VLLMClient``'s constructor and its ``session``
(a ``requests.Session``); a change there is reported as an ``ImportError`` or ``ConfigError``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .trl_sync import (AiosyncConfig, Bridge, LoopThread, Ranks, ShardedBridge, ShardRank, SyncRecord, record_dict,
                       record_of)

try:
    from trl.generation import vllm_generation as _trl_generation
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError(f"aiosync.integrations.trl needs TRL 1.16 without its vLLM extra: pip install "
                      f"'aiosync[trl]' ({exc})") from exc

__all__ = ["AiosyncConfig", "AiosyncVLLMClient", "AiosyncVLLMGeneration", "SyncRecord", "with_aiosync"]
# and, imported on first use (TRL's trainers import slowly): AiosyncGRPOTrainer, AiosyncRLOOTrainer

_SWAP = threading.Lock()  # the trainer modules' VLLMGeneration is swapped only while a trainer is built


class AiosyncVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` for a ``vllm serve`` whose weights aiosync syncs: generation as TRL
    does it (``/v1/completions``); no NCCL communicator; the versions the server says generated
    each completion (its ``x-aiosync-weight-versions`` header) recorded in :attr:`versions`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The versions of each ``/v1/completions`` answer, oldest first (``None``: start-up weights).
        self.versions: list[tuple[int | None, ...]] = []
        self.session.hooks["response"].append(self._record_versions)

    def _record_versions(self, response: Any, *args: Any, **kwargs: Any) -> None:
        from ..engines.vllm_server import parse_versions
        from ..engines.vllm_server_protocol import VERSIONS_HEADER

        if response.request.path_url.endswith("/v1/completions") and response.status_code == 200:
            self.versions.append(parse_versions(response.headers.get(VERSIONS_HEADER)))

    def init_communicator(self, device: Any = 0) -> None:
        """Nothing to set up: aiosync's sync needs no process group (any device works)."""

    def update_named_params(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("aiosync syncs this server's weights: use AiosyncVLLMGeneration.sync_weights()")

    def close_communicator(self) -> None:
        pass


class AiosyncVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` with aiosync's sync (see the module docstring); built by the
    trainers of :func:`with_aiosync` with their usual arguments plus ``aiosync=``."""

    def __init__(self, *args: Any, aiosync: AiosyncConfig | None = None, **kwargs: Any) -> None:
        self.aiosync = AiosyncConfig() if aiosync is None else aiosync
        #: The synchronizer's side (this process, or rank 0 of several); ``None`` on other ranks.
        self.bridge: Bridge | None = None
        #: The trainer's processes (``None``: one), and this rank's part of an FSDP2 trainer's syncs.
        self.ranks: Ranks | None = None
        self.shard_rank: ShardRank | None = None
        self.loop: LoopThread | None = None
        #: Per completion of the last generated batch: the versions whose weights generated it.
        self.sample_versions: list[tuple[int | None, ...]] = []
        #: Every sync so far (kept after :meth:`close`; on every rank).
        self.history: list[SyncRecord] = []
        super().__init__(*args, **kwargs)

    # -- set-up ------------------------------------------------------------------------

    def _init_vllm(self) -> None:
        if self.mode not in ("colocate", "server"):
            return super()._init_vllm()  # TRL's own error
        processes = self.accelerator.num_processes
        if processes != 1 and self.mode == "colocate":
            raise ConfigError(f"aiosync's colocate mode runs one trainer process, got {processes}: use "
                              "vllm_mode='server' (any number of trainer processes), or launch one process")
        if self._dist.is_zero3 or self._dist.fsdp_version == 1:
            raise ConfigError("aiosync syncs plain data-parallel trainers (every rank holds the whole model) and "
                              "FSDP2 trainers (fsdp_version 2: each rank sends its own shard); DeepSpeed ZeRO-3 and "
                              "FSDP1 are not supported: use FSDP2, or TRL's own sync")
        from accelerate.utils import is_peft_model

        if is_peft_model(self.model):
            raise ConfigError("aiosync's TRL integration does not sync PEFT adapters yet: merge them, or use "
                              "TRL's own sync (the plain GRPOTrainer)")
        self.loop = LoopThread(self.aiosync.timeout)
        try:
            if self.mode == "colocate":
                self._init_colocate()
            else:
                self._init_server()
        except BaseException:
            self.close()
            raise

    def _init_colocate(self) -> None:
        if self.enable_sleep_mode:
            raise ConfigError("aiosync writes into the colocated engine's live weights: vllm_enable_sleep_mode "
                              "(which discards them) is not supported; set it to False")
        if self.tensor_parallel_size != 1:
            raise ConfigError("aiosync's colocate mode runs one engine rank: set vllm_tensor_parallel_size=1")
        with _aiosync_engine(self.aiosync):
            super()._init_vllm()
        from ..engines.vllm import VLLMTarget

        target = VLLMTarget(self.llm, inplace=self.aiosync.inplace, timeout=self.aiosync.timeout)
        self.llm.generate = self._recording(self.llm.generate)

        async def pause_s() -> float:
            return target.statistics().last_pause_s

        self.bridge = Bridge(self.loop, self.aiosync, "vllm", target, pause_s, model=self.model)
        self.history = self.bridge.history

    def _recording(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        from ..engines.vllm import output_versions
        from ..errors import VersionError

        def versions(completion: Any) -> tuple[int | None, ...]:
            try:
                return output_versions(completion)
            except VersionError:  # weights aiosync did not write (labelled "default"): unknown
                return (None,)

        @functools.wraps(generate)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            outputs = generate(*args, **kwargs)
            self.sample_versions = [versions(c) for o in outputs for c in o.outputs]
            return outputs

        return recorded

    def _init_server(self) -> None:
        """Rank 0 talks to the server (generation, as TRL does, and the sync); the other ranks of
        a data-parallel trainer only learn what rank 0 did, those of an FSDP2 trainer send their
        own shards through it (:mod:`.trl_sync`)."""
        from ..coordination.shards import SHARD_TAG
        from ..engines.vllm_server import VLLMServer

        if self.accelerator.num_processes > 1:
            if self._dist.fsdp_version != 2 and _sharded(self.model):
                raise ConfigError("the model's parameters are DTensors (sharded) but accelerate does not run FSDP2: "
                                  "let accelerate shard it (fsdp_config={'fsdp_version': 2}), or pass an unsharded model")
            self.ranks = Ranks(self.loop, self.aiosync)  # a collective: every rank
        main, server = self.accelerator.is_main_process, None
        if main:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = AiosyncVLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
            server = VLLMServer(base_url, key=self.aiosync.key, key_file=self.aiosync.key_file,
                                timeout=self.aiosync.timeout)

        async def pause_s() -> float:
            return float((await server.state())["engine"].get("last_pause_s", 0.0))

        if self.ranks is not None and self._dist.fsdp_version == 2:  # attached at the first sync (sharded by then)
            if main:
                peers = [self.ranks.transport(r, SHARD_TAG) for r in range(1, self.ranks.world)]
                self.bridge = ShardedBridge(self.loop, self.aiosync, "server", server, pause_s, peers)
                self.history = self.bridge.history
            else:
                self.shard_rank = ShardRank(self.loop, self.aiosync, self.ranks.transport(0, SHARD_TAG))
        elif main:
            self._on_ranks(lambda: self._start_bridge(server, pause_s), "bootstrapping the vLLM server")
        else:
            self._on_ranks(lambda: None, "bootstrapping the vLLM server")
        self.accelerator.wait_for_everyone()

    def _start_bridge(self, server: Any, pause_s: Callable[[], Any]) -> None:
        self.bridge = Bridge(self.loop, self.aiosync, "server", server, pause_s, model=self.model)
        self.history = self.bridge.history

    def _on_ranks(self, step: Callable[[], Any], what: str) -> Any:
        """``step()`` on this rank; with several trainer ranks, rank 0's outcome on every rank."""
        return step() if self.ranks is None else self.ranks.share(step, what)

    # -- TRL's calls ---------------------------------------------------------------------

    def sync_weights(self) -> SyncRecord:
        """Sync the trainer's weights to the engine (one aiosync version; the engine resets its
        prefix cache with the write). With several trainer processes TRL calls it on every rank:
        rank 0 syncs (an FSDP2 trainer's other ranks send their shards), every rank returns the
        record."""
        if self.ranks is None:
            return self.bridge.sync_weights()
        t0 = time.perf_counter()
        version = len(self.history) + 1
        if version == 1 and (self.shard_rank is not None or isinstance(self.bridge, ShardedBridge)):
            start = (self.shard_rank or self.bridge).start  # every rank's shard, before the first check point
            self.ranks.share(lambda: start(self.model), "the bootstrap of the vLLM server from every rank's shard")

        def step() -> dict | None:
            if self.shard_rank is not None:
                self.shard_rank.sync_weights()
            return None if self.bridge is None else record_dict(self.bridge.sync_weights())

        value = self.ranks.share(step, f"the sync of version {version} to the vLLM server")
        if self.bridge is not None:
            return self.history[-1]
        record = record_of(value, time.perf_counter() - t0)
        self.history.append(record)
        return record

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        if self.mode != "server":
            return super().generate(*args, **kwargs)
        out = super().generate(*args, **kwargs)  # rank 0 asks the server (TRL's client), every rank takes its share

        def versions() -> list[int] | None:
            client = getattr(self, "vllm_client", None)
            if client is None:  # not rank 0
                return None
            seen = sorted({v for batch in client.versions for v in batch if v is not None})
            del client.versions[:]
            return seen

        seen = self._on_ranks(versions, "the versions that generated the batch")
        self.sample_versions = [tuple(seen)] * len(out[1])
        return out

    # -- what the trainer logs -----------------------------------------------------------

    def log_metrics(self) -> dict[str, float]:
        """``aiosync/*`` metrics for the trainer's logs: the synced version, the last sync's bytes,
        changed elements, pause and seconds, and the versions that generated the last batch."""
        if not self.history:
            return {}
        last = self.history[-1]
        out = {"aiosync/version": float(last.version), "aiosync/bytes_per_sync": float(last.bytes),
               "aiosync/changed_elements": float(last.changed_elements), "aiosync/pause_s": last.pause_s,
               "aiosync/sync_s": last.seconds}
        seen = [v for vs in self.sample_versions for v in vs if v is not None]
        if seen:
            out["aiosync/sample_version_min"], out["aiosync/sample_version_max"] = float(min(seen)), float(max(seen))
        return out

    def metrics(self) -> dict:
        """The synchronizer's ``sync.metrics()`` (on rank 0 of several trainer processes)."""
        if self.bridge is None:
            raise ConfigError("sync.metrics() lives where the synchronizer runs: rank 0 of the trainer's processes")
        return self.bridge.metrics()

    def close(self) -> None:
        """Stop aiosync's synchronizer and its event loop (the engine keeps its weights). With
        several trainer processes, call it on every rank."""
        loop, self.loop, self.bridge, self.shard_rank = self.loop, None, None, None
        if loop is not None:
            loop.close()


def _sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def _aiosync_engine(config: AiosyncConfig):
    """TRL's ``LLM(...)`` started with aiosync's weight-transfer backend (and, for in-place writes
    on a CPU, with vLLM-CPU's oneDNN re-packing off while it loads, so its weights stay writable)."""
    build = getattr(_trl_generation, "LLM", None)
    if build is None:
        raise ConfigError("trl.generation.vllm_generation has no LLM: install vLLM, and a TRL this module supports "
                          "(1.16)")

    def aiosync_llm(*args: Any, **kwargs: Any) -> Any:
        kwargs = {**kwargs, **config.engine_kwargs, "weight_transfer_config": {"backend": "aiosync"}}
        if not config.inplace:
            return build(*args, **kwargs)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return build(*args, **kwargs)
        import vllm._custom_ops as ops

        onednn, ops._supports_onednn = ops._supports_onednn, False
        try:
            return build(*args, **kwargs)
        finally:
            ops._supports_onednn = onednn

    _trl_generation.LLM = aiosync_llm
    try:
        yield
    finally:
        _trl_generation.LLM = build


def with_aiosync(trainer_class: type) -> type:
    """A subclass of a TRL trainer (``GRPOTrainer``, ``RLOOTrainer``, …) whose vLLM is synced by
    aiosync: it takes one more argument, ``aiosync=`` (an :class:`AiosyncConfig`; default
    ``AiosyncConfig()``), logs ``aiosync/*`` metrics, and closes the sync with :meth:`close_aiosync`."""
    module = sys.modules[trainer_class.__module__]
    if getattr(module, "VLLMGeneration", None) is not VLLMGeneration:
        raise ConfigError(f"{trainer_class.__name__} does not build its vLLM through "
                          "trl.generation.vllm_generation.VLLMGeneration: aiosync cannot sync it")

    def __init__(self: Any, *args: Any, aiosync: AiosyncConfig | None = None, **kwargs: Any) -> None:
        build = functools.partial(AiosyncVLLMGeneration, aiosync=aiosync or AiosyncConfig())
        with _SWAP:
            module.VLLMGeneration = build
            try:
                trainer_class.__init__(self, *args, **kwargs)
            finally:
                module.VLLMGeneration = VLLMGeneration

    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        generation = getattr(self, "vllm_generation", None)
        if isinstance(generation, AiosyncVLLMGeneration):
            logs = {**logs, **generation.log_metrics()}
        return trainer_class.log(self, logs, *args, **kwargs)

    def close_aiosync(self: Any) -> None:
        """Stop aiosync's synchronizer (call when training is over; the engine keeps its weights)."""
        generation = getattr(self, "vllm_generation", None)
        if isinstance(generation, AiosyncVLLMGeneration):
            generation.close()

    name = f"Aiosync{trainer_class.__name__}"
    return type(name, (trainer_class,), {"__init__": __init__, "log": log, "close_aiosync": close_aiosync,
                                         "__module__": __name__, "__qualname__": name,
                                         "__doc__": f"``{trainer_class.__name__}`` synced by aiosync "
                                                    "(see :func:`with_aiosync`)."})


def __getattr__(name: str) -> type:
    if name in ("AiosyncGRPOTrainer", "AiosyncRLOOTrainer"):  # imported only when used (trainers import slowly)
        import trl

        cls = with_aiosync(getattr(trl, name.removeprefix("Aiosync")))
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
