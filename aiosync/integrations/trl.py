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

Limits: one trainer process (``accelerator.num_processes == 1``), no PEFT, no vLLM sleep mode,
no tensor parallelism in colocate mode. What a TRL minor release could break: the names this
module relies on — ``VLLMGeneration`` imported by name into each trainer's module, its ``_init_vllm``
/ ``sync_weights`` / ``generate`` methods and ``mode``/``llm``/``vllm_client`` attributes, ``LLM``
looked up in ``trl.generation.vllm_generation``, ``VLLMClient``'s constructor and its ``session``
(a ``requests.Session``); a change there is reported as an ``ImportError`` or ``ConfigError``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from ..errors import ApplyError, ConfigError, PeerTimeoutError

try:
    from trl.generation import vllm_generation as _trl_generation
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError(f"aiosync.integrations.trl needs TRL 1.16 without its vLLM extra: pip install "
                      f"'aiosync[trl]' ({exc})") from exc

__all__ = ["AiosyncConfig", "AiosyncVLLMClient", "AiosyncVLLMGeneration", "SyncRecord", "with_aiosync"]
# and, imported on first use (TRL's trainers import slowly): AiosyncGRPOTrainer, AiosyncRLOOTrainer

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}
_SWAP = threading.Lock()  # the trainer modules' VLLMGeneration is swapped only while a trainer is built


@dataclass(frozen=True)
class AiosyncConfig:
    """How aiosync syncs a TRL trainer's vLLM.

    ``weight_syncer`` / ``sync``: aiosync's ``weight_syncer`` and synchronizer configs
    (docs/configuration.md; default: patches coded ``flat``, zstd, fixed sync points).
    ``inplace``: colocate mode writes patches in the engine's own parameters (default) or
    through the shadow copy (``False``). ``engine_kwargs``: extra ``vllm.LLM`` arguments in
    colocate mode (on a CPU e.g. ``{"kv_cache_memory_bytes": 64 << 20}``). ``key`` /
    ``key_file``: the key the ``vllm serve`` was started with (server mode; default: the
    environment's ``AIOSYNC_SERVER_KEY_FILE`` / ``AIOSYNC_SERVER_KEY``). ``timeout``: bound on
    each sync and each engine or server call, in seconds. ``retries``: deliveries a sync may
    repair (a restarted server is bootstrapped) before it raises.
    """

    weight_syncer: dict = field(default_factory=lambda: dict(PATCH))
    sync: dict = field(default_factory=lambda: {"style": "fixed"})
    inplace: bool = True
    engine_kwargs: dict = field(default_factory=dict)
    key: str | None = None
    key_file: str | None = None
    timeout: float = 300.0
    retries: int = 2

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"AiosyncConfig: timeout must be positive seconds, got {self.timeout!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"AiosyncConfig: retries must be an int >= 0, got {self.retries!r}")
        if "weight_transfer_config" in self.engine_kwargs:
            raise ConfigError("AiosyncConfig: engine_kwargs must not set weight_transfer_config (aiosync sets "
                              "{'backend': 'aiosync'})")


@dataclass(frozen=True)
class SyncRecord:
    """One sync: the version, what the synchronizer sent the explorer (``bytes``), the elements
    that changed, the engine's pause for the write, and the sync's wall time (seconds)."""

    version: int
    bytes: int
    changed_elements: int
    pause_s: float
    seconds: float


