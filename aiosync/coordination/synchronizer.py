"""The :class:`Synchronizer`: coordinates one trainer and many explorers inside an event loop.

Use it as an async context manager inside your own runner; it owns a task group holding one
session per explorer (its delivery line, notices, liveness watch), the in-process explorers'
tasks, and a loop-lag ticker — nothing else::

    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(policy)             # publishes version 0
        explorer = await sync.attach_explorer("e0", rollout)    # first sync: always blocking
        ...  # your trainer and explorer coroutines, see TrainerHandle / Explorer
    # leaving the block stops the trainer and drains: every explorer holds the trainer's last
    # weights, or DrainError names those that do not

The layers, and the path of one sync, are described in ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ..aio import leave_task_group
from ..checkpoints import CheckpointDir
from ..errors import AiosyncError, ConfigError, DrainError, PeerTimeoutError
from ..syncers.factory import syncer_factory
from ..syncers.common.state_dicts import collect_param_names_need_sync
from ..transports.base import Transport
from ..transports.inproc import inproc_pair
from .config import SynchronizerConfig
from .explorer import Explorer
from .fanout import FanOut, FanOutStatistics
from .hub import Hub
from .metrics import LoopLagMonitor, LoopLagStatistics, as_plain, log_metrics
from .protocol import UNSERVED, Close
from .session import ExplorerSession, ExplorerStatistics
from .slots import PolicySlot
from .sources import CheckpointSource, DirectSource, MemorySource
from .staleness import StalenessFilter, StalenessStatistics
from .states import RunningStatus, StatusCell
from .styles import SyncMethod
from .trainer import TrainerHandle, TrainerStatistics
from .verify import verify_drained

log = logging.getLogger("aiosync.sync")

TransportFactory = Callable[[str], "tuple[Transport, Transport]"]


@dataclass(frozen=True)
class SynchronizerStatistics:
    """Everything measured so far (B6), as frozen snapshots."""

    trainer: TrainerStatistics | None
    explorers: dict
    fanout: FanOutStatistics | None
    staleness: StalenessStatistics
    loop_lag: LoopLagStatistics | None


class Synchronizer:
    """Coordinates weight syncs between one trainer and any number of explorers (S1-S13).

    ``config``: a :class:`SynchronizerConfig`, mapping or OmegaConf node (``None``: defaults).
    ``weight_syncer``: a ``weight_syncer`` config (default: the shipped
    ``weight_syncer/patch_syncer``), or a zero-argument callable returning a fresh
    :class:`aiosync.syncers.base.WeightSyncer`. ``transport_factory(name) -> (synchronizer_end,
    explorer_end)`` makes each in-process explorer's channel (default: in-process, zero copy).
    ``loop_lag_interval``: period of the event-loop lag ticker in seconds (``None`` disables
    it). ``fan_out`` (S12, default on): explorers at the same version share one payload built
    once per version (:mod:`aiosync.coordination.fanout`).

    Explorers in other processes attach through :meth:`serve_remote` (``docs/distributed.md``).
    Invalid combinations (bucket + ``sync_weight_no_wait``, ...) raise
    :class:`aiosync.errors.ConfigError` here, before any sync.
    """

    def __init__(self, config: Any = None, weight_syncer: Any = None, *,
                 transport_factory: TransportFactory | None = None,
                 loop_lag_interval: float | None = 0.002, fan_out: bool = True) -> None:
        self.config = cfg = SynchronizerConfig.from_any(config)
        if weight_syncer is None:
            from ..configs import load_config

            weight_syncer = load_config("weight_syncer/patch_syncer")
        syncers = syncer_factory(weight_syncer)
        cfg.check_weight_syncer(syncers)
        if cfg.method is SyncMethod.MEMORY:
            source: Any = MemorySource()
        elif cfg.method is SyncMethod.CHECKPOINT:
            source = CheckpointSource(directory=CheckpointDir(cfg.checkpoint_dir), writers=cfg.checkpoint_writers,
                                      complete_timeout=cfg.sync_timeout)
        else:
            source = DirectSource()
        self.hub = Hub(cfg, syncers, source, FanOut() if fan_out else None)
        delivery_timeout = cfg.delivery_timeout
        self._transport_factory = transport_factory or (lambda name: inproc_pair(timeout=delivery_timeout))
        self.staleness = StalenessFilter(cfg.max_staleness, cfg.staleness_mode, cfg.staleness_decay)
        self.loop_lag = LoopLagMonitor(loop_lag_interval) if loop_lag_interval else None
        self.trainer: TrainerHandle | None = None
        #: A sharded trainer's shards (:class:`~aiosync.syncers.patch.shards.ShardSet`), or ``None``.
        self.shards: Any = None
        #: The explorers' sessions by name, in-process and remote alike (lost ones stay, with their ``error``).
        self.explorers: dict[str, ExplorerSession] = self.hub.sessions
        self._transports: list[Transport] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing = False

    @property
    def source(self):
        """Where published weights wait (one class per method)."""
        return self.hub.source

    @property
    def fanout(self) -> FanOut | None:
        return self.hub.fanout

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> "Synchronizer":
        if self._tg is not None:
            raise RuntimeError("a Synchronizer can be entered once")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            if self.loop_lag is not None:
                await tg.start(self.loop_lag.run)
        except BaseException as exc:
            await leave_task_group(tg, exc)  # whatever ended the entry
            raise
        self._tg = tg
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool | None:
        # A body that failed or was cancelled stops the background tasks (applies in progress
        # roll back or commit whole); its exception propagates unchanged. A drain that cannot
        # deliver raises DrainError once everything is closed.
        drain_error: BaseException | None = None
        drained = False
        self._closing = True
        try:
            if exc_type is None:
                try:
                    await self.drain()
                    drained = True
                except DrainError as err:
                    drain_error = err
        finally:
            # Explorers remember it of their wire: one that joins there again fails at once.
            reason = f"{UNSERVED} the synchronizer closed" if exc_type is None else \
                f"{UNSERVED} the synchronizer closed: the trainer failed: {exc!r}"
            await self._close_sessions(reason, timeout=min(self.config.sync_timeout, 30.0) if drained else 5.0)
            if self.hub.shard_peers is not None:
                await self.hub.shard_peers.close(reason)
            self._shutdown()
            await self._tg.__aexit__(None, None, None)
            if self.fanout is not None:
                with anyio.CancelScope(shield=True):
                    await self.fanout.reap()  # senders nobody follows any more, closed off the loop
        if drain_error is not None:
            raise drain_error
        return None

    async def _close_sessions(self, reason: str, *, timeout: float) -> None:
        """End every session (after the drain, explorers hold the final weights); sessions still
        waiting for a Hello are cancelled with the task group."""
        sessions = [s for s in self.explorers.values() if not s.closed]
        if sessions:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for session in sessions:
                        tg.start_soon(_close, session, reason, timeout)

    def _shutdown(self) -> None:
        for session in self.explorers.values():
            if session.line is not None:
                session.line.close()
        for transport in self._transports:
            close = getattr(transport, "close", None)
            if close is not None:
                close()
        if self.loop_lag is not None:
            self.loop_lag.stop()
        self._tg.cancel_scope.cancel()

    def _require_started(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the Synchronizer as `async with Synchronizer(...) as sync:`")
        return self._tg

    # -- attaching -------------------------------------------------------------------------

    async def attach_trainer(self, model: torch.nn.Module | Mapping[str, torch.Tensor], *, version: int = 0,
                             param_names: Iterable[str] | None = None, writer_rank: int | None = None,
                             shard_peers: Iterable[Transport] | None = None, run_id: str | None = None
                             ) -> TrainerHandle:
        """Register the trainer's model (or state dict) and publish its weights as ``version``.

        Synced keys default to trainable parameters and persistent buffers of a module (W5), or
        every key of a mapping. The trainer moves STOPPED → RUNNING. With ``checkpoint_writers``
        > 1, this process writes shard ``writer_rank`` of every version (default: its
        torch.distributed rank) and the other trainer ranks write theirs, all as run ``run_id``
        (``CHECKPOINT``: the run that holds the directory; default a fresh one, required with
        ``checkpoint_writers`` > 1: :func:`aiosync.checkpoints.shared_run_id`).

        ``shard_peers``: this is rank 0 of a sharded (FSDP2) trainer and these are transports to
        its other ranks, each running a :class:`~aiosync.coordination.shards.ShardPeer`: every
        rank builds its own shard's patches (nothing is gathered); needs the NCCL method and a
        patch syncer (``docs/distributed.md``).
        """
        self._require_started()
        if self.trainer is not None:
            raise RuntimeError("a trainer is already attached")
        writers = self.config.checkpoint_writers
        if run_id is not None or writers > 1:
            if self.config.method is not SyncMethod.CHECKPOINT:
                raise ConfigError(f"attach_trainer(run_id=...) applies to synchronizer.method: checkpoint only "
                                  f"(method is {self.config.method.value})")
            if run_id is None:
                raise ConfigError(f"synchronizer.checkpoint_writers={writers}: pass attach_trainer(..., run_id=), the "
                                  "run id every writer rank publishes with (aiosync.checkpoints.shared_run_id())")
            self.hub.source.directory = CheckpointDir(self.hub.source.directory.path, run_id=run_id)
        if writers > 1:
            if writer_rank is None:
                import torch.distributed as dist

                if not (dist.is_available() and dist.is_initialized()):
                    raise ConfigError(f"synchronizer.checkpoint_writers={writers}: pass attach_trainer(..., "
                                      "writer_rank=) or initialise torch.distributed (its rank is the default)")
                writer_rank = dist.get_rank()
            if not 0 <= writer_rank < writers:
                raise ConfigError(f"attach_trainer: writer_rank {writer_rank} is not in [0, {writers}) "
                                  f"(synchronizer.checkpoint_writers={writers})")
            self.hub.source.writer_rank = writer_rank
        if isinstance(model, torch.nn.Module):
            live = model.state_dict
            names = list(param_names) if param_names is not None else collect_param_names_need_sync(model)
        elif isinstance(model, Mapping):
            live = lambda: model  # noqa: E731
            names = list(param_names) if param_names is not None else list(model)
        else:
            raise TypeError(f"attach_trainer takes an nn.Module or a mapping of tensors, got {type(model).__name__}")
        hub = self.hub
        handle = TrainerHandle(hub, live, names, version, StatusCell("trainer"), self.staleness)
        if shard_peers is not None:
            await self._attach_shards(handle, list(shard_peers))
        if self.config.method is SyncMethod.NCCL:
            window = hub.source.open(live(), version)
            await hub.source.close(window, self.config.delivery_timeout)
        else:
            if self.config.method is SyncMethod.CHECKPOINT:
                hub.source.live = live
            await hub.source.publish(live(), names, version)
        handle.state.set(RunningStatus.RUNNING)
        self.trainer = hub.trainer = handle
        hub.trainer_attached.set()
        return handle

    async def _attach_shards(self, handle: TrainerHandle, transports: list[Transport]) -> None:
        """Rank 0 of a sharded trainer: connect the other ranks, make every delivery line's
        sender a sharded one."""
        from ..syncers.factory import SyncerFactory
        from ..syncers.patch.shards import ShardSet
        from .shards import ShardPeers

        cfg, syncers = self.config, self.hub.syncers
        if cfg.method is not SyncMethod.NCCL:
            raise ConfigError(f"a sharded trainer (shard_peers) syncs at its check points on every rank: use "
                              f"synchronizer.method: nccl (got {cfg.method.value}); MEMORY would copy every shard, "
                              "CHECKPOINT has its own writers (checkpoint_writers)")
        if syncers.config is None or syncers.config.type != "patch":
            raise ConfigError("a sharded trainer (shard_peers) needs a patch weight_syncer config: every rank builds "
                              "its shard's patches (bucket mode: gather the state with gather_full_state instead)")
        if syncers.config.patch.encoding == "ctx":
            raise ConfigError("a sharded trainer (shard_peers) sends flat or coo patches: set weight_syncer.patch."
                              "encoding: flat (a ctx patch decodes against the receiver's own values, which the "
                              "shards of a bootstrap staged with it have not written yet)")
        peers = ShardPeers(transports, timeout=cfg.sync_timeout + cfg.delivery_timeout)
        await peers.connect(handle.names)
        shards = ShardSet(handle.live, handle.names, peers.links, syncers.to_dict(), lambda: handle.step,
                          timeout=cfg.delivery_timeout)
        self.hub.senders = SyncerFactory(shards.make, syncers.config, True, syncers.bootstrap_unless_declared)
        self.hub.shard_peers = peers
        self.hub.stalled = shards.stalled  # a delivery that times out names the rank it waited for
        self.shards = shards

    async def attach_explorer(self, name: str, model: Any, *, version: int | None = None,
                              shard_routes: Any = None) -> Explorer:
        """Attach an explorer in this process: its rollout model (an ``nn.Module``, a dict of
        tensors, or a ready :class:`PolicySlot`) gets the trainer's current weights — the syncer
        pair's init conversation (bootstrap), then a first, always blocking, sync. Explorers may
        join at any time (S12). Returns the :class:`Explorer`; it serves until the synchronizer
        closes, :meth:`detach_explorer`, or ``explorer.leave()``.

        With NCCL, call it while the trainer's weights are not changing (e.g. from the trainer's
        task): the first sync is built from the live tensors. A patch syncer whose ``init_sync``
        is off bootstraps the explorer anyway, unless it declares ``version`` equal to the
        trainer's (its model already holds those weights, as the seed assumes). ``shard_routes``:
        this process's channels to a sharded trainer's ranks that send their parts directly
        (:class:`~aiosync.syncers.patch.shards_direct.ShardRoutes`).
        """
        tg = self._require_started()
        if self.trainer is None:
            raise RuntimeError("attach the trainer first: explorers are bootstrapped from its weights")
        held = self.explorers.get(name)
        if (held is not None and not held.closed) or name in self.hub.joining:
            # A closed session's name is free: a lost explorer is attached again this way (its
            # old model may be given again; it starts from the newest version).
            raise ValueError(f"an explorer named {name!r} is already attached")
        slot = model if isinstance(model, PolicySlot) else PolicySlot(model, version)
        sync_end, explorer_end = self._transport_factory(name)
        self._transports += [sync_end, explorer_end]
        cfg = self.config
        session = ExplorerSession(self.hub, sync_end)
        stats = getattr(slot.model, "statistics", None)
        session.model_statistics = stats if callable(stats) else None  # in its metrics line (a server's state)
        explorer = Explorer(name, slot, explorer_end, weight_syncer=self.hub.syncers,
                            connect_timeout=cfg.sync_timeout + cfg.delivery_timeout, shard_routes=shard_routes)
        try:
            await tg.start(session.run)
            if cfg.method is not SyncMethod.NCCL:
                await tg.start(explorer.run)
                return explorer
            async with self._ranks_serving(), anyio.create_task_group() as join_tg:
                join_tg.start_soon(self._serve_joining)  # its first sync, from the live tensors
                try:
                    await tg.start(explorer.run)
                finally:
                    join_tg.cancel_scope.cancel()
            return explorer
        except BaseException:
            # Failed or cancelled: nothing of this attach is left — no session (its name is free
            # at once), no explorer task, no channel.
            session.abandon()
            explorer.abandon()
            for end in (sync_end, explorer_end):
                close = getattr(end, "close", None)
                if close is not None:
                    close()
            raise

    async def detach_explorer(self, name: str) -> None:
        """End an explorer's session (it is told, bounded by ``sync_timeout``); S12: explorers
        may also leave. Its model keeps the weights it holds."""
        session = self.explorers.get(name)
        if session is None:
            raise KeyError(f"no explorer named {name!r} is attached (attached: {sorted(self.explorers)})")
        del self.explorers[name]
        await session.close("detached", timeout=min(self.config.sync_timeout, 30.0))

    def serve_remote(self, transport: Transport) -> None:
        """Serve an explorer in another process over ``transport`` (e.g.
        ``WeightSyncGroup.transport(rank)``): it attaches when its :class:`Explorer` says Hello
        — now or later (S12, elastic joins) — is bootstrapped, then gets the same deliveries,
        coalescing and fan-out as an in-process explorer. Returns at once; the session runs in
        the synchronizer's task group until the synchronizer closes, the explorer leaves, or it
        is lost (then ``explorers[name].error`` says why and the others are served on).

        The weight syncer's communication options (W4 ``comm_options``) are handed to the
        transport first: one that cannot honour them raises :class:`aiosync.errors.ConfigError`
        here, before anything is sent."""
        tg = self._require_started()
        report = transport.use_comm_options(self.hub.syncers.comm_options)
        if report:
            log.info("aiosync: comm_options on a channel: %s", "; ".join(report.values()))
        tg.start_soon(self._serve_wire, transport, name="aiosync-session")

    async def _serve_wire(self, transport: Transport) -> None:
        """Serve explorers over one wire, one session after another: a session that ended with
        the wire intact (the explorer left, or was declared lost and answered the Close) is
        followed by a new one listening for the next Hello — an explorer that comes back on the
        same wire is attached again. Ends when the wire breaks or the synchronizer closes."""
        hello, intact = None, True
        try:
            while not self._closing:
                session = ExplorerSession(self.hub, transport)
                await session.run(hello)
                if session.mux.error is not None:
                    intact = False
                    return  # the wire is gone
                hello = session.next_hello
        finally:
            if intact and self._closing:
                _leave_unserved(transport)

    async def wait_for_explorers(self, n: int, timeout: float) -> list[str]:
        """Wait until at least ``n`` explorers are attached (in this process or others) and not
        lost or gone; returns their names. :class:`~aiosync.errors.PeerTimeoutError` after
        ``timeout`` seconds.

        With NCCL, call it from the trainer's task: a joining explorer's first sync reads the
        trainer's live tensors, so the handshake for it is served here. A sharded trainer's other
        ranks serve it too meanwhile (they are between steps: their next one waits for this rank).
        """
        def attached() -> list[str]:
            return [name for name, s in self.explorers.items() if s.open]

        with anyio.move_on_after(timeout):
            async with self._ranks_serving():
                while len(attached()) < n:
                    await self._serve_joining_once()
                    await self.hub.source.changed(None)  # an explorer joined, or one waits for a window
        if len(attached()) < n:
            why = self.hub.last_refusal
            raise PeerTimeoutError(f"{len(attached())} of {n} explorers attached within {timeout}s"
                                   + (f" (the last join refused: {why})" if why else ""))
        return attached()

    def _ranks_serving(self) -> Any:
        """A sharded trainer's other ranks serve while this rank serves joiners between steps
        (``ShardPeers.serving``); before the first step and after the last they serve anyway."""
        trainer, peers = self.trainer, self.hub.shard_peers
        if peers is None or trainer is None or trainer.step == 0 or trainer.status is RunningStatus.STOPPED:
            return contextlib.nullcontext()
        return peers.serving(trainer.step)

    async def _serve_joining_once(self) -> None:
        trainer, source = self.trainer, self.hub.source
        if (self.config.method is SyncMethod.NCCL and trainer is not None and source.waiting
                and trainer.status is not RunningStatus.STOPPED):
            await trainer.serve_joining(list(source.waiting))

    async def _serve_joining(self) -> None:
        """Serve joining explorers' first syncs until cancelled."""
        while True:
            await self._serve_joining_once()
            await self.hub.source.changed(None)

    # -- draining --------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> dict[str, int | None]:
        """Stop the trainer (publishing what it trained since its last sync), deliver the last
        published version to every explorer and wait for all applies; returns each explorer's
        applied version. Run on exit of the ``async with`` block.

        Failed deliveries are retried (re-bootstrap) up to three times. Then every explorer's
        whole state is verified against the last version (a mismatch is repaired and verified
        again; :mod:`aiosync.coordination.verify`). Raises :class:`~aiosync.errors.DrainError`
        naming every explorer that does not hold the last version afterwards (and the version it
        holds; for a state that does not match, the tensors that differ), unless it was detached
        or lost.
        """
        cfg = self.config
        timeout = cfg.sync_timeout + cfg.delivery_timeout if timeout is None else timeout
        trainer = self.trainer
        if trainer is not None and trainer.status is not RunningStatus.STOPPED:
            await trainer.stop()  # NCCL: also serves explorers that missed the last version
        if cfg.method is not SyncMethod.NCCL:
            self.hub.source.announce()  # the last publish answers requests still waiting for the trainer

        async def drain_one(session: ExplorerSession) -> None:
            line = session.line
            for _ in range(4):
                if session.closed:
                    return  # lost or detached
                await line.wait_settled(timeout)
                if not line.behind or cfg.method is SyncMethod.NCCL:
                    return  # NCCL: only the live tensors can serve it, and TrainerHandle.stop() did
                await line.wait_served(line.request(), timeout)

        if trainer is not None:
            async with anyio.create_task_group() as tg:
                for session in list(self.explorers.values()):
                    tg.start_soon(drain_one, session)
            await verify_drained(self.hub, trainer, timeout)  # every explorer's whole state, always
        self._check_drained()
        return {name: s.version for name, s in self.explorers.items()}

    def _check_drained(self) -> None:
        latest = self.hub.source.latest
        if latest is None:
            return
        behind = {name: s.version for name, s in self.explorers.items()
                  if not s.closed and (s.line.behind or s.line.busy
                                       or (s.line.state_check is not None and s.line.state_check.mismatched))}
        if behind:
            parts = [f"{name} (holds {version}" + (f"; last error: {self.explorers[name].line.stats.last_error}"
                                                   if self.explorers[name].line.stats.last_error else "") + ")"
                     for name, version in behind.items()]
            raise DrainError(f"leaving the Synchronizer could not bring every explorer to the trainer's last version "
                             f"{latest.version}: " + ", ".join(parts)
                             + ". Their models hold the versions named; detach an explorer you no longer need",
                             explorers=behind, target=latest.version)

    # -- metrics ----------------------------------------------------------------------------

    def statistics(self) -> SynchronizerStatistics:
        """Frozen snapshots of every part (B6)."""
        explorers: dict[str, ExplorerStatistics] = {name: s.statistics() for name, s in self.explorers.items()
                                                    if s.line is not None}
        return SynchronizerStatistics(
            None if self.trainer is None else self.trainer.statistics(), explorers,
            None if self.fanout is None else self.fanout.statistics(), self.staleness.statistics(),
            None if self.loop_lag is None else self.loop_lag.statistics())

    def metrics(self) -> dict[str, Any]:
        """:meth:`statistics` as plain dicts, plus totals, per-explorer staleness and the config."""
        stats = self.statistics()
        out: dict[str, Any] = as_plain(stats)
        totals = dict(requests=0, coalesced=0, delivered=0, failed=0, bytes_sent=0, changed_elements=0)
        for name, row in out["explorers"].items():
            for key in totals:
                totals[key] += row[key]
            if self.trainer is not None and row["version"] is not None:
                row["staleness"] = self.trainer.current_version - row["version"]
        out["totals"] = totals
        out["config"] = self.config.to_dict()
        return out

    def log_metrics(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        """Log :meth:`metrics` as one line (flattened ``key=value`` pairs)."""
        log_metrics(self.metrics(), logger, level)


async def _close(session: ExplorerSession, reason: str, timeout: float) -> None:
    await session.close(reason, timeout=timeout)


def _leave_unserved(wire: Transport) -> None:
    """The last word on a wire this synchronizer served, where the wire buffers it
    (``send_nowait``: in-process wires): an explorer that joins on it later reads it at once
    and fails saying why. Not on point-to-point wires that rendezvous (gloo): a send nobody
    reads must not be left pending at the process's exit — there an explorer remembers the
    closing Close of its last session instead."""
    nowait = getattr(wire, "send_nowait", None)
    if nowait is None:
        return
    try:
        nowait(Close(None, f"{UNSERVED} the synchronizer that served this wire (serve_remote) has closed; "
                           "nobody answers on it any more — join a synchronizer that serves it"))
    except (AiosyncError, OSError) as exc:  # a broken or full wire: its explorer learns it its own way
        log.debug("aiosync: could not leave the closing word on a wire: %s", exc)
