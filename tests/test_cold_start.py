"""A fresh installation syncs at once (SPEC L2, issue 31): nothing waits for a numba compile.

Syncers ask for the kernels of their dtypes in the background and take their torch paths until
they are loaded — the same payload bytes and the same writes (tested here with the kernels
switched off, ``AIOSYNC_KERNELS=torch``). A fresh process with an empty numba cache finishes
``init_*`` and its first syncs while the kernels still compile. ``aiosync warm-up`` compiles
them ahead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch

import aiosync
from aiosync.cli.main import main as cli
from aiosync.messages import payload_nbytes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"type": "patch", "patch": {"encoding": "flat", "compression": "none", "init_sync": {"enabled": True}}}


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(300, 64, generator=g), "w": torch.randn(64, 64, generator=g),
            "n": torch.ones(64), "steps": torch.tensor(0, dtype=torch.int64)}


def _step(state: dict[str, torch.Tensor], version: int) -> None:
    g = torch.Generator().manual_seed(100 + version)
    for k in ("emb", "w"):
        flat = state[k].view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 20,), generator=g)
        flat[idx] = flat[idx] * (1 + 2.0 ** -6)
    state["n"][version % 64] += 0.5
    state["steps"] += 1


async def _run_pair() -> tuple[list, dict[str, torch.Tensor]]:
    """A pair over the in-process channel (fp32 sender, bf16 receiver): the payloads sent (the
    bootstrap and three patches) and the receiver's final model."""
    src = _state()
    dst = {k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in src.items()}
    s, r = aiosync.WeightSyncer.create(CONFIG), aiosync.WeightSyncer.create(CONFIG)
    a, b = aiosync.inproc_pair(timeout=30)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    async with anyio.create_task_group() as tg:
        tg.start_soon(s.init_sender, src, list(src), send, a.recv)
        await r.init_receiver(dst, b.recv, b.send)
    for version in (1, 2, 3):
        _step(src, version)
        await s.sync(src, send, version)
        assert await r.apply(dst, b.recv) == version
    assert all(torch.equal(dst[k], v.to(dst[k].dtype)) for k, v in src.items())
    return sent, dst


def _same_payload(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same_payload(x[k], y[k]) for k in x)
    if hasattr(x, "__dataclass_fields__"):
        return type(x) is type(y) and all(_same_payload(getattr(x, f), getattr(y, f)) for f in x.__dataclass_fields__
                                          if f != "session")
    return x == y


async def test_the_torch_paths_send_and_write_what_the_kernels_do(monkeypatch):
    """Builder, flat coder, decoder, writer and bootstrap staging without numba: the same bytes
    on the wire, the same model at the end."""
    with_kernels, model_k = await _run_pair()
    monkeypatch.setenv("AIOSYNC_KERNELS", "torch")
    without, model_t = await _run_pair()
    assert len(with_kernels) == len(without) == 5  # hello + bootstrap bucket + three patches
    for x, y in zip(with_kernels[2:], without[2:]):
        assert payload_nbytes(x) == payload_nbytes(y) and _same_payload(x, y)
    assert all(torch.equal(model_k[k], model_t[k]) for k in model_k)


COLD = textwrap.dedent('''
    import json, sys, time
    t0 = time.perf_counter()
    import anyio, torch, aiosync
    from aiosync.syncers.kernels import warmup
    async def main():
        src = {"w": torch.randn(256, 256), "b": torch.randn(256)}
        dst = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in src.items()}
        cfg = {"type": "patch"}
        s, r = aiosync.WeightSyncer.create(cfg), aiosync.WeightSyncer.create(cfg)
        a, b = aiosync.inproc_pair(timeout=60)
        t1 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.init_sender, src, list(src), a.send, a.recv)
            await r.init_receiver(dst, b.recv, b.send)
        src["w"][3, :7] += 1.0
        await s.sync(src, a.send, 1)
        await r.apply(dst, b.recv)
        return {"init_and_first_sync_s": time.perf_counter() - t1, "kernels_ready": warmup.ready((2,)),
                "bit_exact": all(torch.equal(dst[k], v.to(torch.bfloat16)) for k, v in src.items())}
    print(json.dumps(anyio.run(main)))
''')


def test_a_fresh_process_with_an_empty_cache_syncs_before_its_kernels_are_compiled(tmp_path):
    """An empty ``NUMBA_CACHE_DIR``: ``init_*`` and the first sync are done, bit-exact, while the
    kernels still compile (a bf16 compile takes ten seconds and more); nothing waited for it."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT), "AIOSYNC_COMPILE_IN_PROCESS": "1",
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", COLD], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bit_exact"] and not out["kernels_ready"], out


def test_warm_up_command_checks_its_arguments_and_reports_the_cache(tmp_path, capsys):
    assert cli(["warm-up", "--dtypes", "bf16"]) == 2  # not a torch dtype name: nothing done
    assert "do not name torch dtypes" in capsys.readouterr().err
    report = tmp_path / "warm.json"
    assert cli(["warm-up", "--dtypes", "bfloat16,float32", "--no-ctx", "--json", str(report)]) == 0
    got = json.loads(report.read_text())
    assert got["widths"] == [2, 4] and got["ctx"] is False and got["cache"]
    from aiosync.syncers.kernels.warmup import ready

    assert ready((2, 4))


def test_the_marker_says_what_the_cache_holds():
    """After a warm-up the marker in numba's cache lists the widths compiled for these sources, so
    a process loads them at once instead of compiling them in a child."""
    from aiosync.syncers.kernels import warmup

    warmup.warm_up((2,), ctx=False)
    assert warmup._cached((2,), False)
    path, stamp = warmup._marker()
    mark = json.loads(Path(path).read_text())
    assert 2 in mark["widths"] and mark["stamp"]["numba"] == stamp["numba"]


READ_ONLY = textwrap.dedent('''
    import json
    from aiosync.syncers.kernels import flat, warmup
    before = warmup._cached((1,), False)
    warmup.warm_up((1,), ctx=False)
    stats = flat.diff_encode_flat.stats
    print(json.dumps({"locations": warmup.cache_locations(), "cached_before": before,
                      "cached_after": warmup._cached((1,), False),
                      "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
''')


def _read_only_copy(dst: Path) -> None:
    """A copy of the package that nobody may write into (as a system-wide install)."""
    shutil.copytree(ROOT / "aiosync", dst / "aiosync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.json"))
    for path in sorted(dst.rglob("*"), reverse=True):
        path.chmod(0o555 if path.is_dir() else 0o444)
    dst.chmod(0o555)


@pytest.mark.skipif(sys.platform != "linux", reason="read-only directories for root need Linux capabilities")
def test_a_read_only_package_caches_its_kernels_in_the_users_cache(tmp_path):
    """A package directory the process cannot write (an image's site-packages): numba's user-wide
    cache takes the kernels, and the next process loads them from there instead of compiling."""
    prefix: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere, unless it gives up overriding file permissions
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only for this process")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    pkg, cache = tmp_path / "site", tmp_path / "cache"
    _read_only_copy(pkg)
    env = {"PYTHONPATH": str(pkg), "XDG_CACHE_HOME": str(cache), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    try:
        runs = []
        for _ in range(2):
            done = subprocess.run(prefix + [sys.executable, "-c", READ_ONLY], check=False, env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        for path in [pkg, *pkg.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
    first, second = runs
    assert first["locations"] and all(Path(p).is_relative_to(cache) for p in first["locations"].values()), first
    assert not first["cached_before"] and first["cached_after"] and first["misses"] > 0, first
    assert second["cached_before"] and second["hits"] > 0 and second["misses"] == 0, second
