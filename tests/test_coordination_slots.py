"""PolicySlot (atomic version-stamped swap, S8) and LatestSlot (latest-wins coalescing, B4)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aiosync.coordination import LatestSlot, Lease, PolicySlot
from aiosync.errors import ApplyError, ClosedResourceError, EndOfStream, PeerTimeoutError, WouldBlock

pytestmark = pytest.mark.both_loops  # leases, cancellation and writer priority depend on the loop


def stamped(version: int) -> dict[str, torch.Tensor]:
    """A model whose every tensor encodes its version."""
    return {f"t{i}": torch.full((64,), float(version * 10 + i)) for i in range(4)}


def holds(model: dict[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(model[k], v) for k, v in stamped(version).items())


def slow_writer(version: int, *, fail_after: int | None = None):
    """A write that yields to the event loop between tensors (like a bucket receiver)."""

    async def write(model):
        for i, (k, v) in enumerate(stamped(version).items()):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("injected failure half way")
            model[k].copy_(v)
            await anyio.sleep(0)
        return version

    return write


# ------------------------------------------------------------------ PolicySlot

async def test_lease_yields_model_and_version():
    slot = PolicySlot(stamped(3), version=3)
    async with slot.lease() as lease:
        assert isinstance(lease, Lease)
        model, version = lease
        assert version == 3 and holds(model, 3)
        assert slot.readers == 1
    assert slot.readers == 0 and slot.stats.leases == 1


async def test_lease_waits_for_first_weights_and_times_out():
    slot = PolicySlot(stamped(0))  # version None: no weights yet
    with pytest.raises(PeerTimeoutError, match="no weights"):
        async with slot.lease(timeout=0.05):
            pass
    with pytest.raises(WouldBlock):
        with slot.lease_nowait():
            pass

    got = []

    async def reader():
        async with slot.lease(timeout=10) as (model, version):
            got.append((version, holds(model, 1)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0)
        assert got == []  # still waiting
        assert await slot.apply(slow_writer(1)) == 1
    assert got == [(1, True)]


async def test_apply_waits_for_leases_and_blocks_new_ones():
    slot = PolicySlot(stamped(1), version=1)
    events: list[str] = []
    lease_held = anyio.Event()
    release = anyio.Event()

    async def long_rollout():
        async with slot.lease() as (_, version):
            events.append(f"lease{version}-start")
            lease_held.set()
            await release.wait()
            events.append(f"lease{version}-end")

    async def apply():
        await slot.apply(slow_writer(2), backup=False)  # (a backup is taken before the apply waits)
        events.append("applied2")

    async def late_reader():
        async with slot.lease() as (_, version):
            events.append(f"late-lease{version}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_rollout)
        await lease_held.wait()
        tg.start_soon(apply)
        for _ in range(5):
            await anyio.sleep(0)
        tg.start_soon(late_reader)  # arrives while the apply waits: must not overtake it
        for _ in range(5):
            await anyio.sleep(0)
        assert events == ["lease1-start"]
        assert not slot.applying
        release.set()
    assert events == ["lease1-start", "lease1-end", "applied2", "late-lease2"]
    assert holds(slot.model, 2) and slot.version == 2


async def test_no_torn_reads_under_concurrent_applies():
    slot = PolicySlot(stamped(0), version=0, backup=False)
    torn = 0
    reads = 0
    done = anyio.Event()

    async def reader():
        nonlocal torn, reads
        while not done.is_set():
            async with slot.lease() as (model, version):
                for _ in range(3):
                    if not holds(model, version):
                        torn += 1
                    await anyio.sleep(0)
            reads += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(reader)
        for v in range(1, 30):
            await slot.apply(slow_writer(v))
            await anyio.sleep(0)
        done.set()
    assert reads > 0 and slot.version == 29
    assert torn == 0


async def test_the_torn_read_check_catches_unprotected_writes():
    """Control for the test above: the same readers without the slot do see torn models."""
    model = stamped(0)
    version = 0
    torn = 0
    done = anyio.Event()

    async def reader():
        nonlocal torn
        while not done.is_set():
            if not holds(model, version):
                torn += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        for v in range(1, 10):
            await slow_writer(v)(model)
            version = v
        done.set()
    assert torn > 0


async def test_failed_apply_restores_weights_and_version():
    slot = PolicySlot(stamped(5), version=5)
    with pytest.raises(ApplyError, match="rolled back .*version stays 5"):
        await slot.apply(slow_writer(6, fail_after=2))
    assert slot.version == 5 and holds(slot.model, 5)
    assert slot.stats.failed_applies == 1
    assert isinstance(slot.last_error, RuntimeError)
    async with slot.lease(timeout=1) as (model, version):  # the slot is usable again
        assert version == 5
    assert await slot.apply(slow_writer(6)) == 6 and holds(slot.model, 6)
    assert slot.last_error is None


async def test_version_must_strictly_increase():
    slot = PolicySlot(stamped(5), version=5)
    with pytest.raises(ApplyError, match="not above the applied version 5"):
        await slot.apply(slow_writer(5))
    assert slot.version == 5 and holds(slot.model, 5)
    with pytest.raises(ApplyError, match="not an integer"):
        await slot.apply(lambda model: _return("7"))
    assert slot.version == 5


async def _return(value):
    return value


async def test_cancelled_apply_is_rolled_back():
    slot = PolicySlot(stamped(1), version=1)
    started = anyio.Event()

    async def stuck_write(model):
        model["t0"].fill_(-1.0)
        started.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(slot.apply, stuck_write)
        await started.wait()
        tg.cancel_scope.cancel()
    assert slot.version == 1 and holds(slot.model, 1)
    assert not slot.applying and slot.readers == 0


async def test_backup_and_restore_run_off_the_event_loop_thread(monkeypatch):
    slot = PolicySlot(stamped(1), version=1)
    threads = []
    take, restore = slot._take_backup, slot._restore_backup

    def spy(fn):
        def wrapped():
            threads.append(threading.current_thread())
            return fn()
        return wrapped

    monkeypatch.setattr(slot, "_take_backup", spy(take))
    monkeypatch.setattr(slot, "_restore_backup", spy(restore))
    with pytest.raises(ApplyError):
        await slot.apply(slow_writer(2, fail_after=1))
    assert len(threads) == 2
    assert all(t is not threading.main_thread() for t in threads)
    assert holds(slot.model, 1)


async def test_apply_timeout_when_a_lease_is_never_returned():
    slot = PolicySlot(stamped(1), version=1)
    holding, release = anyio.Event(), anyio.Event()

    async def hold():  # another task's lease (one of the applying task itself is refused at once)
        with slot.lease_nowait():
            holding.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await holding.wait()
        with pytest.raises(PeerTimeoutError, match="lease"):
            await slot.apply(slow_writer(2), timeout=0.05)
        release.set()
    assert slot.version == 1 and holds(slot.model, 1)
    assert await slot.apply(slow_writer(2), timeout=1) == 2


async def test_module_models_are_backed_up_too():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    slot = PolicySlot(net, version=0)

    async def bad(model):
        with torch.no_grad():
            model[0].weight.add_(1.0)
            model[1].running_mean.add_(1.0)
        raise ValueError("boom")

    with pytest.raises(ApplyError):
        await slot.apply(bad)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


# ------------------------------------------------------------------ LatestSlot

async def test_latest_slot_coalesces_and_keeps_the_newest():
    box: LatestSlot[int] = LatestSlot()
    assert box.put_nowait(1) is False
    assert box.put_nowait(2) is True
    assert box.put_nowait(3) is True
    assert box.pending == 1 and box.peek() == 3
    assert box.stats.puts == 3 and box.stats.coalesced == 2 and box.stats.max_pending == 1
    assert await box.get() == 3
    with pytest.raises(WouldBlock):
        box.get_nowait()
    with pytest.raises(PeerTimeoutError):
        await box.get(timeout=0.01)


async def test_latest_slot_merge_and_close_never_drop_the_last_item():
    box = LatestSlot(merge=lambda old, new: old + [new[-1]])
    box.put_nowait([1])
    box.put_nowait([2])
    box.close()
    with pytest.raises(ClosedResourceError):
        box.put_nowait([3])
    assert box.get_nowait() == [1, 2]  # the waiting item survives close
    with pytest.raises(EndOfStream):
        await box.get()


async def test_latest_slot_wakes_a_waiting_consumer():
    box: LatestSlot[str] = LatestSlot()
    got = []

    async def consumer():
        got.append(await box.get(timeout=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await anyio.sleep(0)
        box.put_nowait("a")
    assert got == ["a"] and box.pending == 0 and box.stats.taken == 1
