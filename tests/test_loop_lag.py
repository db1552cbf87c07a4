"""The event loop stays free while a large-ish model syncs (SPEC L1, issue 31).

Large memory is let go in bounded pieces, off the loop (:mod:`aiosync.reclaim`): the ticker
test measures the loop's lag (less the time the loop's thread waited for a CPU: a shared CI box)
while a model of tens of millions of elements syncs by every in-process method, and the
structural tests pin the mechanisms that keep it so — no snapshot freed on the thread that
closes it, no checkpoint kept as a mapping of a file that the next publish deletes (unmapping it
then frees its page cache with the GIL held), pages given back piece by piece with the loop
running between pieces. ``examples/loop_lag.py`` measures the same at 200 M elements.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref

import anyio
import pytest
import torch

from aiosync import reclaim
from aiosync.coordination import Synchronizer
from helpers import PATCH

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat and madvise: Linux")

#: The contract (SPEC L1): the loop's worst lag during syncs.
WORST_MS = 20.0


def _runqueue_s(fd: int) -> float:
    try:
        return int(os.pread(fd, 100, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class Ticker:
    """Sleeps a millisecond at a time; records how late it wakes, less the time its thread waited
    for a CPU (what remains is the loop busy, or waiting for the GIL)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.on = False
        self.stop = False

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        try:
            task_status.started()
            while not self.stop:
                r0, t0 = _runqueue_s(fd), time.perf_counter()
                await anyio.sleep(0.001)
                lag = time.perf_counter() - t0 - 0.001 - (_runqueue_s(fd) - r0)
                if self.on:
                    self.lags.append(lag * 1e3)
        finally:
            os.close(fd)


