"""``functacc.jit`` with hybrid ZeRO-3 under torchrun, for tests/test_jit_zero3.py:
``jit_hybrid_worker.py OUT`` on 4 ranks.

``ZeRO(3, shard_size=2)``: two replicas of two shards each. Every rank trains the WGAN-GP and
distillation bodies of tests/dist/jit_worker.py on its quarter of each global batch; rank 0
saves the trained modules and the gathered optimizer state, which the test compares with
the same bodies trained eagerly in one process on the full batches."""

from __future__ import annotations

import sys

import jit_worker
import torch
import torch.distributed as dist

import functacc


def main(out: str) -> None:
    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {}
    for name in ("wgan_gp", "distill"):
        objects, make_step = jit_worker.SCENARIOS[name]
        first, second, opt = objects(seed=rank)  # the step starts every rank from rank 0's
        opts = opt if isinstance(opt, tuple) else (opt,)
        step = functacc.jit(
            make_step(first, second, opt),
            modules=[first, second],
            optimizers=opts,
            backend="eager",
            parallel=functacc.parallel.ZeRO(3, shard_size=2),
        )
        part = slice(rank * jit_worker.B, (rank + 1) * jit_worker.B)
        for x, y in jit_worker.batches(world):
            step(x[part], y[part])
        nodes = [str(n.target) for n in step.graphs[-1].graph.nodes]
        step.sync_modules()
        saved[name] = {
            "first": {k: v.clone() for k, v in first.state_dict().items()},
            "second": {k: v.clone() for k, v in second.state_dict().items()},
            "optimizer": [o.state_dict() for o in opts],
            "all_reduces": sum("all_reduce" in t for t in nodes),  # across the replicas
        }
    jit_worker.save_and_finish(saved, out)


if __name__ == "__main__":
    main(sys.argv[1])
