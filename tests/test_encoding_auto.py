"""``encoding: auto`` (SPEC L3, issue 31): each explorer link picks the encoding that delivers
soonest over it, from what it measures; a version is built once per encoding chosen."""

from __future__ import annotations

import anyio
import pytest
import torch

import aiosync
from aiosync.coordination import Synchronizer
from aiosync.coordination.encodings import DEFAULT_COSTS, HYSTERESIS, Cost, LinkChoice, break_even_bps
from aiosync.coordination.metrics import RunningStat
from aiosync.transports.inproc import inproc_pair
from aiosync.transports.simulated import simulated_pair

AUTO = {"type": "patch", "patch": {"encoding": "auto", "init_sync": {"enabled": True}}}


class _Stats:
    """What a delivery line counts, as a link choice reads it."""

    def __init__(self) -> None:
        self.bytes_sent = self.changed_elements = self.delivered = 0
        self.transfer_s, self.apply_s = RunningStat(), RunningStat()

    def deliver(self, nbytes: int, changed: int, transfer_s: float, apply_s: float) -> None:
        self.bytes_sent += nbytes
        self.changed_elements += changed
        self.delivered += 1
        self.transfer_s.add(transfer_s)
        self.apply_s.add(apply_s)


def test_break_even_is_where_the_saved_bytes_pay_for_the_extra_seconds():
    costs = {"flat": Cost(1.1, 10e-9, 10e-9), "ctx": Cost(0.8, 30e-9, 20e-9)}
    assert break_even_bps(costs) == pytest.approx(8 * 0.3 / 30e-9)
    assert break_even_bps({"flat": costs["flat"], "ctx": Cost(1.2, 0, 0)}) == 0.0  # ctx never smaller
    assert 40e6 < break_even_bps(DEFAULT_COSTS) < 200e6


@pytest.mark.parametrize("bps,want", [(10e6, "ctx"), (1e9, "flat")])
def test_a_link_takes_ctx_below_the_break_even_and_flat_above(bps, want):
    choice, stats = LinkChoice("e0"), _Stats()
    assert choice.decide(DEFAULT_COSTS) == "flat"  # nothing measured: flat
    for _ in range(3):
        stats.deliver(100_000, 100_000, 100_000 * 8 / bps, 0.0)
        choice.observe(stats)
        choice.served = choice.decide(DEFAULT_COSTS)
    assert choice.encoding == want and choice.bandwidth == pytest.approx(bps / 8)
    assert choice.statistics()["bandwidth_bps"] == pytest.approx(bps)


def test_a_link_near_the_break_even_does_not_flap():
    edge = break_even_bps(DEFAULT_COSTS)
    choice, stats = LinkChoice("e0"), _Stats()
    for bps in [edge * 0.9, edge * 1.1] * 5:  # within the hysteresis either side
        stats.deliver(100_000, 100_000, 100_000 * 8 / bps, 0.0)
        choice.observe(stats)
        choice.decide(DEFAULT_COSTS)
    assert choice.switches == 0 and HYSTERESIS < 0.9


async def test_one_build_serves_each_link_in_the_encoding_it_chose():
    """Two explorers, one behind a slow simulated link (1 MB/s), one in-process: the slow one ends
    on ctx, the fast one on flat; each version is built once (in both encodings while they
    disagree), and both explorers end bit-exact."""
    g = torch.Generator().manual_seed(0)
    state = {f"l{i}": torch.randn(512, 256, generator=g) * 0.02 for i in range(4)}
    links = {"slow": lambda: simulated_pair(latency=0.001, bandwidth=1e6, seed=1, timeout=60),
             "fast": lambda: inproc_pair(timeout=60)}
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True)
    builds = []
    async with Synchronizer(cfg, AUTO, transport_factory=lambda name: links[name]()) as sync:
        trainer = await sync.attach_trainer(state)
        models = {}
        for name in links:
            models[name] = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
            await sync.attach_explorer(name, models[name])
        for version in range(1, 9):
            for t in state.values():
                t.add_(torch.randn(t.shape, generator=g) * 2e-5)
            before = sync.fanout.builds
            await trainer.sync_weight(version)
            for name in links:
                assert await sync.explorers[name].line.wait_settled(60)
            builds.append(sync.fanout.builds - before)
        chosen = sync.metrics()["fanout"]["links"]
        await trainer.stop()
    assert chosen["slow"]["encoding"] == "ctx" and chosen["fast"]["encoding"] == "flat", chosen
    assert chosen["slow"]["served"] == "ctx" and chosen["fast"]["served"] == "flat"
    assert builds == [1] * len(builds)  # one build per version, however many encodings
    for model in models.values():
        assert all(torch.equal(model[k], v.to(torch.bfloat16)) for k, v in state.items())


async def test_sync_encodings_codes_one_diff_twice():
    """The flat patch of a two-coding build is byte for byte the one a flat sender sends; the ctx
    patch of the same version applies bit-exact."""
    g = torch.Generator().manual_seed(1)
    src = {"a": torch.randn(300, 200, generator=g) * 0.02, "b": torch.randn(900, generator=g)}
    pairs = {}
    for enc in ("auto", "flat"):
        cfg = {"type": "patch", "patch": {"encoding": enc, "compression": "none"}}
        s, r = aiosync.WeightSyncer.create(cfg), aiosync.WeightSyncer.create(cfg)
        dst = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in src.items()}
        a, b = aiosync.inproc_pair(timeout=30)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.init_sender, src, list(src), a.send, a.recv)
            await r.init_receiver(dst, b.recv, b.send)
        pairs[enc] = (s, r, dst, a)
    for version in (1, 2, 3, 4):
        for t in src.values():
            t.add_(torch.randn(t.shape, generator=g) * 3e-5)
        s, r, dst, _ = pairs["auto"]
        both = await s.sync_encodings(src, version, ("flat", "ctx"))
        assert set(both) == {"flat", "ctx"} and set(s.encoding_statistics()) == {"flat", "ctx"}
        fs, fr, fdst, _ = pairs["flat"]
        sent = []

        async def keep(p, sent=sent):
            sent.append(p)

        await fs.sync(src, keep, version)
        for name in ("ordinals", "nnz_per_tensor", "cols", "values", "gap_bytes", "old_hashes"):
            assert torch.equal(getattr(both["flat"], name), getattr(sent[0], name)), name
        assert await r.apply_payload(dst, both["ctx" if version % 2 else "flat"]) == version
        assert all(torch.equal(dst[k], v.to(torch.bfloat16)) for k, v in src.items())
