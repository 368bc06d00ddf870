"""The benchmark's command-line options: one parser for ``python -m functacc bench`` (``cli.py``)
and for each torchrun rank of ``--nproc N`` (``distributed.py``), which parses the same
command line again."""

from __future__ import annotations

import argparse

import torch

from . import competitors
from .models import WORKLOADS
from .optimizers import OPTIMIZERS
from .step_bodies import STEP_WORKLOADS

__all__ = ["parser"]


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
        help="a model trained by the standard step, or a whole step body (wgan-gp, distill, "
        "lstm-lm: eager vs torch.compile of the step function vs functacc.jit)",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=None,
        help="train every competitor with this optimizer (default: the workload's own, AdamW "
        "or SGD); those without a functacc twin run their own step(), traced",
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
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="with --nproc > 1: also functacc tensor parallel over groups of this many ranks "
        "(data parallel across them), against functacc and torch DDP data parallel on the "
        "same global batch (--model mlp, transformer, gpt2, gpt2-small)",
    )
    return p