def _model(elements: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(1024, elements // 4096, generator=g) for i in range(4)}


def _step(state: dict[str, torch.Tensor], version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for t in state.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
            flat.index_copy_(0, idx, flat.index_select(0, idx) * (1.0 + 2.0 ** -5))


@pytest.mark.parametrize("method", ["memory", "checkpoint"])
async def test_the_loop_stays_free_while_a_large_model_syncs(method, tmp_path):
    """~30 M fp32 elements, bf16 explorer: the loop's lag (CPU waits taken out) through every
    sync and the stop stays within the contract, but for the host's single hiccups."""
    state = _model(30_000_000)
    explorer = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    cfg = dict(method=method, style="trainer_driven", sync_weight_no_wait=True,
               checkpoint_dir=str(tmp_path) if method == "checkpoint" else None)
    ticker = Ticker()
    gc.collect()
    gc.disable()  # the garbage collector's pauses belong to the test process's heap, not to aiosync
    try:
        await _sync_under_ticker(ticker, cfg, state, explorer)
    finally:
        gc.enable()
    assert all(torch.equal(explorer[k], t.to(torch.bfloat16)) for k, t in state.items())
    assert len(ticker.lags) > 50
    # A stall of aiosync's (a model-sized free or copy on the loop) comes with every sync: 4 syncs
    # and the stop put 5 samples over the contract. The host's own hiccups (one 23 ms sample was
    # seen on an idle 2-core box) are single samples: up to two are let through here, and the
    # worst itself is measured by examples/loop_lag.py, a benchmark, not asserted.
    over = sorted(lag for lag in ticker.lags if lag > WORST_MS)
    assert len(over) <= 2, (f"{len(over)} loop lags over {WORST_MS} ms: {[round(v, 1) for v in over[-8:]]} "
                            f"(p50 {sorted(ticker.lags)[len(ticker.lags) // 2]:.2f} ms)")


async def _sync_under_ticker(ticker: Ticker, cfg: dict, state: dict, explorer: dict) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(ticker.run)
        async with Synchronizer(cfg, PATCH, loop_lag_interval=None) as sync:
            trainer = await sync.attach_trainer(state)
            await sync.attach_explorer("e0", explorer)
            ticker.on = True  # the first attach loads the kernels: not what this measures
            for version in range(1, 5):
                await anyio.to_thread.run_sync(_step, state, version)
                await trainer.sync_weight(version)
                assert await sync.explorers["e0"].line.wait_settled(120)
            await trainer.stop()
        await anyio.sleep(0.05)  # frees handed off at the exit
        ticker.stop = True


async def test_a_snapshot_closed_on_the_loop_is_freed_elsewhere():
    """A sender closed on the loop thread (a session ends, a lineage is dropped) frees its
    snapshot in the reclaimer thread, not on the loop."""
    from aiosync.syncers.snapshot.builder import Snapshot

    snap = Snapshot("cpu")
    snap.load([torch.randn(1 << 20)], [torch.bfloat16])
    freed_in: list = []
    for block in snap._blocks.values():
        weakref.finalize(block, lambda: freed_in.append(threading.current_thread()))
    del block
    snap.close()
    with anyio.fail_after(30):
        while not freed_in:
            await anyio.sleep(0.01)
    assert freed_in[0] is not threading.current_thread()


def _file_backed(ptr: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) >= 6 and fields[5].startswith("/")
    return False


async def test_a_loaded_checkpoint_maps_no_file(tmp_path):
    """The CHECKPOINT source holds a loaded file in memory of its own, never a mapping of it:
    the next publish deletes the file, and unmapping a deleted file's pages then frees its page
    cache with the GIL held — every sync."""
    state = {"w": torch.randn(1 << 20), "b": torch.randn(100)}
    cfg = dict(method="checkpoint", checkpoint_dir=str(tmp_path), style="trainer_driven", sync_weight_no_wait=True)
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        await sync.attach_explorer("e0", {k: torch.zeros_like(v) for k, v in state.items()})
        for version in (1, 2):
            state["w"].add_(1.0)
            await trainer.sync_weight(version)
            await sync.explorers["e0"].line.wait_settled(30)
            loaded = sync.source._cache
            assert loaded.version == version and torch.equal(loaded.state["w"], state["w"])
            assert not _file_backed(loaded.state["w"].data_ptr())


def test_release_gives_pages_back_in_pieces_with_the_gil_free_between_them():
    """A large buffer only its container holds is given back ``PIECE`` bytes per foreign call;
    a thread of Python code keeps running meanwhile; a buffer someone else holds is left alone."""
    big = torch.ones(24 << 20)  # 96 MiB
    kept = torch.ones(2 << 20)
    kept_alias = kept
    before = reclaim.statistics.pieces, reclaim.statistics.released_bytes, reclaim.statistics.shared
    ticks: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=ticker)
    t.start()
    try:
        box = [{"big": big, "kept": kept}]
        del big
        reclaim.release(box, piece=8 << 20)
    finally:
        done.set()
        t.join()
    assert box == []
    assert reclaim.statistics.pieces - before[0] == 12  # 96 MiB in 8 MiB pieces
    assert reclaim.statistics.released_bytes - before[1] == 96 << 20
    assert torch.equal(kept_alias, torch.ones(2 << 20))  # held elsewhere: untouched
    assert len(ticks) > 1


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_a_sent_bucket_is_let_go_off_the_loop(kind):
    """A bootstrap bucket (patch mode) or a sync bucket (bucket mode), once sent, is given back in
    pieces in a worker thread — not freed, GIL held, on the loop's thread by the coroutine that
    sent it (a model's worth per attach or per sync: 20–50 ms at 200 M elements over gloo)."""
    import aiosync

    cfg = {"type": "patch", "patch": {"init_sync": {"enabled": True}}} if kind == "patch" else {"type": "bucket"}
    src = {"a": torch.randn(1024, 4096), "b": torch.randn(1024, 4096)}  # bf16 on the wire: 8 MiB each
    dst = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in src.items()}
    s, r = aiosync.WeightSyncer.create(cfg), aiosync.WeightSyncer.create(cfg)
    a, b = aiosync.inproc_pair(timeout=60)
    freed_on: list = []
    released = reclaim.statistics.released_bytes

    async def send(payload) -> None:
        # The receiver gets its own copy (as over any wire): the sender's bucket is the sender's alone.
        big = [t for t in _tensors(payload) if t.nbytes >= reclaim.LARGE]
        for t in big:
            weakref.finalize(t, lambda: freed_on.append(threading.current_thread()))
        if isinstance(payload, dict):
            payload = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
        await a.send(payload)

    async with anyio.create_task_group() as tg:
        tg.start_soon(s.init_sender, src, list(src), send, a.recv)
        await r.init_receiver(dst, b.recv, b.send)
    if kind == "bucket":
        src["a"][0, :5] += 1.0
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.sync, src, send, 1)
            await r.apply(dst, b.recv)
    assert all(torch.equal(dst[k], v.to(torch.bfloat16)) for k, v in src.items())
    assert len(freed_on) >= 2, freed_on
    assert threading.current_thread() not in freed_on, [x.name for x in freed_on]
    assert reclaim.statistics.released_bytes - released >= 2 * (8 << 20)  # in pieces, not just dropped
    assert reclaim.statistics.released_bytes - released >= 2 * (8 << 20)


