"""aiosync's side of a ``vllm serve`` process: :class:`AiosyncApp`, an ASGI middleware.

Start the server with it, the ``aiosync`` weight-transfer backend and a key::

    AIOSYNC_SERVER_KEY_FILE=key VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --weight-transfer-config '{"backend": "aiosync"}' \\
        --middleware aiosync.engines.vllm_server_app.AiosyncApp

and attach it from the trainer's process as an explorer's model,
``await sync.attach_explorer("srv0", VLLMServer("http://host:8000", key_file="key"))``
(:mod:`aiosync.engines.vllm_server`). The middleware

* runs the explorer's **receiving syncer here**, in the server process (:class:`ServerEnd`):
  the trainer's patches and bootstrap buckets arrive as the bytes they were encoded in
  (``POST /aiosync/call``, :mod:`aiosync.engines.vllm_server_protocol`), are decoded and
  validated here while the engine keeps generating, and a staged write updates the engine
  through :class:`~aiosync.engines.vllm.VLLMTarget` over the server's own ``AsyncLLM`` (its
  host copy of the weights; each write one transaction: pause, load all or nothing, label,
  resume);
* **authenticates** every call, and every request to vLLM's routes that change the weights,
  their label or whether the engine runs (:data:`GUARDED`), before anything is decoded
  (:mod:`aiosync.engines.auth`; unsigned, wrong-key, other-run and replayed requests get
  ``401`` and change nothing);
* **stamps completions**: every ``/v1/completions`` and ``/v1/chat/completions`` answer carries
  ``x-aiosync-weight-versions`` (e.g. ``4`` or ``4,5``): the versions whose weights may have
  generated it — the one the engine held when the request arrived and every one written
  before the answer started (a write in progress then is waited for). For a streamed answer
  that is when its first chunk goes out; vLLM's own per-token spans are on
  ``/inference/v1/generate`` (``--enable-scale-out``). ``none`` stands for the weights the
  server was started with. ``x-aiosync-server`` names the server's run: a client that sees a
  new one knows the server restarted (its weights are the start-up ones). A request carrying
  ``x-aiosync-nonce`` gets the run and the versions signed over it (``x-aiosync-server-mac``,
  :func:`~aiosync.engines.auth.run_mac`), and so does ``GET /aiosync/hello``: the trainer's
  client believes only a run id signed with the key.

It needs one API server process (``--api-server-count 1``, the default with one engine) and
the server's lifespan (uvicorn's default): the receivers' conversations run in a task group
that lives as long as the server. Each API server process builds its own middleware, so with
several the run id, the replay counters and a conversation's staged update would live in one
process while the next request of the same update lands in another (vLLM hands connections to
the least loaded process): the middleware refuses to start then (:data:`SEVERAL_API_SERVERS`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ..aio import run_sync
from ..errors import ApplyError, AuthenticationError, PayloadError
from ..syncers.base import StagedWrite, WeightSyncer
from .auth import Verifier, load_key
from .vllm_server_protocol import (CALL, HELLO, OPS, STATE, VERSIONS_HEADER, ServerAnswer, ServerCall,
                                   error_fields, from_bytes, in_thread_if_large, to_bytes)

log = logging.getLogger("aiosync.engines")

#: vLLM's routes that change the weights, their label, or whether the engine runs: refused
#: unless signed with the key.
GUARDED = frozenset({
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/weight_checker", "/collective_rpc", "/pause", "/resume", "/abort_requests", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/scale_elastic_ep"})
#: Routes whose answers are stamped with the versions that generated them.
STAMPED = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Bound on one step of a receiver's work and on a stamp's wait for a write in progress (seconds).
STEP_TIMEOUT = 600.0
_NOTHING = object()
#: Why the middleware does not start under several API server processes.
SEVERAL_API_SERVERS = (
    "aiosync: this vllm serve runs {count} API server processes (--api-server-count {count}, or its default "
    "with --data-parallel-size > 1); aiosync's middleware keeps the server's run id, replay protection and "
    "staged updates in its process, and the requests of one update would land in different ones. Start it "
    "with --api-server-count 1 (for more HTTP throughput, run several servers and attach each as an explorer)")


def api_server_count(app: Any) -> int:
    """How many API server processes the ``vllm serve`` of ``app`` runs, this one among them
    (vLLM gives each its ``parallel_config._api_process_count``, in ``app.state.vllm_config``;
    a single-process entry point such as ``python -m vllm.entrypoints.openai.api_server`` runs
    one whatever ``--api-server-count`` says); 1 when it does not say."""
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    count = getattr(getattr(config, "parallel_config", None), "_api_process_count", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 1 else 1


class Conversation:
    """A receiver's coroutine (``stage_init``, ``stage``) driven across requests: it runs in
    the app's task group; :meth:`step` hands it the message it waits for and returns, once it
    waits again or has ended, what it sent meanwhile."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.out: list = []
        self.waiting = self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.scope = anyio.CancelScope()
        self._to_it, self._inbox = anyio.create_memory_object_stream(1)
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def run(self, work: Callable[..., Awaitable[Any]]) -> None:
        with self.scope:
            try:
                self.result = await work(self._recv, self._send)
            except Exception as exc:
                self.error = exc
        if not self.finished and self.result is None and self.error is None and self.scope.cancel_called:
            self.error = ApplyError("the conversation was abandoned (a newer one replaced it)")
        self.finished = True
        self._notify()

    async def _recv(self) -> Any:
        self.waiting = True
        self._notify()
        msg = await self._inbox.receive()
        return msg

    async def _send(self, msg: Any) -> None:
        self.out.append(msg)

    async def step(self, msg: Any = _NOTHING) -> tuple[list, str]:
        with anyio.fail_after(STEP_TIMEOUT):
            if msg is not _NOTHING:
                await self._settled()  # a conversation just started asks first
                if not self.waiting:
                    raise PayloadError("the receiver on the server ended before it took the message")
                self.waiting = False
                self._to_it.send_nowait(msg)
            await self._settled()
        out, self.out = self.out, []
        return out, ("failed" if self.error is not None else "done" if self.finished else "wants")

    async def _settled(self) -> None:
        while not (self.waiting or self.finished):
            await self._changed.wait()

    def cancel(self) -> None:
        self.scope.cancel()


