"""The two slots of the runtime, styled after anyio's memory object streams: small dataclasses
holding explicit shared state, paired ``*_nowait`` / awaiting methods, precise exceptions.

* :class:`PolicySlot` (S8) — the explorer-side holder of the rollout model. Rollouts read it
  through :meth:`PolicySlot.lease`; a new version is written with :meth:`PolicySlot.apply`.
  Readers and the writer exclude each other, so a lease never sees two versions at once; the
  version advances only after a whole apply succeeded and is strictly increasing; a failed
  apply is rolled back.
* :class:`Rollout` — a long rollout that holds the model in *segments*
  (:meth:`PolicySlot.rollout`): between two segments a waiting apply goes first, so new weights
  land during the rollout and every segment is stamped with the version it ran on.
* :class:`LatestSlot` (S6, B4) — a one-item, latest-wins mailbox: a put while an item is
  waiting replaces it (the old one is *coalesced*, never queued); closing it still lets the
  waiting item be taken, so the newest item is never dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
import torch

from ..aio import run_sync
from ..errors import ApplyError, ClosedResourceError, EndOfStream, PeerTimeoutError, VersionError, WouldBlock

M = TypeVar("M")
T = TypeVar("T")


class Lease(NamedTuple):
    """What a lease yields: the model and the version of the weights it holds.

    Unpacks as a pair: ``async with slot.lease() as (model, version): ...``.
    """

    model: Any
    version: int


def _state_tensors(model: Any) -> dict[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if isinstance(model, dict) or hasattr(model, "items"):
        return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    raise TypeError(f"PolicySlot holds an nn.Module or a mapping of tensors, got {type(model).__name__}")


def _current_task() -> Any:
    """The running task's id (``None`` outside a task)."""
    try:
        return anyio.get_current_task().id
    except Exception:  # noqa: BLE001 - no async backend running here
        return None


@dataclass
class SlotStats:
    """Counters of a :class:`PolicySlot` (mutable; read a snapshot with :meth:`PolicySlot.statistics`)."""

    leases: int = 0
    applies: int = 0
    failed_applies: int = 0
    last_apply_s: float = 0.0
    total_apply_s: float = 0.0
    #: How long the last apply waited for the leases in use to end.
    last_lock_wait_s: float = 0.0
    #: How long the last apply held the model exclusively (leases waited meanwhile).
    last_exclusive_s: float = 0.0
    max_exclusive_s: float = 0.0
    #: Leases that had to wait for an apply, and the longest such wait.
    leases_waited: int = 0
    max_lease_wait_s: float = 0.0
    max_concurrent_leases: int = 0
    #: The most leases one apply had to wait for (those held when it asked: new ones wait for
    #: it). With segmented rollouts, at most one segment per rollout.
    max_leases_waited_for: int = 0
    #: Times the model lost the weights of its version outside aiosync (:meth:`PolicySlot.lose`).
    losses: int = 0


@dataclass(frozen=True)
class SlotStatistics:
    """A snapshot of a :class:`PolicySlot`'s counters (see :class:`SlotStats`) and state."""

    version: int | None
    readers: int
    applying: bool
    leases: int
    applies: int
    failed_applies: int
    last_apply_s: float
    total_apply_s: float
    last_lock_wait_s: float
    last_exclusive_s: float
    max_exclusive_s: float
    leases_waited: int
    max_lease_wait_s: float
    max_concurrent_leases: int
    max_leases_waited_for: int
    losses: int
    #: Applies waiting for the leases in use to end.
    writers_waiting: int


