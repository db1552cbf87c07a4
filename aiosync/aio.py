"""Small asyncio helpers: awaitable CUDA events (S11), off-loop execution (S13), and the CUDA
context (device and streams) that work carried into a worker thread runs under.

Off-loop work runs on aiosync's own worker threads (:func:`run_sync`), at a lower scheduling
priority than the rest of the process (``nice`` + :data:`WORKER_NICE`, Linux): on a host with
few cores the bulk work of a sync (hashing, copies, file writes, frees) keeps every core busy,
and the event loop's thread, woken by a timer or a socket, would otherwise wait for a time
slice behind it. Set ``AIOSYNC_WORKER_NICE=0`` to run them at the process's own priority.

CUDA's current device and current stream are per thread: a worker thread starts on device 0
and its default stream, whatever the caller had. :func:`run_sync` therefore captures the
caller's current device and each device's current stream (:class:`CudaContext`) and runs the
work under them, so a rank on ``cuda:k`` stays on ``cuda:k`` and a trainer or engine on a side
stream is read and written in its own stream order. :func:`resolve_device` turns a bare
``"cuda"`` into the caller's device on the caller's side; :func:`finish_cuda_work` waits, in the
worker, until the GPU work queued for a set of tensors is done (before a version commits).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .errors import ConfigError, PeerTimeoutError

T = TypeVar("T")


class EventLike(Protocol):
    """Anything with ``query() -> bool`` and ``synchronize()``: ``torch.cuda.Event``,
    ``torch.cuda.Stream``, or a test double."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


async def wait_event(event: EventLike, *, timeout: float | None = None,
                     min_poll: float = 50e-6, max_poll: float = 2e-3) -> None:
    """Wait until ``event.query()`` is true without blocking the event loop.

    Polls with exponential back-off from ``min_poll`` to ``max_poll`` seconds, so a short
    copy completes with microseconds of latency and a long one costs few wake-ups. Raises
    :class:`aiosync.errors.PeerTimeoutError` after ``timeout`` seconds.
    """
    if event.query():
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = min_poll
    while not event.query():
        if deadline is not None and time.monotonic() >= deadline:
            raise PeerTimeoutError(f"event did not complete within {timeout}s")
        await anyio.sleep(delay)
        delay = min(delay * 2, max_poll)


class AwaitableEvent:
    """Wrap an event so that ``await AwaitableEvent(ev)`` waits for it (S11)."""

    __slots__ = ("event", "timeout")

    def __init__(self, event: EventLike, timeout: float | None = None) -> None:
        self.event = event
        self.timeout = timeout

    def __await__(self):
        return wait_event(self.event, timeout=self.timeout).__await__()

    def done(self) -> bool:
        return bool(self.event.query())


def _cuda():
    """``torch.cuda`` once CUDA is initialised in this process, else ``None`` (never initialises
    it, never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


@dataclass(frozen=True)
class CudaContext:
    """A thread's CUDA state: its current device and the current stream of every device.

    :meth:`capture` on the caller's thread, :meth:`enter` in the worker. Empty (and free) when
    CUDA was never initialised in this process."""

    device: int | None = None
    streams: tuple = ()

    @classmethod
    def capture(cls) -> "CudaContext":
        cuda = _cuda()
        if cuda is None:
            return _NO_CUDA
        device = cuda.current_device()
        streams = [cuda.current_stream(device)]
        for i in range(cuda.device_count()):  # other devices only where a side stream is current
            if i != device and cuda.current_stream(i).stream_id != 0:  # (entering a device opens its context)
                streams.append(cuda.current_stream(i))
        return cls(device, tuple(streams))

    @contextlib.contextmanager
    def enter(self):
        if self.device is None:
            yield
            return
        cuda = sys.modules["torch"].cuda
        with contextlib.ExitStack() as stack:
            stack.enter_context(cuda.device(self.device))
            for stream in self.streams:
                stack.enter_context(cuda.stream(stream))
            yield


_NO_CUDA = CudaContext()


def bind_cuda(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` bound to the calling thread's :class:`CudaContext`: wherever it is called (a pool's
    worker thread), it runs on the caller's device and streams."""
    ctx = CudaContext.capture()
    if ctx.device is None:
        return fn

    @functools.wraps(fn)
    def bound(*args: Any, **kwargs: Any) -> T:
        with ctx.enter():
            return fn(*args, **kwargs)

    return bound


