"""Where published weights wait between the trainer and the explorers: one class per method.

A source answers one question for a delivery line: *which weights should I send now?*
:meth:`Source.borrow` yields a :class:`Published` (version + tensors) for the duration of a build.

* :class:`MemorySource` (MEMORY): ``publish`` copies the trainer's synced tensors into memory
  (in a worker thread); ``borrow`` yields the newest copy.
* :class:`CheckpointSource` (CHECKPOINT): ``publish`` writes a safetensors file atomically;
  ``borrow`` discovers the newest file and loads it (once per version).
* :class:`DirectSource` (NCCL): nothing is copied. The trainer opens a :class:`Window` on its
  live tensors (trainer REQUIRE_SYNC); delivery lines that asked build from them inside the
  window; the trainer closes it once every expected line has built — and closing waits until
  no build reads the live tensors any more, even when the trainer's sync was cancelled, so a
  payload never mixes two train steps. This is the seed's two-way handshake.

A line that needs weights newer than a given publish (EXPLORER_DRIVEN: the trainer serves the
request at its next check) waits in ``borrow`` until the trainer publishes, until its deadline,
or until the trainer stops; a stopped trainer answers at once (S5).

Superseded copies (MEMORY) and cached files (CHECKPOINT, read into memory of their own, never
mapped) are released once no build reads them, in a worker thread and in bounded pieces
(:mod:`aiosync.reclaim`): freeing gigabytes takes tens of milliseconds, which must not stall the
event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..aio import finish_cuda_work, run_sync
from ..checkpoints import CheckpointDir
from ..errors import PeerTimeoutError, VersionError
from ..reclaim import release_off_loop
from ..syncers.common.state_dicts import copy_shared, is_dtensor


@dataclass(eq=False)
class Published:
    """One published version. ``state`` maps every state-dict key to a tensor (synced keys hold
    the published values; keys that are never synced refer to the trainer's own tensors).
    ``seq`` counts publishes (1, 2, ...). ``live``: ``state`` holds the trainer's live tensors
    (an NCCL window), so whatever is built from it must own its bytes before the window closes."""

    version: int
    state: Mapping[str, torch.Tensor]
    seq: int
    live: bool = False
    #: Builds reading ``state`` now; a retired publish is freed when the last one ends.
    borrowers: int = 0
    retired: bool = False
    #: Its NCCL window was closed while a build still read it (the build's bound ran out):
    #: whatever that build made is not trusted.
    revoked: bool = False


async def free_off_loop(box: list) -> None:
    """Release what only ``box`` references (large tensors) in a worker thread, in bounded pieces
    (:func:`aiosync.reclaim.release_off_loop`; shielded: a cancelled caller still hands it over).
    The caller keeps no other reference: it hands over the box, not its contents."""
    await release_off_loop(box)


@dataclass(eq=False)
class Source:
    """Shared state of every source: the newest publish, lines waiting for the trainer, whether
    it stopped, and the listeners told of events (remote explorers' sessions)."""

    latest: Published | None = None
    seq: int = 0
    #: Delivery lines waiting in :meth:`borrow` for the trainer to publish / open a window.
    waiting: set = field(default_factory=set)
    trainer_stopped: bool = False
    publish_s: float = 0.0
    #: ``callback(event, version)`` for ``published``, ``window_open``, ``window_closed`` and
    #: ``trainer_stopped``. Must not block.
    listeners: list = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)

    def _notify(self, line: Any = None) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        if line is not None:
            line.notify()  # its "settled" state changed

    def _emit(self, event: str, version: int | None) -> None:
        for listener in list(self.listeners):
            listener(event, version)

    async def changed(self, timeout: float | None) -> None:
        """Wait for the next change (bounded by ``timeout`` seconds, ``None``: no bound)."""
        with anyio.move_on_after(timeout):
            await self._changed.wait()

    def stop(self) -> None:
        """The trainer stopped: waiting lines get the newest publish at once."""
        self.trainer_stopped = True
        self._notify()
        self._emit("trainer_stopped", None if self.latest is None else self.latest.version)

    def announce(self) -> None:
        """Re-offer the newest publish as fresh: the trainer's weights did not change since, so
        it answers explorers waiting for the trainer's current weights."""
        if self.latest is not None:
            self.seq += 1
            self.latest.seq = self.seq
            self._notify()

    def _check_version(self, version: int) -> None:
        if self.latest is not None and version <= self.latest.version:
            raise VersionError(f"published version {version} is not above the last published {self.latest.version}")

    async def _replace(self, new: Published) -> None:
        """Make ``new`` the latest publish; the one it replaces is freed off the loop."""
        old, self.latest = self.latest, new
        self._notify()
        if old is not None and old is not new:
            await self._retire(old)

    async def _retire(self, pub: Published) -> None:
        pub.retired = True
        if pub.borrowers == 0 and not pub.live:
            box, pub.state = [pub.state], {}
            await free_off_loop(box)

    async def _wait_fresh(self, line: Any, fresh_after: int | None, deadline: float | None) -> bool:
        """Wait until a publish newer than ``fresh_after`` exists; False on deadline."""
        if fresh_after is None:
            return True
        self.waiting.add(line)
        self._notify(line)
        try:
            while self.seq <= fresh_after and not self.trainer_stopped:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return False
                await self.changed(timeout)
            return True
        finally:
            self.waiting.discard(line)
            self._notify(line)

    @contextlib.asynccontextmanager
    async def _lend(self, pub: Published | None) -> AsyncIterator[Published | None]:
        if pub is None:
            yield None
            return
        pub.borrowers += 1
        try:
            yield pub
        finally:
            pub.borrowers -= 1
            if pub.retired and pub.borrowers == 0:
                await self._retire(pub)

    async def newest(self) -> Published | None:
        """The publish a line should send now (``None``: nothing published)."""
        return self.latest

    @contextlib.asynccontextmanager
    async def borrow(self, line: Any, fresh_after: int | None, deadline: float | None
                     ) -> AsyncIterator[Published | None]:
        """Yield the newest publish (``None`` if nothing fresh came before ``deadline``) and keep
        it alive while the caller builds from it."""
        ok = await self._wait_fresh(line, fresh_after, deadline)
        async with self._lend(await self.newest() if ok else None) as pub:
            yield pub


def _copy_synced(live: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the synced tensors, made on the trainer's stream (carried here by ``run_sync``)
    and complete when this returns: builds on any stream then read the published values.
    Tensors that share memory (tied weights) share it in the copy too (one copy of them, and
    the handshake sees the trainer's tying)."""
    synced = [k for k in live if k in set(names)]
    out = dict(live)
    out.update(copy_shared(live, synced))
    finish_cuda_work(out[k] for k in synced)
    return out


@dataclass(eq=False)
class MemorySource(Source):
    """MEMORY: published weights are copies held in this process's memory."""

    async def publish(self, live: Mapping[str, torch.Tensor], names: list[str], version: int) -> Published:
        self._check_version(version)
        t0 = time.perf_counter()
        state = await run_sync(_copy_synced, live, names)
        self.publish_s = time.perf_counter() - t0
        self.seq += 1
        await self._replace(Published(version, state, self.seq))
        self._emit("published", version)
        return self.latest


@dataclass(eq=False)
class CheckpointSource(Source):
    """CHECKPOINT: published weights are safetensors files in ``directory``.

    Only synced keys are written; the others (never synced, so never changing) are taken from
    the trainer's tensors when a file is loaded. A loaded file must fit the trainer's tensors
    (keys, shapes, dtype kinds), or it is refused.

    With ``writers`` > 1 (a sharded trainer whose ranks all write), this process is writer
    ``writer_rank``: it writes its shard, and a version counts as published only once every
    writer's shard is in (other processes write theirs with ``CheckpointDir.publish(...,
    writer=(rank, writers))``); the wait is bounded by ``complete_timeout``.
    """

    directory: CheckpointDir | None = None
    live: Callable[[], Mapping[str, torch.Tensor]] | None = None
    writers: int = 1
    writer_rank: int = 0
    complete_timeout: float = 60.0
    _cache: Published | None = None

    async def publish(self, live: Mapping[str, torch.Tensor], names: list[str], version: int) -> Published:
        self._check_version(version)
        t0 = time.perf_counter()
        writer = None if self.writers == 1 else (self.writer_rank, self.writers)
        # A synced key the trainer no longer has is not written: the delivery then says so (a
        # HandshakeError naming it, as with the other methods), the trainer goes on.
        state = {k: live[k] for k in names if k in live}
        await run_sync(functools.partial(self.directory.publish, state, version, writer=writer))
        if writer is not None:
            await self._wait_complete(version)
        self.publish_s = time.perf_counter() - t0
        self.seq += 1
        await self._replace(Published(version, {}, self.seq))  # tensors are loaded on demand
        self._emit("published", version)
        return self.latest

    def stop(self) -> None:
        """The trainer stopped: its run releases the directory's hold (its files stay readable)."""
        super().stop()
        self.directory.release()  # rewrites one small file

    async def _wait_complete(self, version: int) -> None:
        """Wait until the shards of every writer of ``version`` are in. The other writers are
        other processes, so the directory is looked at again and again (every 10 ms at first,
        backing off to 200 ms), at most ``complete_timeout`` seconds."""
        deadline = time.monotonic() + self.complete_timeout
        pause = 0.01
        while True:
            newest = await run_sync(self.directory.newest_version)
            if newest is not None and newest >= version:
                return
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"checkpoint version {version} in {self.directory.path}: not every one of the {self.writers} "
                    f"writers wrote its shard within {self.complete_timeout}s (this is writer {self.writer_rank}); "
                    "every trainer rank must publish each version with CheckpointDir.publish(..., "
                    f"writer=(rank, {self.writers}))")
            await anyio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.2)

    async def newest(self) -> Published | None:
        """The newest version that reads and verifies (:meth:`CheckpointDir.read_newest`): a
        damaged or mislabelled file is refused (logged, kept in ``directory.refused``) and the
        version before it is served, until the next publish."""
        held = None if self._cache is None else self._cache.version
        live = dict(self.live()) if self.live is not None else {}
        got = await run_sync(functools.partial(self.directory.read_newest, held, target=live))
        if got is not None:
            version, tensors = got
            # a file holds tied tensors once per name: tie them again as the trainer's are
            live.update(await run_sync(functools.partial(copy_shared, tensors, list(tensors), like=live, clone=False)))
            seq = self.latest.seq if self.latest is not None and self.latest.version == version else self.seq
            old, self._cache = self._cache, Published(version, live, seq)
            del live, tensors, got
            if old is not None:
                await self._retire(old)
        return self._cache


@dataclass(eq=False)
class Window:
    """One NCCL handshake: the trainer's live tensors, open while delivery lines build from them."""

    published: Published
    joined: set = field(default_factory=set)
    #: Builds reading the live tensors right now.
    active: int = 0


@dataclass(eq=False)
class DirectSource(Source):
    """NCCL: delivery lines build straight from the trainer's live tensors inside a window."""

    window: Window | None = None

    def open(self, live: Mapping[str, torch.Tensor], version: int, *, reopen: bool = False) -> Window:
        """Open a window on ``live`` as ``version``; ``reopen=True`` serves the current version
        again (bootstrapping a new explorer, draining one that missed it)."""
        if not (reopen and self.latest is not None and version == self.latest.version):
            self._check_version(version)
        self.seq += 1
        self.latest = Published(version, live, self.seq, live=True)
        self.window = Window(self.latest)
        self._notify()
        self._emit("window_open", version)
        return self.window

    async def close(self, window: Window, bound: float) -> None:
        """Close ``window``: no new build may start, and this returns once no build reads the
        live tensors any more — at most ``bound`` seconds (then the window is revoked and the
        builds still running are not trusted). Shielded: a cancelled trainer still waits, so it
        never trains on while a build reads its tensors."""
        if self.window is window:
            self.window = None
            self._notify()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(bound):
                while window.active:
                    await self._changed.wait()
        if window.active:
            window.published.revoked = True
        self._emit("window_closed", window.published.version)

    async def wait_window_done(self, window: Window, expected: Callable[[], set], deadline: float) -> set:
        """Wait until every line of ``expected()`` joined ``window`` and no build is running;
        returns the lines that never joined (the deadline passed first). ``expected`` is asked
        again at every change: lines that are lost or stop meanwhile drop out of it."""
        while True:
            missing = {line for line in expected() if line not in window.joined}
            if window.active == 0 and (not missing or time.monotonic() >= deadline):
                return missing
            # A build that started is waited for (it is bounded by the delivery timeout).
            await self.changed(None if window.active else deadline - time.monotonic())

    @contextlib.asynccontextmanager
    async def borrow(self, line: Any, fresh_after: int | None, deadline: float | None
                     ) -> AsyncIterator[Published | None]:
        """Wait for an open window (or a stopped trainer), then hold it while building."""
        self.waiting.add(line)
        self._notify(line)
        try:
            while self.window is None and not self.trainer_stopped:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break
                await self.changed(timeout)
        finally:
            self.waiting.discard(line)
            self._notify(line)
        window = self.window
        if window is None or line in window.joined:
            yield None
            return
        window.joined.add(line)
        window.active += 1
        try:
            yield window.published
        finally:
            window.active -= 1
            self._notify()


def own_bytes(obj: Any, pub: Published) -> Any:
    """``obj`` (a payload, a list of payloads) with every tensor that shares storage with a live
    publish's tensors replaced by a copy: a payload must own its bytes before the trainer's
    window closes, or a receiver that reads it later reads the weights of a later step. Payloads
    of a publish that is not live are returned as they are. The built-in syncers' payloads own
    their bytes already; this protects custom ones."""
    if not pub.live:
        return obj
    live = set()
    for t in pub.state.values():
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
            local = t.to_local() if is_dtensor(t) else t  # a DTensor's bytes are its local shard's
            if local.numel():
                live.add(local.untyped_storage().data_ptr())
    return _own(obj, live, 0)


def _own(obj: Any, live: set, depth: int) -> Any:
    if depth > 16:
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.device.type != "meta" and obj.untyped_storage().data_ptr() in live:
            return obj.detach().clone()
        return obj
    if isinstance(obj, dict):
        out = {k: _own(v, live, depth + 1) for k, v in obj.items()}
        return obj if all(out[k] is v for k, v in obj.items()) else out
    if isinstance(obj, (list, tuple)):
        items = [_own(v, live, depth + 1) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.init:
                value = getattr(obj, f.name)
                owned = _own(value, live, depth + 1)
                if owned is not value:
                    changes[f.name] = owned
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj
