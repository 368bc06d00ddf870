"""Optimizers traced through their own ``step()`` under torchrun, for
tests/test_optimizers.py: ``optim_worker.py OUT``.

Every rank trains a per-sample model (no BatchNorm, no dropout: a half batch gives half the
full batch's gradient sum) on its half of each global batch, through ``functacc.jit`` with
data parallel and with ZeRO-1 (whole parameters per rank), for RMSprop, Adafactor and
timm's LAMB; rank 0 saves the trained weights and the gathered ``opt.state_dict()``. ZeRO-2
must be a clear error for them. The test trains the same steps eagerly in one process on
the full batches and compares.
"""

from __future__ import annotations

import sys

import jit_worker
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functacc

STEPS = 4
B = 8  # per rank


def lamb(params: object) -> torch.optim.Optimizer:
    import timm.optim

    return timm.optim.Lamb(params, lr=1e-2, weight_decay=0.01)


OPTIMIZERS = {
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "timm.Lamb": lamb,
}


def objects(name: str, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 5))
    return model, OPTIMIZERS[name](model.parameters())


def make_step(model: nn.Module, opt: torch.optim.Optimizer) -> object:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def batches(world: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B * world, 16, generator=g), torch.randint(0, 5, (B * world,), generator=g))
        for _ in range(STEPS)
    ]


def expected_traces(name: str) -> int:
    """LAMB's first step adds group["step"], so its second is another graph."""
    return 2 if name == "timm.Lamb" else 1


LAYOUTS = {
    "dp": functacc.parallel.DataParallel,
    "zero1": lambda: functacc.parallel.ZeRO(1),
    "zero2": lambda: functacc.parallel.ZeRO(2),
}


def main(out: str) -> None:
    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {}
    for layout, parallel in LAYOUTS.items():
        for name in OPTIMIZERS:
            model, opt = objects(name, seed=rank)  # rank 0's weights are the start
            step = functacc.jit(
                make_step(model, opt),
                modules=[model],
                optimizers=[opt],
                backend="eager",
                parallel=parallel(),
            )
            for x, y in batches(world):
                part = slice(rank * B, (rank + 1) * B)
                step(x[part], y[part])
            nodes = [str(n.target) for n in step.graphs[-1].graph.nodes]
            saved[layout, name] = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(),  # ZeRO-1: gathered whole, on every rank
                "own_state": len(opt.state),  # what this rank keeps between calls
                "traces": step.num_traces,
                "all_gathers": sum("all_gather" in t for t in nodes),
                "reduce_scatters": sum("reduce_scatter" in t for t in nodes),
                "all_reduces": sum("all_reduce" in t for t in nodes),
                "grads_after_call": [p.grad is not None for p in model.parameters()],
            }
        # compile_step with an optimizer traced whole: the same body on jit's pipeline.
        model, opt = objects("RMSprop", seed=rank)
        step = functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel()
        )
        for x, y in batches(world):
            part = slice(rank * B, (rank + 1) * B)
            step(x[part], y[part])
        saved[layout, "compile_step RMSprop"] = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "stats": step.stats(),  # before state_dict(), which gathers ZeRO's state whole
            "optimizer": opt.state_dict(),
        }
    jit_worker.save_and_finish(saved, out)


if __name__ == "__main__":
    main(sys.argv[1])