@dataclass(eq=False)
class PolicySlot(Generic[M]):
    """The rollout model and the version of the weights it holds.

    ``version`` is ``None`` until the first apply (or give the version the model was loaded
    with). ``timeout`` bounds every wait (leases waiting for an apply or for the first weights,
    applies waiting for leases to end). ``backup`` keeps a copy of the model's tensors taken
    before each apply and restores it if the apply fails (one extra model copy, reused; the
    copies run in a worker thread). Turn it off only when every ``write`` is all-or-nothing by
    itself: otherwise a failed apply may leave partly written weights (the version is still
    kept).
    """

    model: M
    version: int | None = None
    timeout: float = 300.0
    backup: bool = True
    stats: SlotStats = field(default_factory=SlotStats)
    #: The exception of the last failed apply, or ``None``.
    last_error: BaseException | None = None
    _readers: int = field(default=0, repr=False)
    _writing: bool = field(default=False, repr=False)
    _writers_waiting: int = field(default=0, repr=False)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)
    _apply_lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    _backup: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    #: Leases held, by the task holding them (a nested lease of the same task is granted at once).
    _holders: dict = field(default_factory=dict, repr=False)
    #: The thread whose event loop uses this slot (set at the first lease or apply).
    _thread: int | None = field(default=None, repr=False)

    # -- shared state ---------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def readers(self) -> int:
        """Leases held right now."""
        return self._readers

    @property
    def applying(self) -> bool:
        """Whether an apply holds the model right now."""
        return self._writing

    def statistics(self) -> SlotStatistics:
        """A frozen snapshot of the counters and the state."""
        return SlotStatistics(self.version, self._readers, self._writing, **dataclasses.asdict(self.stats),
                              writers_waiting=self._writers_waiting)

    def _can_read(self) -> bool:
        # Writer preference: a waiting apply holds back new leases, so it cannot starve.
        return not self._writing and not self._writers_waiting and self.version is not None

    def _check_thread(self, what: str) -> None:
        """A slot's waits and wake-ups belong to one event loop: refuse a call from another
        thread at once (instead of a wait that can never be woken)."""
        here = threading.get_ident()
        if self._thread is None:
            self._thread = here
        elif here != self._thread:
            raise RuntimeError(
                f"PolicySlot.{what}() called from thread {here}, but this slot belongs to the event loop of thread "
                f"{self._thread}: its waits cannot span two event loops. Lease from that loop (e.g. "
                "anyio.from_thread.run(...) or asyncio.run_coroutine_threadsafe(..., loop) from the other thread)")

    def _why_waiting(self) -> str:
        if self.version is None:
            if self.last_error is not None and self.stats.losses:
                return f"the model lost its weights and none were applied since ({self.last_error})"
            return "no weights were applied yet"
        if self._writing:
            return "an apply held the model (writing) all that time"
        return (f"an apply waited for {self._readers} lease(s) held by other tasks to end, and new leases wait "
                "behind it (writer preference): a lease is held longer than this timeout — hold leases for "
                "shorter, or use explorer.rollout() segments for long rollouts")

    def lose(self, reason: str) -> None:
        """The model no longer holds the weights of :attr:`version`: they were replaced where
        they live, outside aiosync (a ``vllm serve`` process that restarted holds the weights
        it was started from). The version becomes ``None`` until the next apply lands, so the
        slot never reports weights it does not hold: new leases wait for that apply (bounded by
        their timeout); leases held now keep their ``(model, version)``. ``reason`` becomes
        :attr:`last_error` (an :class:`~aiosync.errors.ApplyError`); ``stats.losses`` counts."""
        if self.version is None and self.stats.losses and self.last_error is not None:
            return  # already lost, not applied since
        self.version = None
        self.last_error = ApplyError(reason)
        self.stats.losses += 1
        self._notify()

    # -- readers ----------------------------------------------------------------------

    def _enter_read(self, task: Any) -> Lease:
        self._readers += 1
        self._holders[task] = self._holders.get(task, 0) + 1
        self.stats.leases += 1
        self.stats.max_concurrent_leases = max(self.stats.max_concurrent_leases, self._readers)
        return Lease(self.model, self.version)

    def _exit_read(self, task: Any) -> None:
        self._readers -= 1
        held = self._holders.pop(task, 1) - 1
        if held:
            self._holders[task] = held
        if self._readers == 0:
            self._notify()

    def _holds_lease(self, task: Any) -> bool:
        """Whether ``task`` holds a lease now: a nested lease of it is granted at once, whatever
        waits (an apply waiting for the outer lease would otherwise wait for its own caller)."""
        return task is not None and self._holders.get(task, 0) > 0 and self.version is not None

    @contextlib.asynccontextmanager
    async def lease(self, timeout: float | None = None) -> AsyncIterator[Lease]:
        """Hold the model for reading: yields ``(model, version)``.

        Waits while an apply runs or is waiting, and until the first weights exist. No apply
        writes into the model while any lease is held. Raises
        :class:`aiosync.errors.PeerTimeoutError` after ``timeout`` (default: the slot's).
        """
        timeout = self.timeout if timeout is None else timeout
        self._check_thread("lease")
        task = _current_task()
        if not self._can_read() and not self._holds_lease(task):
            started = time.perf_counter()
            try:
                with anyio.fail_after(timeout):
                    while not self._can_read():
                        await self._changed.wait()
            except TimeoutError as exc:
                raise PeerTimeoutError(f"lease not granted within {timeout}s: {self._why_waiting()}") from exc
            if self.version is not None:
                waited = time.perf_counter() - started
                self.stats.leases_waited += 1
                self.stats.max_lease_wait_s = max(self.stats.max_lease_wait_s, waited)
        lease = self._enter_read(task)
        try:
            yield lease
        finally:
            self._exit_read(task)

    @contextlib.contextmanager
    def lease_nowait(self) -> Iterator[Lease]:
        """Like :meth:`lease` without waiting: raises :class:`aiosync.errors.WouldBlock` when an
        apply runs or waits, or no weights exist yet. The lease may be held across awaits."""
        self._check_thread("lease_nowait")
        task = _current_task()
        if not self._can_read() and not self._holds_lease(task):
            raise WouldBlock("the policy slot is being written, or holds no weights yet")
        lease = self._enter_read(task)
        try:
            yield lease
        finally:
            self._exit_read(task)

    @contextlib.asynccontextmanager
    async def rollout(self, timeout: float | None = None) -> AsyncIterator["Rollout"]:
        """A long rollout held in segments (in-flight updates)::

            async with slot.rollout() as r:
                while not done:
                    async with r.segment() as (model, version):   # one token batch, one env step
                        ...
            r.versions   # the version of every segment; r.first_version, r.last_version

        Each :meth:`Rollout.segment` is a lease of its own: within a segment the weights never
        change; between two segments a waiting apply goes first (writer preference), so an
        apply waits at most for the segment in progress, never for the whole rollout, and never
        times out into a re-bootstrap because a rollout is long. :meth:`lease` keeps its meaning
        (one version throughout). ``timeout`` bounds each segment's wait (default: the slot's).
        """
        yield Rollout(self, self.timeout if timeout is None else timeout)

    # -- the writer -------------------------------------------------------------------

    async def apply(self, write: Callable[[M], Awaitable[int]], *, timeout: float | None = None,
                    backup: bool | None = None, allow_same: bool = False, version: int | None = None) -> int:
        """Write a new version into the model atomically with respect to leases.

        ``write(model)`` writes the new weights and returns their version (e.g. a syncer's
        ``apply``). It runs alone: after the leases in use have ended and while new ones wait.
        The slot's version becomes the returned one, which must be greater than the current.
        If ``write`` raises, or returns a version that does not increase, the tensors are
        restored from the backup, the version is left as it was, and
        :class:`aiosync.errors.ApplyError` is raised (cancellation is re-raised after the same
        rollback). Applies are serialized in call order. ``backup=False`` skips the backup for a
        ``write`` that is all-or-nothing by itself (a patch syncer validates before writing and
        rolls its own writes back); the default is the slot's ``backup``. ``allow_same=True``
        also accepts the current version again (re-bootstrapping the version already held).
        ``version``, when the write's version is known in advance (a staged write), is checked
        before anything is written.
        """
        timeout = self.timeout if timeout is None else timeout
        backup = self.backup if backup is None else backup
        self._check_thread("apply")
        if self._holds_lease(_current_task()):
            raise RuntimeError("PolicySlot.apply() from a task that holds a lease of this slot: the apply would wait "
                               "for its own caller's lease; apply outside the lease")
        async with self._apply_lock:
            if backup:
                # Taken while leases go on reading: this apply is the only writer (the lock),
                # and leases only read, so the copy is consistent without holding them back.
                await run_sync(self._take_backup)
            started = time.perf_counter()
            # From here, leases asked for wait for this apply (writer preference).
            self._writers_waiting += 1
            self.stats.max_leases_waited_for = max(self.stats.max_leases_waited_for, self._readers)
            try:
                with anyio.fail_after(timeout):
                    while self._writing or self._readers:
                        await self._changed.wait()
            except TimeoutError as exc:
                raise PeerTimeoutError(
                    f"apply could not take the model within {timeout}s: {self._readers} lease(s) still held"
                ) from exc
            finally:
                self._writers_waiting -= 1
                if not self._writing:
                    self._notify()
            self._writing = True
            self.stats.last_lock_wait_s = time.perf_counter() - started
            t0 = time.perf_counter()
            try:
                if version is not None:
                    self._check_version(version, allow_same)  # before anything is written
                new_version = await write(self.model)
                if isinstance(new_version, bool) or not isinstance(new_version, int):
                    raise VersionError(f"apply returned {new_version!r}, not an integer version")
                self._check_version(new_version, allow_same)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await self._rollback(backup)
                self.stats.failed_applies += 1
                self.last_error = exc
                self._release_writer(t0)
                if isinstance(exc, Exception):
                    raise ApplyError(
                        f"apply failed and was rolled back (version stays {self.version}): {type(exc).__name__}: {exc}"
                    ) from exc
                raise
            self.version = int(new_version)
            self.last_error = None
            dt = time.perf_counter() - t0
            self.stats.applies += 1
            self.stats.last_apply_s = dt
            self.stats.total_apply_s += dt
            self._release_writer(t0)
            return self.version

    def _check_version(self, version: int, allow_same: bool) -> None:
        if self.version is not None and (version < self.version or (version == self.version and not allow_same)):
            raise VersionError(f"apply returned version {version}, not above the applied version {self.version}")

    def _release_writer(self, t0: float) -> None:
        held = time.perf_counter() - t0
        self.stats.last_exclusive_s = held
        self.stats.max_exclusive_s = max(self.stats.max_exclusive_s, held)
        self._writing = False
        self._notify()

    def _take_backup(self) -> None:
        tensors = _state_tensors(self.model)
        backup = self._backup
        if backup is None or backup.keys() != tensors.keys() or any(
            backup[k].shape != t.shape or backup[k].dtype != t.dtype or backup[k].device != t.device
            for k, t in tensors.items()
        ):
            backup = {k: torch.empty_like(t) for k, t in tensors.items()}
        with torch.no_grad():
            for k, t in tensors.items():
                backup[k].copy_(t)
        self._backup = backup

    def _restore_backup(self) -> None:
        tensors = _state_tensors(self.model)
        with torch.no_grad():
            for k, t in tensors.items():
                t.copy_(self._backup[k])

    async def _rollback(self, backup: bool) -> None:
        if backup and self._backup is not None:
            await run_sync(self._restore_backup)