class _Bridge:
    """aiosync's synchronizer on an event loop of its own (a daemon thread), driven from TRL's
    synchronous code: the trainer's model attached as the trainer, one engine as the explorer."""

    def __init__(self, config: AiosyncConfig, model: Any, name: str, explorer_model: Any,
                 pause_s: Callable[[], Any]) -> None:
        from ..coordination import Synchronizer

        self.config, self.name, self.model = config, name, explorer_model
        self._pause_s = pause_s
        self._portal: BlockingPortal | None = None
        self._thread = self._start_loop()
        self._stack = contextlib.ExitStack()
        try:
            self._stack.callback(self._stop_loop)
            self.sync = self._stack.enter_context(
                self._portal.wrap_async_context_manager(Synchronizer(config.sync, config.weight_syncer)))
            self.trainer = self.call(self.sync.attach_trainer, model, what="attaching the trainer's model")
            self.explorer = self.call(self.sync.attach_explorer, name, explorer_model,
                                      what=f"bootstrapping the {name} engine (its first, full sync)")
        except BaseException:
            self._stack.close()
            raise
        self.version = 0
        self.history: list[SyncRecord] = []

    def _start_loop(self) -> threading.Thread:
        ready = threading.Event()

        async def main() -> None:
            async with BlockingPortal() as portal:
                self._portal = portal
                ready.set()
                await portal.sleep_until_stopped()

        thread = threading.Thread(target=anyio.run, args=(main,), name="aiosync-trl", daemon=True)
        thread.start()
        if not ready.wait(30.0):
            raise PeerTimeoutError("aiosync's event loop thread did not start within 30 s")
        return thread

    def _stop_loop(self) -> None:
        portal, self._portal = self._portal, None
        if portal is not None:
            with contextlib.suppress(Exception):
                portal.call(portal.stop)
            self._thread.join(self.config.timeout)

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
        """Run ``fn(*args)`` (a coroutine function, or a plain one) on aiosync's loop, bounded by the timeout."""
        if self._portal is None:
            raise ApplyError("aiosync's sync for this TRL trainer is closed")
        timeout, what = self.config.timeout, what or getattr(fn, "__name__", "an aiosync call")

        async def bounded() -> Any:
            try:
                with anyio.fail_after(timeout):
                    result = fn(*args)
                    return (await result) if inspect.isawaitable(result) else result
            except TimeoutError:
                raise PeerTimeoutError(f"aiosync: {what} did not finish within {timeout}s "
                                       "(AiosyncConfig.timeout)") from None

        return self._portal.call(bounded)

    def sync_weights(self) -> SyncRecord:
        """Publish the trainer's weights as the next version and wait until the engine holds it."""
        version = self.version + 1
        line = self.sync.explorers[self.name].line.stats
        sent, changed = line.bytes_sent, line.changed_elements
        t0 = time.perf_counter()
        self.call(self._sync, version, what=f"the sync of version {version} to the {self.name} engine")
        pause = self.call(self._pause_s, what=f"reading the {self.name} engine's pause")
        record = SyncRecord(version, line.bytes_sent - sent, line.changed_elements - changed, pause,
                            time.perf_counter() - t0)
        self.version = version
        self.history.append(record)
        return record

    async def _sync(self, version: int) -> None:
        await self.trainer.sync_weight(version)
        got = None
        for _ in range(1 + self.config.retries):  # a failed delivery is repaired by the next one
            got = await self.explorer.sync_weight()
            if got == version:
                return
        raise ApplyError(f"the {self.name} engine holds version {got}, not {version}, after "
                         f"{1 + self.config.retries} deliveries: see sync.metrics()['explorers'][{self.name!r}]")

    def metrics(self) -> dict:
        return self.call(self.sync.metrics, what="sync.metrics()")

    def close(self) -> None:
        self._stack.close()


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
        self.bridge: _Bridge | None = None
        #: Per completion of the last generated batch: the versions whose weights generated it.
        self.sample_versions: list[tuple[int | None, ...]] = []
        #: Every sync so far (kept after :meth:`close`).
        self.history: list[SyncRecord] = []
        super().__init__(*args, **kwargs)

    # -- set-up ------------------------------------------------------------------------

    def _init_vllm(self) -> None:
        if self.mode not in ("colocate", "server"):
            return super()._init_vllm()  # TRL's own error
        if self.accelerator.num_processes != 1:
            raise ConfigError(f"aiosync's TRL integration runs one trainer process for now, got "
                              f"{self.accelerator.num_processes}: launch without accelerate/torchrun")
        from accelerate.utils import is_peft_model

        if is_peft_model(self.model):
            raise ConfigError("aiosync's TRL integration does not sync PEFT adapters yet: merge them, or use "
                              "TRL's own sync (the plain GRPOTrainer)")
        if self.mode == "colocate":
            self._init_colocate()
        else:
            self._init_server()

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

        self.bridge = _Bridge(self.aiosync, self.model, "vllm", target, pause_s)
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
        from ..engines.vllm_server import VLLMServer

        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        self.vllm_client = AiosyncVLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
        server = VLLMServer(base_url, key=self.aiosync.key, key_file=self.aiosync.key_file,
                            timeout=self.aiosync.timeout)

        async def pause_s() -> float:
            return float((await server.state())["engine"].get("last_pause_s", 0.0))

        self.bridge = _Bridge(self.aiosync, self.model, "server", server, pause_s)
        self.history = self.bridge.history
        self.accelerator.wait_for_everyone()

    # -- TRL's calls ---------------------------------------------------------------------

    def sync_weights(self) -> SyncRecord:
        """Sync the trainer's weights to the engine (one aiosync version; the engine resets its
        prefix cache with the write)."""
        return self.bridge.sync_weights()

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        if self.mode == "server":
            start = len(self.vllm_client.versions)
            out = super().generate(*args, **kwargs)
            batches = self.vllm_client.versions[start:]
            versions = tuple(sorted({v for b in batches for v in b if v is not None}))
            self.sample_versions = [versions] * len(out[1])
            del self.vllm_client.versions[:]
            return out
        return super().generate(*args, **kwargs)

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
        """The synchronizer's ``sync.metrics()``."""
        return self.bridge.metrics()

    def close(self) -> None:
        """Stop aiosync's synchronizer and its event loop (the engine keeps its weights)."""
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            bridge.close()


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
