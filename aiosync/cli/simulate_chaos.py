"""``aiosync simulate --scenario chaos``: explorers that misbehave, and a synchronizer that serves on.

Three explorers roll out with the toy policy of :mod:`aiosync.cli.simulate` over simulated links
with latency, under ``max_ahead: 1``, FIXED with ``sync_interval: 2``:

* ``steady`` behaves;
* ``silent`` goes silent (no call, no lease) until the synchronizer declares it lost
  (``liveness_timeout``), then calls in late (``step_done``, ``sync_weight``: each raises — the
  report counts the exception names) and is attached again under its name, with its old model;
* ``dropper`` loses its link in the middle of a request (both ends of its wire close while its
  ``sync_weight`` waits), then is attached again on a new link.

Every rollout checks bit for bit that its lease holds the version it reports, and counts the
rollouts that started more than ``max_ahead`` published versions behind the trainer. With NCCL
an explorer is attached again at the trainer's check point (its first sync reads the live
tensors); with the other methods from its own task. At the end every explorer attached then must
hold the trainer's final weights. The report::

    {"synchronizer_errors": 0, "lost", "reattached", "late_calls", "late_call_errors": {name: n},
     "hold_back_timeouts": 0, "max_ahead_exceeded": 0, "steps", "final_bit_exact": true, ...}
"""

from __future__ import annotations

import tempfile
import time
import traceback
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..coordination import Synchronizer
from ..errors import ClosedResourceError, EndOfStream, PeerTimeoutError, TransportError
from ..transports.simulated import simulated_pair
from .toy import ToyPolicy, warm_up_syncer

#: How often (in train steps) a misbehaving explorer misbehaves.
PERIOD = 16
#: Errors a lost session may carry (its wire broke, it went silent): anything else is the
#: synchronizer's own fault.
EXPECTED_LOSS = (PeerTimeoutError, TransportError, EndOfStream, ClosedResourceError)


