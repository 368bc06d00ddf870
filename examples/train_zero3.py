"""ZeRO-3 (fully sharded) training of a Transformer with functacc under torchrun.

    torchrun --nproc_per_node=2 examples/train_zero3.py
    torchrun --nproc_per_node=4 examples/train_zero3.py --shard-size 2   # hybrid: 2 x 2

Parameters, gradients and optimizer state are sharded: each TransformerEncoderLayer is
all-gathered just before its forward and again in backward, inside the compiled step.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import functacc


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.blocks(self.embed(tokens), mask=causal, is_causal=True))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=None)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()

    functacc.init_distributed()
    rank = functacc.parallel.rank()
    vocab = 512
    torch.manual_seed(0)
    model = LanguageModel(vocab, args.dim, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    zero3 = functacc.parallel.ZeRO(
        3, shard_size=args.shard_size, wrap_layer_cls={"TransformerEncoderLayer"}
    )
    step = functacc.compile_step(
        model, loss_fn, opt, parallel=zero3, backend=args.backend, max_grad_norm=1.0
    )

    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    start = time.perf_counter()
    for i in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g)
        loss = step(tokens[:, :-1], tokens[:, 1:])
        if i == 0:
            start = time.perf_counter()
        if rank == 0 and (i + 1) % 10 == 0:
            rate = (
                i * args.batch_size * functacc.parallel.world_size() / (time.perf_counter() - start)
            )
            print(f"Step: {i + 1}, Loss: {float(loss):.4f}, Throughputs: {rate:.1f} samples/s")
    stats = step.stats()
    model = step.sync_model()  # full weights on every rank, for evaluation or saving
    if rank == 0:
        mib = {k: v / 2**20 for k, v in stats["memory"].items()}
        print(f"{stats['strategy']}: per-rank state {mib} MiB; per step {stats['payload_bytes']}")
        print(f"full model restored: {sum(p.numel() for p in model.parameters()):,} parameters")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