class ServerEnd:
    """The receiving end in the server process: receivers made from the explorer's config,
    writing the engine through its host copy (:class:`~aiosync.engines.vllm.VLLMTarget` over
    ``engine``, made at the first handshake) or into ``target`` (any model a syncer writes).
    ``tg``: the task group the receivers' conversations run in."""

    def __init__(self, engine: Any, tg: Any, target: Any = None) -> None:
        self.engine, self.tg = engine, tg
        self.target: Any = target
        #: The version the engine holds (the last written), ``None``: the start-up weights.
        self.version: int | None = None
        self.receivers: OrderedDict[tuple, WeightSyncer] = OrderedDict()
        self.conv: Conversation | None = None
        self.staged: tuple[tuple, StagedWrite] | None = None
        self.lock = anyio.Lock()
        #: The version being written now, and every version written, in order.
        self.writing: int | None = None
        self.written: list[int | None] = []
        self._write_done = anyio.Event()
        self.stats = {"calls": 0, "bytes_received": 0, "bytes_sent": 0, "writes": 0, "failed": 0, "last_error": None}

    async def _target(self) -> Any:
        if self.target is None:  # reads the engine's checkpoint: off the event loop
            from .vllm import VLLMTarget

            self.target = await run_sync(VLLMTarget, self.engine)
        return self.target

    def _drop_conversation(self) -> None:
        if self.conv is not None and not self.conv.finished:
            self.conv.cancel()
        self.conv = None

    async def call(self, client: str, call: ServerCall) -> ServerAnswer:
        """Run one step (the module docstring of :mod:`aiosync.engines.vllm_server_protocol`)."""
        if call.op not in OPS:
            raise PayloadError(f"unknown call {call.op!r}; one of {OPS}")
        key = (client, call.receiver, call.conv)
        async with self.lock:
            self.stats["calls"] += 1
            try:
                return await getattr(self, "_" + call.op)(key, call)
            except Exception as exc:
                self.stats["failed"] += 1
                self.stats["last_error"] = f"{type(exc).__name__}: {exc}"
                return ServerAnswer("failed", version=self.version, **error_fields(exc))

    async def _start(self, key: tuple, work: Callable[..., Awaitable[Any]], first: Any) -> ServerAnswer:
        self._drop_conversation()
        conv = self.conv = Conversation(key)
        self.tg.start_soon(conv.run, work)
        return await self._step(conv, first)

    async def _step(self, conv: Conversation, msg: Any) -> ServerAnswer:
        out, state = await conv.step(msg)
        answer = ServerAnswer(state, out, self.version)
        if state == "failed":
            answer = ServerAnswer(state, out, self.version, **error_fields(conv.error))
        elif state == "done" and isinstance(conv.result, StagedWrite):
            staged = conv.result
            self.staged = (conv.key, staged)
            answer.staged, answer.nbytes, answer.changed, answer.stage_s = (staged.version, staged.nbytes,
                                                                             staged.changed, staged.stage_s)
        if conv.finished:
            self.conv = None
        return answer

    async def _init(self, key: tuple, call: ServerCall) -> ServerAnswer:
        config = call.config if isinstance(call.config, dict) else {}
        if config.get("type") not in ("patch", "bucket"):
            raise PayloadError(f"a server receives with the patch or bucket syncer, not {config.get('type')!r}")
        receiver = WeightSyncer.create(config)
        target = await self._target()
        rid = key[:2]
        self.receivers[rid] = receiver
        self.receivers.move_to_end(rid)
        while len(self.receivers) > 4:  # an explorer keeps at most its current and its next receiver
            self.receivers.popitem(last=False)
        return await self._start(key, lambda recv, send: receiver.stage_init(target, recv, send), _NOTHING)

    async def _feed(self, key: tuple, call: ServerCall) -> ServerAnswer:
        conv = self.conv
        if conv is None or conv.key != key:
            raise PayloadError("this server has no such conversation (a newer one replaced it, or the server "
                               "restarted)")
        return await self._step(conv, call.payload)

    async def _stage(self, key: tuple, call: ServerCall) -> ServerAnswer:
        receiver = self.receivers.get(key[:2])
        if receiver is None:
            raise PayloadError("this server has no receiver of that explorer's (it restarted, or a newer handshake "
                               "replaced it): the next sync bootstraps it")
        target = await self._target()
        self.staged = None
        return await self._start(key, lambda recv, send: receiver.stage(target, recv),
                                 _NOTHING if call.payload is None else call.payload)

    async def _write(self, key: tuple, call: ServerCall) -> ServerAnswer:
        if self.staged is None or self.staged[0] != key:
            raise PayloadError("this server holds no staged write of that sync (a newer one replaced it, or the "
                               "server restarted); nothing was written")
        staged = self.staged[1]
        self.staged = None
        self.writing = staged.version
        try:
            version = await staged.write(self.target, rollback=bool(call.rollback))
        finally:
            if self.writing is not None:
                self.writing = None
                self._write_done.set()
                self._write_done = anyio.Event()
        self.version = version
        self.written.append(version)
        self.stats["writes"] += 1
        return ServerAnswer("done", [], self.version, staged=version)

    async def _abort(self, key: tuple, call: ServerCall) -> ServerAnswer:
        if self.conv is not None and self.conv.key == key:
            self._drop_conversation()
        if self.staged is not None and self.staged[0] == key:
            self.staged = None
        return ServerAnswer("done", [], self.version)

    async def versions_since(self, version: int | None, count: int) -> list[int | None]:
        """The versions that may have generated an answer that began when the engine held
        ``version`` after ``count`` writes: that one and every one written since; a write in
        progress is waited for (bounded)."""
        with anyio.move_on_after(STEP_TIMEOUT):
            while self.writing is not None:
                await self._write_done.wait()
        return list(dict.fromkeys([version, *self.written[count:]]))

    def state(self) -> dict:
        target = self.target
        pause = {} if not hasattr(target, "statistics") else {k: getattr(target.statistics(), k) for k in (
            "writes", "refused", "bytes_sent", "last_pause_s", "max_pause_s", "mean_pause_s", "broken")}
        return {"version": self.version, "writing": self.writing, **self.stats, "engine": pause}


