"""Helpers shared by the tests: one home for the toy policy, bit comparisons, the syncer
configs the tests use, a hang guard and a gate for holding messages.

The toy policy's weights are a pure function of the version, so every check is bit-exact and
a torn (or wrong) read is detectable.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import anyio
import torch

from aiosync.errors import PeerTimeoutError
from aiosync.transports.base import Transport
from aiosync.transports.inproc import inproc_pair

#: Seconds: only catches hangs, never measures speed.
HANG_GUARD = 30.0

#: The syncer configs most runtime tests use.
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}
PATCH_COO = {"type": "patch", "patch": {"encoding": "coo", "compression": "none", "init_sync": {"enabled": True}}}
BUCKET = {"type": "bucket", "bucket": {"bucket_size": 512}}

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of the same width (bool → uint8), for bit-exact comparisons."""
    return t.detach().contiguous().view(_BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN equal to itself, 0.0 unequal to -0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------ the toy policy

def weights(v: int) -> dict[str, torch.Tensor]:
    """The trainer's state at version ``v``: fp32 weights and bias, an int64 version stamp."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 16, generator=g)
    b = torch.randn(16, generator=g)
    return {"w": w + 0.25 * v, "b": b - 0.5 * v, "stamp": torch.tensor(v, dtype=torch.int64)}


def trainer_state() -> dict[str, torch.Tensor]:
    return weights(0)


def rollout_model() -> dict[str, torch.Tensor]:
    """The explorer's copy: bf16 weights (a cast receiver), fp32 bias, int64 stamp."""
    return {"w": torch.zeros(24, 16, dtype=torch.bfloat16), "b": torch.zeros(16), "stamp": torch.tensor(-1)}


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    """Bit-exact: the model holds version ``v`` cast to its own dtypes."""
    return all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in weights(v).items())


def train_to(state: dict[str, torch.Tensor], v: int) -> None:
    """Move the trainer's tensors to version ``v`` in place."""
    for k, t in weights(v).items():
        state[k].copy_(t)


# ------------------------------------------------------------------ holding messages

class Gate:
    """Holds the messages a :class:`GatedTransport` sends while closed.

    ``blocked`` is set when a message waits at the gate; tests wait for it (an event, no
    polling), then assert, then :meth:`open`.
    """

    def __init__(self) -> None:
        self.opened = anyio.Event()
        self.opened.set()
        self.blocked = anyio.Event()
        self._changed = anyio.Event()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def close(self) -> None:
        self.opened = anyio.Event()
        self.blocked = anyio.Event()
        self._poke()

    def open(self) -> None:
        self.opened.set()

    def hold(self) -> None:
        """A message waits at the gate now."""
        self.blocked.set()
        self._poke()

    async def wait_blocked(self, timeout: float = HANG_GUARD) -> None:
        """Wait until a message is held at the gate (closed before or after this call)."""
        with anyio.fail_after(timeout):
            while not self.blocked.is_set():
                await self._changed.wait()


class GatedTransport(Transport):
    """A transport end whose sends of messages selected by ``holds(msg)`` wait at ``gate``."""

    def __init__(self, inner: Transport, gate: Gate, holds: Callable[[Any], bool]) -> None:
        self.inner, self.gate, self.holds = inner, gate, holds

    async def send(self, payload: Any) -> None:
        if self.holds(payload) and not self.gate.opened.is_set():
            self.gate.hold()
            await self.gate.opened.wait()
        await self.inner.send(payload)

    async def recv(self) -> Any:
        return await self.inner.recv()

    def close(self) -> None:
        self.inner.close()


def gated(gate: Gate, holds: Callable[[Any], bool]):
    """A ``transport_factory`` whose synchronizer ends hold the messages ``holds`` selects."""
    def factory(name: str):
        a, b = inproc_pair(timeout=HANG_GUARD)
        return GatedTransport(a, gate, holds), b

    return factory


def recv_from(items) -> Callable[[], Any]:
    """A ``recv`` that returns ``items`` one by one, then raises PeerTimeoutError (a silent peer)."""
    it = iter(list(items))

    async def recv():
        try:
            return next(it)
        except StopIteration:
            raise PeerTimeoutError("nothing more arrives") from None

    return recv


async def settle(n: int = 20) -> None:
    """Let every ready task run ``n`` rounds (no time passes)."""
    for _ in range(n):
        await anyio.sleep(0)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dead(directory) -> None:
    """Make the hold of ``directory`` (a CheckpointDir's path, or one) look like its run's process
    died: its pid becomes the pid of a child process that has exited."""
    import json
    import subprocess
    from pathlib import Path

    child = subprocess.Popen(["true"])
    child.wait()
    for path in Path(getattr(directory, "path", directory)).glob(".hold-*.json"):
        fields = json.loads(path.read_text())
        path.write_text(json.dumps(fields | {"pid": child.pid, "start": ""}))


