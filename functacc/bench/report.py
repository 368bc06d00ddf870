"""Tables, JSON and plots of benchmark results."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence

import torch

from .runner import Result

__all__ = ["machine", "plot", "table", "write_json"]


def machine() -> str:
    cores = torch.get_num_threads()
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {cores} threads, {gpu}, torch {torch.__version__}"


def table(
    results: Sequence[Result],
    *,
    baseline: str = "eager",
    rivals: Sequence[str] = ("torch.compile", "torch.compile:reduce-overhead"),
) -> str:
    """A Markdown table with throughput ratios to the baseline and to each rival present
    (always a ``vs torch.compile`` column, ``-`` when it did not run)."""
    by_name = {r.name: r for r in results}
    base = by_name.get(baseline)
    shown = [n for n in rivals if n in by_name] or list(rivals[:1])
    lines = [
        f"| | samples/s | vs {baseline} | "
        + "".join(f"vs {n} | " for n in shown)
        + "of matmul peak | first step (s) | trace + compile (s) | host µs/step "
        "| page faults/step | peak memory (MiB) |",
        "|---|---:|---:|" + "---:|" * len(shown) + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratios = [
            f"{r.samples_per_s / other.samples_per_s:.2f}x" if other else "-"
            for other in [base, *(by_name.get(n) for n in shown)]
        ]
        peak = f"{r.peak_fraction:.0%}" if r.peak_fraction is not None else "-"
        compiled = " + ".join(f"{t:.1f}+{c:.1f}" for t, c in r.compile_s) if r.compile_s else "-"
        host = f"{r.host_overhead_us:.0f}" if r.host_overhead_us is not None else "-"
        faults = f"{r.page_faults_per_step:.0f}" if r.page_faults_per_step is not None else "-"
        first = f"{r.first_step_s:.1f}"
        if r.ready_s is not None:
            first += f" (compiled at {r.ready_s:.1f})"
        lines.append(
            f"| {r.name} | {r.samples_per_s:.1f} | {' | '.join(ratios)} | {peak} | "
            f"{first} | {compiled} | {host} | {faults} | "
            f"{r.peak_memory_bytes / 2**20:.1f} |"
        )
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def plot(path: str, results: Sequence[Result], *, title: str) -> None:
    """A bar chart of samples/s (matplotlib is the optional 'plot' extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'functacc[plot]' (or pip install matplotlib)"
        ) from exc
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r.name for r in results]
    values = [r.samples_per_s for r in results]
    bars = ax.bar(names, values, color=["#888888", "#4c72b0", "#dd8452", "#55a868"][: len(names)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("samples / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
