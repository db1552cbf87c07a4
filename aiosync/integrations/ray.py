"""The trainer and explorers as Ray actors (R1), elastic (R2): mixins for your own actor classes.

Nothing here is a new explorer: an explorer actor runs the one :class:`aiosync.Explorer`, over a
:class:`aiosync.transports.ray.RayChannel` to the trainer actor, and the trainer actor serves
it with ``Synchronizer.serve_remote`` — the same protocol as in one process or under
``torchrun``. These mixins only open the channels::

    import ray
    from aiosync.integrations.ray import ExplorerActor, TrainerActor

    @ray.remote
    class Trainer(TrainerActor):                       # an async actor (its methods are coroutines)
        async def train(self, steps):
            async with self.synchronizer(CONFIG, WEIGHT_SYNCER) as sync:    # explorers may connect now
                handle = await sync.attach_trainer(self.policy)
                await sync.wait_for_explorers(2, timeout=120)
                for _ in range(steps):
                    await anyio.to_thread.run_sync(self.train_step)
                    await handle.step_done()
            # drained: every attached explorer holds the last version

    @ray.remote(max_restarts=-1)                       # Ray restarts it if it dies
    class Rollout(ExplorerActor):
        async def run(self, trainer, name):
            async with self.explorer(trainer, name, self.model) as explorer:   # joins: bootstrap, then patches
                while not explorer.trainer_stopped:
                    async with explorer.lease() as (model, version):
                        ...
                    await explorer.step_done()

Elastic. An explorer actor may connect at any time while the trainer's synchronizer runs, leave
(its ``async with`` block ends), or die. A dead explorer actor is detected through Ray — the call
its channel keeps open fails with ``RayActorError`` — and its session is declared lost; the
trainer serves the others on and never waits on it longer than its ``delivery_timeout``. An actor
Ray restarted (``max_restarts``) runs ``__init__`` again; call its method again
(:func:`call_with_restarts` does, from the driver) and it reconnects under the same name: the
trainer drops its old channel, and the explorer is bootstrapped afresh, then gets patches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import ray
from ray.exceptions import RayActorError, RayTaskError

from ..coordination.explorer import Explorer
from ..coordination.synchronizer import Synchronizer
from ..errors import HandshakeError, PeerTimeoutError, TransportError
from ..transports.ray import DEFAULT_OUT_OF_BAND_BYTES, RayChannel, RayEndpoint

__all__ = ["TrainerActor", "ExplorerActor", "ServingStatistics", "CallResult", "call_with_restarts"]

log = logging.getLogger("aiosync.ray")

#: Seconds an explorer allows, beyond ``connect_timeout``, for the trainer actor's answer to come back.
_ANSWER_SLACK = 10.0


@dataclass(frozen=True)
class ServingStatistics:
    """What a trainer actor served: ``joins`` (connections accepted), ``rejoins`` (of them, from
    an actor that had been connected before: it came back after a restart or a leave),
    ``refused``, ``channels_open``, and its channels' counters summed (every channel ever opened)."""

    joins: int
    rejoins: int
    refused: int
    channels_open: int
    messages_sent: int
    bytes_sent: int
    objects_put: int
    bytes_put: int
    objects_reused: int
    bytes_reused: int


@dataclass(eq=False)
class _Serving:
    """The trainer actor's side of the Ray integration (explicit state)."""

    sync: Synchronizer | None = None
    accepting: anyio.Event = field(default_factory=anyio.Event)
    ended: bool = False
    out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES
    #: The newest channel of each explorer actor (by actor id), and every channel ever opened.
    current: dict = field(default_factory=dict)
    channels: list = field(default_factory=list)
    joins: int = 0
    rejoins: int = 0
    refused: int = 0
    connected: anyio.Event = field(default_factory=anyio.Event)

    def notify(self) -> None:
        self.connected.set()
        self.connected = anyio.Event()


