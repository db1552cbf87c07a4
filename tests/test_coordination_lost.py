"""The synchronizer is a server (issue 32, L4): nothing one explorer does or fails to do —
going silent, calling in late after it was declared lost, messages that cross the "lost" Close
on the wire, messages that make no sense in the session's state, malformed ones — ends the
synchronizer or another explorer's session. A lost explorer's calls say why it was lost, and it
can be attached again under its name, starting from the newest version.

Gates hold the synchronizer's Close on the wire, so a late message crosses it deterministically;
nothing asserts on elapsed time (HANG_GUARD only turns a hang into a failure).
"""

from __future__ import annotations

import anyio
import pytest

from aiosync.coordination import Explorer, Synchronizer
from aiosync.coordination.protocol import (Ack, Attached, Close, Credit, Heartbeat, Hello, Leave, Notice, Packet, Part,
                                           Refused, Served, Stopped, SyncRequest, Welcome)
from aiosync.errors import EndOfStream, ExplorerLostError, TransportError
from aiosync.transports.base import Transport
from aiosync.transports.inproc import inproc_pair
from helpers import HANG_GUARD, PATCH, Gate, GatedTransport, holds, rollout_model, train_to, trainer_state

pytestmark = pytest.mark.both_loops


def closes(msg) -> bool:
    return isinstance(msg, Close)


def packets(msg) -> bool:
    return isinstance(msg, Packet)


def gate_for(name: str, gate: Gate, holds_msg):
    """A transport factory whose synchronizer end towards explorer ``name`` holds ``holds_msg``."""
    def factory(who: str):
        a, b = inproc_pair(timeout=HANG_GUARD)
        return (GatedTransport(a, gate, holds_msg) if who == name else a), b

    return factory


async def wait_closed(sync: Synchronizer, name: str) -> None:
    session = sync.explorers[name]
    while not session.closed:
        await sync.source.changed(HANG_GUARD)


async def keep_alive(ex: Explorer, stop: anyio.Event) -> None:
    """An explorer loop that shows signs of life until ``stop``."""
    while not stop.is_set():
        async with ex.lease():
            pass
        await ex.step_done()
        with anyio.move_on_after(0.01):
            await stop.wait()


@pytest.mark.parametrize("method", ["memory", "nccl"])
async def test_a_lost_explorers_request_that_crosses_the_close_ends_nothing_but_its_own_call(method):
    """Item 1: an explorer declared lost (silent past liveness_timeout) that then asks for weights,
    its request crossing the synchronizer's Close on the wire: the synchronizer, the trainer and
    the other explorer go on; the late call raises an error that says why it was lost."""
    gate = Gate()
    state = trainer_state()
    cfg = dict(method=method, style="trainer_driven", liveness_timeout=0.3, sync_timeout=HANG_GUARD,
               delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=gate_for("e0", gate, closes)) as sync:
            trainer = await sync.attach_trainer(state)
            e0 = await sync.attach_explorer("e0", rollout_model())
            e1 = await sync.attach_explorer("e1", rollout_model())
            gate.close()
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_alive, e1, stop)
                await wait_closed(sync, "e0")  # e0 is silent: lost; its Close waits at the gate
                await gate.wait_blocked()
                assert sync.explorers["e0"].lost and not e0.closed
                late = {}

                async def late_call():
                    try:
                        await e0.sync_weight()
                    except Exception as exc:  # noqa: BLE001 - recorded and checked below
                        late["error"] = exc

                tg.start_soon(late_call)
                for v in (1, 2):  # the request reaches the closed session while the trainer publishes
                    train_to(state, v)
                    await trainer.sync_weight(v)
                gate.open()
                while "error" not in late:
                    await e0.wait_applied(HANG_GUARD)
                    await anyio.sleep(0)
                for v in (3, 4):
                    train_to(state, v)
                    await trainer.sync_weight(v)
                stop.set()
            await trainer.stop()
    assert isinstance(late["error"], ExplorerLostError) and isinstance(late["error"], TransportError)
    assert "liveness_timeout" in str(late["error"]) and "attach" in str(late["error"])
    with pytest.raises(ExplorerLostError, match="liveness_timeout"):
        await e0.step_done()
    assert e1.version == 4 and holds(e1.slot.model, 4)


