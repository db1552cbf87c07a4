"""The GPU device and stream rules (issue 18, items 1-4), checked on CPU with a fake CUDA state:
CUDA's current device and current stream are per thread, so what a worker thread runs under
must be carried there from the caller. The real-GPU checks are in ``test_gpu.py``."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

import aiosync.aio as aio
import hostile_cases as hc
from aiosync.aio import bind_cuda, resolve_device, run_sync


class FakeCuda:
    """A per-thread current device and per-(thread, device) current stream, as CUDA keeps them."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.local = threading.local()
        self.events: list = []

    def _state(self):
        if not hasattr(self.local, "device"):
            self.local.device, self.local.streams = 0, {}
        return self.local

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self._state().device

    def current_stream(self, device=None):
        st = self._state()
        i = st.device if device is None else (device if isinstance(device, int) else device.index)
        return st.streams.get(i, FakeStream(i, 0))

    def set_device(self, i: int) -> None:
        self._state().device = i

    def device(self, i: int):
        fake = self

        class Guard:
            def __enter__(self):
                self.prev = fake.current_device()
                fake.set_device(i)

            def __exit__(self, *exc):
                fake.set_device(self.prev)

        return Guard()

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                st = fake._state()
                self.prev = st.streams.get(s.device_index)
                st.streams[s.device_index] = s

            def __exit__(self, *exc):
                st = fake._state()
                if self.prev is None:
                    st.streams.pop(s.device_index, None)
                else:
                    st.streams[s.device_index] = self.prev

        return Ctx()


