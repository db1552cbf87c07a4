"""``aiosync simulate --scenario cancel``: random cancellations of every public await.

A trainer and three explorers run the toy policy of :mod:`aiosync.cli.toy` over simulated links,
and every call into the public API is made under a random budget — already spent (cancelled at
its first await) or a few milliseconds — the way runners bound their awaits (``move_on_after``
rollout budgets, ``asyncio.wait_for``, task groups being cancelled):

* explorers: ``lease()`` (admission and the wait for the slot), ``rollout()`` and its segments,
  ``step_done()``, ``sync_weight()``, ``wait_applied()``; every few steps one explorer is
  detached and attached again with a cancelled ``attach_explorer()`` (with NCCL at the
  trainer's check point: its first sync reads the live tensors);
* the trainer: ``step_done()``.

A call that was cancelled is made again at once, without a budget: it must work
(``failed_after_cancel`` counts the ones that raise). Every lease checks bit for bit that the
model holds the version it reports (``wrong_leases``). ``longest_stale_s`` is the longest any
attached explorer held a version older than the newest published one, measured from the
publish of the first version it lacked; ``exit_s`` how long leaving the ``async with
Synchronizer`` block took once the trainer stopped. The report::

    {"cancellations", "wrong_leases": 0, "failed_after_cancel": 0, "longest_stale_s", "exit_s",
     "final_bit_exact": true, ...}
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..coordination import Synchronizer
from ..transports.inproc import inproc_pair
from ..transports.simulated import simulated_pair
from .toy import ToyPolicy, warm_up_syncer

#: Explorer calls made under a budget, and how often one of them is a re-attach (in trainer steps).
CALLS = ("lease", "rollout", "step_done", "sync_weight", "wait_applied")
REATTACH_EVERY = 10


async def run_cancel(sc: Any, n_explorers: int, seed: int) -> dict[str, Any]:
    """Run the cancel scenario ``sc`` (an :class:`aiosync.cli.simulate.Scenario`)."""
    rng = random.Random(seed)
    policy = ToyPolicy(seed)
    recv_dtype = getattr(torch, sc.receiver_dtype)
    syncer = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}
    await warm_up_syncer(policy, syncer, recv_dtype)
    trainer_state = policy.weights(0)
    config = dict(method=sc.method, style=sc.style, sync_interval=sc.sync_interval, sync_weight_no_wait=sc.no_wait,
                  sync_timeout=sc.sync_timeout, delivery_timeout=sc.delivery_timeout, max_ahead=sc.max_ahead)
    tmp = tempfile.TemporaryDirectory(prefix="aiosync-cancel-") if sc.method == "checkpoint" else None
    if tmp is not None:
        config["checkpoint_dir"] = tmp.name
    seeds = iter(range(seed * 1000, seed * 1000 + 100_000, 2))

    def make_link(name: str):
        if not sc.latency:  # in-process: zero copy, no simulated time
            return inproc_pair(timeout=max(60.0, 4 * sc.delivery_timeout))
        return simulated_pair(latency=sc.latency, jitter=sc.jitter, bandwidth=sc.bandwidth, seed=next(seeds),
                              timeout=max(60.0, 4 * sc.delivery_timeout))

    r: dict[str, Any] = dict(cancellations=0, by_call={}, retries=0, failed_after_cancel=0, failures=[],
                             wrong_leases=0, leases=0, attach_cancels=0, reattached=0, longest_stale_s=0.0)
    published_at: dict[int, float] = {}
    current: dict[str, Any] = {}
    attaching: list = []
    trainer_done = anyio.Event()
    #: Explorers that have yet to re-attach once (a trainer faster than its explorers waits for
    #: them at the end, so every run cancels attaches); ``wake`` when it or ``attaching`` changes.
    pending_reattach: set[str] = {f"e{i}" for i in range(n_explorers) if REATTACH_EVERY + 3 * i <= sc.steps}
    wake = [anyio.Event()]

    def notify() -> None:
        wake[0].set()
        wake[0] = anyio.Event()
    sync = Synchronizer(config, syncer, transport_factory=make_link)
    guard = sc.sync_timeout + sc.delivery_timeout  # a retry that takes longer is a failure

    def on_publish(event: str, version: int | None) -> None:
        if event in ("published", "window_open") and version is not None:
            published_at.setdefault(version, time.monotonic())

    def stale(name: str) -> None:
        ex = current.get(name)
        if ex is None or ex.closed or ex.version is None:
            return
        newer = [v for v in sync.source.history if v > ex.version]
        if newer:
            age = time.monotonic() - published_at.get(min(newer), time.monotonic())
            if age > r["longest_stale_s"]:
                r["longest_stale_s"] = age
                r["stale_at"] = {"explorer": name, "holds": ex.version, "newest": newer[-1],
                                 "trainer_step": sync.trainer.step, "status": ex.status.name,
                                 "requests": len(ex._requests), "delivering": ex._delivering}

    async def budgeted(what: str, fn, *args, budget: float | None = None) -> bool:
        """Call ``fn`` under a random budget (or ``budget``); True when it was cancelled (then it
        is made again)."""
        if budget is None:
            budget = 0.0 if rng.random() < 0.5 else rng.uniform(0.0, sc.cancel_max_s)
        with anyio.move_on_after(budget) as scope:
            await fn(*args)
        if not scope.cancelled_caught:
            return False
        r["cancellations"] += 1
        r["by_call"][what] = r["by_call"].get(what, 0) + 1
        return True

    async def retry(what: str, fn, *args) -> Any:
        r["retries"] += 1
        try:
            with anyio.fail_after(guard):
                return await fn(*args)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            r["failed_after_cancel"] += 1
            r["failures"].append(f"{what}: {type(exc).__name__}: {exc}")
            return None

    async def check(model: Any, version: int, cache: dict) -> None:
        r["leases"] += 1
        if not await run_sync(policy.matches, model, version, cache):
            r["wrong_leases"] += 1

    attached: dict[str, Any] = {}

    async def attach_once(name: str, slot: Any) -> None:
        attached[name] = await sync.attach_explorer(name, slot)

    async def attach_budgeted(name: str, slot: Any) -> Any:
        """``attach_explorer`` under a random budget, made again when it was cancelled."""
        first = name in pending_reattach  # an explorer's first re-attach is always cancelled once
        if await budgeted("attach_explorer", attach_once, name, slot, budget=0.0 if first else None):
            r["attach_cancels"] += 1
            await retry("attach_explorer", attach_once, name, slot)
        return attached.pop(name, None)

    async def reattach(name: str, slot: Any) -> Any:
        if sc.method != "nccl":
            return await attach_budgeted(name, slot)
        if trainer_done.is_set():  # the trainer left while this explorer detached: nobody serves joiners now
            return None
        done, box = anyio.Event(), []  # NCCL: at the trainer's check point (the live tensors do not change)
        attaching.append((name, slot, done, box))  # no await since the check: the trainer's exit sees it
        notify()
        with anyio.fail_after(2 * guard):
            await done.wait()
        return box[0]

    async def explorer_loop(name: str) -> None:
        try:
            await explore(name)
        finally:
            pending_reattach.discard(name)
            notify()

    async def explore(name: str) -> None:
        cache: dict = {}
        ex = current[name]
        next_reattach = REATTACH_EVERY + 3 * int(name[1:])
        while not trainer_done.is_set():
            for other in list(current):
                stale(other)
            call = rng.choice(CALLS)
            if call == "lease":
                async def lease():
                    async with ex.lease() as (model, version):
                        await check(model, version, cache)
                        await anyio.sleep(sc.explore_time)
                if await budgeted("lease", lease):
                    await retry("lease", lease)
            elif call == "rollout":
                async def rollout():
                    async with ex.rollout() as ro:
                        for _ in range(2):
                            async with ro.segment() as (model, version):
                                await check(model, version, cache)
                                await anyio.sleep(sc.explore_time / 2)
                if await budgeted("rollout", rollout):
                    await retry("rollout", rollout)
            else:
                fn = getattr(ex, call)
                if await budgeted(call, fn):
                    await retry(call, fn)
            if sync.trainer.step >= next_reattach and not trainer_done.is_set():
                next_reattach += REATTACH_EVERY * 2
                await sync.detach_explorer(name)
                current.pop(name, None)
                ex = await reattach(name, ex.slot)
                if ex is None:
                    return
                current[name] = ex
                r["reattached"] += 1
                pending_reattach.discard(name)
                notify()
        await ex.stop()

    async def serve_joiners() -> None:
        while attaching:  # NCCL joiners, served where the live tensors do not change
            name, slot, done, box = attaching.pop(0)
            box.append(await attach_budgeted(name, slot))
            done.set()

    async def trainer_loop(trainer: Any) -> None:
        try:
            for step in range(1, sc.steps + 1):
                await run_sync(policy.write, trainer_state, step)
                await anyio.sleep(sc.step_time)
                if await budgeted("trainer.step_done", trainer.step_done) and trainer.step < step:
                    await retry("trainer.step_done", trainer.step_done)  # not counted: the same check point
                await serve_joiners()
                for name in list(current):
                    stale(name)
            with anyio.move_on_after(guard):  # every explorer re-attaches once before the end
                while pending_reattach:
                    await serve_joiners()
                    if pending_reattach:
                        await wake[0].wait()
            await trainer.stop()
        finally:
            trainer_done.set()
            for _, _, done, box in attaching:
                box.append(None)
                done.set()

    t_exit = None
    async with sync:
        sync.source.listeners.append(on_publish)
        trainer = await sync.attach_trainer(trainer_state)
        for i in range(n_explorers):
            current[f"e{i}"] = await sync.attach_explorer(f"e{i}", {
                k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype)
                for k, v in trainer_state.items()})
        async with anyio.create_task_group() as tg:
            for name in list(current):
                tg.start_soon(explorer_loop, name)
            tg.start_soon(trainer_loop, trainer)
        t_exit = time.perf_counter()
    exit_s = time.perf_counter() - t_exit
    final = trainer.version
    final_state = policy.final_state(current, final)
    if tmp is not None:
        tmp.cleanup()
    return {
        "scenario": sc.name, "method": sc.method, "style": sc.style, "no_wait": sc.no_wait,
        "explorers": n_explorers, "steps": trainer.step, "final_version": final,
        "cancellations": r["cancellations"], "cancellations_by_call": r["by_call"], "retries": r["retries"],
        "attach_cancels": r["attach_cancels"], "reattached": r["reattached"],
        "wrong_leases": r["wrong_leases"], "leases": r["leases"], "failed_after_cancel": r["failed_after_cancel"],
        "failures": r["failures"][:10], "longest_stale_s": round(r["longest_stale_s"], 4),
        "stale_at": r.get("stale_at"),
        "loop_lag_max_ms": sync.loop_lag.statistics().max_ms if sync.loop_lag is not None else None,
        "exit_s": round(exit_s, 4),
        "final_bit_exact": bool(final_state) and all(s["version"] == final and not s["differs"]
                                                     for s in final_state.values()),
        "final_state": final_state, "config": sync.config.to_dict(),
        "transport": {"latency_s": sc.latency, "jitter_s": sc.jitter, "bandwidth_Bps": sc.bandwidth},
    }
