"""How :class:`~aiosync.engines.vllm.VLLMTarget` talks to each kind of vLLM engine.

One class per kind, with the same methods: :class:`OfflineCalls` (the offline ``LLM``, in this
process, stepped on a thread of its own so that writes land between two steps) and
:class:`AsyncCalls` (an ``AsyncLLM``, its engine core in another process). Each gives

* generation (``generate``) and the pause a write needs (``paused()``, per ``pause_mode``);
* vLLM's weight-transfer calls (``init``, ``start``, ``update``, ``finish``, ``relabel``), each
  returning a future of the engine's answer, and :meth:`EngineCalls.answer`, which waits for one
  with the timeout and, past it, raises :class:`Late` *without abandoning it*: the call still
  runs in the engine, and a caller can close the update behind it (the engine answers calls
  in order) or keep waiting for it;
* aiosync's own calls into the engine's workers (``rpc(name, *args)``, by name: probe, stage,
  commit, read, digest; :mod:`aiosync.engines.vllm_worker`) — the offline ``LLM`` sends the
  function itself, the ``AsyncLLM`` a string-named worker method (vLLM's RPC carries no
  callables), and both answer the same values or raise the same aiosync errors.

The update transaction that drives these calls is written once, in
:meth:`VLLMTarget._send <aiosync.engines.vllm.VLLMTarget>`; another way to reach an engine
(``vllm serve`` over HTTP) is one more class with these methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

from ..aio import run_sync, worker_token
from ..errors import ApplyError, ConfigError, PeerTimeoutError


class Late(Exception):
    """An engine call that did not answer within its bound; ``pending`` is still running."""

    def __init__(self, what: str, seconds: float, pending: asyncio.Future) -> None:
        super().__init__(f"the vLLM engine did not answer {what} within {seconds:g}s")
        self.what, self.seconds, self.pending = what, seconds, pending

    def drop(self) -> None:
        """Stop waiting for the call (it goes on in the engine): its answer, if it came, is read
        (so that no error goes unretrieved), or the wait for it is cancelled."""
        if not self.pending.done():
            self.pending.cancel()
        elif not self.pending.cancelled():
            self.pending.exception()


class ResumeFailed(Exception):
    """Generation could not be resumed after a write (the engine may stay paused)."""


def per_prompt(prompts: list[Any], params: Any) -> list[Any]:
    """One ``SamplingParams`` per prompt (cloned), asking for the final output only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    given = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(given) != len(prompts):
        raise ValueError(f"{len(given)} sampling params for {len(prompts)} prompts")
    out = []
    for sp in given:
        sp = (sp or SamplingParams()).clone()
        sp.output_kind = RequestOutputKind.FINAL_ONLY
        out.append(sp)
    return out


class EngineCalls:
    """What both kinds share: the bound on every call."""

    def __init__(self, engine: Any, pause_mode: str, clear_cache: bool, timeout: float) -> None:
        self.engine, self.pause_mode, self.clear_cache, self.timeout = engine, pause_mode, clear_cache, timeout
        self._ids = itertools.count()

    def dead(self) -> bool:
        return False

    async def answer(self, what: str, pending: asyncio.Future, patience: float = 1.0) -> Any:
        """The engine's answer to ``pending``; :class:`Late` past ``timeout * patience``."""
        if self.dead():
            pending.cancel()
            raise ApplyError("the vLLM engine is dead (its engine core exited); make a new engine and VLLMTarget")
        seconds = self.timeout * patience
        try:
            with anyio.fail_after(seconds):
                return await asyncio.shield(pending)
        except TimeoutError:
            raise Late(what, seconds, pending) from None

    async def payloads(self, buckets: list[dict]) -> list[dict]:
        """The ``update_info`` of each bucket, made before the pause."""
        raise NotImplementedError

    async def worker(self, name: str, *args: Any, beside: bool = False) -> list[Any]:
        """Every worker's answer to the aiosync call ``name`` (:data:`~aiosync.engines.vllm_worker.CALLS`),
        bounded by ``timeout`` (:class:`~aiosync.errors.PeerTimeoutError` past it). ``beside``:
        not on the engine's thread (a call that only reads the parameters, run while it steps)."""
        try:
            return await self.answer(name, self.rpc(name, *args, beside=beside))
        except Late as late:
            late.drop()
            raise PeerTimeoutError(str(late)) from None


