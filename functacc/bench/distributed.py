"""``python -m functacc bench --nproc N --parallel {dp,zero1,zero2,zero3} [--tp T]``.

Launches N ranks with torchrun; each rank trains the same workload with functacc's strategy
and with PyTorch's own engine for the same job — ``DistributedDataParallel`` for data
parallelism, FSDP2 ``fully_shard`` for sharding, each eager and under ``torch.compile`` —
interleaved round by round. FSDP2 shards the same units as functacc's ZeRO-3 (the modules of
the workload's wrap classes, the rest as the root unit). Rank 0 prints global samples/s,
the ratio to each PyTorch engine, the largest per-rank peak memory and the bytes each rank
communicates per step. With ``--tp T``, functacc's tensor parallelism over groups of T
ranks (data parallel across them; each group trains on T ranks' batches at once, so the
global batch is the same) is measured first, beside functacc's and DDP's data parallelism.
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

from .._compat import compile_with_recompile_limit
from .args import parser
from .memory import peak_memory
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

    batches = workload.cycle()

    def run() -> Tensor:
        return step(*next(batches))

    def sent() -> float:
        return float(sum(step.stats()["payload_bytes"].values()))

    return _Competitor(f"functacc {parallel}", run, sent)


# What --tp splits: the MLP's layers in pairs, the Transformer's feed-forward layers, GPT-2's
# MLPs, embedding and output layer (its attention's fused projection keeps a baked width).
TP_PLANS = {
    "mlp": {str(i): "colwise" if i % 4 == 0 else "rowwise" for i in range(0, 16, 2)},
    "transformer": {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"},
    "gpt2": {
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
        "wte": "vocab",
        "lm_head": "colwise_rep",
    },
}
TP_PLANS["gpt2-small"] = TP_PLANS["gpt2"]


def _tensor_parallel(workload: Any, name: str, size: int) -> _Competitor:
    import functacc

    if name not in TP_PLANS:
        raise SystemExit(f"--tp takes --model {', '.join(TP_PLANS)}; got --model {name}")
    model = copy.deepcopy(workload.model)
    opt = workload.make_opt(model)
    parallel = [functacc.parallel.TensorParallel(TP_PLANS[name], size=size)]
    parallel.append(functacc.parallel.DataParallel())
    step = functacc.compile_step(model, workload.loss_fn, opt, parallel=parallel)
    batches = workload.cycle()

    def run() -> Tensor:  # the group takes as many batches at once as it has ranks
        parts = [next(batches) for _ in range(size)]
        return step(*(torch.cat(t) for t in zip(*parts, strict=True)))

    def sent() -> float:
        return float(sum(step.stats()["payload_bytes"].values()))

    return _Competitor(f"functacc tp{size}", run, sent)


def _ddp(workload: Any, compiled: bool) -> _Competitor:
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(workload.model)
    if compiled:
        # The module inside DDP, not DDP: Dynamo skips DDP's forward, then the frames of
        # torch.nn's own modules (the MLP's Sequential), and would compile nothing; inside
        # DDP's forward its DDPOptimizer splits the graph at the gradient buckets.
        model.compile(options=_compile_options(workload))
    ddp = DistributedDataParallel(model)
    opt = workload.make_opt(ddp)
    counted = {"bytes": 0, "steps": 0}

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # DDP checks real annotations, not the strings of __future__
        counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
    ddp.register_comm_hook(None, hook)

    batches = workload.cycle()

    def run() -> Tensor:
        inputs, targets = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = workload.loss_fn(ddp(inputs), targets)
        loss.backward()
        opt.step()
        counted["steps"] += 1
        return loss.detach()

    def sent() -> float:
        return counted["bytes"] / max(counted["steps"], 1)

    return _Competitor("torch.compile DDP" if compiled else "torch DDP", run, sent)


def _compile_options(workload: Any) -> dict[str, Any]:
    from ..frontends.accelerate import _compile_options as options

    return options(workload.inputs.device)


def _compile_units(units: list[torch.nn.Module], workload: Any) -> None:
    """``torch.compile`` the ``forward`` of each FSDP2 unit, so that FSDP2's hooks (all-gather
    before, reduce-scatter after) run eagerly around a compiled body, as with torchtitan's
    per-block compilation. Compiling the whole sharded model instead compiles nothing on
    the MLP: Dynamo breaks the graph at FSDP2's hooks and skips the frames of ``torch.nn``'s
    own modules (its ``Linear`` units, its ``Sequential`` root). The root's own layers stay
    eager.

    Units of one class share their compiled code; static shapes give each distinct width
    its own graph (automatic dynamic shapes fail in Inductor's backward on ResNet-50's
    Bottlenecks, see ``functacc.accelerate``), and the recompile limit must hold them: these
    functions' own limit, not the process-wide one."""
    shapes = {(type(u), tuple(tuple(q.shape) for q in u.parameters())) for u in units}
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(shapes))
    for unit in units:
        unit.forward = compile_with_recompile_limit(
            unit.forward, limit, dynamic=False, options=_compile_options(workload)
        )


