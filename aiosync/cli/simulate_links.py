"""``aiosync simulate --scenario links``: ``encoding: auto`` with explorers behind a slow and a fast
link side by side (L3).

A transformer-shaped fp32 trainer (the bench's model and realistic AdamW update) publishes a
version per step to two bf16 explorers in this process, one behind a simulated 50 Mbit/s link,
one behind 1 Gbit/s, through one synchronizer (fan-out: each version is built once per encoding
the links chose). Each link measures its bandwidth as versions flow and picks the encoding that
delivers sooner over it: ``ctx`` (fewer bytes) on the slow link, ``flat`` (less CPU) on the fast
one. The report (``--json``)::

    {"links": {"slow": {"bandwidth_bps", "encoding", "bytes_per_changed", "bit_exact", ...},
               "fast": {...}}, "break_even_bps": ..., ...}

``bytes_per_changed`` counts the versions the link received in the encoding it ended on.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..coordination import Synchronizer
from ..coordination.encodings import break_even_bps
from ..transports.simulated import simulated_pair
from .bench import Trainer, transformer_state

#: The links, in bytes per second.
LINKS = {"slow": 50e6 / 8, "fast": 1e9 / 8}
SYNCER = {"type": "patch", "patch": {"encoding": "auto", "init_sync": {"enabled": True}}}


async def run_links(steps: int = 12, seed: int = 0, elements: int = 16_000_000, d_model: int = 512,
                    vocab: int = 8192, lr: float = 2e-6) -> dict[str, Any]:
    trainer = await run_sync(lambda: Trainer(transformer_state(elements, d_model, vocab, seed), lr, seed))
    for _ in range(3):  # past Adam's first-step regime, as the bench
        await run_sync(trainer.step)
    state = trainer.state_dict()

    def link(name: str):
        return simulated_pair(latency=0.001, bandwidth=LINKS[name], seed=seed + len(name), timeout=600)

    config = dict(method="memory", style="trainer_driven", sync_weight_no_wait=True, sync_timeout=600,
                  delivery_timeout=600)
    served: dict[str, list] = {name: [] for name in LINKS}
    t0 = time.perf_counter()
    async with Synchronizer(config, SYNCER, transport_factory=link) as sync:
        handle = await sync.attach_trainer(state)
        explorers = {}
        for name in LINKS:
            model = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
            explorers[name] = await sync.attach_explorer(name, model)
        for version in range(1, steps + 1):
            await run_sync(trainer.step)
            seen = {name: _counts(sync, name) for name in LINKS}
            await handle.sync_weight(version)
            for name in LINKS:
                line = sync.explorers[name].line
                if not await line.wait_settled(600):
                    raise TimeoutError(f"version {version} was not delivered to {name} within 600 s")
                nbytes, changed = (a - b for a, b in zip(_counts(sync, name), seen[name]))
                served[name].append((_link_stats(sync, name).get("served"), nbytes, changed))
        lineage = next((lin for lin in sync.fanout.lineages if lin.costs is not None), None)
        costs = None if lineage is None else dict(lineage.costs.costs)
        await handle.stop()
    metrics = sync.metrics()
    links = {}
    for name, ex in explorers.items():
        stats = _link_stats(sync, name)
        final = [(b, c) for enc, b, c in served[name] if enc == stats["encoding"] and c]
        exact = await run_sync(lambda m=ex.slot.model: all(
            torch.equal(m[k], v.to(torch.bfloat16)) for k, v in state.items()))
        links[name] = {"bandwidth_bps": 8 * LINKS[name], "encoding": stats["encoding"],
                       "bytes_per_changed": sum(b for b, _ in final) / max(1, sum(c for _, c in final)),
                       "bit_exact": exact and ex.version == handle.version,
                       "measured_bandwidth_bps": stats["bandwidth_bps"], "switches": stats["switches"],
                       "versions_in_final_encoding": len(final),
                       "encodings_served": [enc for enc, _, _ in served[name]]}
    return {"scenario": "links", "steps": steps, "elements": sum(t.numel() for t in state.values()),
            "links": links, "break_even_bps": None if costs is None else break_even_bps(costs),
            "costs": None if costs is None else {e: dataclasses.asdict(c) for e, c in costs.items()},
            "default_break_even_bps": break_even_bps(), "bytes_sent": metrics["totals"]["bytes_sent"],
            "wall_s": time.perf_counter() - t0}


def _link_stats(sync: Synchronizer, name: str) -> dict:
    return sync.fanout.statistics().links.get(name) or {"encoding": None, "bandwidth_bps": None, "switches": 0,
                                                        "served": None}


def _counts(sync: Synchronizer, name: str) -> tuple[int, int]:
    s = sync.explorers[name].line.stats
    return s.bytes_sent, s.changed_elements


def simulate(explorers: int = 2, *, steps: int | None = None, seed: int = 0, loop: str = "asyncio",
             **_: Any) -> dict[str, Any]:
    """Run the scenario (``explorers``: one per link, fixed at two) and return its report."""
    backend_options = {"use_uvloop": True} if loop == "uvloop" else {}
    return anyio.run(run_links, steps or 12, seed, backend="asyncio", backend_options=backend_options)


def summary(report: dict[str, Any]) -> list[str]:
    """The lines ``aiosync simulate`` prints."""
    out = [f"break-even (ctx below, flat above): {report['break_even_bps'] / 1e6:.0f} Mbit/s"
           if report["break_even_bps"] else "break-even: not measured"]
    for name, row in report["links"].items():
        out.append(f"{name:<5} {row['bandwidth_bps'] / 1e6:>6.0f} Mbit/s  {row['encoding']:<4}  "
                   f"{row['bytes_per_changed']:.3f} B/changed  bit-exact {row['bit_exact']}  "
                   f"served {''.join(e[0] if e else '-' for e in row['encodings_served'])}")
    return out
