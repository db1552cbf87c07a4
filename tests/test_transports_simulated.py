"""The simulated transport (T4): latency, bandwidth, jitter, loud failures, and the quiet
faults of :mod:`aiosync.transports.faults` — each injected fault does what it says, seeded
runs are reproducible, statistics are frozen snapshots.

Nothing asserts on elapsed time; waits on simulated time only order messages.
"""

from __future__ import annotations

import dataclasses
import random
from collections import namedtuple

import anyio
import pytest
import torch

from aiosync.errors import PeerTimeoutError, TransportError
from aiosync.transports import faults as faults_module
from aiosync.transports.faults import (FAULT_KINDS, FaultInjector, FaultProfile, cut_short, flip_byte, replace_at,
                                       tensor_paths)
from aiosync.transports.simulated import SimulatedTransport, SimulatedTransportStatistics, simulated_pair

from helpers import HANG_GUARD

pytestmark = pytest.mark.both_loops  # delivery times, timeouts and reordering depend on the loop's clock


# ------------------------------------------------------------------ the link

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


async def test_messages_in_flight_are_delivered_after_the_sender_closes():
    a, b = simulated_pair(latency=0.02, timeout=HANG_GUARD)
    await a.send("in flight")
    await a.aclose()
    assert await b.recv() == "in flight"


def test_bad_profiles_are_rejected():
    a, _ = simulated_pair()
    with pytest.raises(ValueError, match="bandwidth"):
        SimulatedTransport(a.inner, bandwidth=0)
    with pytest.raises(ValueError, match="failure_rate"):
        SimulatedTransport(a.inner, failure_rate=2)
    with pytest.raises(ValueError, match="latency and jitter"):
        SimulatedTransport(a.inner, jitter=-1)


# ------------------------------------------------------------------ statistics

