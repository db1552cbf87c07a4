"""The server path without a server (no vLLM): the key both sides share (:mod:`aiosync.engines.auth`),
one message as one byte string, and the whole protocol — :class:`VLLMServer` in the trainer's
process, :class:`AiosyncApp` in the "server" — driven in process through httpx's ASGI
transport, with a plain dict of tensors standing in for the engine's host copy: patch and
bucket syncs end bit-exact, a stranger's and a replayed request are refused and change nothing,
completions are stamped with the version that generated them. The real server:
tests/test_engines_vllm_server.py."""

from __future__ import annotations

import contextlib
import socket
import threading

import anyio
import httpx
import pytest
import torch

from aiosync.coordination import Synchronizer
from aiosync.engines.auth import Signer, Verifier, load_key
from aiosync.engines.vllm_server import VLLMServer
from aiosync.engines.vllm_server_app import AiosyncApp, ServerEnd
from aiosync.errors import ApplyError, AuthenticationError, ConfigError, PayloadError, TransportError, WouldBlock
from aiosync.transports.distributed.bytestring import frame_bytes, message_from_bytes
from aiosync.transports.distributed.wire import encode_message
from aiosync.engines.vllm_server_protocol import ServerCall
from helpers import BUCKET, HANG_GUARD, PATCH, holds, rollout_model, train_to, trainer_state

KEY, OTHER = b"k" * 32, b"x" * 32


def test_a_request_passes_only_signed_with_the_key_for_this_run_and_never_twice():
    verifier, signer = Verifier(KEY), Signer(KEY)

    def check(headers, body=b"body", key_verifier=verifier):
        expected = key_verifier.expected("POST", "/aiosync/call", headers, body)
        return key_verifier.check("POST", "/aiosync/call", headers, expected)

    first = signer.sign("POST", "/aiosync/call", verifier.server, b"body")
    assert check(first) == signer.client
    cases = {"replayed": (first, b"body"),
             "unsigned": ({}, b"body"),
             "bad_signature": (Signer(OTHER).sign("POST", "/aiosync/call", verifier.server, b"body"), b"body")}
    cases["other_server"] = (signer.sign("POST", "/aiosync/call", "an-earlier-run", b"body"), b"body")
    altered = signer.sign("POST", "/aiosync/call", verifier.server, b"body")
    cases["bad_signature "] = (altered, b"bodY")           # altered on the way
    for reason, (headers, body) in cases.items():
        with pytest.raises(AuthenticationError, match="Nothing was changed") as exc:
            check(headers, body)
        assert exc.value.reason == reason.strip()
    with pytest.raises(AuthenticationError) as exc:
        check(signer.sign("POST", "/aiosync/call", "x", b"body"), key_verifier=Verifier(None))
    assert exc.value.reason == "no_key" and "AIOSYNC_SERVER_KEY_FILE" in str(exc.value)
    assert check(signer.sign("POST", "/aiosync/call", verifier.server, b"body")) == signer.client  # the next one
    with pytest.raises(ConfigError, match="at least 16"):
        load_key("short", env=False)


def test_one_message_as_one_byte_string_and_a_truncated_one_refused():
    call = ServerCall("feed", 1, 2, payload={"w": trainer_state()["w"]})
    data = frame_bytes(encode_message(call, detach_shared=True))
    back = message_from_bytes(data, sender="the trainer")
    assert back.op == "feed" and back.payload["w"].equal(call.payload["w"])
    with pytest.raises(PayloadError, match="the trainer"):
        message_from_bytes(data[:-1], sender="the trainer")