@dataclass(eq=False)
class Rollout:
    """A rollout in segments (:meth:`PolicySlot.rollout`); ``versions`` holds the version of
    every segment so far, in order — stamp the rollout's samples with it."""

    slot: PolicySlot
    timeout: float
    versions: list[int] = field(default_factory=list)

    @property
    def first_version(self) -> int | None:
        """The version of the first segment (``None`` before it)."""
        return self.versions[0] if self.versions else None

    @property
    def last_version(self) -> int | None:
        """The version of the latest segment (``None`` before the first)."""
        return self.versions[-1] if self.versions else None

    @property
    def segments(self) -> int:
        return len(self.versions)

    @contextlib.asynccontextmanager
    async def segment(self) -> AsyncIterator[Lease]:
        """Hold the model for one segment: yields ``(model, version)``; a waiting apply runs
        before it starts (it may then run on a newer version than the previous segment)."""
        async with self.slot.lease(self.timeout) as lease:
            self.versions.append(lease.version)
            yield lease

    def apply_waiting(self) -> bool:
        """Whether an apply waits for the segment in progress to end (end it early, e.g. at a
        token boundary, to let the new weights in sooner)."""
        return self.slot._writers_waiting > 0


@dataclass
class LatestSlotStats:
    """Counters of a :class:`LatestSlot` (mutable; read a snapshot with :meth:`LatestSlot.statistics`)."""

    puts: int = 0
    coalesced: int = 0
    taken: int = 0
    #: Most items ever waiting at once (1 by construction: shown so that it can be checked).
    max_pending: int = 0


