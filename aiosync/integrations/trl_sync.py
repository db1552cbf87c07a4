"""aiosync's side of the TRL integration (:mod:`aiosync.integrations.trl`), free of TRL itself.

* :class:`AiosyncConfig` and :class:`SyncRecord`: what the user sets, what each sync did.
* :class:`LoopThread`: aiosync's coroutines on an event loop of their own (a daemon thread),
  driven from TRL's synchronous code; every call bounded.
* :class:`Bridge`: the synchronizer, the trainer's model attached as the trainer and one engine
  as the explorer — in a one-process trainer, or on rank 0 of a data-parallel one (every rank
  holds the whole model: rank 0 sends, the others only learn the version).
* :class:`ShardedBridge` / :class:`ShardRank`: an FSDP2 trainer of several processes. Rank 0
  runs the synchronizer (NCCL method: syncs at check points) with the trainer attached through
  ``shard_peers``; every other rank runs a :class:`~aiosync.coordination.shards.ShardPeer`.
  Each rank snapshots, diffs and encodes its own shard (docs/distributed.md); rank 0 relays the
  other ranks' encoded patches to the server with its own. Nothing is gathered.
* :class:`Ranks`: the trainer's processes. Rank 0's outcome of each step (a sync's record or its
  error, the versions that generated a batch) goes to every other rank point to point over a
  gloo group of aiosync's own (:class:`~aiosync.transports.distributed.WeightSyncGroup`), each
  wait bounded, a timeout naming what hung.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from ..errors import ApplyError, ConfigError, PeerTimeoutError

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}
#: The point-to-point tag of rank 0's outcomes to the other trainer ranks.
CONTROL_TAG = 0x5A62


@dataclass(frozen=True)
class AiosyncConfig:
    """How aiosync syncs a TRL trainer's vLLM.

    ``weight_syncer`` / ``sync``: aiosync's ``weight_syncer`` and synchronizer configs
    (docs/configuration.md; default: patches coded ``flat``, zstd, fixed sync points; an FSDP2
    trainer of several processes syncs at its check points: its ``sync`` gets ``method: nccl``,
    ``style: trainer_driven``). ``inplace``: colocate mode writes patches in the engine's own
    parameters (default) or through the shadow copy (``False``). ``engine_kwargs``: extra
    ``vllm.LLM`` arguments in colocate mode (on a CPU e.g. ``{"kv_cache_memory_bytes": 64 << 20}``).
    ``key`` / ``key_file``: the key the ``vllm serve`` was started with (server mode; default:
    the environment's ``AIOSYNC_SERVER_KEY_FILE`` / ``AIOSYNC_SERVER_KEY``). ``timeout``: bound on
    each sync and each engine or server call, in seconds. ``rank_timeout``: with several trainer
    processes, how long a rank waits for rank 0's outcome of a step (default ``2 × timeout + 30``).
    ``retries``: deliveries a sync may repair (a restarted server is bootstrapped) before it raises.
    """

    weight_syncer: dict = field(default_factory=lambda: dict(PATCH))
    sync: dict = field(default_factory=lambda: {"style": "fixed"})
    inplace: bool = True
    engine_kwargs: dict = field(default_factory=dict)
    key: str | None = None
    key_file: str | None = None
    timeout: float = 300.0
    rank_timeout: float | None = None
    retries: int = 2

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"AiosyncConfig: timeout must be positive seconds, got {self.timeout!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"AiosyncConfig: retries must be an int >= 0, got {self.retries!r}")
        if self.rank_timeout is None:
            object.__setattr__(self, "rank_timeout", 2 * self.timeout + 30.0)
        elif not self.rank_timeout > 0:
            raise ConfigError(f"AiosyncConfig: rank_timeout must be positive seconds, got {self.rank_timeout!r}")
        if "weight_transfer_config" in self.engine_kwargs:
            raise ConfigError("AiosyncConfig: engine_kwargs must not set weight_transfer_config (aiosync sets "
                              "{'backend': 'aiosync'})")


@dataclass(frozen=True)
class SyncRecord:
    """One sync: the version, what the synchronizer sent the explorer (``bytes``), the elements
    that changed, the engine's pause for the write, and the sync's wall time (seconds). On a
    trainer rank other than 0: rank 0's record (rank 0 sends), its ``seconds`` this rank's."""

    version: int
    bytes: int
    changed_elements: int
    pause_s: float
    seconds: float


class LoopThread:
    """An event loop in a daemon thread; :meth:`call` runs a coroutine function on it from
    synchronous code, bounded by ``timeout``."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._portal: BlockingPortal | None = None
        self._stack = contextlib.ExitStack()
        ready = threading.Event()

        async def main() -> None:
            async with BlockingPortal() as portal:
                self._portal = portal
                ready.set()
                await portal.sleep_until_stopped()

        self._thread = threading.Thread(target=anyio.run, args=(main,), name="aiosync-trl", daemon=True)
        self._thread.start()
        if not ready.wait(30.0):
            raise PeerTimeoutError("aiosync's event loop thread did not start within 30 s")

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` (a coroutine function, or a plain one) on the loop, bounded."""
        if self._portal is None:
            raise ApplyError("aiosync's sync for this TRL trainer is closed")
        timeout, what = timeout or self.timeout, what or getattr(fn, "__name__", "an aiosync call")

        async def bounded() -> Any:
            try:
                with anyio.fail_after(timeout):
                    result = fn(*args)
                    return (await result) if inspect.isawaitable(result) else result
            except TimeoutError:
                raise PeerTimeoutError(f"aiosync: {what} did not finish within {timeout}s "
                                       "(AiosyncConfig.timeout)") from None

        return self._portal.call(bounded)

    def enter(self, cm: Any) -> Any:
        """Enter the async context manager ``cm`` on the loop; it is left by :meth:`close`."""
        return self._stack.enter_context(self._portal.wrap_async_context_manager(cm))

    def close(self) -> None:
        """Leave what :meth:`enter` entered (last first), then stop the loop."""
        try:
            self._stack.close()
        finally:
            portal, self._portal = self._portal, None
            if portal is not None:
                with contextlib.suppress(Exception):
                    portal.call(portal.stop)
                self._thread.join(self.timeout)


class Bridge:
    """aiosync's synchronizer on ``loop``: the trainer's ``model`` attached as the trainer, one
    engine (``explorer_model``) as the explorer ``name``, bootstrapped by :meth:`start` (here,
    when ``model`` is given)."""

    def __init__(self, loop: LoopThread, config: AiosyncConfig, name: str, explorer_model: Any,
                 pause_s: Callable[[], Any], model: Any = None) -> None:
        self.loop, self.config, self.name, self.model = loop, config, name, explorer_model
        self._pause_s = pause_s
        self.version = 0
        self.history: list[SyncRecord] = []
        self.trainer: Any = None
        if model is not None:
            self.start(model)

    def start(self, model: Any) -> None:
        """Attach the trainer's ``model`` and bootstrap the engine (once)."""
        if self.trainer is None:
            self.sync = self.loop.enter(self._synchronizer())
            self.trainer = self.call(self._attach_trainer, model, what="attaching the trainer's model")
            self.explorer = self.call(self.sync.attach_explorer, self.name, self.model,
                                      what=f"bootstrapping the {self.name} engine (its first, full sync)")

    def _synchronizer(self) -> Any:
        from ..coordination import Synchronizer

        return Synchronizer(self.config.sync, self.config.weight_syncer)

    async def _attach_trainer(self, model: Any) -> Any:
        return await self.sync.attach_trainer(model)

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
        return self.loop.call(fn, *args, what=what)

    def sync_weights(self) -> SyncRecord:
        """Publish the trainer's weights as the next version and wait until the engine holds it."""
        version = self.version + 1
        line = self.sync.explorers[self.name].line.stats
        sent, changed = line.bytes_sent, line.changed_elements
        t0 = time.perf_counter()
        self.call(self._sync, version, what=f"the sync of version {version} to the {self.name} engine")
        pause = self.call(self._pause_s, what=f"reading the {self.name} engine's pause")
        record = SyncRecord(version, line.bytes_sent - sent, line.changed_elements - changed, pause,
                            time.perf_counter() - t0)
        self.version = version
        self.history.append(record)
        return record

    async def _sync(self, version: int) -> None:
        await self.trainer.sync_weight(version)
        got = None
        for _ in range(1 + self.config.retries):  # a failed delivery is repaired by the next one
            got = await self.explorer.sync_weight()
            if got == version:
                return
        self._refuse(got, version, 1 + self.config.retries)

    def _refuse(self, got: int | None, version: int, deliveries: int) -> None:
        raise ApplyError(f"the {self.name} engine holds version {got}, not {version}, after {deliveries} "
                         f"deliveries: see sync.metrics()['explorers'][{self.name!r}]")

    def metrics(self) -> dict:
        return self.call(self.sync.metrics, what="sync.metrics()")


#: A sharded trainer's sync: at the trainer's check points, every version pushed to the engine.
SHARDED_SYNC = {"method": "nccl", "style": "trainer_driven", "sync_weight_no_wait": True}


class ShardedBridge(Bridge):
    """Rank 0 of an FSDP2 trainer: the synchronizer, with the other ranks' shards through
    ``peers`` (transports to them). Started at the first sync (the trainer's model is sharded
    by then: accelerate wraps it when training starts), while every other rank serves the
    bootstrap from its shard; each sync is one check point (``step_done``) of every rank."""

    def __init__(self, loop: LoopThread, config: AiosyncConfig, name: str, explorer_model: Any,
                 pause_s: Callable[[], Any], peers: list) -> None:
        self.peers = peers
        super().__init__(loop, config, name, explorer_model, pause_s)

    def _synchronizer(self) -> Any:
        from ..coordination import Synchronizer

        timeouts = {"sync_timeout": self.config.timeout, "delivery_timeout": self.config.timeout}
        return Synchronizer({**self.config.sync, **SHARDED_SYNC, **timeouts}, self.config.weight_syncer)

    async def _attach_trainer(self, model: Any) -> Any:
        return await self.sync.attach_trainer(model, shard_peers=self.peers)

    async def _sync(self, version: int) -> None:
        await self.trainer.step_done()  # this check point's version goes to the engine (pushed)
        if self.trainer.version != version:
            raise ApplyError(f"rank 0's check point published version {self.trainer.version}, not {version}")
        got = await self.explorer.wait_applied(self.config.timeout)
        if got != version:  # under the NCCL method a repair waits for the next check point
            self._refuse(got, version, 1)


class ShardRank:
    """A rank > 0 of an FSDP2 trainer: a :class:`~aiosync.coordination.shards.ShardPeer` over
    ``transport`` to rank 0, entered at the first sync; each sync is its check point."""

    def __init__(self, loop: LoopThread, config: AiosyncConfig, transport: Any) -> None:
        self.loop, self.config, self.transport = loop, config, transport
        self.peer = None

    def start(self, model: Any) -> None:
        """Serve rank 0's bootstrap of the engine from this rank's shard (once; before the first
        check point, a :class:`ShardPeer` serves at any time)."""
        from ..coordination.shards import ShardPeer

        if self.peer is None:
            self.peer = self.loop.enter(ShardPeer(model, self.transport, timeout=self.config.timeout))

    def sync_weights(self) -> None:
        self.loop.call(self.peer.step_done, what="this rank's check point (rank 0's sync of its version)",
                       timeout=self.config.rank_timeout)


class Ranks:
    """The trainer's processes (a collective to make: every rank): rank 0 tells the others the
    outcome of each step, point to point, every wait bounded by ``config.rank_timeout``."""

    def __init__(self, loop: LoopThread, config: AiosyncConfig) -> None:
        from ..transports.distributed import WeightSyncGroup

        self.loop, self.config = loop, config
        self.group = WeightSyncGroup.init(backend="gloo", timeout=config.rank_timeout)
        self.rank, self.world = self.group.rank, self.group.world_size
        self._transports: dict[tuple[int, int], Any] = {}

    def transport(self, peer: int, tag: int) -> Any:
        """This rank's one channel to ``peer`` for ``tag`` (a receive cut short by a timeout stays
        posted on it: the next receive takes that message)."""
        key = (peer, tag)
        if key not in self._transports:
            self._transports[key] = self.group.transport(peer, tag=tag)
        return self._transports[key]

    def share(self, outcome: Callable[[], Any], what: str) -> Any:
        """Rank 0 runs ``outcome()`` and sends what it returns (or the error it raised) to every
        other rank; every rank returns it (or raises that error, as an :class:`ApplyError` on the
        other ranks). A rank that waits longer than ``rank_timeout`` raises a
        :class:`PeerTimeoutError` naming ``what``."""
        if self.rank == 0:
            try:
                value, error = outcome(), None
            except Exception as exc:
                value, error = None, exc
            message = {"value": value, "error": None if error is None else f"{type(error).__name__}: {error}"}
            for r in range(1, self.world):
                self.loop.call(self.transport(r, CONTROL_TAG).send, message,
                               what=f"telling trainer rank {r} rank 0's outcome of {what}")
            if error is not None:
                raise error
            return value
        outcome()
        try:
            message = self.loop.call(self.transport(0, CONTROL_TAG).recv, timeout=self.config.rank_timeout,
                                     what=f"rank 0's outcome of {what}")
        except PeerTimeoutError as exc:
            raise PeerTimeoutError(f"trainer rank {self.rank}: rank 0 did not tell its outcome of {what} within "
                                   f"{self.config.rank_timeout}s (AiosyncConfig.rank_timeout): rank 0 hung or died "
                                   f"({exc})") from None
        if message["error"] is not None:
            raise ApplyError(f"trainer rank {self.rank}: {what} failed on rank 0: {message['error']}")
        return message["value"]


def record_of(value: dict, seconds: float) -> SyncRecord:
    """A :class:`SyncRecord` from rank 0's (sent as a dict), with this rank's wall time."""
    return SyncRecord(**{**value, "seconds": seconds})


def record_dict(record: SyncRecord) -> dict:
    return dataclasses.asdict(record)
