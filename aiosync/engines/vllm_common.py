"""What both vLLM targets share (:class:`~aiosync.engines.vllm.VLLMTarget`, the shadow, and
:class:`~aiosync.engines.vllm_inplace.VLLMInPlaceTarget`): their counters, the checks of
their arguments, and :class:`EngineTarget` (the mapping, generation, statistics)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ApplyError, ConfigError
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
    #: Whole-state verification: tensors the last check read from the engine itself (the rest
    #: from the host copy), and tensors found held otherwise than the host copy (re-sent).
    engine_digested: int = 0
    engine_mismatches: int = 0


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
    engine_digested: int = 0
    engine_mismatches: int = 0
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


class EngineTarget(Mapping[str, torch.Tensor]):
    """What both vLLM targets share: the mapping the syncers see (``self._tensors``: a host
    copy, or meta tensors; an engine handle, equal only to itself — ``Mapping`` would compare
    every tensor — and hashable), generation, the bound on engine calls, the statistics."""

    path: str
    _tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def timeout(self) -> float:
        """The bound on every engine call (seconds); may be changed between writes."""
        return self._calls.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ConfigError(f"VLLMTarget: timeout must be positive, got {seconds!r}")
        self._calls.timeout = seconds

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the counters and the state."""
        return EngineStatistics(self.version, self.pause_mode, self.error is not None,
                                **dataclasses.asdict(self.stats), path=self.path)

    def close(self) -> None:
        """Stop the engine thread of an offline ``LLM`` (the engine itself stays the caller's)."""
        self._calls.close()

    async def generate(self, prompts: Sequence[Any], sampling_params: Any = None) -> list[Any]:
        """Generate for ``prompts`` (anything vLLM takes: token-id prompts, strings); returns the
        final ``RequestOutput`` of each, in order. Each completion's ``weight_versions`` names
        the versions that generated its tokens (:func:`output_versions`). Writes may land
        between two engine steps (``pause_mode``); under ``explorer.lease()`` none does."""
        if self.error is not None:
            raise ApplyError(f"the vLLM engine target gave up after an earlier failure: {self.error}")
        prompts = list(prompts)
        self.stats.requests += len(prompts)
        return await self._calls.generate(prompts, sampling_params)
