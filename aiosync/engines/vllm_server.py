"""A running ``vllm serve`` as an explorer's model: :class:`VLLMServer`.

The server runs vLLM's OpenAI-compatible API with aiosync's backend and middleware
(:mod:`aiosync.engines.vllm_server_app`); the trainer's process attaches it like any model::

    server = VLLMServer("http://host:8000", key_file="key")
    explorer = await sync.attach_explorer("srv0", server)      # bootstrap: the first, blocking sync
    answer, versions = await server.completions({"prompt": [16, 3], "max_tokens": 8, "logprobs": 1})

Patch and bucket sync, every method and style, ``sync_weight_no_wait``, coalescing and repair
work as for any explorer: the explorer's ``Applier`` drives a :class:`ForwardingReceiver` in
place of the receiving syncer (the model is a :class:`~aiosync.syncers.base.ReceiverHost`),
which hands every step — the handshake, each payload, the write — to the server as one signed
request, the payloads still encoded. So what crosses the network per version is the patch;
the server decodes it against its own copy of the weights and updates the engine in one
transaction. Several servers take the same encoded patch (a fan-out shares it).

A server that restarted comes back holding the weights it was started from, under a new run
id. The client notices at its next contact — a signed call refused as meant for the old run,
a completion whose answer names the new run (``x-aiosync-server``), ``hello()``, or, after the
server could not be reached, the check it makes before its next request; each only signed with
the key over a nonce of this client's (a forged run id is ignored) — and tells the
explorer (:class:`~aiosync.syncers.base.LosesWeights`): from then on the explorer reports no
version, its leases wait, and it asks for a bootstrap, which the synchronizer delivers at
once. Every request is bounded by ``timeout``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ..errors import ApplyError, AuthenticationError, ConfigError, PeerTimeoutError, TransportError
from ..syncers.base import StagedWrite, WeightSyncer
from .auth import SERVER, Signer, load_key
from .vllm_server_protocol import (CALL, HELLO, STATE, VERSIONS_HEADER, ServerAnswer, ServerCall,
                                   from_bytes, in_thread_if_large, rebuild_error, syncer_config, to_bytes)


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of a :class:`VLLMServer`'s counters: the server's URL and run id
    (``server``), the version the server last said it holds (``None``: none given, or it
    restarted), requests made, bytes sent to and received from the server (aiosync's calls
    only), restarts noticed, calls the server refused, the last error this client saw (a
    refused or failed call, an unreachable server), and ``state``: the server's own counters
    as it last reported them with a signed answer or ``GET /aiosync/state`` (its version,
    writes, the bytes it received, its last error, the engine's pauses, ...)."""

    url: str
    server: str | None
    version: int | None
    calls: int
    bytes_sent: int
    bytes_received: int
    restarts: int
    refused: int
    last_error: str | None = None
    state: dict | None = None


def parse_versions(value: str | None) -> tuple[int | None, ...]:
    """The versions of an ``x-aiosync-weight-versions`` header (``none``: the start-up weights)."""
    if not value:
        return ()
    return tuple(None if v == "none" else int(v) for v in value.split(","))