class TrainerActor(RayEndpoint):
    """Mixin for the trainer's async Ray actor class: explorer actors connect to it.

    Run the synchronizer with :meth:`synchronizer` inside one of the actor's methods; while the
    block runs, explorer actors (:class:`ExplorerActor`) connect through
    :meth:`aiosync_connect`. The mixin needs no ``__init__`` of its own.
    """

    def _aiosync_serving(self) -> _Serving:
        serving = self.__dict__.get("_aiosync_serving_state")
        if serving is None:
            serving = self.__dict__["_aiosync_serving_state"] = _Serving()
        return serving

    @contextlib.asynccontextmanager
    async def synchronizer(self, config: Any = None, weight_syncer: Any = None, *,
                           out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES,
                           **kwargs: Any) -> AsyncIterator[Synchronizer]:
        """``async with self.synchronizer(config, weight_syncer) as sync``: a
        :class:`~aiosync.Synchronizer` (same arguments) that serves explorer actors while the
        block runs. Leaving it stops accepting, drains (every attached explorer gets the last
        version) and closes the channels. ``out_of_band_bytes``: tensors at least this large
        travel as object-store objects, one per tensor however many explorers get it."""
        serving = self._aiosync_serving()
        if serving.sync is not None:
            raise RuntimeError("this trainer actor already runs a synchronizer")
        serving.ended = False
        serving.out_of_band_bytes = out_of_band_bytes
        serving.joins = serving.rejoins = serving.refused = 0
        serving.channels.clear()
        try:
            async with Synchronizer(config, weight_syncer, **kwargs) as sync:
                serving.sync = sync
                serving.accepting.set()
                try:
                    yield sync
                finally:
                    serving.sync = None
                    serving.ended = True
                    serving.accepting = anyio.Event()
        finally:
            for channel in serving.current.values():
                channel.close()
            serving.current.clear()

    def serving_statistics(self) -> ServingStatistics:
        """What this trainer actor served so far (a frozen snapshot)."""
        serving = self._aiosync_serving()
        stats = [c.statistics() for c in serving.channels]
        return ServingStatistics(
            serving.joins, serving.rejoins, serving.refused,
            sum(not c.closed and c.broken is None for c in serving.channels),
            *(sum(getattr(s, f) for s in stats) for f in
              ("messages_sent", "bytes_sent", "objects_put", "bytes_put", "objects_reused", "bytes_reused")))

    async def wait_for_connections(self, joins: int, timeout: float) -> ServingStatistics:
        """Wait until this trainer actor accepted at least ``joins`` connections since its
        synchronizer started (a restarted explorer's reconnection counts again); returns
        :meth:`serving_statistics`. :class:`~aiosync.errors.PeerTimeoutError` after ``timeout``."""
        serving = self._aiosync_serving()
        with anyio.move_on_after(timeout):
            while serving.joins < joins:
                await serving.connected.wait()
        if serving.joins < joins:
            raise PeerTimeoutError(f"{serving.joins} of {joins} explorer connections within {timeout}s")
        return self.serving_statistics()

    async def aiosync_connect(self, peer: Any, channel: str, name: str, timeout: float) -> bool:
        """Called by an explorer actor (:meth:`ExplorerActor.explorer`): open this end of
        ``channel`` to ``peer`` and serve the explorer ``name`` on it. Waits at most ``timeout``
        seconds for the trainer's synchronizer to start. Returns whether the actor had been
        connected before (a rejoin)."""
        serving = self._aiosync_serving()
        if not serving.ended:
            with anyio.move_on_after(timeout):
                await serving.accepting.wait()
        sync = serving.sync
        if sync is None:
            serving.refused += 1
            why = "its synchronizer has closed" if serving.ended else f"no synchronizer started within {timeout}s"
            raise HandshakeError(f"the trainer actor does not serve explorers ({why}); explorer {name} "
                                 "cannot join. Connect while the trainer runs `async with self.synchronizer(...)`")
        actor = peer._actor_id.hex()
        rejoin = actor in serving.current
        old = serving.current.get(actor)
        if old is not None:
            old.abort(f"explorer actor {name} connected again on a new channel (it was restarted or left)")
            await _wait_session_closed(sync, name, old, timeout)
            old.close()
        ch = RayChannel(peer, channel, timeout=sync.config.delivery_timeout,
                        out_of_band_bytes=serving.out_of_band_bytes)
        ch.watch()  # the explorer's end exists: it made it before calling us
        serving.current[actor] = ch
        serving.channels.append(ch)
        serving.joins += 1
        serving.rejoins += rejoin
        sync.serve_remote(ch)
        serving.notify()
        log.info("aiosync: explorer actor %s connected%s", name, " again" if rejoin else "")
        return rejoin