class OfflineCalls(EngineCalls):
    """An offline ``vllm.LLM``: every engine call runs on one thread of its own, in order; a
    lock orders engine steps and writes (a write holds it: no step runs, requests in flight
    are frozen)."""

    kind = "llm"

    def __init__(self, engine: Any, pause_mode: str, clear_cache: bool, timeout: float) -> None:
        super().__init__(engine, pause_mode, clear_cache, timeout)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "aiosync-vllm")
        self.lock = anyio.Lock()
        self._done: dict[str, Any] = {}
        self._inflight: set[str] = set()
        self._draining = False
        self._changed = anyio.Event()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._beside is not None:
            self._beside.shutdown(wait=True)

    _beside: concurrent.futures.ThreadPoolExecutor | None = None

    def rpc(self, name: str, *args: Any, beside: bool = False) -> asyncio.Future:
        """The aiosync call ``name`` in every worker: the function itself, in this process."""
        run = functools.partial(self.rpc_now, name, *args)
        if not beside:
            return self.submit(run)
        if self._beside is None:
            self._beside = concurrent.futures.ThreadPoolExecutor(1, "aiosync-vllm-stage")
        return asyncio.wrap_future(self._beside.submit(run))

    def rpc_now(self, name: str, *args: Any) -> list[Any]:
        """:meth:`rpc`, answered here (the engine idle: while a target is built)."""
        from .vllm_worker import answer, call

        return answer(self.engine.collective_rpc(call, args=(name, *args)))

    def commit(self, label: str | None) -> asyncio.Future:
        """The in-place commit, on the engine's thread (under :meth:`paused`): write the staged
        transaction in every worker, label it, reset the prefix cache."""
        def commit() -> None:
            self.rpc_now("commit_write")
            if label is not None:
                self.engine.llm_engine.set_weight_version(label)
            if self.clear_cache:
                self.engine.reset_prefix_cache(reset_running_requests=True)

        return self.submit(commit)

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the engine's thread (one call at a time: a caller cancelled while its
        call runs cannot let another overlap it), bounded by ``timeout``."""
        try:
            return await self.answer(getattr(fn, "__name__", str(fn)), self.submit(fn, *args, **kwargs))
        except Late as late:
            late.drop()
            raise PeerTimeoutError(str(late)) from None

    def _rpc(self, method: str, **kwargs: Any) -> asyncio.Future:
        return self.submit(self.engine.collective_rpc, method, kwargs=kwargs or None)

    # -- weight updates --------------------------------------------------------------------

    async def payloads(self, buckets: list[dict]) -> list[dict]:
        return [{"bucket": b} for b in buckets]  # in-process: the tensors travel by reference

    def init(self, init_info: dict) -> asyncio.Future:
        return self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start(self) -> asyncio.Future:
        return self._rpc("start_weight_update")

    def update(self, update_info: dict) -> asyncio.Future:
        return self._rpc("update_weights", update_info=update_info)

    def finish(self, label: str | None, committed: bool) -> asyncio.Future:
        def finish() -> None:
            self.engine.collective_rpc("finish_weight_update")
            if committed and label is not None:
                self.engine.llm_engine.set_weight_version(label)
            if committed and self.clear_cache:  # cached prefixes were computed by the old weights
                self.engine.reset_prefix_cache(reset_running_requests=True)

        return self.submit(finish)

    def relabel(self, label: str) -> asyncio.Future:
        return self.submit(self.engine.llm_engine.set_weight_version, label)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        if self.pause_mode == "wait":
            self._draining = True  # no new requests start; those in flight finish on the old weights
        try:
            with anyio.fail_after(self.timeout):
                while self._draining and self._inflight:
                    await self._changed.wait()
            async with self.lock:  # from here no engine step runs: requests in flight are frozen
                yield
        finally:
            if self._draining:
                self._draining = False
                self._notify()

    # -- generation ------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        params = per_prompt(prompts, params)
        ids = [f"aiosync-{next(self._ids)}" for _ in prompts]
        with anyio.fail_after(self.timeout):
            while self._draining:  # a "wait" write lets the requests in flight finish first
                await self._changed.wait()
        async with self.lock:
            await self.call(self._add_requests, ids, prompts, params)
        self._inflight.update(ids)
        try:
            while not all(i in self._done for i in ids):
                async with self.lock:  # one step at a time; a write waiting for the lock goes next
                    if all(i in self._done for i in ids):
                        break  # another caller's step finished ours
                    outputs = await self.call(self.engine.llm_engine.step)
                for out in outputs:
                    if out.finished and out.request_id in self._inflight:
                        self._done[out.request_id] = out
                        self._inflight.discard(out.request_id)
                if not self._inflight:
                    self._notify()
            return [self._done.pop(i) for i in ids]
        except BaseException:
            pending = [i for i in ids if i not in self._done]
            with anyio.CancelScope(shield=True):
                if pending:
                    async with self.lock:
                        with contextlib.suppress(Exception):
                            await self.call(self.engine.llm_engine.abort_request, pending)
            for i in ids:
                self._done.pop(i, None)
                self._inflight.discard(i)
            self._notify()
            raise

    def _add_requests(self, ids: list[str], prompts: list[Any], params: list[Any]) -> None:
        engine = self.engine.llm_engine
        added = []
        try:
            for rid, prompt, sp in zip(ids, prompts, params):
                engine.add_request(rid, prompt, sp)
                added.append(rid)
        except BaseException:
            if added:
                engine.abort_request(added)
            raise


class AsyncCalls(EngineCalls):
    """An ``AsyncLLM`` (vLLM's V1 engine; its engine core runs in another process): writes
    pause it through ``pause_generation`` / ``resume_generation``; buckets travel as
    safetensors bytes (tensors nested in RPC arguments do not survive vLLM's decoding)."""

    kind = "async"

    def dead(self) -> bool:
        return bool(getattr(self.engine, "errored", False))

    def close(self) -> None:
        pass

    def _task(self, coro: Any) -> asyncio.Future:
        return asyncio.ensure_future(coro)

    def rpc(self, name: str, *args: Any, beside: bool = False) -> asyncio.Future:
        """The aiosync call ``name`` in every worker: the string-named worker method
        ``aiosync_call`` (the engine needs ``worker_extension_cls=WORKER_EXTENSION``), its
        arguments and answers as wire values. The engine core runs it between two steps."""
        from .vllm_worker import WORKER_EXTENSION, answer, to_wire

        async def run() -> list[Any]:
            try:
                replies = await self.engine.collective_rpc("aiosync_call", args=(name, *to_wire(list(args))))
            except Exception as exc:
                if "aiosync_call" in str(exc) and ("not implemented" in str(exc) or "no attribute" in str(exc)):
                    raise ConfigError(f"this AsyncLLM's workers cannot take aiosync's calls: start the engine "
                                      f"with worker_extension_cls={WORKER_EXTENSION!r} (vllm serve: "
                                      f"--worker-extension-cls {WORKER_EXTENSION})") from None
                raise
            return answer(replies, wire=True)

        return self._task(run())

    def rpc_now(self, name: str, *args: Any) -> list[Any]:
        """:meth:`rpc`, answered here: from a worker thread of the engine's event loop (a target
        is built there, e.g. ``await aiosync.run_sync(VLLMTarget, engine, inplace=True)``)."""
        async def run() -> list[Any]:
            return await self.worker(name, *args)

        try:
            return anyio.from_thread.run(run, token=worker_token())
        except RuntimeError as exc:
            if "worker thread" not in str(exc) and "event loop" not in str(exc):
                raise
            raise ConfigError("VLLMTarget(async_llm, inplace=...) calls the engine's workers while it is built: "
                              "build it in a worker thread of the engine's event loop, e.g. "
                              "`await aiosync.run_sync(VLLMTarget, engine, inplace=True)`") from None

    def commit(self, label: str | None) -> asyncio.Future:
        """The in-place commit (under :meth:`paused`, which also resets the prefix cache):
        write the staged transaction in every worker, then label it."""
        async def commit() -> None:
            await self.rpc("commit_write")
            if label is not None:
                await self.engine.update_weight_version(label)

        return self._task(commit())

    async def payloads(self, buckets: list[dict]) -> list[dict]:
        from safetensors.torch import save

        return [{"bucket_bytes": data} for data in await run_sync(lambda: [save(b) for b in buckets])]

    def init(self, init_info: dict) -> asyncio.Future:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        return self._task(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start(self) -> asyncio.Future:
        return self._task(self.engine.start_weight_update())

    def update(self, update_info: dict) -> asyncio.Future:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        return self._task(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish(self, label: str | None, committed: bool) -> asyncio.Future:
        return self._task(self.engine.finish_weight_update(weight_version=label if committed else None))

    def relabel(self, label: str) -> asyncio.Future:  # the weights did not change: either label is right
        return self._task(self.engine.update_weight_version(label))

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        engine = self.engine
        try:
            await self.answer("pause_generation", self._task(engine.pause_generation(
                mode=self.pause_mode, clear_cache=self.clear_cache)))
            yield
        finally:  # resumed only here: after the update committed, or was rolled back or aborted
            with anyio.CancelScope(shield=True):
                try:
                    await self.answer("resume_generation", self._task(engine.resume_generation()))
                except Exception as exc:
                    if isinstance(exc, Late):
                        exc.drop()
                    raise ResumeFailed(f"the vLLM engine did not resume generation: {exc}") from exc

    async def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        params = per_prompt(prompts, params)
        results: list[Any] = [None] * len(prompts)

        async def one(i: int) -> None:
            async for out in self.engine.generate(prompts[i], params[i], request_id=f"aiosync-{next(self._ids)}"):
                results[i] = out

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return results


def make_calls(engine: Any, pause_mode: str, clear_cache: bool, timeout: float) -> EngineCalls:
    """The calls for ``engine``: :class:`OfflineCalls` for a ``vllm.LLM``, :class:`AsyncCalls`
    for an ``AsyncLLM``."""
    from .vllm_common import _engine_kind

    cls = OfflineCalls if _engine_kind(engine) == "llm" else AsyncCalls
    return cls(engine, pause_mode, clear_cache, timeout)