def _fsdp2(workload: Any, wrap: set[str], reshard: bool, compiled: bool) -> _Competitor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(workload.model)
    mesh = init_device_mesh(workload.inputs.device.type, (dist.get_world_size(),))
    units = [module for module in model.modules() if type(module).__name__ in wrap]
    for module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if compiled:
        _compile_units(units, workload)
    opt = workload.make_opt(model)

    batches = workload.cycle()

    def run() -> Tensor:
        inputs, targets = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        return loss.detach()

    def sent() -> float:
        # One step of its own, counted by a dispatch mode: outside the timed rounds, whose
        # every op it would slow down (and under which Dynamo runs frames eagerly; FSDP2's
        # collectives are the same either way).
        counter = _CollectiveBytes()
        with counter:
            run()
        return float(counter.bytes)

    name = ("torch.compile FSDP2" if compiled else "torch FSDP2") + (
        "" if reshard else " (no reshard)"
    )
    return _Competitor(name, run, sent)


WRAP = {
    "mlp": {"Linear"},
    "resnet18": {"BasicBlock"},
    "resnet50": {"Bottleneck"},
    "transformer": {"TransformerEncoderLayer"},
    "gpt2": {"GPT2Block"},
    "gpt2-small": {"GPT2Block"},
}


def worker(argv: Sequence[str] | None = None) -> int:
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
    reshard = args.parallel == "zero3"
    for compiled in (False, True):  # PyTorch's engine eager, then under torch.compile
        if args.parallel == "dp":
            factories.append(lambda c=compiled: _ddp(workload, c))
        else:
            factories.append(lambda c=compiled: _fsdp2(workload, wrap, reshard, c))
    if args.tp:  # first, its ratios against the same two engines
        factories.insert(0, lambda: _tensor_parallel(workload, args.model, args.tp))
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
    sent = [competitor.bytes_per_step() for competitor in competitors]
    if rank == 0:
        print(f"{workload.description}, per-rank batch; {world} ranks (gloo); {machine()}")
        print(f"{args.rounds} rounds x {args.steps} steps, interleaved; median round throughput")
        # The ratios are to PyTorch's engine, eager and under torch.compile (the last two).
        eager, compiled = (statistics.median(r) for r in rates[-2:])
        print(
            f"| | samples/s (all ranks) | vs {competitors[-2].name} | vs {competitors[-1].name} "
            "| first step (s) | peak memory per rank (MiB) | payload bytes per rank per step |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for competitor, rate, t0, peak, nbytes in zip(
            competitors, rates, first, peaks, sent, strict=True
        ):
            median = statistics.median(rate)
            print(
                f"| {competitor.name} | {median:.1f} | {median / eager:.2f}x | "
                f"{median / compiled:.2f}x | {t0:.1f} | {peak / 2**20:.1f} | {nbytes:,.0f} |"
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker())
