"""The transport interface (base) and the in-process transport (T1): zero copy, FIFO, the
errors of the Transport contract, statistics snapshots; and the transports package itself
(what it exports, and that it leaves torch.distributed's transport unimported)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosync.messages
import aiosync.transports as transports
from aiosync.errors import ClosedResourceError, EndOfStream, PeerTimeoutError, WouldBlock
from aiosync.transports.base import RecvFn, SendFn, Transport, TransportStatistics, payload_nbytes
from aiosync.transports.inproc import InProcTransport, inproc_pair

from helpers import HANG_GUARD

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the in-process channel

async def test_payloads_travel_by_reference_in_order_both_ways():
    a, b = inproc_pair(timeout=HANG_GUARD)
    tensors = [torch.full((4,), float(i)) for i in range(10)]
    for t in tensors:
        await a.send(t)
    got = [await b.recv() for _ in tensors]
    assert all(x is y for x, y in zip(got, tensors))  # zero copy, FIFO
    await b.send({"ack": 1})
    assert await a.recv() == {"ack": 1}


async def test_statistics_are_frozen_snapshots_of_the_counters():
    a, b = inproc_pair(timeout=HANG_GUARD)
    await a.send(torch.zeros(8))  # 32 bytes
    await a.send(b"abc")
    await b.recv()
    snap = a.statistics()
    assert type(snap) is TransportStatistics
    assert (snap.messages_sent, snap.bytes_sent, snap.messages_received) == (2, 35, 0)
    assert b.statistics() == TransportStatistics(messages_received=1, bytes_received=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.messages_sent = 0  # type: ignore[misc]
    await a.send(b"more")
    assert snap.messages_sent == 2 and a.statistics().messages_sent == 3  # a snapshot, not the live counters


async def test_byte_counting_can_be_turned_off():
    a, b = inproc_pair(timeout=HANG_GUARD)
    a.count_bytes = b.count_bytes = False
    await a.send(torch.zeros(1000))
    await b.recv()
    assert a.statistics().bytes_sent == 0 and a.statistics().messages_sent == 1
    assert b.statistics().bytes_received == 0 and b.statistics().messages_received == 1


async def test_recv_times_out_with_a_peer_timeout_error_and_loses_nothing():
    a, b = inproc_pair(timeout=0.05)
    with pytest.raises(PeerTimeoutError, match="nothing arrived from the peer"):
        await b.recv()
    await a.send("late")
    assert await b.recv() == "late"


async def test_a_full_buffer_blocks_send_until_timeout_or_raises_would_block():
    a, b = inproc_pair(max_buffer_size=1, timeout=0.05)
    a.send_nowait("first")
    with pytest.raises(WouldBlock, match="buffer is full"):
        a.send_nowait("second")
    with pytest.raises(PeerTimeoutError, match="the peer is not receiving"):
        await a.send("second")
    assert await b.recv() == "first"
    a.send_nowait("third")  # room again
    assert await b.recv() == "third"


async def test_closing_ends_the_stream_for_the_peer_and_refuses_own_use():
    a, b = inproc_pair(timeout=HANG_GUARD)
    await a.send("last words")
    await a.aclose()
    assert await b.recv() == "last words"  # what was in flight is still delivered
    with pytest.raises(EndOfStream, match="peer closed"):
        await b.recv()
    with pytest.raises(EndOfStream, match="peer closed its end"):
        await b.send("nobody listens")
    with pytest.raises(ClosedResourceError):
        await a.send("after close")
    with pytest.raises(ClosedResourceError):
        await a.recv()


def test_close_without_waiting():
    a, b = inproc_pair(timeout=HANG_GUARD)
    b.close()
    with pytest.raises(EndOfStream):
        a.send_nowait("x")
    with pytest.raises(ClosedResourceError):
        b.send_nowait("x")


# ------------------------------------------------------------------ the Transport interface

class _Counted(Transport):
    def __init__(self) -> None:
        self.stats = type("S", (), dict(messages_sent=3, bytes_sent=30, messages_received=1, bytes_received=7))()

    async def send(self, payload: Any) -> None:
        raise NotImplementedError

    async def recv(self) -> Any:
        raise NotImplementedError


class _Uncounted(_Counted):
    def __init__(self) -> None:
        pass


def test_default_statistics_read_the_stats_attribute_or_say_there_are_none():
    assert _Counted().statistics() == TransportStatistics(3, 30, 1, 7)
    with pytest.raises(NotImplementedError, match="_Uncounted keeps no statistics"):
        _Uncounted().statistics()


def test_send_recv_types_and_payload_nbytes_come_from_the_message_layer():
    assert payload_nbytes is aiosync.messages.payload_nbytes
    assert SendFn is aiosync.messages.SendFn and RecvFn is aiosync.messages.RecvFn
    assert payload_nbytes({"w": torch.zeros(2, 3), "n": 5, "s": "ab", "b": b"xyz"}) == 1 + 24 + 1 + 8 + 1 + 2 + 1 + 3


def test_the_package_exports_and_the_distributed_names_are_lazy():
    for name in ("Transport", "payload_nbytes", "InProcTransport", "inproc_pair", "SimulatedTransport",
                 "simulated_pair", "FaultProfile", "FAULT_KINDS", "DistributedTransport", "WeightSyncGroup",
                 "Frame", "encode_message", "decode_message", "register_message"):
        assert name in transports.__all__ and hasattr(transports, name), name
    assert transports.InProcTransport is InProcTransport
    assert not hasattr(transports, "CheckpointDir") and not hasattr(transports, "gather_full_state")
    from aiosync.transports.distributed import DistributedTransport

    assert transports.DistributedTransport is DistributedTransport
    assert transports.register_message is aiosync.messages.message
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        transports.nope  # noqa: B018


def test_importing_the_transports_package_does_not_import_the_distributed_transport():
    # A fresh interpreter, so nothing else can have imported the distributed transport first.
    code = textwrap.dedent("""
        import sys
        import aiosync.transports as t
        def above():
            return sorted(m for m in sys.modules if m.startswith(("aiosync.coordination", "aiosync.syncers")))
        assert "aiosync.transports.distributed" not in sys.modules, "imported eagerly"
        assert not above(), above()
        t.WeightSyncGroup
        assert "aiosync.transports.distributed" in sys.modules
        assert not above(), above()  # transports know no protocol above them
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