@dataclass(frozen=True)
class LatestSlotStatistics:
    """A snapshot of a :class:`LatestSlot`'s counters."""

    puts: int
    coalesced: int
    taken: int
    max_pending: int
    pending: int


_EMPTY: Any = object()


@dataclass(eq=False)
class LatestSlot(Generic[T]):
    """A one-item, latest-wins mailbox between a producer and one consumer.

    :meth:`put_nowait` never blocks: if an item is already waiting, the new one replaces it
    (``merge(old, new)`` can combine them instead) and ``stats.coalesced`` counts it. :meth:`get`
    waits for an item. After :meth:`close`, puts raise :class:`aiosync.errors.ClosedResourceError`
    and gets still return the waiting item, then raise :class:`aiosync.errors.EndOfStream`.
    """

    merge: Callable[[T, T], T] | None = None
    stats: LatestSlotStats = field(default_factory=LatestSlotStats)
    _item: Any = field(default=_EMPTY, repr=False)
    _closed: bool = False
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def pending(self) -> int:
        """Items waiting: 0 or 1."""
        return 0 if self._item is _EMPTY else 1

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> LatestSlotStatistics:
        """A frozen snapshot of the counters."""
        return LatestSlotStatistics(**dataclasses.asdict(self.stats), pending=self.pending)

    def peek(self) -> T | None:
        """The waiting item, or ``None``."""
        return None if self._item is _EMPTY else self._item

    def put_nowait(self, item: T) -> bool:
        """Offer ``item``; returns ``True`` when it was merged into (coalesced with) a waiting one."""
        if self._closed:
            raise ClosedResourceError("put on a closed LatestSlot")
        self.stats.puts += 1
        coalesced = self._item is not _EMPTY
        if coalesced:
            self.stats.coalesced += 1
            item = self.merge(self._item, item) if self.merge is not None else item
        self._item = item
        self.stats.max_pending = max(self.stats.max_pending, self.pending)
        self._notify()
        return coalesced

    def get_nowait(self) -> T:
        """Take the waiting item; :class:`WouldBlock` if none, :class:`EndOfStream` if closed and empty."""
        if self._item is _EMPTY:
            if self._closed:
                raise EndOfStream("the LatestSlot is closed and empty")
            raise WouldBlock("no item is waiting")
        item, self._item = self._item, _EMPTY
        self.stats.taken += 1
        self._notify()
        return item

    async def get(self, timeout: float | None = None) -> T:
        """Wait for an item and take it; :class:`PeerTimeoutError` after ``timeout`` seconds."""
        try:
            with anyio.fail_after(timeout):
                while self._item is _EMPTY and not self._closed:
                    await self._changed.wait()
        except TimeoutError as exc:
            raise PeerTimeoutError(f"nothing was put within {timeout}s") from exc
        return self.get_nowait()

    def discard(self) -> T | None:
        """Drop the waiting item (if any) and return it."""
        item, self._item = self._item, _EMPTY
        if item is _EMPTY:
            return None
        self._notify()
        return item

    def close(self) -> None:
        """No more puts; a waiting item can still be taken."""
        self._closed = True
        self._notify()
