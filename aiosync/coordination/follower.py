"""An explorer that follows a CHECKPOINT directory on shared storage — no process group, no
transport: :class:`CheckpointFollower`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .._strict import check_seconds
from ..aio import run_sync
from ..checkpoints import CheckpointDir
from ..errors import PeerTimeoutError
from ..syncers.common.state_dicts import module_state_dict
from .slots import PolicySlot


class CheckpointFollower:
    """Follows the files a synchronizer with ``method: checkpoint`` publishes.

    The trainer's :class:`~aiosync.Synchronizer` publishes every version as a safetensors file,
    atomically; this reads the newest one (outside the slot's exclusive section: rollouts go on
    meanwhile), verifies the digests of its tensors, checks it fits the model (keys, shapes,
    dtype kinds), and swaps it into
    ``model`` through a :class:`PolicySlot` (cast to the model's dtypes; rollouts never see a
    half-applied version). For explorers on nodes that share a file system with the trainer
    but no network path a process group could use::

        follower = CheckpointFollower("/shared/run42/sync", rollout_model)
        await follower.wait_for_version(0, timeout=600)          # the first weights
        while ...:
            async with follower.lease() as (model, version): ...
            await follower.poll()                                 # at each check point

    The model's keys that are not in a file are left alone (they are never synced).
    ``poll_interval``: seconds between looks at the directory in :meth:`wait_for_version`.
    """

    def __init__(self, directory: Any, model: Any, *, poll_interval: float = 0.25, timeout: float = 600.0) -> None:
        self.directory = directory if isinstance(directory, CheckpointDir) else CheckpointDir(directory)
        self.slot = model if isinstance(model, PolicySlot) else PolicySlot(model)
        self.poll_interval = check_seconds("CheckpointFollower poll_interval", poll_interval)
        self.timeout = check_seconds("CheckpointFollower timeout", timeout)
        self.loads = 0

    @property
    def version(self) -> int | None:
        return self.slot.version

    def lease(self, timeout: float | None = None):
        """``async with follower.lease() as (model, version)``."""
        return self.slot.lease(timeout)

    async def poll(self) -> int | None:
        """Apply the newest published version if it is newer than the one held; returns the
        version held afterwards. A file that is refused (damaged: its digests do not match;
        mislabelled; truncated) is never applied: the version held stays, the refusal is logged
        and kept in :attr:`refused`, and the next good version is taken when it comes. A
        version that does not fit the model raises :class:`~aiosync.errors.HandshakeError`."""
        got = await run_sync(functools.partial(self.directory.read_newest, self.slot.version,
                                               target=module_state_dict(self.slot.model)))
        if got is None:
            return self.slot.version
        version, tensors = got
        if self.slot.version is not None and version <= self.slot.version:
            return self.slot.version

        async def write(model: Any) -> int:
            await run_sync(_load_into, module_state_dict(model), tensors)
            return version

        await self.slot.apply(write, timeout=self.timeout)
        self.loads += 1
        return self.slot.version

    @property
    def refused(self) -> list:
        """The files refused so far (newest last): ``(file name, error)``."""
        return self.directory.refused

    async def wait_for_version(self, version: int, *, timeout: float | None = None) -> int:
        """Poll until a version ≥ ``version`` is held; :class:`PeerTimeoutError` after ``timeout``.
        (A shared file system offers no change notification every platform honours, so this
        looks every ``poll_interval`` seconds.)"""
        timeout = self.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while self.slot.version is None or self.slot.version < version:
                await self.poll()
                if self.slot.version is not None and self.slot.version >= version:
                    break
                await anyio.sleep(self.poll_interval)
        if self.slot.version is None or self.slot.version < version:
            raise PeerTimeoutError(f"version {version} was not published in {self.directory.path} within {timeout}s")
        return self.slot.version


def _load_into(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in tensors.items():
            target[key].copy_(value)