class VLLMServer:
    """A ``vllm serve`` process as an explorer's model (see the module docstring).

    ``url``: the server's base URL. ``key`` / ``key_file``: the key the server was started with
    (default: the environment's ``AIOSYNC_SERVER_KEY_FILE`` or ``AIOSYNC_SERVER_KEY``; required).
    ``timeout``: bound on every request (a write pauses the engine: allow for it).
    ``connect_timeout``: bound on connecting. ``client``: an ``httpx.AsyncClient`` of your own
    (TLS settings, proxies, event hooks); the server is then reached through it and it stays
    yours to close.
    """

    def __init__(self, url: str, *, key: str | bytes | None = None, key_file: str | None = None,
                 timeout: float = 300.0, connect_timeout: float = 10.0, client: Any = None) -> None:
        key = load_key(key, key_file)
        if key is None:
            raise ConfigError("VLLMServer needs the server's key: key=, key_file=, or AIOSYNC_SERVER_KEY_FILE")
        if not (timeout > 0 and connect_timeout > 0):
            raise ConfigError("VLLMServer: timeout and connect_timeout must be positive")
        self.url = url.rstrip("/")
        self.signer = Signer(key)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._client, self._own_client = client, client is None
        #: The server run this client signs for (``GET /aiosync/hello``), and what it last held.
        self.server: str | None = None
        self.version: int | None = None
        self._stats = {"calls": 0, "bytes_sent": 0, "bytes_received": 0, "restarts": 0, "refused": 0}
        self._lock = anyio.Lock()  # signed calls go one at a time, in counter order
        self._receivers = itertools.count()
        #: Told when the server restarted (its weights are lost): the explorer holding this model.
        self._on_lost: Any = None
        #: The server could not be reached: ask which run it is before the next request.
        self._recheck = False
        self._last_error: str | None = None
        self._state: dict | None = None  # the server's counters, as it last reported them

    def __repr__(self) -> str:
        return f"VLLMServer({self.url!r}, version={self.version})"

    def statistics(self) -> ServerStatistics:
        """A snapshot of this client's counters and the server's last reported state (cheap:
        no request; ``await state()`` asks the server now)."""
        return ServerStatistics(self.url, self.server, self.version, **self._stats, last_error=self._last_error,
                                state=None if self._state is None else dict(self._state))

    # -- the explorer's side (ReceiverHost) ------------------------------------------------

    def host_receiver(self, syncer: WeightSyncer) -> WeightSyncer:
        """The syncer the explorer drives for this server: ``syncer``'s twin, running there."""
        return ForwardingReceiver(self, syncer, next(self._receivers))

    def on_weights_lost(self, callback: Any) -> None:
        """``callback(reason)`` when this client notices that the server restarted (it holds
        its start-up weights now); the explorer that holds this model registers itself
        (:class:`~aiosync.syncers.base.LosesWeights`; the latest registered is told)."""
        self._on_lost = callback

    def _restarted(self, server: str | None, how: str) -> None:
        """The server is a new run (``server``; ``None``: unknown yet): what it held is lost."""
        self._stats["restarts"] += 1
        held, self.server, self.version, self._state = self.version, server, None, None
        if self._on_lost is not None:
            self._on_lost(f"the vLLM server at {self.url} restarted ({how}): it holds the weights it was started "
                          f"from, not version {held}")

    # -- HTTP --------------------------------------------------------------------------------

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))
        return self._client

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return await self._send(method, path, **kwargs)
        except (PeerTimeoutError, TransportError) as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            raise

    async def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            with anyio.fail_after(self.timeout + self.connect_timeout):
                return await self._http().request(method, self.url + path, **kwargs)
        except TimeoutError:
            raise PeerTimeoutError(f"the vLLM server at {self.url} did not answer {method} {path} within "
                                   f"{self.timeout}s") from None
        except httpx.TimeoutException as exc:
            raise PeerTimeoutError(f"the vLLM server at {self.url} did not answer {method} {path} in time: "
                                   f"{type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            self._recheck = self.server is not None  # it may come back as a new run: ask before the next request
            raise TransportError(f"cannot reach the vLLM server at {self.url} ({method} {path}): "
                                 f"{type(exc).__name__}: {exc}") from None

    async def hello(self) -> dict:
        """Ask the server which run it is (a restart makes a new one); returns its answer. The
        run id must come signed with the key over this request's nonce
        (:class:`~aiosync.errors.AuthenticationError` otherwise: nothing is believed)."""
        asked = self.signer.nonce()
        response = await self._request("GET", HELLO, headers=asked)
        if response.status_code == 404:
            raise ConfigError(f"{self.url} has no aiosync routes: start vllm serve with --middleware "
                              "aiosync.engines.vllm_server_app.AiosyncApp (and the aiosync weight-transfer backend)")
        info = self._json(response, HELLO)
        if self.signer.signed_run(asked, response.headers) != info.get("server"):
            self._stats["refused"] += 1
            raise AuthenticationError(f"the vLLM server at {self.url} did not sign its run id with this key (a server "
                                      "started with another key or none, or an answer altered on the way): ignored",
                                      reason="bad_signature")
        self._recheck = False
        if self.server is not None and info["server"] != self.server:
            self._restarted(info["server"], "GET /aiosync/hello names a new run")
        self.server = info["server"]
        return info

    async def state(self) -> dict:
        """What the server holds and did (``GET /aiosync/state``; not authenticated: informative);
        also kept for :meth:`statistics` unless it names another run than this client's."""
        state = self._json(await self._request("GET", STATE), STATE)
        if self.server is None or state.get("server") == self.server:
            self._state = state
        return state

    def _json(self, response: Any, path: str) -> dict:
        if response.status_code != 200:
            raise TransportError(f"the vLLM server at {self.url} answered {path} with {response.status_code}: "
                                 f"{response.text[:300]}")
        return response.json()

    async def call(self, call: ServerCall, size_hint: int = 0) -> ServerAnswer:
        """One signed step of the receiver's work on the server; its answer, checked."""
        try:
            answer = await self._call(call, size_hint)
        except Exception as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            raise
        if answer.state == "failed":
            self._last_error = f"{answer.error_type}: {answer.error}"
        return answer

    async def _call(self, call: ServerCall, size_hint: int) -> ServerAnswer:
        async with self._lock:
            if self.server is None or self._recheck:
                await self.hello()
            body = await to_bytes(call, size_hint)
            headers = await in_thread_if_large(self.signer.sign, body, "POST", CALL, self.server, body)
            self._stats["calls"] += 1
            self._stats["bytes_sent"] += len(body)
            response = await self._request("POST", CALL, content=body,
                                           headers={**headers, "content-type": "application/octet-stream"})
            data = response.content
            self._stats["bytes_received"] += len(data)
            if response.status_code == 401:
                await self._refused(response, headers)
            if response.status_code != 200:
                raise TransportError(f"the vLLM server at {self.url} answered {CALL} with {response.status_code}: "
                                     f"{response.text[:300]}")
            await in_thread_if_large(self.signer.check_answer, data, headers, 200, data, response.headers)
        answer = await from_bytes(data, f"the vLLM server at {self.url}")
        if not isinstance(answer, ServerAnswer):
            raise ApplyError(f"the vLLM server at {self.url} answered with a {type(answer).__name__}")
        self.version = answer.version
        if isinstance(answer.server, dict):
            self._state = answer.server
        return answer

    async def _refused(self, response: Any, request: Mapping[str, str]) -> None:
        try:
            info = response.json()
        except ValueError:
            info = {}
        self._stats["refused"] += 1
        if info.get("reason") == "other_server":  # the server restarted since we last asked, if it says so signed
            self.signer.check_answer(request, 401, response.content, response.headers)
            self._restarted(info.get("server"), "it refused a call signed for its earlier run")
            raise ApplyError(f"the vLLM server at {self.url} restarted: it holds the weights it was started from "
                             "(the next sync bootstraps it)")
        raise AuthenticationError(f"the vLLM server at {self.url} refused the update: {info.get('error', response.text)}",
                                  reason=info.get("reason", "unknown"))

    # -- generation ----------------------------------------------------------------------

    async def completions(self, body: Mapping[str, Any], path: str = "/v1/completions"
                          ) -> tuple[dict, tuple[int | None, ...]]:
        """POST an OpenAI completion request (``body`` without ``model`` gets the server's);
        returns its JSON answer and the versions whose weights generated it (oldest first;
        ``None``: the weights the server was started with). An answer from a new run of the
        server (it restarted) tells the explorer first (:meth:`on_weights_lost`)."""
        body = dict(body)
        if "model" not in body:
            body["model"] = await self._model()
        if self._recheck:
            await self.hello()
        asked = self.signer.nonce()
        response = await self._request("POST", path, json=body, headers=asked)
        versions = response.headers.get(VERSIONS_HEADER, "")
        named = response.headers.get(SERVER)
        run = self.signer.signed_run(asked, response.headers, versions)  # a forged or unsigned run id: ignored
        if named is not None and run is None:
            self._last_error = f"an answer of {path} names a run not signed with this key (ignored)"
        if run is not None and self.server is not None and run != self.server:
            self._restarted(run, f"an answer of {path} names a new run")
        if response.status_code != 200:
            raise TransportError(f"the vLLM server at {self.url} answered {path} with {response.status_code}: "
                                 f"{response.text[:300]}")
        return response.json(), parse_versions(versions)

    async def _model(self) -> str:
        if not hasattr(self, "_model_id"):
            self._model_id = self._json(await self._request("GET", "/v1/models"), "/v1/models")["data"][0]["id"]
        return self._model_id

    async def aclose(self) -> None:
        """Close the HTTP client (one given as ``client=`` stays open)."""
        if self._own_client and self._client is not None:
            await self._client.aclose()
        self._client = None if self._own_client else self._client

    async def __aenter__(self) -> "VLLMServer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class ForwardingReceiver(WeightSyncer):
    """The receiving syncer of a :class:`VLLMServer`'s explorer: the twin of ``syncer`` (the
    same config) runs in the server; this one forwards its conversation, still encoded, and
    raises what the server refuses, as the error class it names."""

    supports_staging = True

    def __init__(self, server: VLLMServer, syncer: WeightSyncer, number: int) -> None:
        super().__init__()
        self.server, self.number = server, number
        self.config = syncer_config(syncer)
        self.supports_no_wait = syncer.supports_no_wait
        self.payloads_per_sync = syncer.payloads_per_sync
        self._convs = itertools.count()

    async def init_sender(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a ForwardingReceiver only receives")

    async def sync(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a ForwardingReceiver only receives")

    async def init_receiver(self, state_dict: Any, recv: Any, send: Any = None) -> None:
        raise NotImplementedError("a ForwardingReceiver stages: use stage_init and stage")

    async def apply(self, model: Any, recv: Any) -> int:
        staged = await self.stage(model, recv)
        return await staged.write(model)

    async def stage_init(self, state_dict: Any, recv: Any, send: Any) -> None:
        await self._converse(ServerCall("init", self.number, next(self._convs), config=self.config), recv, send)

    async def stage(self, model: Any, recv: Any) -> StagedWrite:
        first = await recv() if self.payloads_per_sync == 1 else None  # one payload: it goes with the call
        conv = next(self._convs)
        answer = await self._converse(ServerCall("stage", self.number, conv, payload=first), recv, None)
        if answer.staged is None:
            raise ApplyError("the vLLM server staged nothing")

        async def write(model: Any, rollback: bool = True) -> int:
            done = await self.server.call(ServerCall("write", self.number, conv, rollback=rollback))
            if done.state != "done":
                raise rebuild_error(done.error_type, done.error)
            return done.staged

        return StagedWrite(answer.staged, write, nbytes=answer.nbytes, changed=answer.changed,
                           stage_s=answer.stage_s)

    async def _converse(self, call: ServerCall, recv: Any, send: Any) -> ServerAnswer:
        """Run one conversation: hand the server each message it waits for, send on what it
        sends. A conversation given up on here is dropped there (bounded)."""
        from ..messages import payload_nbytes

        ended = False  # the server's side of the conversation ended (it needs no abort)
        try:
            answer = await self.server.call(call, payload_nbytes(call.payload))
            while True:
                ended = answer.state != "wants"
                for msg in answer.out:
                    if send is None:
                        raise ApplyError(f"the vLLM server's receiver sent a {type(msg).__name__} during a sync")
                    await send(msg)
                if answer.state == "failed":
                    raise rebuild_error(answer.error_type, answer.error)
                if answer.state == "done":
                    return answer
                msg = await recv()
                answer = await self.server.call(ServerCall("feed", call.receiver, call.conv, payload=msg),
                                                payload_nbytes(msg))
        except BaseException:
            if not ended:
                with anyio.move_on_after(min(self.server.timeout, 10.0), shield=True):
                    try:
                        await self.server.call(ServerCall("abort", call.receiver, call.conv))
                    except Exception:  # the original error is the one to report
                        pass
            raise


def first_choice(answer: dict) -> tuple[list[int], list[float]]:
    """``(token ids, their log-probabilities)`` of the first choice of a ``/v1/completions``
    answer asked with ``logprobs`` and ``return_tokens_as_token_ids`` (tokens ``token_id:<n>``)."""
    logprobs = answer["choices"][0]["logprobs"]
    ids = [int(t.rpartition(":")[2]) for t in logprobs["tokens"]]
    return ids, [float(lp) for lp in logprobs["token_logprobs"]]

