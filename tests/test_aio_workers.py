"""aiosync's worker threads (aiosync.aio.run_sync): below the event loop's priority, back to the
loop from inside, not abandoned on cancellation, and the AIOSYNC_WORKER_NICE setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import anyio
import pytest

from aiosync import aio

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
def test_bulk_work_runs_below_the_event_loop_thread():
    async def main():
        loop_nice = _nice()
        worker_nice, name = await aio.run_sync(lambda: (_nice(), threading.current_thread().name))
        return loop_nice, worker_nice, name

    loop_nice, worker_nice, name = anyio.run(main)
    assert aio.WORKER_NICE == 10  # the default (the test environment sets none)
    assert worker_nice == min(19, loop_nice + aio.WORKER_NICE)
    assert name.startswith("aiosync-worker")
    assert _nice() == loop_nice  # the caller's thread keeps its priority


@linux
def test_the_encoders_threads_run_below_the_event_loop_thread_too():
    from aiosync.syncers.patch.format import _codec_pool

    assert _codec_pool().submit(_nice).result(timeout=30) > _nice()


def test_a_worker_gets_back_to_its_event_loop():
    async def on_loop(x: int) -> tuple[int, int]:
        return x + 1, threading.get_ident()

    async def main():
        def work() -> tuple[int, int]:
            return anyio.from_thread.run(on_loop, 41, token=aio.worker_token())

        value, ident = await aio.run_sync(work)
        return value, ident == threading.get_ident(), aio.worker_token()

    assert anyio.run(main) == (42, True, None)  # ran on the loop's thread; no token outside a worker


def test_a_cancelled_caller_still_waits_for_its_thread():
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []

    def work() -> str:
        entered.set()
        release.wait(30)
        events.append("work done")
        return "value"

    async def main():
        scope = anyio.CancelScope()

        async def caller():
            with scope:
                await aio.run_sync(work)
                events.append("caller resumed")  # the result is returned...
                await anyio.sleep(0)  # ...and the next checkpoint raises the cancellation
                events.append("not cancelled")
            events.append("scope left")

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(entered.wait, 30)
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            events.append("cancelled")
            release.set()

    anyio.run(main)
    # The caller's scope was left only after the thread finished.
    assert events == ["cancelled", "work done", "caller resumed", "scope left"]


def _in_fresh_process(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@linux
def test_worker_nice_zero_runs_them_at_the_process_priority():
    code = ("import anyio, json, os, threading; from aiosync import aio\n"
            "nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
            "async def main():\n"
            "    return await aio.run_sync(lambda: (nice(), threading.current_thread().name))\n"
            "print(json.dumps([*anyio.run(main), nice()]))")
    done = _in_fresh_process({"AIOSYNC_WORKER_NICE": "0"}, code)
    assert done.returncode == 0, done.stderr
    worker, name, main = json.loads(done.stdout)
    assert worker == main and not name.startswith("aiosync-worker")  # anyio's own threads


@pytest.mark.parametrize("value", ["ten", "25", "-1"])
def test_a_bad_worker_nice_is_refused_by_name(value):
    done = _in_fresh_process({"AIOSYNC_WORKER_NICE": value}, "import aiosync.aio")
    assert done.returncode != 0
    assert "AIOSYNC_WORKER_NICE" in done.stderr and repr(value) in done.stderr
