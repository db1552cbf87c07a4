"""Does the event loop stay free while a large model syncs? Loop lag per sync method (L1).

A trainer of four fp32 tensors (``--elements`` in all) publishes ``--syncs`` versions to a
bf16 explorer, a sparse update (``--density`` of the elements) between syncs; a ticker task
sleeps a millisecond at a time and records how late it wakes up — the time the event loop
spent on something else without yielding, whether on the loop's own thread or a worker thread
holding the GIL (tensor deallocation, some copies). Each method runs in a fresh process:

* ``memory`` and ``checkpoint``: the explorer in the trainer's process (its staging and writes
  count too);
* ``nccl``: the NCCL method's handshake, the explorer in a second process over gloo.

Prints (and with ``--json`` writes)::

    {"first_attach_ms": ..., "methods": {"memory": {"sync_worst_ms", "sync_p99_ms",
     "stop_worst_ms", ...}, "checkpoint": {...}, "nccl": {...}}}

``first_attach_ms`` is the worst lag while the trainer and the explorer attach (the first
sync included) in a fresh process, over the methods; each process loads aiosync's kernels before
its event loop starts (``aiosync.warm_up()``, as docs/performance.md recommends; ``--no-warm-up``
leaves them to the background loader) and then calls ``gc.freeze()`` (``--no-gc-freeze`` does
not). The ``*_cpu_adjusted`` figures take out the time the
loop's thread waited for a CPU (a busy machine).

A *canary* runs beside them: a bare Python process (no torch, no aiosync) that sleeps a
millisecond at a time and records when it wakes late although it was neither running nor
waiting for a CPU — a stall of the machine itself (a virtual machine's CPU taken away by its
host), which no code in the measured process causes or can avoid. ``host_worst_ms`` is the
canary's worst during the syncs; the ``*_host_excluded`` figures leave out the ticker's
samples that overlap such a stall of the canary's (``--no-canary`` runs without it). The goal
(SPEC L1): every worst ≤ 20 ms, every p99 ≤ 5 ms, the first attach ≤ 50 ms::

    python examples/loop_lag.py --elements 200000000 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import anyio
import torch
import torch.multiprocessing as mp

import aiosync
from aiosync.coordination import Explorer, Synchronizer
from aiosync.transports.distributed import WeightSyncGroup

RANKS = 2  # nccl: the trainer (rank 0) and one explorer (rank 1)
SYNCER = {"type": "patch", "patch": {"encoding": "flat", "compression": "none", "init_sync": {"enabled": True}}}


def make_model(elements: int) -> dict[str, torch.Tensor]:
    """Four fp32 tensors of ``elements // 4`` elements each (rows of 4096)."""
    rows = 4096
    cols = max(1, elements // (4 * rows))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(4)}


def explorer_model(elements: int) -> dict[str, torch.Tensor]:
    """The explorer's bf16 model, zeros: its first sync (the bootstrap) writes every element."""
    cols = max(1, elements // (4 * 4096))
    return {f"layer{i}.weight": torch.zeros(4096, cols, dtype=torch.bfloat16) for i in range(4)}


def same(model: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    """Whether the explorer holds the trainer's weights cast to bf16, bit for bit."""
    return all(torch.equal(model[k], t.to(torch.bfloat16)) for k, t in state.items())


def sparse_step(state: dict[str, torch.Tensor], version: int, density: float) -> None:
    """Scale ``density`` of each tensor's elements by 1 + 2**-5 (their bf16 values change); the
    temporaries are O(changed), so the step itself frees nothing large."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for t in state.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * density)),), generator=g)
            flat.index_copy_(0, idx, flat.index_select(0, idx) * (1.0 + 2.0 ** -5))


def _runqueue_wait(fd: int | None) -> float:
    """Seconds a thread has waited for a CPU while ready to run: its Linux schedstat (``fd``, opened
    on that thread); 0 elsewhere."""
    if fd is None:
        return 0.0
    try:
        return int(os.pread(fd, 100, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class Ticker:
    """Sleeps ``interval`` at a time and records when it woke and how late, in milliseconds: as
    measured, and less the time the loop's thread waited for a CPU meanwhile (other processes on
    a busy machine: what remains is the loop waiting for the GIL or busy itself)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []
        self.stopped = False

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = None
        task_status.started()
        while not self.stopped:
            r0, t0 = _runqueue_wait(fd), time.monotonic()
            await anyio.sleep(self.interval)
            t1, r1 = time.monotonic(), _runqueue_wait(fd)
            lag = max(0.0, t1 - t0 - self.interval)
            self.samples.append((t1, lag * 1e3, max(0.0, lag - (r1 - r0)) * 1e3))

    def between(self, start: float, end: float, adjusted: bool = False) -> list[float]:
        return [s[2 if adjusted else 1] for s in self.samples if start <= s[0] <= end]


def summary(lags: list[float]) -> dict[str, float]:
    lags = sorted(lags)
    if not lags:
        return {"worst_ms": 0.0, "p99_ms": 0.0, "samples": 0}
    return {"worst_ms": round(lags[-1], 2), "p99_ms": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))], 2),
            "samples": len(lags)}


