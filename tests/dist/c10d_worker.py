"""torch.distributed's in-place collectives in a jitted step, on 2 gloo ranks.

NVIDIA apex's ImageNet example averages its loss and accuracy over the ranks inside the step
(``reduce_tensor``: ``dist.all_reduce(rt)``, then ``rt /= world_size``). The same body runs
eagerly under DDP and through ``functacc.jit`` (data parallel); rank 0 saves both runs'
per-step values and weights, and the errors for collectives the graph does not run.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import functacc


def reduce_tensor(tensor: torch.Tensor) -> torch.Tensor:
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= dist.get_world_size()
    return rt


def run(jitted: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward = model if jitted else nn.parallel.DistributedDataParallel(model)

    def body(x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = forward(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        correct = (out.argmax(1) == y).float().sum()
        predictions = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(predictions, out.argmax(1))
        shift = torch.full((), float(rank + 1))
        dist.broadcast(shift, src=1)
        dist.barrier()
        accuracy = reduce_tensor(correct / y.numel())
        return reduce_tensor(loss.data).item(), accuracy.item(), torch.cat(predictions), shift

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jitted else body
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        out.append(step(x.chunk(world)[rank], y.chunk(world)[rank]))
    return {"steps": out, "params": [p.detach().clone() for p in model.parameters()]}


def errors() -> dict:
    model = nn.Linear(4, 2)
    found = {}
    for name, call in {
        "reduce": lambda t: dist.reduce(t, dst=0),
        "async": lambda t: dist.all_reduce(t, async_op=True),
        "band": lambda t: dist.all_reduce(t, op=dist.ReduceOp.BAND),
    }.items():

        def body(x: torch.Tensor, call=call) -> torch.Tensor:
            loss = model(x).sum()
            call(loss.detach().clone())
            return loss

        try:
            functacc.jit(body, modules=[model], backend="eager")(torch.randn(2, 4))
        except functacc.TraceError as exc:
            found[name] = str(exc)
    # A DDP-wrapped model given to jit (the error blamed DDP's `_lazy_init_ran` attribute).
    ddp = nn.parallel.DistributedDataParallel(model)
    try:
        functacc.jit(lambda x: ddp(x).sum(), modules=[ddp], backend="eager")
    except TypeError as exc:
        found["ddp"] = str(exc)
    return found


def main(out: str) -> None:
    functacc.init_distributed()
    saved = {"eager": run(False), "jit": run(True), "errors": errors()}
    if dist.get_rank() == 0:
        torch.save(saved, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