async def _answer_empty(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


class InProcessServer(httpx.AsyncBaseTransport):
    """:class:`AiosyncApp` over a stand-in for vLLM's app (completions answer ``{}``), its
    receivers writing ``target`` (a dict of tensors), reached through httpx's ASGI transport.
    :meth:`restart` makes it a new run holding start-up weights; while ``down`` it cannot be
    reached."""

    def __init__(self, target, key=KEY) -> None:
        self.key, self.target, self.down = key, target, False
        self.app = AiosyncApp(_answer_empty, key=key)

    async def handle_async_request(self, request):
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await httpx.ASGITransport(app=self.app).handle_async_request(request)

    def client(self, key=KEY) -> VLLMServer:
        return VLLMServer("http://srv", key=key, client=httpx.AsyncClient(transport=self, base_url="http://srv"))

    def start(self, tg) -> None:
        self.app._tg = tg
        self.app.end = ServerEnd(None, tg, target=self.target)

    def restart(self, tg) -> None:
        """A new run of the server, holding the weights it was started from."""
        self.app, self.target = AiosyncApp(_answer_empty, key=self.key), rollout_model()
        self.start(tg)


@contextlib.asynccontextmanager
async def attached(server, state, syncer=PATCH):
    """``server`` started, its client attached as explorer ``srv`` of a FIXED synchronizer with
    trainer ``state``; yields ``(tg, client, sync, trainer, explorer)``; the server stops after."""
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            server.start(tg)
            client = server.client()
            async with Synchronizer({"style": "fixed"}, syncer) as sync:
                trainer = await sync.attach_trainer(state)
                yield tg, client, sync, trainer, await sync.attach_explorer("srv", client)
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("syncer", [PATCH, BUCKET], ids=["patch", "bucket"])
async def test_syncs_through_the_protocol_end_bit_exact_and_completions_carry_the_version(syncer):
    state, served = trainer_state(), rollout_model()
    server = InProcessServer(served)
    async with attached(server, state, syncer) as (_, client, _, trainer, explorer):
        assert holds(served, 0)
        for v in (1, 2, 3):
            train_to(state, v)
            await trainer.sync_weight(v)
            assert await explorer.sync_weight() == v
            assert holds(served, v)
            _, versions = await client.completions({"model": "m", "prompt": [1]})
            assert versions == (v,)
    assert client.statistics().version == 3 and server.app.end.state()["writes"] == 4


@pytest.mark.parametrize("noticed", ["completion", "call", "unreachable"])
async def test_a_restarted_server_is_reported_holding_no_version_until_its_bootstrap_lands(noticed):
    """Between a server's restart and its repair the explorer reports no version and hands out
    no lease: the restart is noticed on a completion's answer, on a refused call, or, after the
    server could not be reached, before the next request; then the explorer asks for a
    bootstrap itself."""
    state, server = trainer_state(), InProcessServer(rollout_model())
    async with attached(server, state) as (tg, client, sync, trainer, explorer):
        for v in (1, 2):
            train_to(state, v)
            await trainer.sync_weight(v)
            assert await explorer.sync_weight() == v
        if noticed == "unreachable":
            server.down = True
            with pytest.raises(TransportError, match="cannot reach"):
                await client.completions({"model": "m", "prompt": [1]})
            server.down = False
        server.restart(tg)
        assert explorer.version == 2 and not holds(server.target, 2)  # not noticed yet
        v = 2
        if noticed == "call":
            v = 3
            train_to(state, v)
            await trainer.sync_weight(v)                 # its delivery is refused: the old run's
            await explorer.sync_weight()
        else:
            _, versions = await client.completions({"model": "m", "prompt": [1]})
            assert explorer.version is None              # noticed: it holds no version it was given
            with pytest.raises(WouldBlock):
                with explorer.lease_nowait():
                    pass
            assert versions == (None,)                   # generated by its start-up weights
        async with explorer.lease() as (_, held):       # waits for the bootstrap it asked for
            assert held == v and holds(server.target, v) and server.app.end.version == v
        await explorer.wait_applied()                   # its Ack reached the synchronizer
        line = sync.explorers["srv"].statistics()
        assert line.version == v and line.repairs == 1 and line.reinits == 2
        row = sync.metrics()["explorers"]["srv"]["model"]  # the server's state in its metrics line
        assert row["url"] == "http://srv" and row["server"] == server.app.verifier.server
        assert row["version"] == v and row["restarts"] == 1 and row["state"]["version"] == v
        assert row["state"]["server"] == row["server"] and row["state"]["bytes_received"] > 0
        why = {"completion": None, "call": "restarted", "unreachable": "cannot reach"}[noticed]
        assert (row["last_error"] is None) if why is None else why in row["last_error"]
        assert (await client.state())["writes"] == 1 == client.statistics().state["writes"]
    assert client.statistics().restarts == 1 and explorer.slot.statistics().losses == 1


async def test_a_stranger_and_a_replay_are_refused_and_change_nothing():
    state, served = trainer_state(), rollout_model()
    server = InProcessServer(served)
    recorded = {}

    async def record(request):
        recorded.update(headers=dict(request.headers), body=request.content)

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            server.start(tg)
            client = server.client()
            client._http().event_hooks["request"].append(record)
            async with Synchronizer({"style": "fixed"}, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                explorer = await sync.attach_explorer("srv", client)
                train_to(state, 1)
                await trainer.sync_weight(1)
                assert await explorer.sync_weight() == 1
            http = client._http()
            replayed = await http.post("/aiosync/call", content=recorded["body"], headers=recorded["headers"])
            assert replayed.status_code == 401 and replayed.json()["reason"] == "replayed"
            for path in ("/update_weights", "/pause", "/aiosync/call"):
                refused = await http.post(path, json={"update_info": {}})
                assert refused.status_code == 401 and refused.json()["reason"] == "unsigned", path
            impostor = server.client(OTHER)
            with pytest.raises(AuthenticationError, match="did not sign its run id"):  # it cannot trust the run id
                await impostor.call(ServerCall("init", 0, 0, config=PATCH))
            impostor.server = server.app.verifier.server                  # told it: its call is refused there
            with pytest.raises(AuthenticationError, match="does not verify"):
                await impostor.call(ServerCall("init", 0, 0, config=PATCH))
            async with Synchronizer({"style": "fixed"}, PATCH) as other:
                await other.attach_trainer(trainer_state())
                with pytest.raises(ApplyError, match="AuthenticationError"):
                    await other.attach_explorer("impostor", server.client(OTHER))
            tg.cancel_scope.cancel()
    assert holds(served, 1) and server.app.end.version == 1
    refused = server.app.verifier.refused  # the impostor's explorer stopped at the run id it could not trust
    assert refused["replayed"] == 1 and refused["unsigned"] == 3 and refused["bad_signature"] == 1


async def test_two_servers_share_each_patch_and_take_it_without_the_trainer_waiting():
    state = trainer_state()
    servers = [InProcessServer(rollout_model()) for _ in range(2)]
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for server in servers:
                server.start(tg)
            async with Synchronizer({"style": "trainer_driven", "sync_weight_no_wait": True}, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                for i, server in enumerate(servers):
                    await sync.attach_explorer(f"srv{i}", server.client())
                lines = [sync.explorers[f"srv{i}"].line.stats for i in range(2)]
                for v in (1, 2, 3):
                    train_to(state, v)
                    await trainer.step_done()            # publishes; the servers apply in the background
                await trainer.stop()
            tg.cancel_scope.cancel()                     # the synchronizer drained: every server holds 3
    for server in servers:
        assert holds(server.target, 3) and server.app.end.version == 3
    assert sum(line.shared for line in lines) >= 1       # a patch built once, taken by both


class ForgingServer(InProcessServer):
    """An :class:`InProcessServer` whose answers someone on the way alters: ``forge`` (header ->
    value) is written over every answer's headers."""

    forge: dict = {}
    #: A forged refusal of every call, "signed for another run" (unsigned).
    refuse = False

    async def handle_async_request(self, request):
        if self.refuse and request.url.path == "/aiosync/call":
            return httpx.Response(401, json={"error": "restarted", "reason": "other_server", "server": "a-forged-run"})
        response = await super().handle_async_request(request)
        for name, value in self.forge.items():
            response.headers[name] = value
        return response


async def test_a_forged_run_id_is_ignored():
    state, server = trainer_state(), ForgingServer(rollout_model())
    async with attached(server, state) as (_, client, _, trainer, explorer):
        train_to(state, 1)
        await trainer.sync_weight(1)
        assert await explorer.sync_weight() == 1
        run = server.app.verifier.server
        server.forge = {"x-aiosync-server": "a-forged-run"}       # a new run, unsigned: not believed
        _, versions = await client.completions({"model": "m", "prompt": [1]})
        assert versions == (1,) and "not signed" in client.statistics().last_error
        server.forge = {"x-aiosync-server": "a-forged-run", "x-aiosync-server-mac": "0" * 64}
        await client.completions({"model": "m", "prompt": [1]})
        with pytest.raises(AuthenticationError, match="did not sign its run id"):
            await client.hello()
        assert client.server == run and client.statistics().restarts == 0 and explorer.version == 1
        server.forge, server.refuse = {}, True
        with pytest.raises(AuthenticationError, match="not signed with this key"):
            await client.call(ServerCall("abort", 0, 99))            # "you restarted", unsigned: not believed
        server.refuse = False
        assert client.statistics().restarts == 0 and explorer.version == 1
        await client.completions({"model": "m", "prompt": [1]})   # signed: believed, same run
        assert (await client.hello())["server"] == run
        train_to(state, 2)
        await trainer.sync_weight(2)
        assert await explorer.sync_weight() == 2 and holds(server.target, 2)
    assert client.statistics().restarts == 0 and server.app.end.state()["writes"] == 3  # no second bootstrap


async def test_the_middleware_refuses_to_start_under_several_api_server_processes():
    from types import SimpleNamespace

    sent, started = [], []

    async def inner(scope, receive, send):                    # vLLM's app: would start
        started.append(await receive())
        await send({"type": "lifespan.startup.complete"})

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        sent.append(message)

    def vllm_app(count):  # what vLLM's app holds in each API server process
        return SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(_api_process_count=count))))

    with anyio.fail_after(HANG_GUARD):
        await AiosyncApp(inner, key=KEY)({"type": "lifespan", "app": vllm_app(2)}, receive, send)
    assert not started and [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "--api-server-count 2" in sent[0]["message"] and "--api-server-count 1" in sent[0]["message"]
    sent.clear()
    with anyio.fail_after(HANG_GUARD):  # one process: it starts (and ends with vLLM's lifespan)
        await AiosyncApp(inner, key=KEY)({"type": "lifespan", "app": vllm_app(1)}, receive, send)
    assert len(started) == 1 and [m["type"] for m in sent] == ["lifespan.startup.complete"]


def test_vllms_own_http_client_signed_passes_the_guard_and_follows_a_restart():
    pytest.importorskip("vllm")
    from aiosync.engines.vllm_signed_client import SignedHTTPWeightSyncClient

    verifier, seen = Verifier(KEY), []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"server": verifier.server})
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            expected = verifier.expected("POST", request.url.path, headers, request.content)
            verifier.check("POST", request.url.path, headers, expected)
        except AuthenticationError as exc:
            return httpx.Response(401, json={"error": str(exc), "reason": exc.reason})
        seen.append((request.url.path, request.content))
        return httpx.Response(200, json={})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = SignedHTTPWeightSyncClient("http://srv", key=KEY, client=http)
    client.start_weight_update()
    client.update_weights({"commit": True, "update_id": "u1"})
    verifier.server = "restarted"                         # the server's next run: signed again, once
    client.finish_weight_update("3")
    assert [p for p, _ in seen] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert seen[1][1] == b'{"update_info": {"commit": true, "update_id": "u1"}}'
    with pytest.raises(AuthenticationError, match="does not verify") as exc:
        SignedHTTPWeightSyncClient("http://srv", key=OTHER, client=http).start_weight_update()
    assert exc.value.reason == "bad_signature" and verifier.refused == {"other_server": 1, "bad_signature": 1}


