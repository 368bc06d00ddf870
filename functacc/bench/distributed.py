"""``python -m functacc bench --nproc N --parallel {dp,zero1,zero2,zero3}``.

Launches N ranks with torchrun; each rank trains the same workload with functacc's strategy
and with PyTorch's own engine for the same job — ``DistributedDataParallel`` for data
parallelism, FSDP2 ``fully_shard`` for sharding — interleaved round by round. Rank 0 prints
global samples/s, the largest per-rank peak memory and the bytes each rank communicates per
step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import peak_memory
from .models import build

__all__ = ["launch", "worker"]

PARALLEL = ("dp", "zero1", "zero2", "zero3")


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-run this benchmark under torchrun with ``args.nproc`` ranks."""
    forwarded = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--nproc":
            skip = True
            continue
        if item.startswith("--nproc="):
            continue
        forwarded.append(item)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "functacc.bench.distributed",
        *forwarded,
    ]
    env = dict(os.environ)
    # Ranks share the cores: one thread each, or they fight over them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    return subprocess.call(cmd, env=env)


class _CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of the c10d collectives PyTorch issues from Python (FSDP2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = str(func)
        if name.startswith("c10d.") and any(
            k in name for k in ("allgather", "all_gather", "reduce_scatter", "allreduce")
        ):
            # The payload: the full tensor (an all-gather's output, a reduce-scatter's input).
            first = args[1] if "reduce_scatter" in name else args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
            self.bytes += sum(t.numel() * t.element_size() for t in flat if isinstance(t, Tensor))
        return func(*args, **(kwargs or {}))


class _Competitor:
    def __init__(self, name: str, step: Callable[[], Any], bytes_per_step: Callable[[], float]):
        self.name = name
        self.step = step
        self.bytes_per_step = bytes_per_step


def _functacc(workload: Any, parallel: str, wrap: set[str]) -> _Competitor:
    import functacc

    model = copy.deepcopy(workload.model)
    opt = workload.make_opt(model)
    strategy = {
        "dp": functacc.parallel.DataParallel(),
        "zero1": functacc.parallel.ZeRO(1),
        "zero2": functacc.parallel.ZeRO(2),
        "zero3": functacc.parallel.ZeRO(3, wrap_layer_cls=wrap),
    }[parallel]
    step = functacc.compile_step(model, workload.loss_fn, opt, parallel=strategy)

    def run() -> Tensor:
        return step(workload.inputs, workload.targets)

    def sent() -> float:
        return float(sum(step.stats()["payload_bytes"].values()))

    return _Competitor(f"functacc {parallel}", run, sent)


def _ddp(workload: Any) -> _Competitor:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(workload.model))
    opt = workload.make_opt(model)
    counted = {"bytes": 0, "steps": 0}

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # DDP checks real annotations, not the strings of __future__
        counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
    model.register_comm_hook(None, hook)

    def run() -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model(workload.inputs), workload.targets)
        loss.backward()
        opt.step()
        counted["steps"] += 1
        return loss.detach()

    def sent() -> float:
        return counted["bytes"] / max(counted["steps"], 1)

    return _Competitor("torch DDP", run, sent)


def _fsdp2(workload: Any, wrap: set[str], reshard: bool) -> _Competitor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(workload.model)
    mesh = init_device_mesh(workload.inputs.device.type, (dist.get_world_size(),))
    for module in model.modules():
        if type(module).__name__ in wrap:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = workload.make_opt(model)
    counter = _CollectiveBytes()
    counted = {"bytes": 0, "steps": 0}

    def run() -> Tensor:
        before = counter.bytes
        with counter:
            opt.zero_grad(set_to_none=True)
            loss = workload.loss_fn(model(workload.inputs), workload.targets)
            loss.backward()
            opt.step()
        counted["bytes"] += counter.bytes - before
        counted["steps"] += 1
        return loss.detach()

    def sent() -> float:
        return counted["bytes"] / max(counted["steps"], 1)

    name = "torch FSDP2" + ("" if reshard else " (no reshard)")
    return _Competitor(name, run, sent)


WRAP = {
    "mlp": {"Linear"},
    "resnet18": {"BasicBlock"},
    "resnet50": {"Bottleneck"},
    "transformer": {"TransformerEncoderLayer"},
}


def worker(argv: Sequence[str] | None = None) -> int:
    from .cli import parser
    from .report import machine

    args = parser().parse_args(argv)
    import functacc

    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = build(
        args.model,
        batch_size=args.batch_size,
        image_size=args.image_size,
        seq_len=args.seq_len,
        device=args.device,
    )
    wrap = WRAP[args.model]
    factories: list[Callable[[], _Competitor]] = [lambda: _functacc(workload, args.parallel, wrap)]
    if args.parallel == "dp":
        factories.append(lambda: _ddp(workload))
    else:
        factories.append(lambda: _fsdp2(workload, wrap, reshard=args.parallel == "zero3"))
    competitors, first = [], []
    for make in factories:
        dist.barrier()
        start = time.perf_counter()
        competitor = make()
        competitor.step()
        first.append(time.perf_counter() - start)
        competitors.append(competitor)
    for competitor in competitors:
        for _ in range(args.warmup):
            competitor.step()
    rates: list[list[float]] = [[] for _ in competitors]
    batch = workload.inputs.shape[0] * world
    for r in range(args.rounds):
        order = list(range(len(competitors)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                competitors[i].step()
            dist.barrier()
            rates[i].append(args.steps * batch / (time.perf_counter() - start))
    peaks = []
    for competitor in competitors:
        peak = torch.tensor(float(peak_memory(competitor.step, device=args.device)))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(float(peak))
    if rank == 0:
        print(f"{workload.description}, per-rank batch; {world} ranks (gloo); {machine()}")
        print(f"{args.rounds} rounds x {args.steps} steps, interleaved; median round throughput")
        print(
            "| | samples/s (all ranks) | ratio | first step (s) | peak memory per rank (MiB) "
            "| payload bytes per rank per step |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        base = statistics.median(rates[1])
        for competitor, rate, t0, peak in zip(competitors, rates, first, peaks, strict=True):
            median = statistics.median(rate)
            print(
                f"| {competitor.name} | {median:.1f} | {median / base:.2f}x | {t0:.1f} | "
                f"{peak / 2**20:.1f} | {competitor.bytes_per_step():,.0f} |"
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker())