#: The canary: sleeps 1 ms at a time and appends ``<woke at> <late by, less its CPU waits>`` (seconds,
#: CLOCK_MONOTONIC) to the file it is given, for every wake-up more than 2 ms late.
CANARY = r"""
import os, sys, time
try:
    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
except OSError:
    fd = None
def waited():
    return 0.0 if fd is None else int(os.pread(fd, 100, 0).split()[1]) / 1e9
with open(sys.argv[1], "a", buffering=1) as out:
    while True:
        r0, t0 = waited(), time.monotonic()
        time.sleep(0.001)
        t1, r1 = time.monotonic(), waited()
        late = t1 - t0 - 0.001 - (r1 - r0)
        if late > 0.002:
            out.write(f"{t1:.6f} {late:.6f}\n")
"""

#: A canary stall at least this long (seconds) marks the ticker's samples it overlaps as the host's.
HOST_STALL = 0.004


def host_stalls(path: str | None) -> list[tuple[float, float]]:
    """The canary's stalls so far: ``(start, end)`` in CLOCK_MONOTONIC seconds."""
    if not path or not os.path.exists(path):
        return []
    stalls = []
    with open(path) as fh:
        for line in fh:
            try:
                end, late = (float(x) for x in line.split())
            except ValueError:
                continue
            stalls.append((end - late - 0.001, end))
    return stalls


def overlaps(start: float, end: float, stalls: list[tuple[float, float]], least: float = HOST_STALL) -> bool:
    return any(a < end and b > start and b - a - 0.001 >= least for a, b in stalls)


async def trainer_side(method: str, args: argparse.Namespace, state: dict, model: dict | None = None,
                       connect=None) -> dict:
    """The trainer's process: the synchronizer, the ticker, and (``model``) an in-process explorer."""
    ticker = Ticker()
    tmp = tempfile.TemporaryDirectory(prefix="aiosync-lag-") if method == "checkpoint" else None
    # The explorer only receives (no call into its API): it must not be declared lost on a slow host.
    config = {"method": method, "style": "trainer_driven", "sync_weight_no_wait": True, "sync_timeout": 600,
              "delivery_timeout": 600, "liveness_timeout": 600}
    if tmp is not None:
        config["checkpoint_dir"] = tmp.name
    report: dict = {"elements": sum(t.numel() for t in state.values())}
    async with anyio.create_task_group() as tg:
        await tg.start(ticker.run)
        await anyio.sleep(0.05)
        t0 = time.monotonic()
        async with Synchronizer(config, SYNCER, loop_lag_interval=None) as sync:
            trainer = await sync.attach_trainer(state)
            if connect is None:
                explorer = await sync.attach_explorer("e0", model)
                names = ["e0"]
            else:
                sync.serve_remote(connect)
                names = await sync.wait_for_explorers(1, timeout=600)
            t1 = time.monotonic()
            windows: list[tuple[float, float]] = []
            for version in range(1, args.syncs + 1):
                await anyio.to_thread.run_sync(sparse_step, state, version, args.density)
                s0 = time.monotonic()
                await trainer.sync_weight(version)
                for name in names:
                    if not await sync.explorers[name].line.wait_settled(600):
                        raise TimeoutError(f"version {version} was not delivered to {name}")
                windows.append((s0, time.monotonic()))
            t2 = time.monotonic()
            await trainer.stop()
        t3 = time.monotonic()
        await anyio.sleep(0.05)  # frees handed off at the exit show up here
        t4 = time.monotonic()
        ticker.stopped = True
        if connect is None:
            report["bit_exact"] = await anyio.to_thread.run_sync(same, explorer.slot.model, state)
        report["final_version"] = trainer.version
    phases = {"attach": (t0, t1), "sync": (t1, t2), "stop": (t2, t4)}
    for adjusted, suffix in ((False, ""), (True, "_cpu_adjusted")):
        sums = {name: summary(ticker.between(a, b, adjusted) if name != "sync" else
                              [lag for s0, s1 in windows for lag in ticker.between(s0, s1, adjusted)])
                for name, (a, b) in phases.items()}
        report.update({f"first_attach_ms{suffix}": sums["attach"]["worst_ms"],
                       f"sync_worst_ms{suffix}": sums["sync"]["worst_ms"], f"sync_p99_ms{suffix}": sums["sync"]["p99_ms"],
                       f"stop_worst_ms{suffix}": sums["stop"]["worst_ms"]})
    stalls = host_stalls(args.canary_file)
    if args.canary_file:
        def own(a: float, b: float) -> list[float]:  # the samples no stall of the host's overlaps
            return [s[1] for s in ticker.samples if a <= s[0] <= b
                    and not overlaps(s[0] - ticker.interval - s[1] / 1e3, s[0], stalls)]

        sums = {"attach": summary(own(t0, t1)), "stop": summary(own(t2, t4)),
                "sync": summary([lag for s0, s1 in windows for lag in own(s0, s1)])}
        report.update({"first_attach_ms_host_excluded": sums["attach"]["worst_ms"],
                       "sync_worst_ms_host_excluded": sums["sync"]["worst_ms"],
                       "sync_p99_ms_host_excluded": sums["sync"]["p99_ms"],
                       "stop_worst_ms_host_excluded": sums["stop"]["worst_ms"],
                       "host_worst_ms": round(max([(b - a - 0.001) * 1e3 for a, b in stalls
                                                   if any(a < s1 and b > s0 for s0, s1 in windows)], default=0.0), 2)})
    report.update({"sync_samples": sum(len(ticker.between(a, b)) for a, b in windows), "attach_s": round(t1 - t0, 2),
                   "syncs_s": round(t2 - t1, 2), "stop_s": round(t3 - t2, 2)})
    if tmp is not None:
        await anyio.to_thread.run_sync(tmp.cleanup)
    return report


async def explorer_side(args: argparse.Namespace, transport) -> dict:
    model = explorer_model(args.elements)
    async with Explorer("remote", model, transport) as explorer:
        while not explorer.trainer_stopped:
            await anyio.sleep(0.05)
    return {"version": explorer.version}


def _method_process(method: str, rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
    if not args.no_warm_up:
        # The kernels loaded before the event loop starts, as docs/performance.md recommends:
        # loading them holds the GIL for a few tenths of a second (numba's start-up, and the
        # garbage collections its imports set off), once per process.
        aiosync.warm_up((2, 4), ctx=False)
    if not args.no_gc_freeze:
        # Start-up done: its objects (torch's, numpy's, aiosync's modules) leave the garbage
        # collector's generations, as docs/performance.md recommends — a full collection scans
        # every tracked object with the GIL held (200-250 ms here), whichever thread set it off.
        gc.collect()
        gc.freeze()
    if method != "nccl":
        report = anyio.run(trainer_side, method, args, make_model(args.elements), explorer_model(args.elements))
    else:
        group = WeightSyncGroup.init(backend="gloo", timeout=600)
        peer = 1 - rank
        if rank == 0:
            report = anyio.run(trainer_side, method, args, make_model(args.elements), None, group.transport(peer))
        else:
            report = anyio.run(explorer_side, args, group.transport(peer))
        torch.distributed.destroy_process_group()
    with open(out, "w") as fh:
        json.dump(report, fh)


def run_method(method: str, args: argparse.Namespace) -> dict:
    """One method in a fresh process (two with nccl); returns the trainer process's report."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(RANKS)]
        procs = [ctx.Process(target=_method_process, args=(method, r, port, args, outs[r]))
                 for r in range(RANKS if method == "nccl" else 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"{method}: a process failed (exit codes {[p.exitcode for p in procs]})")
        with open(outs[0]) as fh:
            return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=20_000_000, help="elements of the model, in all")
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--density", type=float, default=0.02, help="fraction of the elements each step changes")
    parser.add_argument("--methods", default="memory,checkpoint,nccl")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="do not load the kernels before the event loop starts (they load in the background then)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="do not gc.freeze() the start-up's objects (full collections then scan them all)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-canary", action="store_true",
                        help="run no canary process (no host_worst_ms, no *_host_excluded figures)")
    args = parser.parse_args(argv)
    args.canary_file = None
    canary = died = None
    with tempfile.TemporaryDirectory(prefix="aiosync-canary-") as tmp:
        if not args.no_canary:
            import subprocess

            args.canary_file = os.path.join(tmp, "stalls.txt")
            canary = subprocess.Popen([sys.executable, "-S", "-c", CANARY, args.canary_file])
        try:
            methods = {m: run_method(m, args) for m in args.methods.split(",")}
        finally:
            if canary is not None:
                died = canary.poll()
                canary.kill()
                canary.wait()
        if died is not None:
            raise SystemExit(f"the canary process exited early (code {died}): its figures would be empty")
    out = {"first_attach_ms": max(r["first_attach_ms"] for r in methods.values()),
           "elements": next(iter(methods.values()))["elements"], "methods": methods}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