async def test_a_lost_explorer_is_attached_again_under_its_name_from_the_newest_version():
    """Item 2: a lost session's name is free; attaching it again (its old model, its old
    weights) starts it from the newest version."""
    state = trainer_state()
    cfg = dict(style="trainer_driven", liveness_timeout=0.3, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            e0 = await sync.attach_explorer("e0", rollout_model())
            await wait_closed(sync, "e0")
            lost = sync.explorers["e0"]
            assert lost.lost
            for v in (1, 2, 3):
                train_to(state, v)
                await trainer.sync_weight(v)
            assert e0.version == 0
            back = await sync.attach_explorer("e0", e0.slot)  # the same model, holding version 0
            assert sync.explorers["e0"] is not lost and back.version == 3 and holds(back.slot.model, 3)
            train_to(state, 4)
            await trainer.sync_weight(4)
            assert await back.sync_weight() == 4 and holds(back.slot.model, 4)
            with pytest.raises(ExplorerLostError, match="liveness_timeout"):
                await e0.step_done()
            await trainer.stop()
    assert back.version == 4 and sync.explorers["e0"].version == 4


# ------------------------------------------------------------------ every state, every message

#: Control messages an explorer (or a confused peer) may send at any time.
LATE = [SyncRequest(7), Heartbeat(3), Stopped(2), Hello("e0"), Attached(1), Served(1, "delivered", 1),
        Notice("published", 1), Welcome({}, None, 0, None), Refused("no"), SyncRequest(-5)]
#: Delivery-line messages out of turn.
STRAY = [Ack(99, 1), Ack(1, None, "boom", conv=3), Credit(1, 0), Part(1, 0, b"x"), Packet(99, [])]


async def send_raw(end, msgs) -> None:
    for msg in msgs:
        try:
            await end.send(msg)
        except Exception:  # noqa: BLE001 - a closed end refuses: that is fine here
            return


@pytest.mark.parametrize("state", ["joining", "attached", "stopped", "lost", "closing"])
async def test_any_message_in_any_session_state_ends_nothing_but_that_session(state):
    """Control and delivery messages that make no sense in the session's state (sent straight on
    the explorer's wire, bypassing its protocol): the synchronizer and the other explorer go on,
    and every explorer ends holding the trainer's last weights or is lost / refused cleanly."""
    held = Gate()
    wire: dict = {}

    def factory(who: str):
        a, b = inproc_pair(timeout=HANG_GUARD)
        wire[who] = b
        gate = held if who == "e0" else Gate()
        return GatedTransport(a, gate, packets if state == "joining" else closes), b

    st = trainer_state()
    cfg = dict(style="trainer_driven", liveness_timeout=0.3 if state == "lost" else HANG_GUARD,
               sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=factory) as sync:
            trainer = await sync.attach_trainer(st)
            e1 = await sync.attach_explorer("e1", rollout_model())
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_alive, e1, stop)
                if state == "joining":
                    held.close()
                    tg.start_soon(sync.attach_explorer, "e0", rollout_model())
                    await held.wait_blocked()  # its first sync waits at the gate
                    await send_raw(wire["e0"], LATE + STRAY + [Leave("x")])
                    held.open()
                else:
                    e0 = await sync.attach_explorer("e0", rollout_model())
                    held.close()
                    if state == "stopped":
                        await e0.stop()
                    elif state == "lost":
                        await wait_closed(sync, "e0")
                        await held.wait_blocked()
                    elif state == "closing":
                        tg.start_soon(sync.detach_explorer, "e0")
                        await held.wait_blocked()
                    await send_raw(wire["e0"], LATE + STRAY)
                    held.open()
                for v in (1, 2, 3):
                    train_to(st, v)
                    await trainer.sync_weight(v)
                stop.set()
            await trainer.stop()
    assert e1.version == 3 and holds(e1.slot.model, 3)
    assert not sync.explorers["e1"].closed or sync.explorers["e1"].error is None


