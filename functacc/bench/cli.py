"""Command line of the benchmark."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

from ..remat import POLICIES
from . import competitors, report, runner
from .models import WORKLOADS, build
from .step_bodies import STEP_WORKLOADS

__all__ = ["main", "parser"]

REMAT_DEFAULTS = {
    "mlp": {"Linear"},
    "resnet18": {"BasicBlock"},
    "resnet50": {"Bottleneck"},
    "transformer": {"TransformerEncoderLayer"},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m functacc bench",
        description="Train one workload with eager PyTorch, torch.compile and functacc, "
        "interleaved in one process, and compare throughput, compile time and memory.",
    )
    p.add_argument(
        "--model",
        choices=(*WORKLOADS, *STEP_WORKLOADS),
        default="mlp",
        help="a model trained by the standard step, or a whole step body (wgan-gp, distill: "
        "eager vs torch.compile of the step function vs functacc.jit)",
    )
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None, help="resnet models only")
    p.add_argument("--seq-len", type=int, default=None, help="transformer and gpt2 models only")
    p.add_argument(
        "--cold",
        action="store_true",
        help="an empty Inductor cache, so every first step includes a full compile",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--accelerate",
        action="store_true",
        help="compare eager with functacc.accelerate (the TorchAcc-style front door)",
    )
    p.add_argument(
        "--competitors",
        default="eager,torch.compile,functacc",
        help="comma-separated subset of: " + ", ".join(competitors.COMPETITORS),
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16"),
        default=None,
        help="also run functacc in this precision, next to float32",
    )
    p.add_argument(
        "--amp",
        choices=("bf16",),
        default=None,
        help="run every competitor in bf16 mixed precision (eager and torch.compile under "
        "torch.autocast, functacc with precision='bf16'; float32 weights in all)",
    )
    p.add_argument(
        "--cuda-graphs-off",
        action="store_true",
        help="also run functacc with cuda_graphs=False (CUDA only), next to the default",
    )
    p.add_argument(
        "--remat",
        metavar="CLASSES",
        nargs="?",
        const="default",
        default=None,
        help="also run functacc recomputing these modules' activations in backward, once per "
        "remat_policy (comma-separated class names; without a value, the model's blocks)",
    )
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="also run functacc on a channels-last copy of the model and batch (converted "
        "once; Inductor's layout optimization on), next to the default layout",
    )
    p.add_argument(
        "--inductor-variants",
        metavar="OPT[,OPT]",
        default=None,
        help="also run functacc with each of these boolean torch._inductor.config settings "
        "turned on, one variant each (e.g. cpp_wrapper,max_autotune,freezing)",
    )
    p.add_argument(
        "--lengths",
        metavar="MIN:MAX",
        default=None,
        help="varying sequence lengths (with --model gpt2): every batch padded to its own "
        "longest sequence; compares eager, torch.compile and functacc with automatic dynamic "
        "shapes and with loader buckets; --steps is the number of batches",
    )
    p.add_argument(
        "--buckets",
        metavar="L1,L2,...",
        default=None,
        help="with --lengths: bucket lengths for the bucketed run (default: 4 uniform buckets)",
    )
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="with --lengths: keep the Inductor cache (default: a fresh one, so the whole-run "
        "times include every compile)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks to launch with torchrun (then --parallel picks the strategy)",
    )
    p.add_argument(
        "--parallel",
        choices=("dp", "zero1", "zero2", "zero3"),
        default="dp",
        help="with --nproc > 1: functacc's strategy; compared with torch DDP (dp) or FSDP2",
    )
    return p


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
        batch_size=workload.batches[0][0].shape[0],
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
