"""Quickstart: patch sync from an fp32 trainer to a bf16 explorer, in one process.

Run:  python examples/quickstart.py

A small transformer-shaped model is trained with real AdamW steps; after each step the new
weights travel as a compact patch (the shipped ``weight_syncer/patch_syncer`` config) and
are applied on the explorer, which ends bit-identical to the trainer's weights cast to bf16.
"""

import asyncio

import torch

import aiosync


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many LMs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


async def main() -> None:
    torch.manual_seed(0)
    trainer_model = TinyLM()                                   # fp32 master weights
    explorer_model = TinyLM().to(torch.bfloat16)               # different init, bf16
    cfg = aiosync.load_config("weight_syncer/patch_syncer")    # the recommended config
    sender, receiver = aiosync.WeightSyncer.create(cfg), aiosync.WeightSyncer.create(cfg)
    trainer_end, explorer_end = aiosync.inproc_pair(timeout=30)

    names = aiosync.collect_param_names_need_sync(trainer_model)
    await asyncio.gather(   # metadata handshake + one-time bootstrap (init_sync)
        sender.init_sender(trainer_model.state_dict(), names, trainer_end.send, trainer_end.recv),
        receiver.init_receiver(explorer_model.state_dict(), explorer_end.recv, explorer_end.send),
    )
    opt = torch.optim.AdamW(trainer_model.parameters(), lr=2e-5, betas=(0.9, 0.95))
    full = sum(t.numel() * 2 for t in explorer_model.state_dict().values())
    for version in range(1, 6):
        tokens = torch.randint(0, 512, (8, 32))
        loss = torch.nn.functional.cross_entropy(trainer_model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        await sender.sync(trainer_model.state_dict(), trainer_end.send, version)
        applied = await receiver.apply(explorer_model, explorer_end.recv)
        st = sender.statistics()
        print(f"version {applied}: {st.changed:>7,} changed elements, {st.bytes:>8,} bytes "
              f"({st.bytes / max(st.changed, 1):.2f} B/changed; the bf16 model is {full:,} bytes)")

    exact = all(torch.equal(t.to(torch.bfloat16).view(torch.int16), explorer_model.state_dict()[k].view(torch.int16))
                for k, t in trainer_model.state_dict().items())
    print("explorer bit-identical to the trainer (cast to bf16):", exact)
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
