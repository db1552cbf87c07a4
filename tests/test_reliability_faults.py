"""Faults injected through the simulated transport, end to end through the Synchronizer
(SPEC §7): each fault leaves the explorer at a consistent, known version (its weights are
exactly the ones of the version its lease reports) and the next sync repairs the gap.

Also: the simulated transport's fault injection itself, and the ``faults`` scenario of
``aiosync simulate``. Nothing here asserts on elapsed time; timeouts only bound waits.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import torch

from aiosync.cli.main import main
from aiosync.cli.simulate import is_delivery, simulate
from aiosync.coordination import Packet, Synchronizer
from aiosync.coordination.delivery import DeliveryLine
from aiosync.coordination.protocol import Ack, Reinit
from aiosync.syncers.bucket.format import BUCKET_KEY
from aiosync.syncers.faults import ApplyFaults, flaky_syncer_factory
from aiosync.transports.faults import FaultProfile
from aiosync.transports.simulated import SimulatedTransport, simulated_pair
from helpers import HANG_GUARD, holds, rollout_model, train_to, weights

pytestmark = pytest.mark.both_loops
DELIVERY = 0.4  # a short delivery bound, so lost messages are noticed quickly
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "verify_checksums": True,
                                    "init_sync": {"enabled": True, "bucket_size": 256}}}
PATCH_COO = {"type": "patch", "patch": {"encoding": "coo", "compression": "none", "verify_checksums": True,
                                        "init_sync": {"enabled": True, "bucket_size": 256}}}
BUCKET = {"type": "bucket", "bucket": {"bucket_size": 256, "verify_checksums": True}}


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    """Compile the numba kernels once before the short delivery timeouts start counting."""
    from aiosync.syncers.base import WeightSyncer
    from aiosync.transports.inproc import inproc_pair

    async def round_trip(cfg):
        s, r = WeightSyncer.create(cfg), WeightSyncer.create(cfg)
        a, b = inproc_pair(timeout=120)
        dst = rollout_model()
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.init_sender, weights(0), None, a.send, a.recv)
            await r.init_receiver(dst, b.recv, b.send)
        for v in (1, 2):
            await s.sync(weights(v), a.send, v)
            await r.apply(dst, b.recv)

    for cfg in (PATCH, PATCH_COO, BUCKET):
        anyio.run(round_trip, cfg)


class Harness:
    """One trainer, one explorer, a simulated link whose two ends the test can reach."""

    def __init__(self, syncer: Any = PATCH, style: str = "fixed") -> None:
        self.syncer = syncer
        self.style = style
        self.ends: tuple[SimulatedTransport, SimulatedTransport] | None = None
        self.state = weights(0)

    def factory(self, name: str):
        self.ends = simulated_pair(latency=0.001, seed=11, timeout=HANG_GUARD)
        for end in self.ends:  # faults strike the delivery line, not the control messages
            end.faults_where = is_delivery
        return self.ends

    @property
    def to_explorer(self) -> SimulatedTransport:
        return self.ends[0]

    @property
    def to_synchronizer(self) -> SimulatedTransport:
        return self.ends[1]

    def synchronizer(self) -> Synchronizer:
        cfg = dict(style=self.style, delivery_timeout=DELIVERY, sync_timeout=2.0)
        return Synchronizer(cfg, self.syncer, transport_factory=self.factory)

    async def publish(self, trainer, v: int) -> None:
        train_to(self.state, v)
        await trainer.sync_weight(v)


async def consistent(ex) -> int:
    """The explorer's lease sees exactly the weights of the version it reports."""
    async with ex.lease(timeout=HANG_GUARD) as (model, version):
        assert holds(model, version), f"explorer holds other weights than version {version}"
        return version


async def run_one_fault(h: Harness, inject, late_copies: float = 0.0) -> tuple[int, Any]:
    """v1 delivered; ``inject(h)``; v2 (possibly lost to the fault); v3 must repair it."""
    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1
            inject(h)
            await h.publish(trainer, 2)
            after_fault = await ex.sync_weight()
            assert after_fault in (1, 2) and await consistent(ex) == after_fault  # a known version
            if late_copies:
                await anyio.sleep(late_copies)  # late copies of the faulty messages land; a hung peer recovers
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 3  # the next sync repairs
            assert await consistent(ex) == 3 and holds(ex.slot.model, 3)
            return after_fault, sync.explorers[ex.name].line.stats


MATRIX = ([("patch-flat", k) for k in ("fail", "drop", "corrupt", "truncate", "stall", "duplicate", "delay")]
          + [("patch-coo", k) for k in ("corrupt", "truncate", "duplicate")]
          + [("bucket", k) for k in ("drop", "corrupt", "truncate", "stall", "duplicate")])
SYNCERS = {"patch-flat": PATCH, "patch-coo": PATCH_COO, "bucket": BUCKET}


