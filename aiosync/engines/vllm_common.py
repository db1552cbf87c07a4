"""What both vLLM targets share (:class:`~aiosync.engines.vllm.VLLMTarget`, the shadow, and
:class:`~aiosync.engines.vllm_inplace.VLLMInPlaceTarget`): their counters and the checks of
their arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .vllm_plugin import BACKEND, BACKENDS

PAUSE_MODES = ("keep", "wait", "abort")


@dataclass
class EngineStats:
    """Counters of a :class:`VLLMTarget` (mutable; :meth:`VLLMTarget.statistics` snapshots them)."""

    commits: int = 0
    #: Commits that sent weights to the engine (an empty patch only relabels the version).
    writes: int = 0
    #: Calls to put the old values back after a failed write (``commit_write(keys, None)``).
    restores: int = 0
    #: Writes the engine refused or that were aborted; it kept its previous weights each time.
    refused: int = 0
    tensors_sent: int = 0
    bytes_sent: int = 0
    #: How long generation was paused for a write: the last, the longest, in total.
    last_pause_s: float = 0.0
    max_pause_s: float = 0.0
    total_pause_s: float = 0.0
    requests: int = 0


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of a :class:`VLLMTarget`'s counters (see :class:`EngineStats`) and state."""

    version: int | None
    pause_mode: str
    broken: bool
    commits: int
    writes: int
    restores: int
    refused: int
    tensors_sent: int
    bytes_sent: int
    last_pause_s: float
    max_pause_s: float
    total_pause_s: float
    requests: int
    #: How writes reach the engine: ``"inplace"`` (patches written in its parameters) or ``"shadow"``.
    path: str = "shadow"

    @property
    def mean_pause_s(self) -> float:
        return self.total_pause_s / self.writes if self.writes else 0.0


def _engine_kind(engine: Any) -> str:
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    if isinstance(engine, LLM):
        return "llm"
    if isinstance(engine, AsyncLLM):
        return "async"
    raise TypeError(f"VLLMTarget needs a vllm.LLM or a vllm AsyncLLM, got {type(engine).__name__}")


def check_target_args(engine: Any, kind: str, pause_mode: str, bucket_size: int, timeout: float) -> Any:
    """The engine's ``vllm_config``, once the engine and the target's arguments are checked."""
    vllm_config = engine.llm_engine.vllm_config if kind == "llm" else engine.vllm_config
    wt = vllm_config.weight_transfer_config
    if wt is None or wt.backend not in BACKENDS:
        raise ConfigError(f"VLLMTarget: start the engine with weight_transfer_config={{'backend': '{BACKEND}'}} "
                          f"(it has {None if wt is None else wt.backend!r}); aiosync registers that backend with "
                          "vLLM as a plugin when it is installed")
    if pause_mode not in PAUSE_MODES:
        raise ConfigError(f"VLLMTarget: pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    if pause_mode == "abort" and kind == "llm":
        raise ConfigError("VLLMTarget: pause_mode='abort' needs an AsyncLLM (vLLM aborts in-flight requests "
                          "there); with an offline LLM use 'keep' or 'wait'")
    if bucket_size <= 0 or timeout <= 0:
        raise ConfigError("VLLMTarget: bucket_size and timeout must be positive")
    return vllm_config