async def test_a_payload_someone_else_still_holds_is_left_whole():
    """hand_over after an in-process send (the receiver holds the very object): nothing in it is
    emptied or given back — only the sender's reference goes."""
    payload = {"w": torch.ones(4 << 20), "n": torch.tensor(3)}  # 16 MiB
    held: list = []

    async def send(p) -> None:
        held.append(p)

    box = [payload]
    del payload
    await reclaim.hand_over(send, box)
    assert box == [] and set(held[0]) == {"w", "n"}
    assert torch.equal(held[0]["w"], torch.ones(4 << 20)) and int(held[0]["n"]) == 3


async def test_a_payload_whose_send_failed_is_only_dropped():
    """A send that fails may have posted bytes a transport still reads (a posted send whose wait
    timed out): hand_over then gives nothing back, it only drops its reference."""
    released = reclaim.statistics.released_bytes

    async def send(p) -> None:
        del p  # the traceback keeps no reference: only the box holds the payload
        raise TimeoutError("posted, not waited for")

    box = [{"w": torch.ones(4 << 20)}]
    with pytest.raises(TimeoutError):
        await reclaim.hand_over(send, box)
    assert box == [] and reclaim.statistics.released_bytes == released


@pytest.mark.parametrize("keep_one", [False, True])
def test_a_received_messages_body_is_given_back_whole(keep_one):
    """A message decoded from a torch.distributed frame: one tensor per entry on the body's bytes
    (not views of the body tensor, which would keep it alive unseen). Released by whoever holds
    them, the body goes back in pieces with the last of them — unless one of them is still held
    elsewhere: then nothing of it is touched."""
    from aiosync.transports.distributed import decode_message, encode_message

    sent = {"a": torch.randn(2 << 20), "b": torch.randn(2 << 20), "step": torch.tensor(3)}  # 16 MiB in all
    frame = encode_message(sent)
    got = decode_message(frame.header, frame.host)
    body_bytes = frame.host.numel()
    del frame
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    kept = got["a"] if keep_one else None
    before = reclaim.statistics.released_bytes
    box = [got]
    del got
    reclaim.release(box)
    released = reclaim.statistics.released_bytes - before
    if keep_one:
        assert released == 0 and torch.equal(kept, sent["a"])
    else:
        assert released == body_bytes >= 16 << 20


async def test_a_received_bootstrap_bucket_is_let_go_off_the_loop():
    """The receiving end of a bootstrap: once a bucket is planned, what the plan did not keep of
    it (here all of it: the receiver already holds those values) is given back in a worker
    thread, not freed on the loop's thread when the next bucket replaces it."""
    import aiosync

    cfg = {"type": "patch", "patch": {"init_sync": {"enabled": True}}}
    src = {"a": torch.randn(1024, 4096), "b": torch.randn(1024, 4096)}  # bf16 on the wire: 8 MiB each
    dst = {k: v.to(torch.bfloat16) for k, v in src.items()}  # equal already: the plan keeps no values
    s, r = aiosync.WeightSyncer.create(cfg), aiosync.WeightSyncer.create(cfg)
    a, b = aiosync.inproc_pair(timeout=60)
    freed_on: list = []
    released = reclaim.statistics.released_bytes

    async def send(payload) -> None:
        if isinstance(payload, dict):  # the receiver's own copy, as over a wire, watched
            payload = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
            for t in _tensors(payload):
                if t.nbytes >= reclaim.LARGE:
                    weakref.finalize(t, lambda: freed_on.append(threading.current_thread()))
        await a.send(payload)

    async with anyio.create_task_group() as tg:
        tg.start_soon(s.init_sender, src, list(src), send, a.recv)
        await r.init_receiver(dst, b.recv, b.send)
    assert all(torch.equal(dst[k], v.to(torch.bfloat16)) for k, v in src.items())
    assert len(freed_on) >= 2, freed_on
    assert threading.current_thread() not in freed_on, [x.name for x in freed_on]
    assert reclaim.statistics.released_bytes - released >= 2 * (8 << 20)  # in pieces, not just dropped
