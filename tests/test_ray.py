"""The trainer and explorers as Ray actors (R1, R2) on one local Ray cluster for the module.

Every method (MEMORY, CHECKPOINT, NCCL) and style, patch and bucket; a late joiner that leaves;
a killed explorer the trainer stops waiting for through Ray's own signal (its timeouts here are
far longer than the module's hang guard, so a pass shows it never waited them out); a restarted
explorer that rejoins and ends bit-exact (the example); joins that are refused or fail instead
of hanging. Weights are a pure function of the version, so every check is bit-exact. Nothing
asserts on elapsed time; GUARD only turns a hang into a failure.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import anyio
import pytest
import torch

ray = pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402

from aiosync.errors import HandshakeError, TransportError  # noqa: E402
from aiosync.integrations.ray import ExplorerActor, TrainerActor, call_with_restarts  # noqa: E402
from aiosync.transports.ray import RayChannel, RayEndpoint  # noqa: E402
from helpers import BUCKET, PATCH, load_example, weights  # noqa: E402

#: Seconds: only catches hangs (a Ray actor's process start is a few seconds on a loaded CPU).
GUARD = 90.0
#: Timeouts of the kill test: far above GUARD, so only Ray's death signal can end the wait.
LONG = 600.0
EMB = torch.randn(256, 256, generator=torch.Generator().manual_seed(7))  # 128 KiB in bf16: out of band


def state(v: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at version ``v`` (one tensor large enough for the object store)."""
    return {**weights(v), "emb": EMB + 0.125 * v}


def rollout_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(24, 16, dtype=torch.bfloat16), "b": torch.zeros(16), "stamp": torch.tensor(-1),
            "emb": torch.zeros(256, 256, dtype=torch.bfloat16)}


def holds(model: dict[str, torch.Tensor], v: int | None) -> bool:
    """Bit-exact: ``model`` holds version ``v`` cast to its own dtypes."""
    return v is not None and all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in state(v).items())


@pytest.fixture(scope="module", autouse=True)
def cluster():
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Trainer(TrainerActor):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.version = 0
        self._stepped = anyio.Event()

    async def wait_version(self, version: int) -> int:
        while self.version < version:
            await self._stepped.wait()
        return self.version

    async def train(self, config: dict, syncer: dict, versions: int, explorers: int, *,
                    await_joins: dict | None = None, await_closed: dict | None = None) -> dict:
        """Train to ``versions``; after version v: wait for ``await_joins[v]`` connections, or for
        the session ``await_closed[v]`` to end (a leaving explorer)."""
        try:
            return await self._train(config, syncer, versions, explorers, await_joins, await_closed)
        finally:
            self.version = 0  # the next test's wait_version counts from its own run

    async def _train(self, config, syncer, versions, explorers, await_joins, await_closed) -> dict:
        live = state(0)
        async with self.synchronizer(config, syncer) as sync:
            handle = await sync.attach_trainer(live)
            await sync.wait_for_explorers(explorers, timeout=GUARD)
            attached_at: dict = {}
            joined: dict = {}
            left: dict = {}
            for v in range(1, versions + 1):
                for k, t in state(v).items():
                    live[k].copy_(t)
                await handle.step_done()
                self.version = v
                self._stepped.set()
                self._stepped = anyio.Event()
                if await_joins and v in await_joins:
                    await self.wait_for_connections(await_joins[v], timeout=GUARD)
                    await sync.wait_for_explorers(explorers + 1, timeout=GUARD)
                    attached_at = {name: s.version for name, s in sync.explorers.items()}
                    joined = dict(sync.explorers)  # a leaving explorer's session is no longer listed
                if await_closed and v in await_closed:
                    session = joined[await_closed[v]]
                    with anyio.fail_after(GUARD):
                        while not session.closed:
                            await sync.source.changed(None)
                    left = {"lost": session.lost, "version": session.version,
                            "delivered": session.statistics().delivered,
                            "still_listed": session.name in sync.explorers}
                await anyio.sleep(0.02)
            await handle.stop()
        sessions = {name: {"lost": s.lost, "closed": s.closed, "error": None if s.error is None else repr(s.error),
                           "version": s.version} for name, s in sync.explorers.items()}
        return {"version": handle.version, "metrics": sync.metrics(), "sessions": sessions,
                "serving": self.serving_statistics(), "attached_at": attached_at, "left": left}


