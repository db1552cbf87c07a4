"""A HuggingFace decoder-only model trained in fp32, served in bf16, synced with patches.

The model is built from a config (a small ``LlamaConfig``; nothing is downloaded). The
trainer keeps fp32 master weights and takes real AdamW steps (betas 0.9 / 0.95 and an RL
learning rate) on a toy RL objective: REINFORCE on sequences the explorer sampled, rewarded
for using tokens from the lower half of the vocabulary. The explorer holds a bf16 copy and
samples under ``lease()``. After each step the trainer publishes the new version and the
explorer receives only the bf16 values that changed, as a compact, lossless patch: the
script prints the bytes of every sync against the size of the full bf16 model, and checks at
the end that the explorer is bit-identical to the trainer's weights cast to bf16.

Syncs here are blocking (each patch is applied before the next step, so the bytes of each
sync are exact); ``sync_weight_no_wait: true`` runs the same patches in the background.

Run::

    python examples/hf_patch_sync.py                       # ~5 M parameters, 8 steps
    python examples/hf_patch_sync.py --hidden 512 --layers 8 --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch

from aiosync import load_config, run_sync
from aiosync.coordination import Synchronizer


def build_model(vocab: int, hidden: int, layers: int, seed: int) -> torch.nn.Module:
    """A small Llama-style decoder from a config: random weights, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@torch.no_grad()
def sample(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Sample ``new_tokens`` tokens after a random prompt (plain loop, no KV cache: tiny model)."""
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, prompt_len), generator=generator)
    for _ in range(new_tokens):
        logits = model(input_ids=tokens).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def reinforce_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                   prompt_len: int) -> float:
    """One AdamW step of REINFORCE: reward = fraction of generated tokens in the lower half of the vocab."""
    generated = tokens[:, prompt_len:]
    reward = (generated < model.config.vocab_size // 2).float().mean(1)
    advantage = reward - reward.mean()
    logits = model(input_ids=tokens[:, :-1]).logits[:, prompt_len - 1:]
    logp = torch.log_softmax(logits, -1).gather(-1, generated.unsqueeze(-1)).squeeze(-1).sum(1)
    loss = -(advantage * logp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(reward.mean())


def bits_equal(trainer_model: torch.nn.Module, explorer_model: torch.nn.Module) -> bool:
    """Whether the explorer's bf16 weights are exactly the trainer's fp32 weights cast to bf16."""
    theirs = explorer_model.state_dict()
    return all(torch.equal(t.to(theirs[k].dtype).view(torch.int16), theirs[k].view(torch.int16))
               for k, t in trainer_model.state_dict().items() if t.is_floating_point())


async def run(steps: int = 8, vocab: int = 4096, hidden: int = 256, layers: int = 4, batch: int = 8,
              prompt_len: int = 8, new_tokens: int = 8, lr: float = 3e-6, seed: int = 0,
              verbose: bool = True) -> dict[str, Any]:
    trainer_model = build_model(vocab, hidden, layers, seed)                      # fp32 master weights
    explorer_model = build_model(vocab, hidden, layers, seed + 1).to(torch.bfloat16).eval()  # bf16, other init
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    full_bf16 = sum(t.numel() * t.element_size() for t in explorer_model.state_dict().values())
    n_params = sum(t.numel() for t in trainer_model.state_dict().values())
    say = print if verbose else (lambda *a, **k: None)
    say(f"Llama-style decoder: {n_params:,} parameters; trainer fp32 ({n_params * 4:,} bytes), "
        f"explorer bf16 ({full_bf16:,} bytes)")

    # FIXED, every step, blocking: the explorer asks after each of its steps and waits for the
    # patch, so each sync's bytes are exactly one version's changes.
    config = {"method": "memory", "style": "fixed", "sync_interval": 1}
    weight_syncer = load_config("weight_syncer/patch_syncer")   # the shipped, recommended patch config
    syncs = []
    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(trainer_model)                    # version 0
        # The explorer joins with other weights: it is bootstrapped once (the whole model, cast to
        # bf16, outside the patch byte counts), then receives patches.
        explorer = await sync.attach_explorer("explorer", explorer_model)
        for _ in range(steps):
            async with explorer.lease() as (model, version):                 # the explorer's rollout, in bf16
                tokens = await run_sync(sample, model, batch, prompt_len, new_tokens, generator)
            before = sync.metrics()["totals"]
            t0 = time.perf_counter()
            reward = await run_sync(reinforce_step, trainer_model, optimizer, tokens, prompt_len)
            await trainer.step_done()                                         # publish the new version
            await explorer.step_done()                                        # check point: patch, apply
            after = sync.metrics()["totals"]
            row = {"version": trainer.version, "explorer_version": explorer.version,
                   "bytes": after["bytes_sent"] - before["bytes_sent"],
                   "changed": after["changed_elements"] - before["changed_elements"],
                   "reward": reward, "seconds": time.perf_counter() - t0}
            syncs.append(row)
            say(f"version {row['version']:3d}: {row['changed']:>9,} bf16 values changed "
                f"({row['changed'] / n_params:6.2%}), patch {row['bytes']:>10,} bytes = "
                f"{row['bytes'] / full_bf16:6.2%} of the bf16 model "
                f"({row['bytes'] / max(1, row['changed']):.2f} B/changed)  reward {reward:.3f}")
    exact = bits_equal(trainer_model, explorer_model)
    total = sync.metrics()["totals"]["bytes_sent"]
    patch_bytes = sum(r["bytes"] for r in syncs)
    say(f"{steps} syncs: {patch_bytes:,} bytes in patches, {patch_bytes / max(1, steps):,.0f} per sync "
        f"(a full bf16 copy each time would be {full_bf16 * steps:,}); explorer at version {explorer.version}; "
        f"bit-identical to the trainer cast to bf16: {exact}")
    return {"params": n_params, "full_bf16_bytes": full_bf16, "syncs": syncs,
            "bytes_sent_total": total, "final_version": trainer.version, "explorer_version": explorer.version,
            "bit_exact": exact}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.steps, args.vocab, args.hidden, args.layers, args.batch, lr=args.lr,
                             seed=args.seed, verbose=not args.quiet))
    if not report["bit_exact"]:
        raise SystemExit("explorer weights differ from the trainer's (cast to bf16)")
    return report


if __name__ == "__main__":
    main()