async def test_an_explorer_comes_back_on_the_same_wire_after_its_session_ended():
    """Issue 34 item 8: serve_remote keeps serving its wire — after an explorer was lost (and
    answered the Close) or left, a new Explorer on the same wire is attached, from the newest
    version (before: nobody listened; it waited connect_timeout for "no answer")."""
    state = trainer_state()
    a, b = inproc_pair(timeout=HANG_GUARD)
    cfg = dict(style="trainer_driven", liveness_timeout=0.3, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            sync.serve_remote(a)
            async with Explorer("e0", rollout_model(), b) as first:
                await wait_closed(sync, "e0")  # silent: lost
                await first._finished.wait()  # told so
            assert isinstance(first.error, ExplorerLostError)
            train_to(state, 1)
            await trainer.sync_weight(1)
            async with Explorer("e0", rollout_model(), b, connect_timeout=5) as again:
                assert again.version == 1 and holds(again.slot.model, 1)
                await again.leave()
            async with Explorer("e1", rollout_model(), b, connect_timeout=5) as other:
                assert other.version == 1
                train_to(state, 2)
                await trainer.sync_weight(2)
                assert await other.sync_weight() == 2 and holds(other.slot.model, 2)
                await trainer.stop()


@pytest.mark.parametrize("joined_before", [True, False])
async def test_an_explorer_on_a_wire_whose_synchronizer_closed_is_told_so_at_once(joined_before):
    """Issue 34 item 8: once the synchronizer closed, nobody serves the wires it served; an
    Explorer that joins on one fails at once, saying why (before: it waited connect_timeout for
    "no answer from the synchronizer" — 120 s by default)."""
    state = trainer_state()
    a, b = inproc_pair(timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(dict(style="trainer_driven", sync_timeout=HANG_GUARD), PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            sync.serve_remote(a)
            if joined_before:
                async with Explorer("e0", rollout_model(), b) as first:
                    await trainer.stop()
                assert first.version == 0 and first.error is None
        with pytest.raises(EndOfStream, match="nobody serves this wire — the synchronizer .*closed"):
            async with Explorer("e0", rollout_model(), b, connect_timeout=2 * HANG_GUARD):
                pass


class HeartbeatCounter(Transport):
    """The synchronizer's end towards an explorer: counts the Heartbeats that arrive and sets
    ``reached`` at the ``n``-th counted one (counting starts at :meth:`start`)."""

    def __init__(self, inner: Transport, n: int) -> None:
        self.inner, self.n, self.counted, self.counting = inner, n, 0, False
        self.reached = anyio.Event()

    def start(self) -> None:
        self.counting = True

    async def send(self, payload) -> None:
        await self.inner.send(payload)

    async def recv(self):
        msg = await self.inner.recv()
        if self.counting and isinstance(msg, Heartbeat):
            self.counted += 1
            if self.counted >= self.n:
                self.reached.set()
        return msg

    def close(self) -> None:
        self.inner.close()


async def test_an_explorer_waiting_in_a_call_is_alive():
    """A call in progress is a sign of life: a FIXED explorer under NCCL that waits at its sync
    point for the trainer's next window, longer than liveness_timeout, is not declared lost
    (before: the chaos scenario lost every explorer this way).

    Heartbeats go out at most every liveness_timeout / 4: seven counted after the call began
    (at most one of them from before it) span at least five intervals of the call, longer than
    the bound. Without the fix at most two go out after the call began and the session is lost
    instead; the test waits for whichever comes first."""
    state = trainer_state()
    counters: list[HeartbeatCounter] = []

    def factory(name: str):
        a, b = inproc_pair(timeout=HANG_GUARD)
        counters.append(HeartbeatCounter(a, 7))
        return counters[-1], b

    cfg = dict(method="nccl", style="fixed", liveness_timeout=0.5, sync_timeout=HANG_GUARD,
               delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=factory) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            counter, done = counters[-1], anyio.Event()

            async def until_lost() -> None:
                await wait_closed(sync, "e0")
                done.set()

            async def until_counted() -> None:
                await counter.reached.wait()
                done.set()

            async with anyio.create_task_group() as tg:
                counter.start()
                tg.start_soon(ex.sync_weight)  # waits for the next window
                async with anyio.create_task_group() as watch:
                    watch.start_soon(until_lost)
                    watch.start_soon(until_counted)
                    await done.wait()
                    watch.cancel_scope.cancel()
                assert not sync.explorers["e0"].lost, sync.explorers["e0"].error
                train_to(state, 1)
                await trainer.step_done()
            assert not sync.explorers["e0"].lost and ex.version == 1 and holds(ex.slot.model, 1)
            await trainer.stop()


async def test_nccl_attach_after_a_train_step_without_a_publish_serves_the_live_weights_as_a_new_version():
    """NCCL joiners are served from the live tensors: when the trainer trained since its last
    publish, they are a new version (before: they were stamped with the last published
    version, a lease saw weights that were not that version's)."""
    state = trainer_state()
    cfg = dict(method="nccl", style="fixed", sync_interval=2, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            train_to(state, 1)
            await trainer.step_done()  # step 1: no sync (interval 2)
            assert trainer.version == 0
            ex = await sync.attach_explorer("e0", rollout_model())  # from the trainer's task
            async with ex.lease() as (model, version):
                assert version == 1 and holds(model, 1)
            await trainer.stop()
