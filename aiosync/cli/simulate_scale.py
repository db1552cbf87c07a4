"""``aiosync simulate --scenario scale``: R trainer ranks × E engines, relayed vs direct routes.

What one version costs on the network when a sharded trainer of ``--ranks`` ranks syncs
``--params`` parameters to ``--engines`` engines, every process behind one link of the given
bandwidth (full duplex) and one-way latency. The patch size is not assumed: real patches are built
here (:class:`~aiosync.syncers.patch.syncer.PatchWeightSyncer`, flat + zstd) on a tensor of 8 M
fp32 values of which a random fraction (the density) moves one bfloat16 ulp up or down — what an
RL step at a small learning rate does to a changed weight — and the bytes per parameter measured
there scale to the model.

The two routes, as aiosync builds them (:mod:`aiosync.syncers.patch.shards_direct`):

* ``relay`` — rank 0 takes every other rank's part (its ingress: ``(R-1)·p``), then sends each
  engine the whole patch (its egress: ``E·P``); ``P`` the version's patch, ``p = P/R`` a rank's.
  ``relay_broadcast`` is the same with an ideal pipelined broadcast from rank 0 (egress ``P``),
  a lower bound for multicast rounds.
* ``direct`` — every rank sends its own part to every engine at once (a rank's egress ``E·p``),
  each engine takes the whole patch from R ranks (its ingress ``P / nics``; ``--engine-nics`` > 1
  models an engine whose tensor-parallel workers each have a link and take their own rows —
  not built yet: aiosync sends each engine one stream).

``time = max(what the busiest link carries) / bandwidth + hops × latency``: the links are the
bottleneck, build and encode time (per rank, in parallel, reported from the measurement) are
left out. The report (``--json``)::

    {"scenario": "scale", "measured": {"elements", "density", "bytes_per_param", "build_s", ...},
     "rows": [{"params", "ranks", "engines", "gbits", "engine_nics", "patch_gb", "relay_s",
               "relay_broadcast_s", "direct_s"}, ...]}
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import torch

from ..messages import payload_nbytes
from ..syncers.factory import create_syncer
from ..syncers.patch.handshake import receiver_metadata

#: The table docs/performance.md quotes: 1 T parameters, 256 ranks, 64 engines, 2 % density.
DEFAULTS = dict(params=1e12, ranks=256, engines=64, density=0.02, gbits=(100.0, 400.0), latency=10e-6,
                engine_nics=(1, 8), measure_elements=8_000_000)
SYNCER = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": False}}}


def route_times(params: float, bytes_per_param: float, ranks: int, engines: int, bandwidth: float, latency: float,
                engine_nics: int = 1) -> dict[str, float]:
    """Seconds per version of each route (``bandwidth`` in bytes per second per link)."""
    if min(params, bytes_per_param, bandwidth) <= 0 or min(ranks, engines, engine_nics) < 1 or latency < 0:
        raise ValueError("route_times: params, bytes_per_param and bandwidth must be > 0, ranks, engines and "
                         "engine_nics >= 1, latency >= 0")
    total = params * bytes_per_param
    part = total / ranks
    relay = ((ranks - 1) * part + engines * total) / bandwidth + 2 * latency  # store and forward at rank 0
    hops = 1 + math.ceil(math.log2(engines)) if engines > 1 else 1
    relay_broadcast = ((ranks - 1) * part + total) / bandwidth + (1 + hops) * latency
    # rank 0's refs, the explorer's fetch, the parts: three one-way hops
    direct = max(engines * part, total / engine_nics) / bandwidth + 3 * latency
    return {"patch_bytes": total, "relay_s": relay, "relay_broadcast_s": relay_broadcast, "direct_s": direct}


async def measure(elements: int, density: float, seed: int = 0, syncer: dict | None = None) -> dict[str, Any]:
    """Bytes per parameter of a real patch at ``density``: ``elements`` fp32 values (rows of 1024)
    sent to a bfloat16 receiver; a random ``density`` of them moves one bfloat16 ulp up or down."""
    if not 0 < density <= 1:
        raise ValueError(f"--density {density} must be in (0, 1]")
    cols = 1024
    rows = max(1, elements // cols)
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(rows, cols, generator=g)}
    dst = {"w": state["w"].to(torch.bfloat16)}
    sender = create_syncer(syncer or SYNCER)

    async def recv():
        return receiver_metadata(dst, 1)

    sent: list = []

    async def send(payload):
        sent.append(payload)

    await sender.init_sender(state, ["w"], send, recv)
    n = rows * cols
    changed = torch.randperm(n, generator=g)[: max(1, int(n * density))]
    flat = state["w"].view(-1)
    # an RL step at a small learning rate moves a changed weight by about one bfloat16 ulp, up or down
    step = torch.randint(0, 2, (changed.numel(),), generator=g, dtype=torch.int16) * 2 - 1
    bits = flat[changed].to(torch.bfloat16).view(torch.int16) + step
    flat[changed] = bits.view(torch.bfloat16).float()
    sent.clear()
    t0 = time.perf_counter()
    await sender.sync(state, send, 1)
    build_s = time.perf_counter() - t0
    nbytes = payload_nbytes(sent[-1])
    stats = sender.statistics()
    sender.close()
    return {"elements": n, "density": density, "changed": int(stats.changed or changed.numel()),
            "patch_bytes": nbytes, "bytes_per_param": nbytes / n, "bytes_per_changed": nbytes / changed.numel(),
            "build_s": build_s, "encoding": (syncer or SYNCER)["patch"]["encoding"]}


def scale(*, params: float = DEFAULTS["params"], ranks: int = DEFAULTS["ranks"], engines: int = DEFAULTS["engines"],
          density: float = DEFAULTS["density"], gbits=DEFAULTS["gbits"], latency: float = DEFAULTS["latency"],
          engine_nics=DEFAULTS["engine_nics"], measure_elements: int = DEFAULTS["measure_elements"],
          seed: int = 0) -> dict[str, Any]:
    """Measure a patch at ``density``, then the table of route times (see the module docstring)."""
    measured = anyio.run(measure, measure_elements, density, seed)
    rows = []
    for g in gbits:
        for nics in engine_nics:
            t = route_times(params, measured["bytes_per_param"], ranks, engines, g * 1e9 / 8, latency, nics)
            rows.append({"params": params, "ranks": ranks, "engines": engines, "gbits": g, "engine_nics": nics,
                         "patch_gb": round(t["patch_bytes"] / 1e9, 3), "relay_s": round(t["relay_s"], 3),
                         "relay_broadcast_s": round(t["relay_broadcast_s"], 3), "direct_s": round(t["direct_s"], 3)})
    return {"scenario": "scale", "measured": measured, "latency_s": latency, "rows": rows}


def simulate(explorers: int = 2, *, steps: int | None = None, seed: int = 0, loop: str = "asyncio",
             bandwidth: float | None = None, latency: float | None = None, **_: Any) -> dict[str, Any]:
    """``aiosync simulate --scenario scale`` (``--bandwidth`` in bytes per second replaces the two
    default links; ``--latency`` the 10 µs; ``explorers`` and ``steps`` do not apply)."""
    kwargs: dict[str, Any] = {"seed": seed}
    if bandwidth is not None:
        kwargs["gbits"] = (bandwidth * 8 / 1e9,)
    if latency is not None:
        kwargs["latency"] = latency
    return scale(**kwargs)


def summary(report: dict[str, Any]) -> list[str]:
    """The lines ``aiosync simulate`` prints: the measurement, then one row per link and engine NICs."""
    m = report["measured"]
    out = [f"measured: {m['encoding']} patch of {m['elements'] / 1e6:.0f} M params at density {m['density']:g}: "
           f"{m['bytes_per_param']:.4f} B/param ({m['bytes_per_changed']:.2f} B/changed), built in "
           f"{m['build_s']:.2f} s on this CPU",
           f"{'params':>8} {'ranks':>5} {'engines':>7} {'Gbit/s':>6} {'NICs':>4} {'patch GB':>8} {'relay s':>9} "
           f"{'relay bcast s':>13} {'direct s':>8}"]
    for r in report["rows"]:
        out.append(f"{r['params']:>8.2g} {r['ranks']:>5} {r['engines']:>7} {r['gbits']:>6.0f} {r['engine_nics']:>4} "
                   f"{r['patch_gb']:>8.2f} {r['relay_s']:>9.2f} {r['relay_broadcast_s']:>13.2f} {r['direct_s']:>8.2f}")
    return out