@pytest.mark.parametrize("syncer,kind", MATRIX, ids=[f"{s}-{k}" for s, k in MATRIX])
async def test_a_fault_on_the_way_to_the_explorer_is_repaired_by_the_next_sync(syncer, kind):
    syncer = SYNCERS[syncer]

    def inject(h: Harness) -> None:
        if kind == "stall":
            h.to_explorer.faults = FaultProfile(stall_s=3 * DELIVERY)  # the sender is cancelled mid-send
        if kind == "delay":
            h.to_explorer.faults = FaultProfile(delay_max=DELIVERY / 4)
        h.to_explorer.inject(kind)

    h = Harness(syncer)
    after_fault, stats = await run_one_fault(h, inject, late_copies=DELIVERY if kind in ("duplicate", "delay") else 0)
    assert h.to_explorer.stats.faults[kind] == 1
    if kind in ("fail", "drop", "corrupt", "truncate", "stall"):
        # the Packet of version 2 never arrived intact: refused or lost, the explorer stayed at 1
        assert after_fault == 1 and stats.failed == 1 and stats.repairs == 1
    else:
        # a duplicate is refused (or, for a whole-tensor bucket, idempotent); a delay is just late
        assert after_fault == 2


@pytest.mark.parametrize("kind", ["drop", "stall", "duplicate"])
async def test_a_lost_or_duplicated_acknowledgement_leaves_a_known_version(kind):
    def inject(h: Harness) -> None:
        if kind == "stall":
            h.to_synchronizer.faults = FaultProfile(stall_s=2 * DELIVERY)  # the explorer hangs while answering
        h.to_synchronizer.inject(kind)

    h = Harness()
    # the next sync repairs once the explorer answers again
    after_fault, stats = await run_one_fault(h, inject, late_copies=2 * DELIVERY if kind == "stall" else DELIVERY)
    # the explorer applied 2 (its lease says so and its weights agree); the synchronizer did
    # not hear about it (drop, stall) and re-bootstraps, or heard twice (duplicate) and moves on
    assert after_fault == 2
    if kind != "duplicate":
        assert stats.failed == 1 and stats.repairs == 1


async def test_reordered_bootstrap_buckets_are_refused_and_repaired():
    """A bootstrap bucket overtaken by the next one: out of order, refused, rolled back."""
    h = Harness()
    armed = {"on": False}

    def inject(h: Harness) -> None:
        h.to_explorer.inject("fail")  # the Packet of v2 is lost: v3 comes with a re-bootstrap
        end = h.to_explorer
        send = end.send

        async def send_and_reorder(payload):
            if armed["on"] and isinstance(payload, dict) and BUCKET_KEY in payload and int(payload[BUCKET_KEY][0]) == 0:
                end.faults = FaultProfile(reorder_max=DELIVERY / 4)
                end.inject("reorder")  # bucket 0 is held back; bucket 1 overtakes it
                armed["on"] = False
            await send(payload)

        end.send = send_and_reorder

    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1
            inject(h)
            await h.publish(trainer, 2)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1
            armed["on"] = True
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1  # the reordered bootstrap failed
            assert h.to_explorer.stats.faults["reorder"] == 1
            assert "out of order" in sync.explorers[ex.name].line.stats.last_error
            await anyio.sleep(DELIVERY)
            await h.publish(trainer, 4)
            assert await ex.sync_weight() == 4 and await consistent(ex) == 4


@pytest.mark.parametrize("syncer", [PATCH, BUCKET], ids=["patch", "bucket"])
async def test_an_apply_that_raises_half_way_keeps_the_old_version_and_is_repaired(syncer):
    faults = ApplyFaults(1.0, seed=0)

    def inject(h: Harness) -> None:
        faults.enabled = True

    h = Harness(flaky_syncer_factory(syncer, faults))
    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1
            faults.enabled = True
            await h.publish(trainer, 2)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1
            assert faults.fired == 1 and "injected fault" in sync.explorers[ex.name].line.stats.last_error
            faults.enabled = False
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 3 and await consistent(ex) == 3
            assert sync.explorers[ex.name].line.stats.repairs == 1


async def test_a_sender_cancelled_in_the_middle_of_a_bootstrap_is_repaired():
    """The link hangs after the first bootstrap bucket: the delivery timeout cancels the
    sender half way through the init conversation; the explorer, which loaded part of the
    bootstrap, rolls back to its version; the next sync repairs."""
    h = Harness()
    armed = {"on": False}

    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            end = h.to_explorer
            send = end.send

            async def send_and_stall(payload):
                if armed["on"] and isinstance(payload, dict) and int(payload[BUCKET_KEY][0]) == 1:
                    end.faults = FaultProfile(stall_s=3 * DELIVERY)
                    end.inject("stall")
                    armed["on"] = False
                await send(payload)

            end.send = send_and_stall
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1
            end.inject("drop")  # v2's Packet is lost: v3 comes with a re-bootstrap ...
            await h.publish(trainer, 2)
            assert await ex.sync_weight() == 1
            armed["on"] = True  # ... which stalls after its first bucket
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1
            assert end.stats.faults["stall"] == 1
            await h.publish(trainer, 4)
            assert await ex.sync_weight() == 4 and await consistent(ex) == 4