def resolve_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` with an index: a bare ``"cuda"`` becomes the *caller's*
    current CUDA device (call this on the caller's side: in a worker thread it would be device 0).
    ``None`` stays ``None``."""
    if device is None:
        return None
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def finish_cuda_work(tensors: Iterable[Any]) -> None:
    """Block (a worker thread) until the GPU work queued so far on the current stream of every
    CUDA device holding one of ``tensors`` has completed: an event recorded after the writes,
    then waited for. A version is committed only after this, so no reader — on any stream, or
    the host — can see it before its writes landed."""
    cuda = _cuda()
    if cuda is None:
        return
    devices = _cuda_devices(tensors)
    events = []
    for device in devices:
        event = cuda.Event()
        event.record(cuda.current_stream(device))
        events.append(event)
    for event in events:
        event.synchronize()


def _cuda_devices(tensors: Iterable[Any]) -> set:
    return {t.device for t in tensors if getattr(t, "is_cuda", False)}


def _worker_nice() -> int:
    raw = os.environ.get("AIOSYNC_WORKER_NICE", "10")
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ConfigError(f"AIOSYNC_WORKER_NICE must be an integer from 0 (aiosync's worker threads at the process's "
                          f"own priority) to 19 (the lowest), got {raw!r}; unset it for the default, 10")
    return nice


#: How much lower than the process's main thread aiosync's worker threads run (a ``nice``
#: increment; ``AIOSYNC_WORKER_NICE``, default 10, 0 = the same priority). Lowering a thread's
#: priority needs no privilege; raising it back would, so only aiosync's own threads get it.
WORKER_NICE = _worker_nice()
#: aiosync's worker threads, at most (as many as anyio's default thread limiter allows).
MAX_WORKERS = 40

_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def lower_priority() -> None:
    """Lower the calling thread's scheduling priority to the main thread's + :data:`WORKER_NICE`
    (call it at the start of a thread of aiosync's own; never on the event loop's thread). A
    no-op where threads have no priority of their own (not Linux) or it is already that low."""
    if not WORKER_NICE or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + WORKER_NICE)
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)
    except OSError:  # pragma: no cover - a sandbox that forbids it: run at the same priority
        pass


def _workers() -> ThreadPoolExecutor | None:
    global _pool
    if not WORKER_NICE:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="aiosync-worker", initializer=lower_priority)
        return _pool


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another backend (trio): anyio's threads
        return False
    return True


def worker_token() -> Any:
    """The event-loop token of the :func:`run_sync` call the calling thread is running, else
    ``None``: ``anyio.from_thread.run(fn, token=worker_token())`` gets back to that loop from
    an aiosync worker thread (an anyio worker thread needs no token)."""
    return getattr(_local, "token", None)


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in one of aiosync's worker threads and await its result.

    Heavy tensor work goes through here so that it never runs on the event-loop thread, and
    at a lower priority than that thread (:data:`WORKER_NICE`). The call is not abandoned on
    cancellation: a cancelled caller still waits for the thread, so state it mutates is never
    left half-written behind the caller's back. The work runs under the caller's CUDA device
    and current streams (:class:`CudaContext`).
    """
    work = bind_cuda(functools.partial(fn, *args, **kwargs))
    pool = _workers()
    if pool is None or not _on_asyncio():
        return await anyio.to_thread.run_sync(work)
    token = anyio.lowlevel.current_token()
    # The worker lets go of the call and its result before the caller wakes: the pool's work
    # item (and its future) live on in the worker thread for a moment after the call, and a
    # large argument or result whose last reference went there would be freed there, GIL held,
    # racing the caller's own release of it (aiosync.reclaim).
    calls, results = [work], []
    del work

    def run() -> None:
        _local.token = token
        try:
            results.append(calls.pop()())
        finally:
            _local.token = None

    future = asyncio.wrap_future(pool.submit(run))
    with anyio.CancelScope(shield=True):
        await future
    return results.pop()


@contextlib.asynccontextmanager
async def hold_all(locks: Iterable[Any]) -> AsyncIterator[None]:
    """Hold every lock of ``locks``, taken in the order given and released in reverse: callers
    that take the same locks always in the same order never wait on one another."""
    async with contextlib.AsyncExitStack() as stack:
        for lock in locks:
            await stack.enter_async_context(lock)
        yield


async def leave_task_group(tg: Any, exc: BaseException) -> None:
    """Leave a task group entered by hand (``await tg.__aenter__()``) after ``exc`` ended the code
    inside it — its ``__aenter__`` caller is failing: a cancellation is handed to the group (so
    its cancel scope unwinds together with the caller's), any other exception stays the
    caller's to raise (the group's children are cancelled and waited for either way)."""
    tg.cancel_scope.cancel()
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        await tg.__aexit__(type(exc), exc, exc.__traceback__)
    else:
        await tg.__aexit__(None, None, None)