async def test_statistics_are_frozen_snapshots_with_the_faults_by_kind():
    a, b = simulated_pair(bandwidth=1e9, timeout=HANG_GUARD)
    a.fail_next()
    with pytest.raises(TransportError):
        await a.send("lost")
    a.inject("duplicate")
    await a.send(torch.zeros(4))
    await b.recv()
    await b.recv()
    snap = a.statistics()
    assert isinstance(snap, SimulatedTransportStatistics)
    assert (snap.messages_sent, snap.bytes_sent, snap.failures_injected) == (1, 16, 1)
    assert snap.wire_seconds == pytest.approx(16 / 1e9)
    assert dict(snap.faults) == {**dict.fromkeys(FAULT_KINDS, 0), "duplicate": 1} and snap.faults_injected == 2
    assert (b.statistics().messages_received, b.statistics().bytes_received) == (2, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.failures_injected = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.faults["drop"] = 5  # type: ignore[index]
    a.inject("drop")
    await a.send("gone")
    assert snap.faults["drop"] == 0 and a.statistics().faults["drop"] == 1  # a copy, not the live dict
    assert a.stats.faults["drop"] == 1  # the live counters stay available


# ------------------------------------------------------------------ faults

async def test_each_injected_fault_does_what_it_says():
    a, b = simulated_pair(seed=3, timeout=5)
    t = torch.arange(16, dtype=torch.int32)
    a.faults = FaultProfile(reorder_max=0.05, delay_max=0.01, stall_s=HANG_GUARD)
    # drop: sent, never arrives
    a.inject("drop")
    await a.send("lost")
    await a.send("kept")
    assert await b.recv() == "kept"
    # duplicate: arrives twice
    a.inject("duplicate")
    await a.send("twice")
    assert [await b.recv(), await b.recv()] == ["twice", "twice"]
    # reorder: held back, overtaken by the next message
    a.inject("reorder")
    await a.send("first")
    await a.send("second")
    assert [await b.recv(), await b.recv()] == ["second", "first"]
    # delay: held back, but FIFO is kept
    a.inject("delay")
    await a.send("delayed")
    await a.send("behind it")
    assert [await b.recv(), await b.recv()] == ["delayed", "behind it"]
    # corrupt: one byte of a copy differs; the sender's tensor is untouched
    original = t.clone()
    a.inject("corrupt")
    await a.send({"x": t, "meta": "no tensor here"})
    got = await b.recv()
    assert torch.equal(t, original) and got["x"] is not t and got["meta"] == "no tensor here"
    assert int((got["x"].view(torch.uint8) != t.view(torch.uint8)).sum()) == 1
    # truncate: a shorter, flattened copy
    a.inject("truncate")
    await a.send([t.reshape(4, 4)])
    got = await b.recv()
    assert got[0].dim() == 1 and got[0].numel() < 16 and torch.equal(got[0], t[: got[0].numel()])
    # stall: a send that hangs; a sender that gives up loses the message
    a.inject("stall")
    with anyio.move_on_after(0.05) as scope:
        await a.send("stalled")
    assert scope.cancelled_caught
    await a.send("after")
    assert await b.recv() == "after"
    # fail: loud
    a.inject("fail")
    with pytest.raises(TransportError, match="injected"):
        await a.send("x")
    # corrupt/truncate skip messages without tensors (the injection waits for one)
    a.inject("corrupt")
    await a.send("text")
    assert await b.recv() == "text" and a.stats.faults["corrupt"] == 1
    await a.send(torch.zeros(4, dtype=torch.uint8))
    assert int((await b.recv()).count_nonzero()) == 1
    assert dict(a.statistics().faults) == {"fail": 1, "drop": 1, "delay": 1, "duplicate": 1, "reorder": 1,
                                           "corrupt": 2, "truncate": 1, "stall": 1}
    assert a.statistics().faults_injected == 9
    with pytest.raises(ValueError, match="unknown fault"):
        a.inject("gremlins")


async def test_inject_without_a_profile_makes_one_and_rates_stay_zero():
    a, b = simulated_pair(timeout=HANG_GUARD)
    assert a.faults is None
    a.inject("duplicate")
    assert a.faults == FaultProfile()
    await a.send("x")
    await a.send("y")  # the forced fault was used up: no second duplicate
    assert [await b.recv() for _ in range(3)] == ["x", "x", "y"]


async def test_faults_strike_only_the_messages_faults_where_selects():
    a, b = simulated_pair(timeout=HANG_GUARD, faults=FaultProfile(duplicate=1.0))
    a.faults_where = lambda msg: msg.startswith("data")
    a.fail_next()  # a forced failure waits for a selected message too
    await a.send("control 1")  # neither duplicated nor failed
    with pytest.raises(TransportError):
        await a.send("data 1")
    a.inject("drop")
    await a.send("control 2")
    await a.send("data 2")  # dropped
    await a.send("data 3")  # duplicated (the rate)
    assert [await b.recv() for _ in range(4)] == ["control 1", "control 2", "data 3", "data 3"]
    assert a.statistics().faults["drop"] == 1 and a.statistics().failures_injected == 1


async def test_delays_keep_fifo_order_and_drops_time_out():
    a, b = simulated_pair(seed=5, timeout=0.2, faults=FaultProfile(delay=1.0, delay_max=0.02))
    for i in range(10):
        await a.send(i)
    assert [await b.recv() for _ in range(10)] == list(range(10))
    assert a.stats.faults["delay"] == 10
    a.faults = FaultProfile(drop=1.0)
    await a.send("gone")
    with pytest.raises(PeerTimeoutError):
        await b.recv()


def test_each_direction_gets_its_own_copy_of_the_profile():
    profile = FaultProfile(drop=0.5)
    a, b = simulated_pair(faults=profile)
    assert a.faults == b.faults == profile and a.faults is not profile and a.faults is not b.faults


def _fault_trace(seed: int) -> list[tuple[str, int]]:
    async def run():
        a, b = simulated_pair(seed=seed, timeout=5, faults=FaultProfile.uniform(0.2, reorder_max=0.0,
                                                                                delay_max=0.0, stall_s=0.0))
        a.faults.fail = 0.0
        for i in range(40):
            await a.send(torch.full((4,), i, dtype=torch.int32))
        return sorted(a.statistics().faults.items())

    return anyio.run(run)


def test_faults_are_reproducible_from_the_seed():
    assert _fault_trace(1) == _fault_trace(1)
    assert _fault_trace(1) != _fault_trace(2)


def test_fault_profiles_are_validated():
    with pytest.raises(ValueError, match="drop"):
        FaultProfile(drop=1.5)
    with pytest.raises(ValueError, match="stall_s"):
        FaultProfile(stall_s=-1)
    assert not FaultProfile().active and FaultProfile.uniform(0.1).active
    assert set(FAULT_KINDS) == {"fail", "drop", "delay", "duplicate", "reorder", "corrupt", "truncate", "stall"}


def test_the_fault_pieces_stay_importable_from_the_simulated_module():
    from aiosync.transports import simulated

    assert simulated.FaultProfile is FaultProfile and simulated.FAULT_KINDS is FAULT_KINDS
    assert simulated.flip_byte is flip_byte and simulated.cut_short is cut_short
    assert faults_module.__all__ and all(hasattr(faults_module, n) for n in faults_module.__all__)


# ------------------------------------------------------------------ the fault helpers

@dataclasses.dataclass
class _Msg:
    name: str
    tensors: dict
    extra: tuple


_Pair = namedtuple("_Pair", "left right")


def test_tensor_paths_find_every_non_empty_tensor():
    msg = _Msg("m", {"w": torch.ones(2), "empty": torch.zeros(0)}, (torch.ones(1), [b"x", torch.ones(3)]))
    assert tensor_paths(msg) == [("tensors", "w"), ("extra", 0), ("extra", 1, 1)]
    assert tensor_paths("no tensors") == [] and tensor_paths(torch.ones(1)) == [()]


def test_replace_at_copies_only_the_containers_on_the_path():
    shared = torch.ones(3)
    msg = _Msg("m", {"w": torch.ones(2), "v": shared}, (_Pair(torch.ones(1), shared), [shared]))
    assert ("extra", 0, 0) in tensor_paths(msg)
    out = replace_at(msg, ("extra", 0, 0), lambda t: t * 5)
    assert out is not msg and out.extra is not msg.extra and isinstance(out.extra[0], _Pair)
    assert float(out.extra[0].left) == 5.0 and float(msg.extra[0].left) == 1.0  # the original is untouched
    assert out.tensors is msg.tensors and out.extra[1] is msg.extra[1] and out.extra[0].right is shared
    assert replace_at({"k": [shared]}, ("k", 0), lambda t: None) == {"k": [None]}


def test_flip_byte_and_cut_short_damage_copies():
    rng = random.Random(0)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    before = t.clone()
    flipped = flip_byte(t, rng)
    assert flipped.shape == t.shape and torch.equal(t, before)
    assert int((flipped.reshape(-1).view(torch.uint8) != t.reshape(-1).view(torch.uint8)).sum()) == 1
    short = cut_short(t, rng)
    assert short.dim() == 1 and short.numel() < 12 and torch.equal(short, t.reshape(-1)[: short.numel()])
    assert torch.equal(t, before)


def test_the_injector_counts_forced_faults_and_draws_rates_from_its_rng():
    counts = dict.fromkeys(FAULT_KINDS, 0)
    inj = FaultInjector(random.Random(0), counts)
    with pytest.raises(ValueError, match="unknown fault"):
        inj.force("gremlins")
    assert not inj.roll(None, "drop") and not inj.roll(FaultProfile(), "drop")
    inj.force("drop", 2)
    assert inj.roll(None, "drop") and inj.roll(None, "drop") and not inj.roll(None, "drop")
    assert counts["drop"] == 2
    always = FaultProfile(duplicate=1.0)
    assert all(inj.roll(always, "duplicate") for _ in range(5)) and counts["duplicate"] == 5
    assert inj.mangle(FaultProfile(corrupt=1.0), "no tensor", "corrupt") == "no tensor" and counts["corrupt"] == 0
    hit = inj.mangle(FaultProfile(truncate=1.0), {"t": torch.ones(4)}, "truncate")
    assert hit["t"].numel() < 4 and counts["truncate"] == 1
