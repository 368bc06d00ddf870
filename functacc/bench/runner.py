"""Run competitors side by side in one process, interleaved round by round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from .competitors import Competitor
from .memory import peak_memory

__all__ = ["Result", "run"]


@dataclass
class Result:
    name: str
    first_step_s: float  # time to first step: tracing + compilation + one step
    samples_per_s: float  # median over rounds
    round_samples_per_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    final_loss: float = float("nan")
    # functacc only: (trace s, compile s) per graph, and the per-call work outside the graph
    compile_s: list[tuple[float, float]] = field(default_factory=list)
    host_overhead_us: float | None = None
    peak_fraction: float | None = None  # of the machine's measured fp32 matmul peak
    # Minor page faults per timed step, the whole process (CPU): memory faulted in afresh.
    page_faults_per_step: float | None = None
    # Background compiles: from the start to the compiled code in use (the runner waits).
    ready_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (``None`` where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    factories: Sequence[Callable[[], Competitor]],
    *,
    batch_size: int,
    device: torch.device,
    warmup: int,
    steps: int,
    rounds: int,
    progress: bool = True,
    failures: dict[str, str] | None = None,
    labels: Sequence[str] | None = None,
) -> list[Result]:
    """Build each competitor (timing its first step), warm up, then time ``rounds`` rounds of
    ``steps`` steps, rotating the order each round so that no competitor always runs first
    (CPU frequency and cache state drift over a run).

    With ``failures`` (and ``labels``, the competitors' names), a competitor that cannot
    build or take its first step is recorded there (label -> the error) and left out,
    instead of ending the run: a rival that does not support a workload is a result."""
    total = len(factories) * (1 + warmup + rounds * steps + 1)
    bar = tqdm(total=total, desc="bench", unit="step", disable=not progress, leave=False)
    competitors: list[Competitor] = []
    results: list[Result] = []
    for factory in factories:
        if device.type == "cuda":
            _sync(device)
            live = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        try:
            competitor = factory()
            competitor.step()
        except Exception as exc:
            if failures is None or labels is None:
                raise
            label = labels[len(competitors) + len(failures)]
            failures[label] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            bar.update(1 + warmup + rounds * steps + 1)
            continue
        _sync(device)
        first = time.perf_counter() - start
        competitors.append(competitor)
        results.append(Result(competitor.name, first, 0.0))
        if hasattr(competitor, "ready"):  # a background compile: its code before any timing
            competitor.ready()
            results[-1].ready_s = time.perf_counter() - start
        bar.update(1)
        if device.type == "cuda":
            # A replayed CUDA graph allocates nothing, so one step's high point would miss
            # the graph's memory pool: count the whole footprint from building the
            # competitor through the steps that warm up and capture.
            for _ in range(max(warmup, 2)):
                competitor.step()
                bar.update(1)
            _sync(device)
            results[-1].peak_memory_bytes = torch.cuda.max_memory_allocated(device) - live
    for competitor in competitors:
        for _ in range(warmup if device.type != "cuda" else 0):
            competitor.step()
            bar.update(1)
    for r in range(rounds):
        order = list(range(len(competitors)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            _sync(device)
            faults = _minor_faults()
            start = time.perf_counter()
            for _ in range(steps):
                loss = competitors[i].step()
            _sync(device)
            elapsed = time.perf_counter() - start
            results[i].round_samples_per_s.append(steps * batch_size / elapsed)
            if faults is not None and device.type == "cpu":
                # The last round's count: earlier rounds may still be growing the heap.
                results[i].page_faults_per_step = (_minor_faults() - faults) / steps
            results[i].final_loss = float(loss)
            bar.update(steps)
    for competitor, result in zip(competitors, results, strict=True):
        result.samples_per_s = statistics.median(result.round_samples_per_s)
        if device.type != "cuda":
            result.peak_memory_bytes = peak_memory(competitor.step, device=device)
        if hasattr(competitor, "compile_times"):
            result.compile_s = competitor.compile_times()
        if hasattr(competitor, "host_overhead_s") and device.type == "cpu":
            seconds = competitor.host_overhead_s()
            result.host_overhead_us = None if seconds != seconds else seconds * 1e6
        bar.update(1)
    bar.close()
    return results
