"""Optional loop skeletons with step hooks (S1), shaped like the seed's trainer and explorer.

You do not need them: a plain coroutine that calls the handles' ``need_sync`` /
``sync_weight`` (or ``step_done``) at its check points is the same thing. Subclass them
when the seed's shape fits:

* :class:`TrainerLoop` — ``sample()`` and ``train_step(batch)``; checks for a needed sync
  while waiting for samples and after each train step.
* :class:`ExplorerLoop` — ``explore_step(model, version)``; checks after each explore step,
  before collecting more.
"""

from __future__ import annotations

from typing import Any

import anyio

from ..coordination.explorer import Explorer
from ..coordination.trainer import TrainerHandle


class TrainerLoop:
    """Skeleton of a trainer coroutine. Override :meth:`sample` and :meth:`train_step`.

    ``check_interval`` is how often (seconds) the loop checks for a needed sync while a
    sample is being collected. :meth:`sample` may raise ``StopAsyncIteration`` to end training.
    """

    def __init__(self, trainer: TrainerHandle, total_steps: int, *, check_interval: float = 0.05) -> None:
        self.trainer = trainer
        self.total_steps = total_steps
        self.check_interval = check_interval
        self.metrics: list[dict[str, Any]] = []

    async def sample(self) -> Any:
        """Collect the next batch (may wait for the explorers)."""
        raise NotImplementedError

    async def train_step(self, batch: Any) -> dict[str, Any]:
        """Update the trainer's weights from ``batch``; return metrics. Run heavy work off the loop."""
        raise NotImplementedError

    async def _sample_while_checking(self) -> Any:
        box: dict[str, Any] = {}
        done = anyio.Event()

        async def collect() -> None:
            try:
                box["batch"] = await self.sample()
            except StopAsyncIteration as exc:
                box["stop"] = exc
            finally:
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            while not done.is_set():
                if self.trainer.need_sync():  # serve explorers that wait for new weights
                    await self.trainer.sync_weight()
                with anyio.move_on_after(self.check_interval):
                    await done.wait()
        if "stop" in box:
            raise box["stop"]
        return box["batch"]

    async def run(self) -> None:
        """Train until ``total_steps`` or a ``StopAsyncIteration`` from :meth:`sample`; then stop
        the trainer (its final weights are published)."""
        try:
            while self.trainer.step < self.total_steps:
                try:
                    batch = await self._sample_while_checking()
                except StopAsyncIteration:
                    break
                metrics = dict(await self.train_step(batch) or {})
                metrics["synced"] = await self.trainer.step_done()
                self.metrics.append(metrics)
        finally:
            with anyio.CancelScope(shield=True):
                await self.trainer.stop()


class ExplorerLoop:
    """Skeleton of an explorer coroutine. Override :meth:`explore_step`.

    Each step runs under a lease, so the model cannot change during it, and receives the
    version it holds: stamp what the step produces with it (S10).
    """

    def __init__(self, explorer: Explorer, *, max_steps: int | None = None) -> None:
        self.explorer = explorer
        self.max_steps = max_steps

    async def explore_step(self, model: Any, version: int) -> bool:
        """Generate experience with ``model`` (weights of ``version``); return False to stop."""
        raise NotImplementedError

    async def run(self) -> None:
        """Explore until :meth:`explore_step` returns False or ``max_steps``; then stop the explorer."""
        try:
            while self.max_steps is None or self.explorer.step < self.max_steps:
                async with self.explorer.lease() as (model, version):
                    keep_going = await self.explore_step(model, version)
                if not keep_going:
                    break
                await self.explorer.step_done()
        finally:
            with anyio.CancelScope(shield=True):
                await self.explorer.stop()