async def run_chaos(sc: Any, n_explorers: int, seed: int) -> dict[str, Any]:
    """Run the chaos scenario ``sc`` (an :class:`aiosync.cli.simulate.Scenario`)."""
    if n_explorers < 3:
        raise ValueError("--scenario chaos needs --explorers 3 or more (one steady, one silent, one dropping)")
    policy = ToyPolicy(seed)
    recv_dtype = getattr(torch, sc.receiver_dtype)
    syncer = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}
    await warm_up_syncer(policy, syncer, recv_dtype)  # no compile while liveness counts
    trainer_state = policy.weights(0)
    config = dict(method=sc.method, style=sc.style, sync_interval=sc.sync_interval, max_ahead=sc.max_ahead,
                  sync_weight_no_wait=sc.no_wait, sync_timeout=sc.sync_timeout, delivery_timeout=sc.delivery_timeout,
                  liveness_timeout=sc.liveness_timeout)
    tmp = tempfile.TemporaryDirectory(prefix="aiosync-chaos-") if sc.method == "checkpoint" else None
    if tmp is not None:
        config["checkpoint_dir"] = tmp.name
    seeds = iter(range(seed * 1000, seed * 1000 + 100_000, 2))
    links: dict[str, tuple] = {}

    def make_link(name: str):
        links[name] = simulated_pair(latency=sc.latency, jitter=sc.jitter, bandwidth=sc.bandwidth, seed=next(seeds),
                                     timeout=max(60.0, 4 * sc.delivery_timeout))
        return links[name]

    roles = ["steady"] * (n_explorers - 2) + ["silent", "dropper"]
    names = [f"{role}{i}" for i, role in enumerate(roles)]
    r: dict[str, Any] = dict(lost=0, reattached=0, late_calls=0, late_call_errors={}, dropped=0, drop_errors={},
                             max_ahead_exceeded=0, torn_reads=0, torn_at=[], rollouts=0, unexpected_errors=[])
    attaching: list[tuple[str, Any, anyio.Event, list]] = []  # NCCL: attached at the trainer's check point
    current: dict[str, Any] = {}
    trainer_done = anyio.Event()
    sync = Synchronizer(config, syncer, transport_factory=make_link)

    def count(bucket: str, exc: BaseException) -> None:
        r[bucket][type(exc).__name__] = r[bucket].get(type(exc).__name__, 0) + 1

    async def attach_again(name: str, slot: Any) -> Any:
        if sc.method != "nccl":
            return await sync.attach_explorer(name, slot)
        if trainer_done.is_set():  # the trainer left while this explorer was away: nobody serves joiners now
            return None
        done, box = anyio.Event(), []
        attaching.append((name, slot, done, box))  # no await since the check: the trainer's exit sees it
        with anyio.fail_after(20 * sc.liveness_timeout + sc.delivery_timeout):
            await done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    async def until_lost(name: str) -> None:
        session = sync.explorers[name]
        with anyio.fail_after(20 * sc.liveness_timeout + sc.delivery_timeout):
            while not session.closed:
                await sync.source.changed(None)
        r["lost"] += 1

    async def go_silent(ex: Any) -> Any:
        await until_lost(ex.name)
        with anyio.fail_after(sc.delivery_timeout):
            await ex._finished.wait()  # its Close arrives over the link
        for call in (ex.step_done, ex.sync_weight):  # late calls: each raises, saying why
            r["late_calls"] += 1
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 - counted by name in the report
                count("late_call_errors", exc)
        return await attach_again(ex.name, ex.slot)

    async def drop_mid_request(ex: Any) -> Any:
        async with anyio.create_task_group() as tg:
            async def ask() -> None:
                try:
                    await ex.sync_weight(wait=True)
                except Exception as exc:  # noqa: BLE001 - counted by name in the report
                    count("drop_errors", exc)

            tg.start_soon(ask)
            await anyio.sleep(sc.latency / 2)  # the request is on the wire
            links[ex.name][1].close()  # the explorer's end: its process is gone
        r["dropped"] += 1
        await until_lost(ex.name)
        return await attach_again(ex.name, ex.slot)

    async def explorer_loop(name: str, role: str) -> None:
        cache: dict = {}
        ex = current[name]
        next_at = PERIOD // 2 if role == "silent" else PERIOD
        while not trainer_done.is_set():
            async with ex.lease() as (model, version):
                ok = await run_sync(policy.matches, model, version, cache)
                if sync.source.behind(version) > sc.max_ahead:
                    r["max_ahead_exceeded"] += 1
                await anyio.sleep(sc.explore_time)
            if not ok:
                r["torn_reads"] += 1
                r["torn_at"].append({"explorer": name, "version": version, "reattached": r["reattached"],
                                     "trainer_version": sync.trainer.version})
            r["rollouts"] += 1
            try:
                await ex.step_done()
            except Exception as exc:  # noqa: BLE001 - a steady explorer's call must not fail
                r["unexpected_errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                return
            if role != "steady" and sync.trainer.step >= next_at and not trainer_done.is_set():
                next_at += PERIOD
                ex = await (go_silent(ex) if role == "silent" else drop_mid_request(ex))
                if ex is None:  # the run ended while it was away
                    current.pop(name, None)
                    return
                current[name] = ex
                r["reattached"] += 1
        await ex.stop()

    step_times: list[float] = []
    escaped: list[str] = []
    t_start = time.perf_counter()
    try:
        async with sync:
            trainer = await sync.attach_trainer(trainer_state)
            for name in names:
                current[name] = await sync.attach_explorer(name, {
                    k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype)
                    for k, v in trainer_state.items()})

            async def trainer_loop() -> None:
                try:
                    for step in range(1, sc.steps + 1):
                        t0 = time.perf_counter()
                        await run_sync(policy.write, trainer_state, step)
                        await anyio.sleep(sc.step_time)
                        await trainer.step_done()
                        while attaching:  # NCCL: joiners' first syncs read the live tensors, here
                            name, slot, done, box = attaching.pop(0)
                            try:
                                box.append(await sync.attach_explorer(name, slot))
                            except Exception as exc:  # noqa: BLE001 - handed to the explorer's task
                                box.append(exc)
                            done.set()
                        step_times.append(time.perf_counter() - t0)
                    await trainer.stop()
                finally:
                    trainer_done.set()
                    for _, _, done, box in attaching:
                        box.append(None)  # the trainer stopped before the explorer was attached again
                        done.set()

            async with anyio.create_task_group() as tg:
                for name, role in zip(names, roles):
                    tg.start_soon(explorer_loop, name, role)
                tg.start_soon(trainer_loop)
    except BaseException as exc:  # noqa: BLE001 - the synchronizer ended: what the report is about
        escaped.append("".join(traceback.format_exception(exc)))
        if not isinstance(exc, Exception):
            raise
    internal = [f"{name}: {type(s.error).__name__}: {s.error}" for name, s in sync.explorers.items()
                if s.error is not None and not isinstance(s.error, EXPECTED_LOSS)]
    final = sync.trainer.version if sync.trainer is not None else None
    final_state = policy.final_state(current, final)
    if tmp is not None:
        tmp.cleanup()
    stats = sync.trainer.statistics() if sync.trainer is not None else None
    return {
        "scenario": sc.name, "method": sc.method, "explorers": n_explorers, "roles": dict(zip(names, roles)),
        "synchronizer_errors": len(escaped) + len(internal), "synchronizer_error_messages": escaped + internal,
        "lost": r["lost"], "reattached": r["reattached"], "late_calls": r["late_calls"],
        "late_call_errors": r["late_call_errors"], "dropped": r["dropped"], "drop_errors": r["drop_errors"],
        "hold_back_timeouts": stats.hold_back_timeouts if stats else None,
        "hold_back_waits": stats.hold_back_s.count if stats else None,
        "handshake_timeouts": stats.handshake_timeouts if stats else None,
        "max_ahead": sc.max_ahead, "max_ahead_exceeded": r["max_ahead_exceeded"],
        "steps": stats.step if stats else 0, "final_version": final,
        "final_bit_exact": bool(final_state) and all(s["version"] == final and not s["differs"]
                                                     for s in final_state.values()),
        "final_state": final_state, "torn_reads": r["torn_reads"], "torn_at": r["torn_at"][:20],
        "rollouts": r["rollouts"],
        "unexpected_errors": r["unexpected_errors"],
        "trainer_step_ms": 1e3 * sum(step_times) / max(1, len(step_times)),
        "transport": {"latency_s": sc.latency, "jitter_s": sc.jitter, "bandwidth_Bps": sc.bandwidth},
        "config": sync.config.to_dict(), "wall_s": time.perf_counter() - t_start,
    }