@contextlib.contextmanager
def served_over_http(target):
    """:class:`AiosyncApp` over ``target`` (a dict of tensors) behind uvicorn on 127.0.0.1, in a
    thread of its own (real HTTP, no vLLM server); yields ``(url, app)``."""
    import uvicorn

    ready, app = threading.Event(), None

    async def inner(scope, receive, send):
        if scope["type"] != "lifespan":
            return await _answer_empty(scope, receive, send)
        while (await receive())["type"] != "lifespan.shutdown":
            app.end = ServerEnd(None, app._tg, target=target)    # in the server's event loop
            await send({"type": "lifespan.startup.complete"})
            ready.set()
        await send({"type": "lifespan.shutdown.complete"})

    app = AiosyncApp(inner, key=KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, interface="asgi3", lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert ready.wait(HANG_GUARD), "the HTTP server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD)
        sock.close()


def test_vllms_trainer_api_switches_to_aiosync_by_naming_the_backend():
    """Code written against vLLM's TrainerWeightTransferEngine (trainer_init, send_weights,
    shutdown) takes aiosync's patches by naming the backend; a wrong key changes nothing."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource

    from aiosync.integrations.vllm_trainer import AiosyncTrainerInitInfo, AiosyncTrainerWeightTransferEngine
    from aiosync.engines.vllm_signed_client import SignedHTTPWeightSyncClient

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    target = {k: torch.zeros_like(t) for k, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def served_equals_model() -> bool:
        return all(torch.equal(target[k], t) for k, t in model.state_dict().items())

    with served_over_http(target) as (url, app):
        client = SignedHTTPWeightSyncClient(url, key=KEY)
        engine = WeightTransferTrainerFactory.trainer_init(AiosyncTrainerInitInfo(rank=0, timeout=HANG_GUARD),
                                                           client=client, source=ModuleSource(model))
        try:
            assert isinstance(engine, AiosyncTrainerWeightTransferEngine)
            assert engine.version == 0 and served_equals_model()              # the bootstrap
            for v in (1, 2):
                model(torch.randn(4, 16)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                assert not served_equals_model()
                engine.send_weights()
                assert engine.version == v == app.end.version and served_equals_model()
            assert engine.server.statistics().state["writes"] == 3
            with pytest.raises(ApplyError, match="AuthenticationError"):
                WeightTransferTrainerFactory.trainer_init(
                    AiosyncTrainerInitInfo(rank=0, key=OTHER, timeout=HANG_GUARD),
                    client=client, source=ModuleSource(model))
            follower = WeightTransferTrainerFactory.trainer_init(AiosyncTrainerInitInfo(rank=1), client=client,
                                                                 source=ModuleSource(model))
            follower.send_weights()                                             # iterates the source only
            assert follower.server is None and not follower.is_sender
        finally:
            engine.shutdown()
        assert app.end.version == 2 and served_equals_model()
        with pytest.raises(ApplyError, match="shut down"):
            engine.send_weights()