@contextlib.asynccontextmanager
async def two_writer_synchronizer(path, state, shard_of_writer_1):
    """A CHECKPOINT synchronizer whose trainer is writer 0 of 2 (``state``), attached while
    writer 1 (another ``CheckpointDir`` of run ``run``) publishes its shard of version 0;
    yields ``(sync, writer_1)``."""
    import anyio

    from aiosync.aio import run_sync
    from aiosync.checkpoints import CheckpointDir
    from aiosync.coordination import Synchronizer

    other = CheckpointDir(path, run_id="run")
    cfg = dict(method="checkpoint", checkpoint_dir=str(path), checkpoint_writers=2, style="trainer_driven",
               sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD * 2):
        async with Synchronizer(cfg, PATCH) as sync:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: sync.attach_trainer(state, writer_rank=0, run_id="run"))
                await run_sync(other.publish, shard_of_writer_1, 0, writer=(1, 2))  # joins writer 0's hold
            yield sync, other


@contextlib.contextmanager
def in_process_engine(start: Callable[[], Any]):
    """An in-process vLLM engine for one test module, shut down with its distributed state when
    the module ends. Left to the garbage collector, an engine's workers tear down vLLM's global
    model-parallel groups whenever it is collected — possibly while the next module's engine
    runs, which then fails with "pipeline model parallel group is not initialized"."""
    threads = torch.get_num_threads()
    engine = start()
    try:
        yield engine
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        (core or engine).shutdown()
        del engine, core
        cleanup_dist_env_and_memory()
        torch.set_num_threads(threads)  # vLLM lowers it for serving


# ------------------------------------------------------------------ a two-rank sharded trainer

def rank_rows(model: torch.nn.Module, rank: int) -> dict:
    """Rank ``rank``'s pieces of a two-rank FSDP2-like trainer (dim 0 split unevenly, a third
    to rank 0): views of the live parameters, so that every training step shows in both."""
    from aiosync.pieces import TensorSlice

    out = {}
    for key, t in model.state_dict().items():
        cut = max(1, t.shape[0] // 3)
        a, b = (0, cut) if rank == 0 else (cut, t.shape[0])
        out[key] = TensorSlice(t[a:b], (a,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


async def two_rank_syncs(model: torch.nn.Module, explorer_model: Any, steps: int, train: Callable[[int], None],
                         after_bootstrap: Callable[[], Any] | None = None, timeout: float = 30) -> list[int]:
    """Rank 0 (the synchronizer's) and rank 1 (a :class:`~aiosync.coordination.shards.ShardPeer`)
    of a sharded trainer over ``model``, each building the patch of its own rows, syncing
    ``explorer_model`` (explorer ``"e"``) after each of ``steps`` steps of ``train(step)`` (run
    in a thread); ``after_bootstrap()`` is awaited once the explorer is attached. Returns the
    versions the explorer applied; ``timeout`` bounds each wait on a rank or a delivery."""
    from aiosync.coordination import Synchronizer
    from aiosync.coordination.shards import ShardPeer

    names = list(model.state_dict())
    to_peer, peer_end = inproc_pair(max_buffer_size=1, timeout=timeout)
    peer = ShardPeer(rank_rows(model, 1), peer_end, rank=1, names=names, timeout=timeout)
    gates = {v: anyio.Event() for v in range(1, steps + 1)}
    config = dict(method="nccl", style="trainer_driven", sync_weight_no_wait=True, sync_timeout=2 * timeout,
                  delivery_timeout=2 * timeout)

    async def rank1() -> None:
        async with peer:
            for v in range(1, steps + 1):
                await gates[v].wait()
                await peer.step_done()

    async with anyio.create_task_group() as tg:
        tg.start_soon(rank1)
        async with Synchronizer(config, PATCH) as sync:
            trainer = await sync.attach_trainer(rank_rows(model, 0), param_names=names, shard_peers=[to_peer])
            await sync.attach_explorer("e", explorer_model)
            if after_bootstrap is not None:
                await after_bootstrap()
            line = sync.explorers["e"].line
            for v in range(1, steps + 1):
                await anyio.to_thread.run_sync(train, v)
                gates[v].set()
                await trainer.step_done()
                assert await line.wait_settled(2 * timeout)  # each version its own write
            await trainer.stop()
            return list(line.stats.versions_applied)
