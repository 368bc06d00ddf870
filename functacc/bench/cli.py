"""Command line of the benchmark."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

from ..transforms.remat import POLICIES
from . import competitors, report, runner
from .args import parser
from .models import build
from .optimizers import OPTIMIZERS
from .step_bodies import STEP_WORKLOADS

__all__ = ["main"]

REMAT_DEFAULTS = {
    "mlp": {"Linear"},
    "resnet18": {"BasicBlock"},
    "resnet50": {"Bottleneck"},
    "transformer": {"TransformerEncoderLayer"},
}


def warm_inductor(device: str) -> None:
    """Pay Inductor's once-per-machine costs before any competitor starts (probing the
    CPU's vector instructions, building the precompiled kernel header): whichever compiled
    first would otherwise carry them in its first-step time."""
    torch.compile(lambda x: x * 2 + 1)(torch.ones(64, device=device))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.nproc > 1:
        from .distributed import launch

        return launch(args, argv)
    if args.lengths:
        from . import shapes

        return shapes.main(args, "python -m functacc bench " + " ".join(argv))
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="functacc-bench-")
        competitors.FunctaccBackground.cold = True
    warm_inductor(args.device)
    if args.model in STEP_WORKLOADS:
        return _step_bodies(args, argv)
    workload = build(
        args.model,
        batch_size=args.batch_size,
        image_size=args.image_size,
        seq_len=args.seq_len,
        device=args.device,
        amp=torch.bfloat16 if args.amp == "bf16" else None,
    )
    if args.optimizer:
        workload.make_opt = OPTIMIZERS[args.optimizer]
        workload.description += f" (optimizer: {args.optimizer})"
    names = [n.strip() for n in args.competitors.split(",") if n.strip()]
    if args.accelerate and "accelerate" not in names:
        names = ["eager", "accelerate"]
    factories = [lambda n=n: competitors.make(n, workload) for n in names]
    if args.precision:
        factories.append(
            lambda: competitors.functacc_variant(workload, args.precision, precision=args.precision)
        )
    if args.remat:
        classes = (
            REMAT_DEFAULTS[args.model] if args.remat == "default" else set(args.remat.split(","))
        )
        for policy in POLICIES:  # "functacc remat" (full), "... remat save_matmuls", ...
            label = "remat" if policy == "full" else f"remat {policy}"
            factories.append(
                lambda label=label, policy=policy: competitors.functacc_variant(
                    workload, label, remat=classes, remat_policy=policy
                )
            )
    if args.channels_last:
        factories.append(
            lambda: competitors.functacc_variant(
                workload,
                "channels_last",
                memory_format=torch.channels_last,
                inductor_options={"layout_optimization": True},
            )
        )
    if args.cuda_graphs_off:
        if torch.device(args.device).type != "cuda":
            raise SystemExit("--cuda-graphs-off compares CUDA-graph replay: it needs --device cuda")
        factories.append(
            lambda: competitors.functacc_variant(workload, "no cuda graphs", cuda_graphs=False)
        )
    variants = [o.strip() for o in (args.inductor_variants or "").split(",") if o.strip()]
    for option in variants:
        factories.append(
            lambda o=option: competitors.functacc_variant(workload, o, inductor_options={o: True})
        )
    results = runner.run(
        factories,
        batch_size=workload.inputs.shape[0],
        device=torch.device(args.device),
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        progress=not args.no_progress,
    )
    from .roofline import matmul_peak_flops, step_flops

    device = torch.device(args.device)
    peak = matmul_peak_flops(device, dtype=workload.amp or torch.float32)
    flops = step_flops(workload.model, workload.inputs, workload.targets, workload.loss_fn)
    steps_per_s = {r.name: r.samples_per_s / workload.inputs.shape[0] for r in results}
    for r in results:
        r.peak_fraction = flops * steps_per_s[r.name] / peak
    print(f"{workload.description}; {report.machine()}")
    kind = "bf16" if workload.amp == torch.bfloat16 else "fp32"
    print(
        f"{kind} matmul peak measured now: {peak / 1e9:.0f} GFLOP/s; one step: "
        f"{flops / 1e6:.0f} MFLOP (forward + backward)"
    )
    if device.type == "cuda":
        print(
            "peak memory on CUDA: the high point of building the competitor and its first "
            "3 steps (weights, optimizer state, graphs' memory pools included)"
        )
    print(
        f"{args.rounds} rounds x {args.steps} steps, interleaved; median round throughput; "
        f"every competitor cycles through the same {len(workload.batches)} random batches"
    )
    print(report.table(results))
    if args.json:
        report.write_json(
            args.json,
            {
                "workload": workload.description,
                "machine": report.machine(),
                "matmul_peak_flops": peak,
                "matmul_peak_dtype": kind,
                "step_flops": flops,
                "batches": len(workload.batches),
                "command": "python -m functacc bench "
                + " ".join(sys.argv[1:] if argv is None else argv),
                "results": [r.as_dict() for r in results],
            },
        )
    if args.plot:
        report.plot(args.plot, results, title=workload.description)
    return 0


def _step_bodies(args: argparse.Namespace, argv: list[str]) -> int:
    """``--model wgan-gp`` / ``distill``: whole step bodies, eager vs torch.compile vs jit."""
    from .step_bodies import build_step_workload, make_step_competitor

    workload = build_step_workload(args.model, batch_size=args.batch_size, device=args.device)
    names = [n.strip() for n in args.competitors.split(",") if n.strip()]
    failures: dict[str, str] = {}
    results = runner.run(
        [lambda n=n: make_step_competitor(n, workload) for n in names],
        failures=failures,
        labels=names,
        batch_size=workload.samples or workload.batches[0][0].shape[0],
        device=torch.device(args.device),
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        progress=not args.no_progress,
    )
    print(f"{workload.description}; {report.machine()}")
    print(f"{args.rounds} rounds x {args.steps} steps, interleaved; median round throughput")
    print(report.table(results))
    for name, error in failures.items():
        print(f"{name}: failed at its first step, left out: {error}")
    if args.json:
        report.write_json(
            args.json,
            {
                "workload": workload.description,
                "machine": report.machine(),
                "command": "python -m functacc bench " + " ".join(argv),
                "results": [r.as_dict() for r in results],
                "failures": failures,
            },
        )
    return 0
