"""The simulated transport (T4) and the checkpoint directory of the CHECKPOINT method."""

from __future__ import annotations

import os

import anyio
import pytest
import torch

from aiosync.errors import TransportError, VersionError
from aiosync.transports.checkpoint import CheckpointDir
from aiosync.transports.simulated import SimulatedTransport, simulated_pair


# ------------------------------------------------------------------ simulated transport

async def test_payloads_arrive_by_reference_in_order():
    a, b = simulated_pair(latency=0.002, jitter=0.004, seed=7)
    tensors = [torch.full((4,), float(i)) for i in range(20)]
    for t in tensors:
        await a.send(t)
    got = [await b.recv() for _ in tensors]
    assert all(x is y for x, y in zip(got, tensors))  # zero copy, FIFO despite jitter
    assert a.stats.messages_sent == 20 and b.stats.messages_received == 20
    assert a.stats.bytes_sent == b.stats.bytes_received == 20 * 16


async def test_latency_and_bandwidth_are_simulated_with_the_loop_running():
    a, b = simulated_pair(latency=0.05, bandwidth=1e6)
    assert a.wire_time(250_000) == pytest.approx(0.25)
    ticks = 0
    done = anyio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await a.send(torch.zeros(25_000))  # 100 kB: 0.1 s on the wire
        await b.recv()
        done.set()
    assert a.stats.wire_seconds == pytest.approx(0.1)
    assert ticks > 1  # the event loop kept running while the payload was "on the wire"


async def test_injected_failures_lose_the_payload():
    a, b = simulated_pair()
    a.fail_next(2)
    for _ in range(2):
        with pytest.raises(TransportError, match="simulated transport failure"):
            await a.send("lost")
    await a.send("kept")
    assert await b.recv() == "kept"
    assert a.stats.failures_injected == 2 and a.stats.messages_sent == 1


def _failures(seed: int) -> list[bool]:
    async def run() -> list[bool]:
        a, _ = simulated_pair(failure_rate=0.3, seed=seed)
        out = []
        for _ in range(50):
            try:
                await a.send(b"x")
                out.append(False)
            except TransportError:
                out.append(True)
        return out

    return anyio.run(run)


def test_failures_are_reproducible_from_the_seed():
    first, again, other = _failures(3), _failures(3), _failures(4)
    assert first == again and first != other
    assert 5 < sum(first) < 30


async def test_a_cancelled_receive_loses_nothing():
    a, b = simulated_pair(latency=0.2)
    await a.send("slow")
    with anyio.move_on_after(0.01):
        await b.recv()  # cancelled while the message is still "in flight"
    assert await b.recv() == "slow"


def test_bad_profiles_are_rejected():
    a, _ = simulated_pair()
    with pytest.raises(ValueError, match="bandwidth"):
        SimulatedTransport(a.inner, bandwidth=0)
    with pytest.raises(ValueError, match="failure_rate"):
        SimulatedTransport(a.inner, failure_rate=2)


# ------------------------------------------------------------------ checkpoint directory

def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), v), "b": torch.full((4,), v, dtype=torch.bfloat16),
            "n": torch.tensor(int(v), dtype=torch.int64)}


def test_publish_discover_load_and_remove_superseded(tmp_path):
    d = CheckpointDir(tmp_path / "ckpt")
    assert d.newest() is None
    d.publish(_state(1), 1)
    d.publish(_state(2), 2, keep=True)  # a full checkpoint: marked and kept
    d.publish(_state(3), 3)
    names = sorted(os.listdir(d.path))
    assert names == ["full-000000000002.safetensors", "sync-000000000003.safetensors"]
    version, tensors = d.load()
    assert version == 3
    assert all(torch.equal(tensors[k], v) for k, v in _state(3).items())
    assert tensors["b"].dtype == torch.bfloat16
    assert d.load(2)[0] == 2
    with pytest.raises(VersionError, match="not above the newest published 3"):
        d.publish(_state(3), 3)


def test_publish_is_atomic_on_failure(tmp_path):
    d = CheckpointDir(tmp_path)
    d.publish(_state(1), 1)
    bad = {"w": object()}  # not a tensor: the write fails
    with pytest.raises(Exception):
        d.publish(bad, 2)  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["sync-000000000001.safetensors"]  # no temporary file left
    assert d.load()[0] == 1


def test_tied_tensors_can_be_published(tmp_path):
    w = torch.randn(4, 4)
    d = CheckpointDir(tmp_path)
    d.publish({"emb": w, "head": w}, 0)
    _, tensors = d.load()
    assert torch.equal(tensors["emb"], w) and torch.equal(tensors["head"], w)
