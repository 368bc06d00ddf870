"""Tensor-parallel training of a (tiny, random) Hugging Face Llama with functacc under torchrun.

    torchrun --nproc_per_node=2 examples/train_tensor_parallel.py              # TP=2
    torchrun --nproc_per_node=4 examples/train_tensor_parallel.py --tp 2       # TP=2 x DP=2

The model's own ``base_model_tp_plan`` splits the attention and MLP projections of every layer
over groups of ``--tp`` ranks (column-wise in, row-wise out); the embedding is split by
vocabulary and the output layer by columns, its logits gathered for the model's loss. The
collectives of both mesh dimensions (tensor parallel inside a group, data parallel across
groups) are nodes of the one compiled step. Every rank of a tensor-parallel group trains on
the same batch; each data-parallel replica draws its own.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import transformers

import functacc
from functacc.parallel import DataParallel, TensorParallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tp", type=int, default=None, help="ranks per group (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="per replica")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()

    functacc.init_distributed()
    rank, world = functacc.parallel.rank(), functacc.parallel.world_size()
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    whole = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    plan = {**config.base_model_tp_plan, "embed_tokens": "rowwise", "lm_head": "colwise_rep"}
    parallel = [TensorParallel(plan, size=args.tp), DataParallel()]
    step = functacc.compile_step(
        model, None, opt, parallel=parallel, backend=args.backend, max_grad_norm=1.0
    )

    size = args.tp or world
    g = torch.Generator().manual_seed(1000 + rank // size)  # one batch per replica
    start = time.perf_counter()
    for i in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
        loss = step(input_ids=ids, labels=ids)
        if i == 0:
            start = time.perf_counter()
        if rank == 0 and (i + 1) % 10 == 0:
            rate = i * args.batch_size * (world // size) / (time.perf_counter() - start)
            print(f"Step: {i + 1}, Loss: {float(loss):.4f}, Throughputs: {rate:.1f} samples/s")
    stats = step.stats()
    local = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"{stats['strategy']}: {local:,} of {whole:,} parameters on this rank; "
            f"tensor-parallel payload {stats['tensor_parallel_bytes']:,} bytes per step"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
