"""``functacc.jit`` under ZeRO-3 with a weight tied across its wrap units, for
tests/test_jit_zero3.py: ``jit_tied_worker.py OUT`` on 2 ranks.

``tests/models.Tied`` shares one weight between its embedding and its output projection;
``ZeRO(3, wrap_layer_cls={"Embedding"})`` puts the embedding in a unit of its own, so the
shared weight belongs to two units. Each rank trains on its half of every batch; rank 0
saves the trained model and the gathered optimizer state for each layout (``dp``: data
parallel, the reference)."""

from __future__ import annotations

import os
import sys

import jit_worker
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import functacc  # noqa: E402
from functacc.parallel import ZeRO  # noqa: E402

LAYOUTS = {"dp": None, "zero3": ZeRO(3), "zero3_split": ZeRO(3, wrap_layer_cls={"Embedding"})}


def main(out: str) -> None:
    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 20, (4 * world, 6), generator=g), torch.randint(0, 20, (4 * world,)))
        for _ in range(4)
    ]
    saved = {}
    for name, parallel in LAYOUTS.items():
        torch.manual_seed(0)
        model = models.Tied(vocab=20, dim=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def body(x, y, model=model, opt=opt):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        step = functacc.jit(body, modules=model, optimizers=opt, backend="eager", parallel=parallel)
        for x, y in data:
            step(x.chunk(world)[rank], y.chunk(world)[rank])
        step.sync_modules()
        saved[name] = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "tied": model.embed.weight is model.out.weight,
            "optimizer": opt.state_dict(),
        }
    jit_worker.save_and_finish(saved, out)


if __name__ == "__main__":
    main(sys.argv[1])