@ray.remote(num_cpus=0)
class Rollout(ExplorerActor):
    def __init__(self) -> None:
        torch.set_num_threads(1)

    async def run(self, trainer, name: str, leave_at: int | None = None, connect_timeout: float = GUARD) -> dict:
        model = rollout_model()
        seen: set[int] = set()
        async with self.explorer(trainer, name, model, connect_timeout=connect_timeout, timeout=GUARD) as explorer:
            while not explorer.trainer_stopped:
                async with explorer.lease() as (_, version):
                    seen.add(version)
                if leave_at is not None and version >= leave_at:
                    break  # leaves while the trainer still trains
                await explorer.step_done()
                await anyio.sleep(0.005)  # a rollout's worth of work
        return {"version": explorer.version, "holds": holds(model, explorer.version), "seen": sorted(seen),
                "error": None if explorer.error is None else repr(explorer.error)}

    async def try_join(self, trainer, name: str, connect_timeout: float) -> str:
        try:
            async with self.explorer(trainer, name, rollout_model(), connect_timeout=connect_timeout):
                return "joined"
        except (HandshakeError, TransportError) as exc:
            return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def actors():
    trainer, explorers = Trainer.remote(), [Rollout.remote() for _ in range(2)]
    ray.get([trainer.__ray_ready__.remote(), *(e.__ray_ready__.remote() for e in explorers)])
    return trainer, explorers


def run(fn, *args):
    async def guarded():
        with anyio.fail_after(GUARD):
            return await fn(*args)

    return anyio.run(guarded)


async def train_and_explore(trainer, explorers, config, syncer, versions, **train_kw):
    names = [f"e{i}" for i in range(len(explorers))]
    training = trainer.train.remote(config, syncer, versions, len(explorers), **train_kw)
    running = [e.run.remote(trainer, name) for e, name in zip(explorers, names)]
    return await training, {name: await ref for name, ref in zip(names, running)}


# ------------------------------------------------------------------ every method, style and syncer

#: method, style, syncer, sync_weight_no_wait
CASES = [
    ("memory", "trainer_driven", PATCH, True),
    ("checkpoint", "fixed", BUCKET, False),
    ("nccl", "explorer_driven", PATCH, False),
    ("nccl", "trainer_driven", BUCKET, False),
]


@pytest.mark.parametrize("method,style,syncer,no_wait", CASES, ids=[f"{m}-{s}-{c['type']}" for m, s, c, _ in CASES])
def test_every_method_and_style_ends_bit_exact(actors, tmp_path, method, style, syncer, no_wait):
    trainer, explorers = actors
    config = {"method": method, "style": style, "sync_interval": 1, "sync_weight_no_wait": no_wait,
              "sync_timeout": GUARD, "delivery_timeout": GUARD}
    if method == "checkpoint":
        config["checkpoint_dir"] = str(tmp_path / "sync")
    trained, results = run(train_and_explore, trainer, explorers, config, syncer, 5)
    assert trained["version"] == 5
    for name, result in results.items():
        assert result["version"] == 5 and result["holds"], (name, result)
        assert trained["sessions"][name]["version"] == 5 and not trained["sessions"][name]["lost"]
    served = trained["serving"]
    assert served.joins == 2 and served.rejoins == 0
    assert served.bytes_sent > 0 and served.objects_put > 0  # the large tensor travelled as an object
    if (method, style) == ("nccl", "trainer_driven"):
        # every handshake serves both explorers one packet: its object is put once, sent twice
        assert served.objects_reused >= 5, served


# ------------------------------------------------------------------ elastic

def test_late_joiner_is_bootstrapped_gets_patches_and_may_leave(actors):
    trainer, (first, late) = actors
    config = {"method": "memory", "style": "trainer_driven", "sync_timeout": GUARD, "delivery_timeout": GUARD}

    async def scenario():
        training = trainer.train.remote(config, PATCH, 8, 1, await_joins={3: 2}, await_closed={6: "late"})
        staying = first.run.remote(trainer, "first")
        await trainer.wait_version.remote(3)
        leaving = await late.run.remote(trainer, "late", leave_at=5)  # joins at 3, leaves holding 5 or later
        return await training, await staying, leaving

    trained, staying, leaving = run(scenario)
    assert trained["attached_at"]["late"] == 3  # bootstrapped to the trainer's current version, not 0
    assert staying["version"] == 8 and staying["holds"]
    assert leaving["holds"] and 5 <= leaving["version"] < 8
    left = trained["left"]
    assert left["delivered"] >= 3  # the bootstrap, then patches (4, 5, ...) until it left
    assert not left["lost"] and not left["still_listed"]  # it left (detached), it was not lost


def test_killed_explorer_is_declared_lost_through_ray_and_the_trainer_carries_on(actors):
    trainer, (survivor, _) = actors
    victim = Rollout.remote()
    # NCCL handshakes wait for every explorer, blocking syncs wait for every delivery: with
    # timeouts this long, only Ray's death signal lets the trainer go on within GUARD.
    config = {"method": "nccl", "style": "trainer_driven", "sync_timeout": LONG, "delivery_timeout": LONG,
              "liveness_timeout": LONG}

    async def scenario():
        training = trainer.train.remote(config, PATCH, 8, 2)
        staying = survivor.run.remote(trainer, "survivor")
        doomed = victim.run.remote(trainer, "victim")
        await trainer.wait_version.remote(3)
        ray.kill(victim, no_restart=True)
        with pytest.raises(RayActorError):
            await doomed
        return await training, await staying

    trained, staying = run(scenario)
    assert trained["version"] == 8 and staying["version"] == 8 and staying["holds"]
    lost = trained["sessions"]["victim"]
    assert lost["lost"] and "died" in lost["error"] and "TransportError" in lost["error"]
    assert 3 <= lost["version"] < 8
    assert trained["metrics"]["explorers"]["victim"]["last_error"]


