"""Small asyncio helpers: awaitable CUDA events (S11) and off-loop execution (S13)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Callable, Protocol, TypeVar

import anyio
import anyio.to_thread

from .errors import PeerTimeoutError

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


async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a worker thread and await its result.

    Heavy tensor work goes through here so that it never runs on the event-loop thread.
    The call is not abandoned on cancellation: a cancelled caller still waits for the
    thread, so state it mutates is never left half-written behind the caller's back.
    """
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@contextlib.asynccontextmanager
async def hold_all(locks: Iterable[Any]) -> AsyncIterator[None]:
    """Hold every lock of ``locks``, taken in the order given and released in reverse: callers
    that take the same locks always in the same order never wait on one another."""
    async with contextlib.AsyncExitStack() as stack:
        for lock in locks:
            await stack.enter_async_context(lock)
        yield