async def test_an_explorer_at_another_base_version_refuses_the_patch_and_is_rebootstrapped():
    """B3 through the Synchronizer: the explorer's syncer believes it holds another version
    (as after a stale delivery); the patch is refused before anything is written, and the next
    delivery re-bootstraps it."""
    h = Harness()
    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1
            ex.applier.receiver.version = 0  # out of step with the sender's chain
            before = {k: v.clone() for k, v in ex.slot.model.items()}
            await h.publish(trainer, 2)
            assert await ex.sync_weight() == 1
            assert all(torch.equal(before[k], v) for k, v in ex.slot.model.items())  # nothing written
            assert "PatchChainError" in sync.explorers[ex.name].line.stats.last_error and sync.explorers[ex.name].line.needs_reinit
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 3 and holds(ex.slot.model, 3)
            assert sync.explorers[ex.name].line.stats.repairs == 1 and sync.explorers[ex.name].line.stats.versions_applied == [0, 1, 3]


async def test_a_packet_with_a_duplicated_payload_is_refused_before_writing():
    h = Harness()
    with anyio.fail_after(HANG_GUARD):
        async with h.synchronizer() as sync:
            trainer = await sync.attach_trainer(h.state)
            ex = await sync.attach_explorer("e0", rollout_model())
            end = h.to_explorer
            send = end.send
            doubled = {"n": 0}

            async def send_doubled(payload):
                if isinstance(payload, Packet) and payload.version == 2:
                    doubled["n"] += 1
                    payload = Packet(payload.version, payload.payloads * 2)
                await send(payload)

            end.send = send_doubled
            await h.publish(trainer, 1)
            assert await ex.sync_weight() == 1
            await h.publish(trainer, 2)
            assert await ex.sync_weight() == 1 and await consistent(ex) == 1
            assert doubled["n"] == 1 and "holds 2 payloads, expected 1" in sync.explorers[ex.name].line.stats.last_error
            await h.publish(trainer, 3)
            assert await ex.sync_weight() == 3 and await consistent(ex) == 3


# ------------------------------------------------------------------ the delivery line

async def test_a_late_answer_to_an_abandoned_conversation_is_not_taken_for_the_current_one():
    """Acks echo the conversation id of the Reinit they answer."""
    a, b = simulated_pair(timeout=5)
    await b.send(Ack(3, 2, "stale failure", conv=1))
    await b.send(Ack(3, 3, None, conv=2))
    line = DeliveryLine("x", a, None, None, [], 5.0)
    line._conv = 2
    ack = await line._recv_ack(3, 2)
    assert ack.error is None and ack.conv == 2
    assert Reinit(3, True).conv == 0


# ------------------------------------------------------------------ the faults scenario

def test_the_faults_scenario_repairs_what_it_injects_and_ends_bit_exact():
    profile = FaultProfile(fail=0.02, drop=0.03, delay=0.1, delay_max=0.2, duplicate=0.05, reorder=0.05,
                           reorder_max=0.03, corrupt=0.05, truncate=0.05, stall=0.02, stall_s=1.0)
    report = simulate("faults", 2, steps=150, seed=4, faults=profile, apply_failure_rate=0.1)
    assert report["final_bit_exact"] is True and report["torn_reads"] == 0
    assert report["faults_injected"] > 0 and report["repairs"] > 0 and report["failed"] > 0
    assert report["faults_injected"] == sum(report["faults"].values())
    assert sum(1 for n in report["faults"].values() if n) >= 4  # several kinds at once
    assert report["final_version"] == report["steps"] == 150
    assert report["max_pending"] <= 1
    for name, st in report["final_state"].items():
        assert st == {"version": 150, "differs": []}, name
    for versions in report["versions_applied"].values():
        assert versions == sorted(versions) and versions[-1] == 150


def test_the_faults_scenario_with_bucket_mode(tmp_path):
    out = tmp_path / "faults.json"
    assert main(["simulate", "--scenario", "faults", "--syncer", "bucket", "--wait", "--steps", "40",
                 "--explorers", "1", "--seed", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scenario"] == "faults" and report["syncer"] == "bucket"
    assert report["final_bit_exact"] is True and report["torn_reads"] == 0
    assert report["faults_injected"] > 0
    assert {"faults_injected", "repairs", "faults", "final_state"} <= set(report)
