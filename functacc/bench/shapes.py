"""Varying input shapes: a language model fine-tuned on dynamically padded batches.

Every batch is padded to its own longest sequence, as ``DataCollatorWithPadding`` does, so
the sequence length changes from step to step. Four ways to train the same weights on the
same batches:

- eager PyTorch;
- ``torch.compile`` of the model and of the optimizer step (automatic dynamic shapes);
- ``functacc.compile_step`` with its default ``dynamic=None`` (automatic dynamic shapes);
- ``functacc.compile_step(dynamic=False)`` on batches padded to a few bucket lengths by
  ``functacc.DeviceLoader(buckets=...)`` (one static graph per bucket).

Two measurements: the **whole run** (a fresh model, every compile included, one competitor
after the other, with an empty Inductor cache so nobody profits from another's compiles),
then the **steady state** (every graph compiled: rounds over the same batches, interleaved,
the order rotated each round).
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..frontends.compile_step import compile_step
from .models import gpt2

__all__ = ["ShapesResult", "gpt2_batches", "main"]


@dataclass
class ShapesResult:
    name: str
    whole_run_s: float = 0.0
    traces: int = 0
    compile_s: list[float] = field(default_factory=list)  # functacc: per trace
    samples_per_s: float = 0.0
    round_samples_per_s: list[float] = field(default_factory=list)
    final_loss: float = float("nan")

    def as_dict(self) -> dict:
        return asdict(self)


def parse_lengths(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"--lengths takes MIN:MAX (e.g. 8:128); got {text!r}") from None
    if not 2 <= low <= high:
        raise SystemExit(f"--lengths needs 2 <= MIN <= MAX; got {text!r}")
    return low, high


def gpt2_batches(
    steps: int, batch_size: int, lengths: tuple[int, int], vocab: int, seed: int = 0
) -> list[dict[str, Tensor]]:
    """Batches padded to their own longest sequence, with masks and -100 labels on padding."""
    g = torch.Generator().manual_seed(seed)
    low, high = lengths
    out = []
    for _ in range(steps):
        real = torch.randint(low, high + 1, (batch_size,), generator=g)
        longest = int(real.max())
        ids = torch.randint(1, vocab, (batch_size, longest), generator=g)
        mask = (torch.arange(longest) < real[:, None]).long()
        ids = ids * mask
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def bucketed(batches: Sequence[dict[str, Tensor]], buckets: Sequence[int]) -> list[dict]:
    """The same batches as a ``DeviceLoader(buckets=...)`` pads them."""
    from ..data import DeviceLoader

    loader = DeviceLoader(
        list(batches),
        device="cpu",
        buckets=list(buckets),
        pad_values={"input_ids": 0, "attention_mask": 0, "labels": -100},
        prefetch=0,
    )
    return list(loader)


class _Loop:
    """One competitor: a fresh copy of the weights and its own optimizer."""

    name = ""

    def __init__(self, model: nn.Module, make_opt: Callable[[nn.Module], Any]):
        self.model = copy.deepcopy(model)
        self.opt = make_opt(self.model)

    def step(self, batch: dict[str, Tensor]) -> Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(**batch).loss
        loss.backward()
        self.opt_step()
        return loss.detach()

    def forward(self, **batch: Tensor) -> Any:
        return self.model(**batch)

    def opt_step(self) -> None:
        self.opt.step()

    def traces(self) -> int:
        return 0

    def compile_times(self) -> list[float]:
        return []


class _Eager(_Loop):
    name = "eager"


class _TorchCompile(_Loop):
    name = "torch.compile"

    def __init__(self, model: nn.Module, make_opt: Callable[[nn.Module], Any]):
        super().__init__(model, make_opt)
        self.compiled = torch.compile(self.model)
        self.compiled_opt_step = torch.compile(self.opt.step)

    def forward(self, **batch: Tensor) -> Any:
        return self.compiled(**batch)

    def opt_step(self) -> None:
        self.compiled_opt_step()

    def traces(self) -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])


class _Functacc(_Loop):
    def __init__(self, model: nn.Module, make_opt: Callable, *, name: str, **options: Any):
        super().__init__(model, make_opt)
        self.name = name
        self.compiled = compile_step(self.model, None, self.opt, **options)

    def step(self, batch: dict[str, Tensor]) -> Tensor:
        return self.compiled(**batch)

    def traces(self) -> int:
        return self.compiled.num_traces

    def compile_times(self) -> list[float]:
        return [r.trace_s + r.compile_s for r in self.compiled.traces]


def _samples(batches: Sequence[dict[str, Tensor]]) -> int:
    return sum(int(b["input_ids"].shape[0]) for b in batches)


def run(
    model: nn.Module,
    batches: Sequence[dict[str, Tensor]],
    buckets: Sequence[int],
    *,
    rounds: int,
    progress: bool,
) -> list[ShapesResult]:
    from tqdm.auto import tqdm

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    padded = bucketed(batches, buckets)
    plans: list[tuple[Callable[[], _Loop], Sequence[dict[str, Tensor]]]] = [
        (lambda: _Eager(model, adamw), batches),
        (lambda: _TorchCompile(model, adamw), batches),
        (lambda: _Functacc(model, adamw, name="functacc dynamic=None"), batches),
        (
            lambda: _Functacc(model, adamw, name="functacc buckets", dynamic=False),
            padded,
        ),
    ]
    loops: list[_Loop] = []
    results: list[ShapesResult] = []
    bar = tqdm(total=len(plans) * (1 + rounds), desc="bench", leave=False, disable=not progress)
    for make, data in plans:
        torch.manual_seed(0)
        start = time.perf_counter()
        loop = make()
        for batch in data:
            loss = loop.step(batch)
        elapsed = time.perf_counter() - start
        results.append(
            ShapesResult(
                loop.name,
                whole_run_s=elapsed,
                traces=loop.traces(),
                compile_s=loop.compile_times(),
                final_loss=float(loss),
            )
        )
        loops.append(loop)
        bar.update(1)
    for r in range(rounds):
        order = list(range(len(loops)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            data = plans[i][1]
            start = time.perf_counter()
            for batch in data:
                loops[i].step(batch)
            results[i].round_samples_per_s.append(_samples(data) / (time.perf_counter() - start))
            bar.update(1)
    bar.close()
    for result in results:
        result.samples_per_s = statistics.median(result.round_samples_per_s)
        result.traces = loops[results.index(result)].traces()
    return results


def table(results: Sequence[ShapesResult]) -> str:
    by_name = {r.name: r for r in results}
    eager, rival = by_name["eager"], by_name["torch.compile"]
    lines = [
        "| | whole run (s) | vs torch.compile | traces | steady samples/s | vs eager "
        "| vs torch.compile |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.whole_run_s:.1f} | {rival.whole_run_s / r.whole_run_s:.2f}x | "
            f"{r.traces if r.name != 'eager' else '-'} | {r.samples_per_s:.1f} | "
            f"{r.samples_per_s / eager.samples_per_s:.2f}x | "
            f"{r.samples_per_s / rival.samples_per_s:.2f}x |"
        )
    return "\n".join(lines)


def main(args: Any, command: str) -> int:
    from . import report

    if args.model != "gpt2":
        raise SystemExit("--lengths (varying sequence lengths) is measured on --model gpt2")
    if not args.keep_cache:
        # An empty Inductor cache: the whole-run times include every compile, for all.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="functacc-bench-")
    lengths = parse_lengths(args.lengths)
    batch_size = args.batch_size or 8
    layers, dim, vocab = 4, 256, 1000
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    if not buckets:
        buckets = [lengths[1] * (i + 1) // 4 for i in range(4)]  # uniform, as TorchAcc
    torch.manual_seed(0)
    model = gpt2(layers, dim, vocab, positions=max(lengths[1], max(buckets)))
    batches = gpt2_batches(args.steps, batch_size, lengths, vocab)
    distinct = len({int(b["input_ids"].shape[1]) for b in batches})
    results = run(model, batches, buckets, rounds=args.rounds, progress=not args.no_progress)
    description = (
        f"HF GPT-2 {layers} layers x {dim}, batch {batch_size}, each batch padded to its "
        f"longest sequence (lengths {lengths[0]}-{lengths[1]}, {args.steps} steps, {distinct} "
        f"distinct lengths); buckets {buckets}; AdamW"
    )
    print(f"{description}; {report.machine()}")
    print(
        f"whole run: fresh model, compiles included, empty Inductor cache; steady state: "
        f"{args.rounds} interleaved rounds over the same batches, median"
    )
    print(table(results))
    for r in results:
        if r.compile_s:
            times = ", ".join(f"{t:.1f}" for t in r.compile_s)
            print(f"{r.name}: trace + compile per graph (s): {times}")
    if args.json:
        report.write_json(
            args.json,
            {
                "workload": description,
                "machine": report.machine(),
                "command": command,
                "results": [r.as_dict() for r in results],
            },
        )
    return 0
