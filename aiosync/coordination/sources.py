"""Where published weights wait between the trainer and the explorers: one class per method.

A source answers one question for an explorer's link: *which weights should I send now?*
:meth:`borrow` yields a :class:`Published` (version + tensors) for the duration of a build.

* :class:`MemorySource` (MEMORY): ``publish`` copies the trainer's synced tensors into memory
  (in a worker thread); ``borrow`` yields the newest copy.
* :class:`CheckpointSource` (CHECKPOINT): ``publish`` writes a safetensors file atomically;
  ``borrow`` discovers the newest file and loads it (once per version).
* :class:`DirectSource` (NCCL): nothing is copied. The trainer opens a *window* on its live
  tensors (trainer REQUIRE_SYNC); links that asked (explorer REQUIRE_SYNC) build from them
  inside the window; the trainer closes it when every expected link has handed its payload
  off. This is the seed's two-way handshake.

A link that needs weights newer than a given publish (EXPLORER_DRIVEN: the trainer serves the
request at its next check) waits in :meth:`borrow` until the trainer publishes, until its
deadline, or until the trainer stops; a stopped trainer answers at once (S5).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..errors import VersionError
from ..transports.checkpoint import CheckpointDir


@dataclass(frozen=True, eq=False)
class Published:
    """One published version: ``state`` maps every state-dict key to a tensor (synced keys
    hold the published values; keys that are never synced refer to the trainer's own tensors).
    ``seq`` counts publishes (1, 2, ...)."""

    version: int
    state: Mapping[str, torch.Tensor]
    seq: int


def _copy_synced(live: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    synced = set(names)
    with torch.no_grad():
        return {k: (t.detach().clone() if k in synced else t) for k, t in live.items()}


@dataclass(eq=False)
class _SourceBase:
    """Shared state: the newest publish, links waiting for the trainer, whether it stopped."""

    latest: Published | None = None
    seq: int = 0
    #: Links waiting in :meth:`borrow` for the trainer to publish / open a window.
    waiting: set = field(default_factory=set)
    trainer_stopped: bool = False
    publish_s: float = 0.0
    #: ``callback(event, version)`` for ``published``, ``window_open``, ``window_closed`` and
    #: ``trainer_stopped`` (remote explorers are told through these). Must not block.
    listeners: list = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)

    def _notify(self, link: Any = None) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        if link is not None and hasattr(link, "_notify"):
            link._notify()  # its "settled" state changed

    def _emit(self, event: str, version: int | None) -> None:
        for listener in list(self.listeners):
            listener(event, version)

    def stop(self) -> None:
        """The trainer stopped: waiting links get the newest publish at once."""
        self.trainer_stopped = True
        self._notify()
        self._emit("trainer_stopped", None if self.latest is None else self.latest.version)

    def announce(self) -> None:
        """Re-offer the newest publish as fresh: the trainer's weights did not change since, so
        it answers explorers waiting for the trainer's current weights."""
        if self.latest is not None:
            self.seq += 1
            self.latest = Published(self.latest.version, self.latest.state, self.seq)
            self._notify()

    async def _wait_fresh(self, link: Any, fresh_after: int | None, deadline: float | None) -> bool:
        """Wait until a publish newer than ``fresh_after`` exists; False on deadline."""
        if fresh_after is None:
            return True
        self.waiting.add(link)
        self._notify(link)
        try:
            while self.seq <= fresh_after and not self.trainer_stopped:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return False
                with anyio.move_on_after(timeout):
                    await self._changed.wait()
            return True
        finally:
            self.waiting.discard(link)
            self._notify(link)

    def _check_version(self, version: int) -> None:
        if self.latest is not None and version <= self.latest.version:
            raise VersionError(f"published version {version} is not above the last published {self.latest.version}")


@dataclass(eq=False)
class MemorySource(_SourceBase):
    """MEMORY: published weights are copies held in this process's memory."""

    async def publish(self, live: Mapping[str, torch.Tensor], names: list[str], version: int) -> Published:
        self._check_version(version)
        t0 = time.perf_counter()
        state = await run_sync(_copy_synced, live, names)
        self.publish_s = time.perf_counter() - t0
        self.seq += 1
        self.latest = Published(version, state, self.seq)
        self._notify()
        self._emit("published", version)
        return self.latest

    @contextlib.asynccontextmanager
    async def borrow(self, link: Any, fresh_after: int | None, deadline: float | None) -> AsyncIterator[Published | None]:
        """Yield the newest publish (``None`` if nothing fresh came before ``deadline``)."""
        ok = await self._wait_fresh(link, fresh_after, deadline)
        yield self.latest if ok else None


@dataclass(eq=False)
class CheckpointSource(_SourceBase):
    """CHECKPOINT: published weights are safetensors files in ``directory``.

    Only synced keys are written; the others (never synced, so never changing) are taken
    from the trainer's tensors when a file is loaded.
    """

    directory: CheckpointDir | None = None
    live: Callable[[], Mapping[str, torch.Tensor]] | None = None
    _cache: Published | None = None

    async def publish(self, live: Mapping[str, torch.Tensor], names: list[str], version: int) -> Published:
        self._check_version(version)
        t0 = time.perf_counter()
        await run_sync(self.directory.publish, {k: live[k] for k in names}, version)
        self.publish_s = time.perf_counter() - t0
        self.seq += 1
        self.latest = Published(version, {}, self.seq)  # tensors are loaded on demand
        self._notify()
        self._emit("published", version)
        return self.latest

    async def load_newest(self) -> Published | None:
        newest = await run_sync(self.directory.newest)
        if newest is None:
            return None
        if self._cache is None or self._cache.version != newest[0]:
            version, tensors = await run_sync(self.directory.load)
            state = dict(self.live()) if self.live is not None else {}
            state.update(tensors)
            seq = self.latest.seq if self.latest is not None and self.latest.version == version else self.seq
            self._cache = Published(version, state, seq)
        return self._cache

    @contextlib.asynccontextmanager
    async def borrow(self, link: Any, fresh_after: int | None, deadline: float | None) -> AsyncIterator[Published | None]:
        ok = await self._wait_fresh(link, fresh_after, deadline)
        yield (await self.load_newest()) if ok else None


@dataclass(eq=False)
class Window:
    """One NCCL handshake: the trainer's live tensors, open while links build from them."""

    published: Published
    joined: set = field(default_factory=set)
    active: int = 0


@dataclass(eq=False)
class DirectSource(_SourceBase):
    """NCCL: links build straight from the trainer's live tensors inside a handshake window."""

    window: Window | None = None

    def open(self, live: Mapping[str, torch.Tensor], version: int, *, reopen: bool = False) -> Window:
        """Open a window on ``live`` as ``version``; ``reopen=True`` serves the current version
        again (bootstrapping a new explorer, draining one that missed it)."""
        if not (reopen and self.latest is not None and version == self.latest.version):
            self._check_version(version)
        self.seq += 1
        self.latest = Published(version, live, self.seq)
        self.window = Window(self.latest)
        self._notify()
        self._emit("window_open", version)
        return self.window

    def close_window(self) -> None:
        self.window = None
        self._notify()
        self._emit("window_closed", None if self.latest is None else self.latest.version)

    async def wait_window_done(self, window: Window, expected: set, deadline: float) -> set:
        """Wait until every link in ``expected`` joined ``window`` and no build is running;
        returns the links that never joined (the deadline passed first)."""
        while True:
            missing = {link for link in expected if link not in window.joined and not link.closed}
            if window.active == 0 and (not missing or time.monotonic() >= deadline):
                return missing
            # A build that started is waited for (it is bounded by the delivery timeout).
            timeout = None if window.active else deadline - time.monotonic()
            with anyio.move_on_after(timeout):
                await self._changed.wait()

    @contextlib.asynccontextmanager
    async def borrow(self, link: Any, fresh_after: int | None, deadline: float | None) -> AsyncIterator[Published | None]:
        """Wait for an open window (or a stopped trainer), then hold it while building."""
        self.waiting.add(link)
        self._notify(link)
        try:
            while self.window is None and not self.trainer_stopped:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break
                with anyio.move_on_after(timeout):
                    await self._changed.wait()
        finally:
            self.waiting.discard(link)
            self._notify(link)
        window = self.window
        if window is None or link in window.joined:
            yield None
            return
        window.joined.add(link)
        window.active += 1
        try:
            yield window.published
        finally:
            window.active -= 1
            self._notify()


def wait_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout

