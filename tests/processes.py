"""Scenarios in spawned processes of one gloo group on 127.0.0.1, for the multi-process tests.

A test module defines ``SCENARIOS = {name: fn(rank, world, out, extra) -> dict}``; :func:`start`
spawns one process per rank that runs ``module.SCENARIOS[name]`` and writes its result (or its
traceback) to ``out/rank<r>.json``; :func:`join` bounds the wait (a hang is a failure, never a
stuck CI job); :func:`results` reads the files and fails with a worker's traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOIN_BOUND = 120  # seconds: only catches hangs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, module: str, scenario: str, extra: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NUMBA_NUM_THREADS="1")
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.json"
    try:
        result = importlib.import_module(module).SCENARIOS[scenario](rank, world, Path(out), extra)
    except BaseException:  # reported to the test process, which fails with it
        path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    path.write_text(json.dumps(result if result is not None else {}))


def start(module: str, scenario: str, world: int, out: Path, extra: dict | None = None,
          ranks=None) -> dict[int, Any]:
    """Spawn ranks ``ranks`` (default: all) of a ``world``-process group running ``scenario``
    of test module ``module`` (its ``__name__``)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = {}
    for rank in (range(world) if ranks is None else ranks):
        p = ctx.Process(target=_entry, args=(rank, world, port, str(out), module, scenario, extra or {}),
                        daemon=True)
        p.start()
        procs[rank] = p
    return procs


def join(procs: dict[int, Any], bound: float = JOIN_BOUND) -> None:
    """Wait for every process, at most ``bound`` seconds in all; kill and fail on a hang."""
    deadline = time.monotonic() + bound
    try:
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in procs.items() if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {bound}s"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)


def results(out: Path, ranks) -> dict[int, dict]:
    """The results of ``ranks``; fails with a worker's traceback when one raised."""
    found = {}
    for r in ranks:
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result"
        data = json.loads(path.read_text())
        assert "error" not in data, f"rank {r} failed:\n{data['error']}"
        found[r] = data
    return found
