"""Waiting on posted torch.distributed work without blocking the event loop.

gloo's point-to-point work handles cannot be polled (``is_completed()`` stays false until
someone calls ``wait()``) and a gloo wait that times out poisons the whole group, so each
posted gloo operation is waited for by a small daemon thread that calls ``wait()`` (with no
timeout of its own) and wakes the event loop when it returns (the threads are kept and reused:
starting one makes the caller wait until the OS schedules it, milliseconds of loop stall on a
busy machine — see :class:`_Waiters`); NCCL work is polled with
``is_completed()`` and exponential back-off. The event loop only posts operations and awaits,
with aiosync's own deadline (:class:`aiosync.errors.PeerTimeoutError`). An :class:`_Op` whose
wait timed out or was cancelled is still pending: waiting on it again resumes the same
operation, so nothing is lost or misframed.
"""

from __future__ import annotations

import _thread
import asyncio
import queue
import threading
import time
from typing import Any

import anyio
import torch.distributed as dist

from ...errors import PeerTimeoutError

def is_gloo(group: Any) -> bool:
    """Whether ``group`` (``None``: the world group) runs on gloo, whose work is waited for in a thread."""
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # pragma: no cover - an unusual group object
        return True


class _Waiters:
    """Threads that run blocking waits, reused: an idle one takes the next wait; when none is idle
    a new one is started without waiting for it to run (``threading.Thread.start`` blocks its
    caller, the event loop, until the OS schedules the new thread). At most ``keep`` idle threads
    stay; the others end."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that idle thread takes this job
        self._jobs.put(job)
        if start:
            _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            del job
            with self._lock:
                if self._idle >= self.keep:
                    return
                self._idle += 1


_WAITERS = _Waiters()


class _Op:
    """One posted torch.distributed operation, awaited without blocking the event loop.

    gloo: a daemon thread calls ``work.wait()`` and wakes the waiting loop. NCCL: the loop polls
    ``work.is_completed()`` with back-off. Waiting again after a timeout resumes the same op.
    """

    __slots__ = ("work", "keep", "what", "_done", "_error", "_wakers", "_lock", "_poll")

    def __init__(self, work: Any, keep: Any, what: str, *, threaded: bool) -> None:
        self.work, self.keep, self.what = work, keep, what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._wakers: list = []
        self._lock = threading.Lock()
        self._poll = not threaded
        if work is None:  # a rank outside the group: nothing to wait for
            self._done.set()
        elif threaded:
            _WAITERS.submit(self._wait_in_thread)

    def _wait_in_thread(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            self._error = exc
        with self._lock:
            self._done.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def done(self) -> bool:
        if not self._done.is_set() and self._poll:
            try:
                if self.work.is_completed():
                    self.work.wait()
                    self._done.set()
            except BaseException as exc:  # noqa: BLE001
                self._error = exc
                self._done.set()
        return self._done.is_set()

    def result(self) -> None:
        if self._error is not None:
            raise self._error

    async def wait(self, deadline: float | None) -> None:
        """Wait until done or until ``deadline`` (monotonic); :class:`PeerTimeoutError` then."""
        if self.done():
            return self.result()
        if self._poll:
            delay = 50e-6
            while not self.done():
                if deadline is not None and time.monotonic() >= deadline:
                    raise PeerTimeoutError(f"{self.what} did not complete in time")
                await anyio.sleep(delay)
                delay = min(delay * 2, 2e-3)
            return self.result()
        loop = asyncio.get_running_loop()
        event = anyio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        with self._lock:
            if self._done.is_set():
                return self.result()
            self._wakers.append(wake)
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
        if not self._done.is_set():
            raise PeerTimeoutError(f"{self.what} did not complete in time")
        return self.result()
