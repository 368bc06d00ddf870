"""Shared by the functacc.jit examples: the jitted step and the same eager step, from the
same start on the same batches, one after the other; prints each one's last result and
the speed-up."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


def arguments(doc: str, steps: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument(
        "--backend",
        default="inductor",
        choices=["inductor", "eager"],
        help="eager: the traced graph run op by op (bit for bit as the eager step)",
    )
    return p.parse_args()


def race(
    runs: dict[str, Callable[[Any], Any]],
    batches: list,
    describe: Callable[[Any], str],
    jitted: Any,
) -> None:
    """``runs`` maps "functacc.jit" and "eager" to a function of one batch."""
    times = {}
    for name, advance in runs.items():
        torch.manual_seed(0)  # the same dropout masks and random draws in both runs
        result = advance(batches[0])  # functacc traces and compiles here
        start = time.perf_counter()
        for batch in batches[1:]:
            result = advance(batch)
        times[name] = time.perf_counter() - start
        print(f"[{name}] {describe(result)}")
    print(
        f"{len(batches) - 1} steps: eager {times['eager']:.2f} s, functacc.jit "
        f"{times['functacc.jit']:.2f} s ({times['eager'] / times['functacc.jit']:.2f}x), "
        f"{jitted.num_traces} trace"
    )
