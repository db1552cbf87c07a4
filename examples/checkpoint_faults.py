"""Faults of a checkpoint directory, with explorers and a ``CheckpointFollower`` leasing throughout.

Run:  python examples/checkpoint_faults.py --json out.json

Each fault runs in a fresh directory: a trainer publishes versions through a ``Synchronizer``
with ``method: checkpoint``; two in-process explorers and a ``CheckpointFollower`` (an explorer
that reads the directory itself) lease the weights all the time and check, under every lease,
that the model holds exactly the weights of the version the lease reports (``wrong_leases``).
Part way, the fault strikes:

* ``two_trainers`` — a second trainer (another policy) is pointed at the directory.
* ``stale_shard_resume`` — a run with two writers dies after writer 1 wrote its shard of
  version 4; the resumed run publishes from 4; a writer of the dead run that lived on writes again.
* ``bit_flip`` — one mantissa bit of one element flips in a published file.
* ``truncated_file`` — a published file loses its tail.
* ``stranger_file`` — a file the run did not write appears under the name of its next version.
* ``disk_full`` — a publish meets a file size limit (``RLIMIT_FSIZE``: a real ``EFBIG``).
* ``dir_replaced`` — the directory is swapped for another run's (a ``mv`` gone wrong), then put back.

For each: ``wrong_leases`` (must be 0), ``refused_with`` (the aiosync error that refused the
fault, and its message, which names the file or directory) and ``recovered`` (the trainer went on,
and the explorers and the follower end holding its last version, bit for bit). Then the cost of
the digests: ``digest_verify_s_per_gb`` (computing them), ``write_s_per_gb`` and
``read_s_per_gb`` (a whole publish and a whole verified load, digests included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import aiosync
from aiosync.checkpoints import CheckpointDir, TensorSlice
from aiosync.checkpoints.files import tensor_digest
from aiosync.coordination import CheckpointFollower
from aiosync.errors import AiosyncError

STEPS = 8
FAULT_AT = 3
SYNCER = {"type": "patch", "patch": {"init_sync": {"enabled": True}}}


def weights(v: int, run: int = 0) -> dict[str, torch.Tensor]:
    """The policy of ``run`` at version ``v``: every element depends on both."""
    g = torch.Generator().manual_seed(run)
    w = torch.randn(64, 48, generator=g) + 0.125 * v
    return {"w": w, "b": torch.randn(48, generator=g) - 0.25 * v, "stamp": torch.tensor(v)}


def receiver() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 48, dtype=torch.bfloat16), "b": torch.zeros(48), "stamp": torch.tensor(-1)}


class Watch:
    """Leases and checks them; ``expected(version)`` is what a lease at that version must hold."""

    def __init__(self, expected) -> None:
        self.expected, self.leases, self.wrong, self.stop = expected, 0, 0, asyncio.Event()

    def check(self, model, version) -> None:
        if version is None:
            return
        self.leases += 1
        want = self.expected(version)
        if not all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in want.items()):
            self.wrong += 1

    async def explorer(self, ex) -> None:
        while not self.stop.is_set():
            async with ex.lease() as (model, version):
                self.check(model, version)
            await ex.step_done()
            await asyncio.sleep(0.002)

    async def follower(self, follower: CheckpointFollower) -> None:
        while not self.stop.is_set():
            await follower.poll()
            async with follower.lease() as (model, version):
                self.check(model, version)
            await asyncio.sleep(0.002)


def refusal(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc)}


def dead(path: Path) -> None:
    """The run holding ``path`` is gone: its hold names a process that has exited."""
    child = subprocess.Popen(["true"])
    child.wait()
    for hold in path.glob(".hold-*.json"):
        hold.write_text(json.dumps(json.loads(hold.read_text()) | {"pid": child.pid, "start": ""}))


def flip_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + json.loads(raw[8:8 + n])["w"]["data_offsets"][0] + 4 * 7] ^= 1 << 2
    path.write_bytes(bytes(raw))


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Every file this process writes is limited to ``nbytes`` (a write past it: EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


async def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return cond()


async def run_fault(fault: str, root: Path) -> dict:
    path = root / fault
    cfg = {"method": "checkpoint", "checkpoint_dir": str(path), "style": "trainer_driven", "sync_timeout": 10.0,
           "delivery_timeout": 30.0}
    first_run = {}  # stale_shard_resume: the versions the dead run published
    if fault == "stale_shard_resume":
        cfg["checkpoint_writers"] = 2
        await dead_run_with_a_stale_shard(path)
        first_run = {v: weights(v, 7) for v in (1, 2, 3)}
    start = FAULT_AT + 1 if fault == "stale_shard_resume" else 0
    watch = Watch(lambda v: first_run.get(v) or weights(v))
    refused: list = []
    state = weights(start)
    follower = CheckpointFollower(path, receiver(), poll_interval=0.01, timeout=30)
    await follower.poll()  # stale_shard_resume: it followed the dead run up to its version 3
    async with aiosync.Synchronizer(cfg, SYNCER) as sync:
        directory = sync.source.directory
        peer = CheckpointDir(path, run_id="resumed") if fault == "stale_shard_resume" else None
        if peer is not None:  # the resumed run: this rank writes rows 0-31, the peer rank 32-63
            mine = {"w": TensorSlice(state["w"][:32], (0, 0), (64, 48)), "b": state["b"], "stamp": state["stamp"]}
            attach = asyncio.create_task(sync.attach_trainer(mine, writer_rank=0, run_id="resumed", version=start))
            await aiosync.run_sync(peer.publish, {"w": TensorSlice(state["w"][32:], (32, 0), (64, 48))}, start,
                                   writer=(1, 2))
            trainer = await attach
        else:
            trainer = await sync.attach_trainer(state)
        explorers = [await sync.attach_explorer(f"e{i}", receiver()) for i in range(2)]
        tasks = [asyncio.create_task(watch.explorer(ex)) for ex in explorers]
        tasks.append(asyncio.create_task(watch.follower(follower)))
        version, struck = start, False
        try:
            while version < start + STEPS:
                version += 1
                new = weights(version)
                for k, t in new.items():
                    state[k].copy_(t)
                if version == start + FAULT_AT and not struck:
                    struck = True
                    refused += await strike(fault, sync, trainer, path, version, follower)
                try:
                    if peer is not None:
                        mine["w"] = TensorSlice(state["w"][:32], (0, 0), (64, 48))
                        other = aiosync.run_sync(peer.publish, {"w": TensorSlice(state["w"][32:], (32, 0), (64, 48))},
                                                 version, writer=(1, 2))
                        await asyncio.gather(trainer.sync_weight(version), other)
                    else:
                        await trainer.sync_weight(version)
                except AiosyncError as exc:  # a refused publish: the trainer carries on with the next version
                    refused.append(refusal(exc))
                    if fault == "dir_replaced":
                        put_back(path)
                    version -= 1
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.sleep(0.02)
            await trainer.stop()
            final = trainer.version
            done = await wait_until(lambda: all(ex.version == final for ex in explorers) and follower.version == final)
        finally:
            watch.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    refused += [refusal(err) for _, err in sync.source.directory.refused + follower.refused]
    held = [ex.slot.model for ex in explorers] + [follower.slot.model]
    exact = all(torch.equal(m[k], t.to(m[k].dtype)) for m in held for k, t in weights(final).items())
    return {"wrong_leases": watch.wrong, "leases": watch.leases,
            "refused_with": refused[0]["error"] if refused else None,
            "message": refused[0]["message"] if refused else None, "refusals": len(refused),
            "recovered": bool(done and exact and final == start + STEPS)}


async def dead_run_with_a_stale_shard(path: Path) -> None:
    """Run 7 (two writers) published versions 1-3, then died after writer 1 wrote its shard of 4."""
    w0, w1 = CheckpointDir(path, run_id="dead"), CheckpointDir(path, run_id="dead")
    for v in (1, 2, 3, 4):
        full = weights(v, 7)
        if v < 4:
            w0.publish({"w": TensorSlice(full["w"][:32], (0, 0), (64, 48)), "b": full["b"], "stamp": full["stamp"]},
                       v, writer=(0, 2))
        w1.publish({"w": TensorSlice(full["w"][32:], (32, 0), (64, 48))}, v, writer=(1, 2))
    dead(path)
    ZOMBIE[path] = w1


ZOMBIE: dict = {}
SWAPPED: dict = {}


def put_back(path: Path) -> None:
    if path in SWAPPED:
        other, aside = SWAPPED.pop(path)
        os.rename(path, other)
        os.rename(aside, path)


async def strike(fault: str, sync, trainer, path: Path, version: int, follower) -> list:
    """Inject ``fault`` just before ``version`` is published; returns what refused it right away."""
    directory = sync.source.directory
    if fault == "two_trainers":
        try:
            async with aiosync.Synchronizer({"method": "checkpoint", "checkpoint_dir": str(path)}, SYNCER) as other:
                await other.attach_trainer(weights(version + 100, 1), version=version + 100)
        except AiosyncError as exc:
            return [refusal(exc)]
        return []
    if fault == "stale_shard_resume":
        try:  # the dead run's writer 1, which lived on, writes its shard of the next version
            await aiosync.run_sync(ZOMBIE.pop(path).publish, {"w": TensorSlice(torch.ones(32, 48), (32, 0), (64, 48))},
                                   version, writer=(1, 2))
        except AiosyncError as exc:
            return [refusal(exc)]
        return []
    if fault in ("bit_flip", "truncated_file"):
        publish = directory.publish

        def damaged(*args, **kwargs):
            out = publish(*args, **kwargs)
            flip_bit(out) if fault == "bit_flip" else os.truncate(out, out.stat().st_size - 100)
            directory.publish = publish
            return out

        directory.publish = damaged
        return []
    if fault == "stranger_file":  # a copy of the newest file under the name of the next version
        shutil.copyfile(directory.file_for(version - 1), directory.file_for(version))
        await wait_until(lambda: follower.refused)
        return []
    if fault == "disk_full":
        publish = directory.publish

        def limited(*args, **kwargs):
            directory.publish = publish
            with file_size_limit(4096):
                return publish(*args, **kwargs)

        directory.publish = limited
        return []
    if fault == "dir_replaced":  # another run's directory takes this one's place
        other, aside = path.with_name(path.name + "-other"), path.with_name(path.name + "-aside")
        run = CheckpointDir(other, run_id="other-run")
        run.publish(weights(0, 3), 0)
        os.rename(path, aside)
        os.rename(other, path)
        SWAPPED[path] = (other, aside)
        return []
    raise ValueError(f"unknown fault {fault!r}")


def measure(mb: int, root: Path) -> dict:
    """Seconds per GB: the digests alone, a whole publish (digests, write, fsync), a whole verified load."""
    state = {f"t{i}": torch.randn(mb << 16) for i in range(4)}  # 4 tensors of mb/4 MiB... mb MiB in all
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    t0 = time.perf_counter()
    for t in state.values():
        tensor_digest(t)
    digest = time.perf_counter() - t0
    d = CheckpointDir(root / "measure")
    t0 = time.perf_counter()
    d.publish(state, 1)
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    d.load()
    read = time.perf_counter() - t0
    return {"digest_verify_s_per_gb": digest / gb, "write_s_per_gb": write / gb, "read_s_per_gb": read / gb,
            "measured_gb": gb}


FAULTS = ["two_trainers", "stale_shard_resume", "bit_flip", "truncated_file", "stranger_file", "disk_full",
          "dir_replaced"]


async def main(args) -> dict:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG instead
    with tempfile.TemporaryDirectory(prefix="aiosync-faults-") as tmp:
        faults = {}
        for fault in args.faults:
            faults[fault] = await run_fault(fault, Path(tmp))
            print(f"{fault:<20} {json.dumps(faults[fault])}")
        report = {"faults": faults} | measure(args.mb, Path(tmp))
    return report


if __name__ == "__main__":
    from aiosync.cli.args import output_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", type=output_path, default=None)
    p.add_argument("--mb", type=int, default=256, help="MiB of tensors for the cost measurement")
    p.add_argument("--faults", type=lambda s: s.split(","), default=FAULTS)
    args = p.parse_args()
    report = asyncio.run(main(args))
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if any(f["wrong_leases"] or not f["recovered"] or not f["refused_with"] for f in report["faults"].values()):
        raise SystemExit(1)
