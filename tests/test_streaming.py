"""Streamed bucket syncs through the synchronizer (issue 16): a bucket sync travels a bucket at
a time, the next only once the explorer staged the one before, and is still applied as one
all-or-nothing write; the receiver holds about one bucket beyond the model."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiosync.coordination import Synchronizer
from aiosync.coordination.protocol import Credit, Packet, Part
from aiosync.transports.base import Transport
from aiosync.transports.inproc import inproc_pair
from helpers import HANG_GUARD, same_bits

pytestmark = pytest.mark.both_loops

BUCKET_SIZE = 4096
BUCKET = {"type": "bucket", "bucket": {"bucket_size": BUCKET_SIZE, "bucket_dtype": "bfloat16", "load_instant": True}}
CFG = dict(style="trainer_driven", sync_timeout=10, delivery_timeout=10)


def state(v: int) -> dict[str, torch.Tensor]:
    """16 tensors of 2 KiB as the explorer holds them (bf16): 8 buckets of 4 KiB. Each version
    changes about 1 % of the values (an RL update's density)."""
    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(16):
        t = torch.randn(32, 32, generator=g)
        t.view(-1)[:: 97] += 0.5 * v
        out[f"layer{i}.w"] = t
    return out


def rollout() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in state(0).items()}


def holds(model, v: int) -> bool:
    return all(same_bits(model[k], t.to(torch.bfloat16)) for k, t in state(v).items())


class Spy(Transport):
    """The synchronizer's end of an explorer's channel, noting what goes out and comes back."""

    def __init__(self, inner: Transport, log: list) -> None:
        self.inner, self.log = inner, log

    async def send(self, payload):
        self.log.append(("out", payload))
        await self.inner.send(payload)

    async def recv(self):
        payload = await self.inner.recv()
        self.log.append(("in", payload))
        return payload

    def close(self) -> None:
        self.inner.close()


def spied(log: list):
    def factory(name: str):
        a, b = inproc_pair(timeout=HANG_GUARD)
        return Spy(a, log), b

    return factory


async def test_a_bucket_sync_streams_one_bucket_at_a_time_and_holds_about_one():
    log: list = []
    live = state(0)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(CFG, BUCKET, transport_factory=spied(log)) as sync:
            trainer = await sync.attach_trainer(live)
            ex = await sync.attach_explorer("e0", rollout())
            for key, t in state(1).items():
                live[key].copy_(t)
            log.clear()
            await trainer.sync_weight(1)
            assert ex.version == 1 and holds(ex.slot.model, 1)
            stats = ex.applier.receiver.statistics()
    sent = [m for d, m in log if d == "out" and isinstance(m, (Packet, Part))]
    (header,) = [m for m in sent if isinstance(m, Packet)]
    assert header.parts == 8 and header.payloads == []  # the packet carries no bucket itself
    # every part after the first went out only once the explorer was done with the one before
    order = [(d, m.index) for d, m in log if isinstance(m, (Part, Credit))]
    parts = [i for d, i in order if d == "out"]
    assert parts == list(range(8))
    for k in range(1, 8):
        assert order.index(("in", k - 1)) < order.index(("out", k))
    # about one bucket beyond the model, and the changes planned (the all-or-nothing write needs them)
    assert stats.changed == 16 * 11 and 0 < stats.peak_bytes <= 2 * BUCKET_SIZE


async def test_a_streamed_sync_refused_half_way_writes_nothing_and_stops_sending():
    log: list = []
    live = state(0)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(CFG, BUCKET, transport_factory=spied(log)) as sync:
            trainer = await sync.attach_trainer(live)
            ex = await sync.attach_explorer("e0", rollout())
            receiver = ex.applier.receiver
            real = receiver.stage

            async def stage(model, recv):  # the explorer refuses the third bucket (it came corrupted)
                calls = 0

                async def faulty():
                    nonlocal calls
                    calls += 1
                    payload = await recv()
                    if calls == 3:
                        payload = {k: v for k, v in payload.value.items() if not k.startswith("layer")}
                    return payload

                return await real(model, faulty)

            receiver.stage = stage
            for key, t in state(1).items():
                live[key].copy_(t)
            log.clear()
            await trainer.sync_weight(1)
            assert ex.version == 0 and holds(ex.slot.model, 0)  # nothing of version 1 was written
            parts = [m.index for d, m in log if d == "out" and isinstance(m, Part)]
            assert parts == [0, 1, 2]  # the rest of the stream was never sent
            receiver.stage = real
            assert await ex.sync_weight() == 1 and holds(ex.slot.model, 1)  # the next delivery repairs it