def test_restarted_explorer_rejoins_and_ends_bit_exact():
    example = load_example("ray_sync")
    args = argparse.Namespace(steps=10, explorers=2, kill_explorer_at=4, method="memory",
                                      style="trainer_driven", syncer="patch", lr=3e-4, timeout=GUARD,
                                      step_pause=0.05)
    result = anyio.run(example.run, args)
    assert result["bit_exact"] and result["final_version"] == 10
    assert result["restarts"] == 1 and result["rejoined"] == 1
    assert result["versions"] == {"explorer-0": 10, "explorer-1": 10}


# ------------------------------------------------------------------ bounded joins

def test_joins_are_refused_or_fail_instead_of_hanging_and_a_dead_trainer_is_reported(actors):
    trainer, (holder, other) = actors
    config = {"method": "memory", "style": "trainer_driven", "sync_timeout": GUARD, "delivery_timeout": GUARD}

    async def scenario():
        fresh = Trainer.remote()
        out = {"idle": await other.try_join.remote(fresh, "x", 1.0)}  # no synchronizer runs: refused
        training = trainer.train.remote(config, PATCH, 3, 1, await_joins={1: 2})
        holding = holder.run.remote(trainer, "taken")
        await trainer.wait_version.remote(1)
        out["taken"] = await other.try_join.remote(trainer, "taken", GUARD)  # the name is in use
        out["second"] = await other.run.remote(trainer, "second")  # unblocks the trainer's await_joins
        await training
        await holding
        out["closed"] = await other.try_join.remote(trainer, "late", GUARD)  # the synchronizer has closed
        doomed = fresh.train.remote(config, PATCH, 10_000, 1)
        orphan = other.run.remote(fresh, "orphan")
        await fresh.wait_version.remote(2)
        ray.kill(fresh)  # the trainer dies under a running explorer...
        with pytest.raises(TransportError, match="lost the synchronizer"):
            await orphan  # ...whose next call says so instead of hanging
        with pytest.raises(RayActorError):
            await doomed
        out["dead"] = await other.try_join.remote(fresh, "y", GUARD)
        return out

    out = run(scenario)
    assert out["idle"].startswith("HandshakeError") and "no synchronizer started" in out["idle"]
    assert out["taken"].startswith("HandshakeError") and "already attached" in out["taken"]
    assert out["second"]["holds"] and out["second"]["version"] == 3
    assert out["closed"].startswith("HandshakeError") and "has closed" in out["closed"]
    assert out["dead"].startswith("TransportError") and "gone" in out["dead"]


# ------------------------------------------------------------------ the transport alone

@ray.remote(num_cpus=0)
class Peer(RayEndpoint):
    async def open(self, peer, channel: str | None = None) -> str:
        self.channel = RayChannel(peer, channel) if channel else RayChannel(peer)
        return self.channel.channel

    async def send(self, payload) -> dict:
        await self.channel.send(payload)
        await self.channel.send(payload)  # again: its large tensor is not put a second time
        return vars(self.channel.statistics())

    async def recv(self, n: int) -> list:
        return [await self.channel.recv() for _ in range(n)]

    async def recv_error(self) -> str:
        try:
            await self.channel.recv()
        except Exception as exc:  # the type is what we report
            return f"{type(exc).__name__}: {exc}"
        return "received"


def test_channel_carries_payloads_shares_objects_and_breaks_on_peer_death():
    a, b = Peer.remote(), Peer.remote()
    channel = ray.get(a.open.remote(b))
    ray.get(b.open.remote(a, channel))
    big = torch.arange(1 << 15, dtype=torch.float32)  # 128 KiB: out of band
    payload = {"big": big, "small": torch.arange(3, dtype=torch.int16), "raw": b"\x00\x01", "n": (1, 2.5, None)}
    got = b.recv.remote(2)
    stats = ray.get(a.send.remote(payload))
    received = ray.get(got)
    for msg in received:
        assert torch.equal(msg["big"], big) and msg["big"].dtype == torch.float32
        assert torch.equal(msg["small"], payload["small"]) and msg["raw"] == b"\x00\x01" and msg["n"] == (1, 2.5, None)
    assert stats["objects_put"] == 1 and stats["objects_reused"] == 1 and stats["bytes_put"] == big.numel() * 4
    waiting = b.recv_error.remote()
    ray.kill(a)
    error = ray.get(waiting, timeout=GUARD)
    assert error.startswith("TransportError") and "died" in error
