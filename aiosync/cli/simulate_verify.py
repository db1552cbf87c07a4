"""``aiosync simulate --scenario verify``: whole-state verification, end to end (issue 35).

One run per method × style (``memory``, ``checkpoint``, ``nccl`` × ``fixed``,
``explorer_driven``, ``trainer_driven``; ``sync_interval`` 3), each with the default
``verify_state`` schedule: a trainer, an explorer attached at the start and a *late joiner*
attached from the trainer's task between two syncs, every explorer rolling out and checking,
under its lease, that its model holds exactly the weights of the version the lease reports (the
toy policy's weights are a function of the version). Patch syncers, ``flat`` and ``coo`` in
turn.

Once per run a fault injector flips one bit of one explorer's weights behind aiosync's back
(inside a lease, in a tensor the trainer never changes: no patch touches it, so only the
whole-state verification can see it). The report counts, over all runs:

* ``injected`` — bits flipped; ``detected`` — mismatches the verification found;
  ``repaired`` — mismatches a later verification found gone (a re-bootstrap). Equal counts say
  that exactly the injected faults were found, and each repaired;
* ``wrong_leases_undetected`` — leases on weights other than the version they report that no
  detection accounts for (a lease after an injection that was then detected, and before its
  repair, is accounted for): must be 0;
* ``verify_overhead`` — the seconds spent on verification (the trainer-side references and the
  explorers' digests) as a fraction of the trainer's step time over the run;
* ``final_bit_exact`` — every explorer holds the trainer's last version after the drain.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..coordination import Synchronizer
from ..errors import PeerTimeoutError
from .toy import ToyPolicy

METHODS = ("memory", "checkpoint", "nccl")
STYLES = ("fixed", "explorer_driven", "trainer_driven")
FROZEN = "frozen.weight"


class FrozenToy(ToyPolicy):
    """The toy policy plus a synced tensor the trainer never changes (a frozen layer)."""

    def weights(self, version: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        out = super().weights(version, dtype)
        out[FROZEN] = torch.linspace(-2.0, 2.0, 4096, dtype=torch.float32).to(dtype)
        return out


def _flip(model: dict[str, torch.Tensor], rng: random.Random) -> None:
    """One bit of one element of the frozen tensor, flipped in place."""
    bits = model[FROZEN].view(torch.int16 if model[FROZEN].element_size() == 2 else torch.int32)
    bits[rng.randrange(bits.numel())] ^= 1 << rng.randrange(8 * model[FROZEN].element_size() - 1)


async def _run(method: str, style: str, encoding: str, steps: int, seed: int, step_time: float,
               explore_time: float) -> dict[str, Any]:
    policy, rng = FrozenToy(seed), random.Random(seed)
    recv_dtype = torch.bfloat16
    state = policy.weights(0)
    tmp = tempfile.TemporaryDirectory(prefix="aiosync-verify-") if method == "checkpoint" else None
    config = dict(method=method, style=style, sync_interval=3, sync_timeout=5.0, delivery_timeout=30.0,
                  checkpoint_dir=tmp.name if tmp is not None else None)
    syncer = {"type": "patch", "patch": {"encoding": encoding, "compression": "zstd" if encoding == "flat" else "none",
                                         "init_sync": {"enabled": True}}}
    join_step, inject_step = max(2, steps // 3) // 3 * 3 + 1, rng.randrange(steps // 4, steps // 2 + 1)
    explorers: list = []
    leases = {"total": 0}
    wrong: list[tuple[str, int]] = []  # (explorer, its repairs so far) per wrong lease
    injected: dict[str, float] = {}
    trainer_done = anyio.Event()
    step_s = 0.0

    def new_model() -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}

    async with Synchronizer(config, syncer) as sync:
        trainer = await sync.attach_trainer(state)

        async def explorer_loop(ex, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
            cache: dict = {}
            task_status.started()
            while not trainer_done.is_set():
                async with ex.lease() as (model, version):
                    if injected.get(ex.name) == -1.0:  # the injector's turn: behind aiosync's back
                        await run_sync(_flip, model, rng)
                        injected[ex.name] = time.monotonic()
                    ok = await run_sync(policy.matches, model, version, cache)
                    await anyio.sleep(explore_time)
                leases["total"] += 1
                if not ok:
                    check = sync.explorers[ex.name].line.state_check
                    wrong.append((ex.name, -1 if check is None else check.repaired))
                await ex.step_done()
            await ex.stop()

        async with anyio.create_task_group() as tg:
            explorers.append(await sync.attach_explorer("explorer0", new_model()))
            await tg.start(explorer_loop, explorers[0])
            try:
                for step in range(1, steps + 1):
                    t0 = time.perf_counter()
                    await run_sync(policy.write, state, step)
                    await anyio.sleep(step_time)
                    try:
                        await trainer.step_done()
                    except PeerTimeoutError:
                        pass
                    step_s += time.perf_counter() - t0
                    if step == join_step:  # a late joiner, between two syncs, from the trainer's task
                        explorers.append(await sync.attach_explorer("joiner", new_model()))
                        await tg.start(explorer_loop, explorers[-1])
                    if step == inject_step:
                        injected[rng.choice(explorers).name] = -1.0  # at its next lease
                await trainer.stop()
            finally:
                trainer_done.set()
    metrics = sync.metrics()["explorers"]
    expected = policy.weights(trainer.version)
    exact = all(ex.version == trainer.version and all(torch.equal(ex.slot.model[k], v.to(ex.slot.model[k].dtype))
                                                      for k, v in expected.items()) for ex in explorers)
    verify = [m["verify"] for m in metrics.values()]
    # a wrong lease is accounted for by an injection into its explorer that a check then found,
    # before that explorer's repair; anything else went unseen
    found = {name for name, m in metrics.items() if m["verify"]["mismatches"]}
    undetected = sum(1 for name, repairs in wrong if name not in injected or name not in found or repairs != 0)
    spent = sum(v["reference_s"]["total"] + v["digest_s"]["total"] for v in verify)
    if tmp is not None:
        tmp.cleanup()
    return {"method": method, "style": style, "encoding": encoding, "versions": trainer.version,
            "injected": sum(1 for t in injected.values() if t > 0), "detected": sum(v["mismatches"] for v in verify),
            "repaired": sum(v["repaired"] for v in verify), "checks": sum(v["checks"] for v in verify),
            "leases": leases["total"], "wrong_leases": len(wrong), "wrong_leases_undetected": undetected,
            "final_bit_exact": exact, "verify_s": spent, "trainer_step_s": step_s,
            "verify_state": sync.config.verify_state, "joined_at_version": metrics["joiner"]["versions_applied"][0]}


async def _all(steps: int, seed: int, step_time: float, explore_time: float, methods, styles) -> list[dict]:
    runs = []
    for i, (method, style) in enumerate((m, s) for m in methods for s in styles):
        runs.append(await _run(method, style, ("flat", "coo")[i % 2], steps, seed + i, step_time, explore_time))
    return runs


def simulate_verify(steps: int | None = None, seed: int = 0, loop: str = "asyncio", methods=METHODS,
                    styles=STYLES, step_time: float = 0.01, explore_time: float = 0.004) -> dict[str, Any]:
    """Run the verify scenario; returns its report (the ``--json`` content)."""
    steps = 36 if steps is None else steps
    if steps < 12:
        raise ValueError("--steps must be at least 12 for the verify scenario (a join, an injection, syncs after)")
    logger = logging.getLogger("aiosync")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the injected mismatches are warnings; the report counts them
    t0 = time.perf_counter()
    try:
        runs = anyio.run(_all, steps, seed, step_time, explore_time, list(methods), list(styles), backend="asyncio",
                         backend_options={"use_uvloop": True} if loop == "uvloop" else {})
    finally:
        logger.setLevel(level)
    step_s = sum(r["trainer_step_s"] for r in runs)
    return {
        "scenario": "verify",
        "runs": len(runs),
        "wrong_leases_undetected": sum(r["wrong_leases_undetected"] for r in runs),
        "injected": sum(r["injected"] for r in runs),
        "detected": sum(r["detected"] for r in runs),
        "repaired": sum(r["repaired"] for r in runs),
        "verify_overhead": sum(r["verify_s"] for r in runs) / step_s if step_s else 0.0,
        "final_bit_exact": all(r["final_bit_exact"] for r in runs),
        "checks": sum(r["checks"] for r in runs),
        "leases": sum(r["leases"] for r in runs),
        "wrong_leases": sum(r["wrong_leases"] for r in runs),
        "verify_state": runs[0]["verify_state"] if runs else None,
        "per_run": runs,
        "wall_s": time.perf_counter() - t0,
    }


def simulate(explorers: int = 2, *, steps: int | None = None, seed: int = 0, loop: str = "asyncio",
             method: str | None = None, style: str | None = None, **_: Any) -> dict[str, Any]:
    """``aiosync simulate --scenario verify``: every method × style (``method``/``style`` narrow it;
    the scenario sets its own explorers). Returns the report."""
    return simulate_verify(steps, seed, loop, methods=[method] if method else METHODS,
                           styles=[style] if style else STYLES)


def summary(report: dict[str, Any]) -> list[str]:
    """The lines ``aiosync simulate`` prints."""
    out = []
    for key in ("runs", "injected", "detected", "repaired", "wrong_leases_undetected", "verify_overhead",
                "final_bit_exact", "checks", "leases", "wrong_leases", "verify_state"):
        value = report[key]
        out.append(f"{key:<24}  {value:.4f}" if isinstance(value, float) else f"{key:<24}  {value}")
    return out


def ok(report: dict[str, Any]) -> bool:
    """Whether every check held (the command's exit status)."""
    return bool(report["final_bit_exact"] and report["wrong_leases_undetected"] == 0)