async def _wait_session_closed(sync: Synchronizer, name: str, wire: RayChannel, timeout: float) -> None:
    """Wait (bounded) until the session on ``wire`` noticed its channel broke, so the name is free."""
    with anyio.move_on_after(timeout):
        while True:
            session = sync.explorers.get(name)
            if session is None or session.wire is not wire or session.closed:
                return
            await sync.source.changed(None)  # a session closing wakes it


class ExplorerActor(RayEndpoint):
    """Mixin for an explorer's async Ray actor class: :meth:`explorer` joins a trainer actor."""

    @contextlib.asynccontextmanager
    async def explorer(self, trainer: Any, name: str, model: Any, *, connect_timeout: float = 120.0,
                       timeout: float = 60.0, **kwargs: Any) -> AsyncIterator[Explorer]:
        """``async with self.explorer(trainer, name, model) as explorer``: connect to the trainer
        actor ``trainer`` (a :class:`TrainerActor`), then run an :class:`aiosync.Explorer`
        (``kwargs`` go to it) over the channel: it joins (bootstrap, first blocking sync) on
        entry and leaves on exit, as anywhere else.

        ``connect_timeout`` bounds the connection and the join; ``timeout`` each send or receive
        on the channel. A trainer actor that is gone raises :class:`~aiosync.errors.TransportError`;
        one that does not serve (its synchronizer not running) :class:`~aiosync.errors.HandshakeError`.
        """
        me = ray.get_runtime_context().current_actor
        channel = RayChannel(trainer, timeout=timeout)
        try:
            try:  # the trainer waits up to connect_timeout for its synchronizer; then Ray brings the answer
                with anyio.fail_after(connect_timeout + _ANSWER_SLACK):
                    await trainer.aiosync_connect.remote(me, channel.channel, name, connect_timeout)
            except TimeoutError:
                raise PeerTimeoutError(f"explorer {name}: the trainer actor did not answer the connection within "
                                       f"{connect_timeout + _ANSWER_SLACK}s") from None
            except RayActorError as exc:
                raise TransportError(f"explorer {name}: the trainer actor is gone ({type(exc).__name__})") from exc
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                raise HandshakeError(f"explorer {name}: {cause}") from exc
            channel.watch()
            async with Explorer(name, model, channel, connect_timeout=connect_timeout, **kwargs) as explorer:
                yield explorer
        finally:
            channel.close()


@dataclass(frozen=True)
class CallResult:
    """What :func:`call_with_restarts` returns: the method's ``value`` and how many times the
    call was made again because Ray restarted the actor under it."""

    value: Any
    restarts: int
    errors: tuple = ()


async def call_with_restarts(actor: Any, method: str, *args: Any, max_restarts: int, restart_timeout: float = 120.0,
                             **kwargs: Any) -> CallResult:
    """Call ``actor.<method>`` from async code (e.g. the driver) until it returns.

    When the call fails because the actor died (``RayActorError``), and Ray restarts it (the
    actor's own ``max_restarts``), the call is made again on the new incarnation — at most
    ``max_restarts`` times, then the error propagates. Before calling again it waits, at most
    ``restart_timeout`` seconds, for the new incarnation to be up (Ray's own readiness call,
    retried by Ray while the actor restarts). Errors the method raises itself propagate at once.
    """
    errors: list[str] = []
    while True:
        try:
            value = await getattr(actor, method).remote(*args, **kwargs)
            return CallResult(value, len(errors), tuple(errors))
        except RayActorError as exc:
            if len(errors) >= max_restarts:
                raise
            text = str(exc).strip()
            errors.append(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
            log.info("aiosync: %s of %s failed (%s); calling it again once the actor is back", method, actor,
                     errors[-1])
        try:
            with anyio.fail_after(restart_timeout):
                await actor.__ray_ready__.options(max_task_retries=-1).remote()
        except TimeoutError:
            raise PeerTimeoutError(f"the actor was not back within restart_timeout={restart_timeout}s after "
                                   f"{errors[-1]}") from None