class FakeStream:
    def __init__(self, device_index: int, stream_id: int) -> None:
        self.device_index, self.stream_id = device_index, stream_id

    def __eq__(self, other):
        return isinstance(other, FakeStream) and (self.device_index, self.stream_id) == (other.device_index,
                                                                                         other.stream_id)

    def __hash__(self):
        return hash((self.device_index, self.stream_id))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("is_initialized", "is_available", "device_count", "current_device", "current_stream", "set_device",
                 "device", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


# ------------------------------------------------------------------ item 1: the device

async def test_work_in_a_worker_thread_runs_on_the_callers_device_and_stream(fake_cuda):
    side = FakeStream(1, 7)
    fake_cuda.set_device(1)
    with torch.cuda.stream(side):
        seen = await run_sync(lambda: (torch.cuda.current_device(), torch.cuda.current_stream(1),
                                       threading.current_thread() is threading.main_thread()))
    assert seen == (1, side, False)
    # a fresh worker thread alone would be on device 0, default stream
    fresh = await anyio.to_thread.run_sync(lambda: (torch.cuda.current_device(), torch.cuda.current_stream(1)))
    assert fresh == (0, FakeStream(1, 0))


def test_a_pool_worker_runs_bound_work_under_the_callers_context(fake_cuda):
    from concurrent.futures import ThreadPoolExecutor

    side = FakeStream(1, 3)
    fake_cuda.set_device(1)
    with torch.cuda.stream(side), ThreadPoolExecutor(1) as pool:
        bound = pool.submit(bind_cuda(lambda: (torch.cuda.current_device(), torch.cuda.current_stream()))).result()
        plain = pool.submit(lambda: (torch.cuda.current_device(), torch.cuda.current_stream())).result()
    assert bound == (1, side) and plain == (0, FakeStream(0, 0))


def test_other_devices_are_entered_only_where_a_side_stream_is_current(fake_cuda):
    fake_cuda.set_device(1)
    ctx = aio.CudaContext.capture()
    assert ctx.device == 1 and [s.device_index for s in ctx.streams] == [1]  # device 0 is never touched
    with torch.cuda.stream(FakeStream(0, 5)):
        assert [s.device_index for s in aio.CudaContext.capture().streams] == [1, 0]


def test_a_bare_cuda_device_is_the_callers_not_device_0(fake_cuda):
    fake_cuda.set_device(1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cpu") == torch.device("cpu")
    from aiosync.syncers import BucketWeightSyncer
    from aiosync.syncers.snapshot.builder import Snapshot

    assert Snapshot("cuda").device == torch.device("cuda", 1)
    assert BucketWeightSyncer(bucket_device="cuda")._device == torch.device("cuda", 1)


# ------------------------------------------------------------------ item 2: commit after the writes

def test_a_write_records_an_event_after_it_and_waits_before_the_version_commits(fake_cuda, monkeypatch):
    """The patch write (a worker thread) records an event on the caller's stream after its last
    write and waits for it; only then does the receiver commit the version."""
    r, dst0, patch, after = hc.prepared_patch("flat", "zstd")
    dst = {k: v.clone() for k, v in dst0.items()}
    side = FakeStream(0, 9)
    log = []

    class Event:
        def record(self, stream):
            log.append(("record", stream))

        def synchronize(self):
            log.append(("synchronize", r.version, all(torch.equal(dst[k], after[k]) for k in dst)))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(aio, "_cuda_devices", lambda tensors: {(list(tensors), torch.device("cuda", 0))[1]})
    r.version = 1
    with torch.cuda.stream(side):
        assert anyio.run(r.apply_payload, dst, patch) == 2
    assert log[0] == ("record", side)  # on the stream the caller writes under
    assert log[1] == ("synchronize", 1, True)  # written, not yet committed
    assert r.version == 2


# ------------------------------------------------------------------ item 4: the pinned snapshot

def test_the_pinned_snapshot_is_one_block_of_exactly_its_size(monkeypatch):
    from aiosync.syncers.snapshot import builder as snapshot

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(snapshot, "_cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    block = snapshot.PinnedBlock([10, 1000, 4 * 3])
    assert calls == [("register", block.buffer.data_ptr(), 64 + 1024 + 64)]  # not rounded to a power of two
    v = block.view(1, torch.float32)
    assert v.numel() == 250 and v.data_ptr() == block.buffer.data_ptr() + 64
    block.release()
    assert calls[-1] == ("unregister", block.buffer.data_ptr())


# ------------------------------------------------------------------ items 3 and 5 on CPU

def test_the_first_nccl_post_to_a_peer_runs_off_the_event_loop(monkeypatch):
    """Item 3: the first data-group (NCCL) operation to a peer builds that pair's communicator
    and blocks until the peer joins; it is posted from a worker thread while the loop runs on."""
    import torch.distributed as dist

    from aiosync.transports.distributed import transport as tr

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(tr, "is_gloo", lambda group: group == "ctrl")
    monkeypatch.setattr(tr, "_WARM", {})
    joined, posts = threading.Event(), []
    loop_thread = []

    class Work:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def isend(tensor, peer, group=None, tag=0):
        on_loop = threading.current_thread() is loop_thread[0]
        posts.append((group, on_loop))
        if group == "data" and len([p for p in posts if p[0] == "data"]) == 1:
            assert joined.wait(10), "the loop could not run while the first NCCL post waited for the peer"
        return Work()

    monkeypatch.setattr(dist, "isend", isend)

    async def main():
        loop_thread.append(threading.current_thread())
        t = tr.DistributedTransport(1, group="ctrl", data_group="data", device=torch.device("cpu"), timeout=10)

        async def peer_joins():
            await anyio.sleep(0)  # the loop runs while the first post waits
            joined.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(peer_joins)
            await t.send({"w": torch.ones(4)})
        await t.send({"w": torch.ones(4)})

    anyio.run(main)
    data = [on_loop for group, on_loop in posts if group == "data"]
    assert data == [False, True]  # the first off the loop, later ones posted on it


def test_the_torch_builder_needs_two_host_syncs_per_group_not_per_tensor(monkeypatch):
    """Item 5 on CPU (``builder_kernel: torch`` runs the CUDA algorithm): 64 small tensors, each
    changed, cost one ``nonzero`` for the whole build (each is a host sync on a GPU)."""
    from aiosync.syncers.snapshot import cuda as snapshot_cuda
    from aiosync.syncers.snapshot.builder import Snapshot

    tensors = [torch.randn(100 + i) for i in range(64)]
    snap = Snapshot("cpu", kernel="torch")
    snap.load(tensors, [torch.bfloat16] * 64)
    for t in tensors:
        t[::7] += 1.0
    calls = []
    real = torch.nonzero
    monkeypatch.setattr(snapshot_cuda.torch, "nonzero", lambda *a, **k: calls.append(1) or real(*a, **k))
    diffs = snap.diff(tensors)
    assert len(diffs) == 64 and len(calls) == 1
    for d, t in zip(diffs, tensors):
        assert d.positions.tolist() == list(range(0, t.numel(), 7))
        assert torch.equal(snap.tensor(d.slot).view(torch.int16), t.to(torch.bfloat16).view(torch.int16))