async def _read_body(receive: Callable[[], Awaitable[dict]]) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise PayloadError("the client went away before its request arrived whole")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay_body(body: bytes, receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Callable[[dict], Awaitable[None]], status: int, body: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: dict) -> dict[str, str]:
    """A request's headers, names in lower case."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class AiosyncApp:
    """The ASGI middleware (``vllm serve --middleware aiosync.engines.vllm_server_app.AiosyncApp``):
    see the module docstring. The key comes from ``AIOSYNC_SERVER_KEY_FILE`` (or
    ``AIOSYNC_SERVER_KEY``; ``key=`` when the middleware is built by hand); without one every
    signed route is refused."""

    def __init__(self, app: Any, *, key: str | bytes | None = None) -> None:
        self.app = app
        self.verifier = Verifier(load_key(key))
        if self.verifier.key is None:
            log.warning("aiosync: no AIOSYNC_SERVER_KEY_FILE: this server will accept no weights from aiosync")
        self.end: ServerEnd | None = None
        self._tg: Any = None
        self.started = time.time()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            count = api_server_count(scope.get("app"))
            if count > 1:  # refused before the server takes a request
                message = SEVERAL_API_SERVERS.format(count=count)
                log.error("%s", message)
                if (await receive())["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.failed", "message": message})
                return
            async with anyio.create_task_group() as tg:  # the receivers' conversations live as long as the server
                self._tg = tg
                try:
                    await self.app(scope, receive, send)
                finally:
                    self._tg = None
                    tg.cancel_scope.cancel()
            return
        path = scope.get("path", "")
        if kind != "http":
            await self.app(scope, receive, send)
        elif path.startswith("/aiosync/"):
            await self._aiosync(scope, receive, send, path)
        elif path in GUARDED:
            await self._guarded(scope, receive, send, path)
        elif path in STAMPED:
            await self._stamped(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _end(self, scope: dict) -> ServerEnd:
        if self.end is None:
            if self._tg is None:
                raise ApplyError("aiosync needs the server's lifespan (uvicorn's default; do not pass --lifespan off)")
            self.end = ServerEnd(scope["app"].state.engine_client, self._tg)
        return self.end

    async def _authenticate(self, scope: dict, send: Any, path: str, body: bytes) -> dict[str, str] | None:
        """The request's headers if it passes; otherwise answers 401 and returns ``None``."""
        headers = _headers(scope)
        method = scope["method"]
        try:  # the body is hashed (in a worker thread when large), then the counter checked here, in order
            expected = await in_thread_if_large(self.verifier.expected, body, method, path, headers, body)
            self.verifier.check(method, path, headers, expected)
        except AuthenticationError as exc:
            log.warning("aiosync: %s", exc)
            body = _json({"error": str(exc), "reason": exc.reason, "server": self.verifier.server})
            # a request signed with the key (another run's, or a replay) gets a signed refusal
            signed = self.verifier.sign_answer(headers, 401, body) if exc.reason in ("other_server", "replayed") else {}
            await _respond(send, 401, body, "application/json", signed)
            return None
        return headers

    async def _aiosync(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        method = scope["method"]
        if method == "GET" and path in (HELLO, STATE):
            info = {"server": self.verifier.server, "keyed": self.verifier.key is not None,
                    "refused": dict(self.verifier.refused)}
            signed = self.verifier.sign_run(_headers(scope)) if path == HELLO else {}
            await _respond(send, 200, _json(self._state() if path == STATE else info), "application/json", signed)
            return
        if method != "POST" or path != CALL:
            await _respond(send, 404, _json({"error": f"no aiosync route {method} {path}"}), "application/json")
            return
        try:
            body = await _read_body(receive)
        except PayloadError:
            return
        headers = await self._authenticate(scope, send, path, body)
        if headers is None:
            return
        try:
            end = self._end(scope)
            call = await from_bytes(body, "the trainer")
            if not isinstance(call, ServerCall):
                raise PayloadError(f"expected a ServerCall, got {type(call).__name__}")
            end.stats["bytes_received"] += len(body)
            answer = await end.call(headers["x-aiosync-client"], call)
        except Exception as exc:  # a malformed call: refused, nothing done
            answer = ServerAnswer("failed", version=None if self.end is None else self.end.version,
                                  **error_fields(exc))
        answer.server = self._state()
        data = await to_bytes(answer)
        if self.end is not None:
            self.end.stats["bytes_sent"] += len(data)
        signature = await in_thread_if_large(self.verifier.sign_answer, data, headers, 200, data)
        await _respond(send, 200, data, "application/octet-stream", signature)

    def _state(self) -> dict:
        """What ``GET /aiosync/state`` answers: the run, what it holds, its counters."""
        info = {"server": self.verifier.server, "keyed": self.verifier.key is not None,
                "refused": dict(self.verifier.refused), "started": self.started}
        info.update(self.end.state() if self.end is not None else {"version": None})
        return info

    async def _guarded(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        try:
            body = await _read_body(receive)
        except PayloadError:
            return
        if await self._authenticate(scope, send, path, body) is not None:
            await self.app(scope, _replay_body(body, receive), send)

    async def _stamped(self, scope: dict, receive: Any, send: Any) -> None:
        end = self.end
        version, count = (None, 0) if end is None else (end.version, len(end.written))

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                versions = [version] if self.end is None else await self.end.versions_since(version, count)
                value = ",".join("none" if v is None else str(v) for v in versions)
                run = self.verifier.sign_run(_headers(scope), value)
                message = {**message, "headers": [*message.get("headers", []), (VERSIONS_HEADER.encode(), value.encode()),
                                                  *((k.encode(), v.encode()) for k, v in run.items())]}
            await send(message)

        await self.app(scope, receive, stamped)
