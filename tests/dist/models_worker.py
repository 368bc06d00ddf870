"""Scenarios run under torchrun by tests/test_parallel_models.py: ``models_worker.py SCENARIO
OUT``. Every rank runs the scenario; rank 0 saves what the test asserts on with
``torch.save``.

The references are computed on rank 0 in the same scenario: eager PyTorch and
``torch.optim``, one process, on the global batch of all ranks. With dropout on, one
process cannot draw the masks the ranks drew from their own generators, so the reference
replays them: for each rank slice it reseeds with that rank's seed, runs the forward and
backward of ``loss / world`` on the slice, and steps once (the gradient is the average of
the ranks' gradients, which is what data parallelism computes).
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models

import functacc
from functacc.core.engine import draws_random
import functacc.parallel.schedule as schedule
from functacc.parallel import DataParallel, ZeRO

B = 4  # per-rank batch


def seed(step: int, rank: int) -> int:
    """The seed rank ``rank`` draws step ``step``'s dropout masks from."""
    return 1000 + 10 * step + rank


# -- data ----------------------------------------------------------------------------------
def token_batches(lengths: list[int], world: int, vocab: int = 64) -> list[dict]:
    """Global batches of B * world sequences, one length per step (rank r: the r-th slice).

    One label per sequence and equal slices, so the mean of the ranks' mean losses is the
    full batch's mean loss (as with DDP).
    """
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (B * world, n), generator=g)
        out.append({"input_ids": ids, "labels": torch.randint(0, 5, (B * world,), generator=g)})
    return out


def lm_batches(lengths: list[int], world: int, vocab: int = 64) -> list[dict]:
    """Language-modelling batches for GPT-2, one length per step: the labels are the inputs
    (HF shifts them)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (B * world, n), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def vector_batches(steps: int, world: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "x": torch.randn(B * world, 16, generator=g),
            "y": torch.randint(0, 5, (B * world,), generator=g),
        }
        for _ in range(steps)
    ]


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


# -- models ----------------------------------------------------------------------------------
class TokenClassifier(nn.Module):
    """Any sequence length: embedding, LayerNorm, a GELU MLP over tokens, mean, linear.
    The loss is computed inside (HF style), so the step is called as step(**batch)."""

    def __init__(self, vocab: int = 64, dim: int = 16, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
        h = self.norm(self.embed(input_ids))
        logits = self.head((h + self.mlp(h)).mean(dim=1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class DropoutMLP(nn.Module):
    """A small MLP with two nn.Dropout layers and a LayerNorm."""

    def __init__(self, p: float = 0.2):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 32),
            nn.GELU(),
            nn.Dropout(p),
            nn.Linear(32, 32),
            nn.LayerNorm(32),
            nn.GELU(),
            nn.Dropout(p),
        )
        self.head = nn.Linear(32, 5)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def loss_of(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    return out["loss"] if isinstance(out, dict) else out.loss


OPTS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
}


# -- the distributed run and its reference ---------------------------------------------------
def train(
    make: Callable[[], nn.Module],
    opt_name: str,
    batches: list[dict],
    parallel: Any,
    *,
    backend: str = "eager",
    dropout_seeds: bool = False,
    **kw: Any,
) -> dict:
    """Train with functacc on this rank's slices; gather every rank's losses. A failure is
    recorded as ``{"error": traceback}`` (the same on every rank: tracing is deterministic),
    so the tests of the other runs still get their results."""
    try:
        return _train(
            make, opt_name, batches, parallel, backend=backend, dropout_seeds=dropout_seeds, **kw
        )
    except Exception:
        traceback.print_exc()
        return {"error": traceback.format_exc()}


def _train(
    make: Callable[[], nn.Module],
    opt_name: str,
    batches: list[dict],
    parallel: Any,
    *,
    backend: str,
    dropout_seeds: bool,
    **kw: Any,
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make()
    step = functacc.compile_step(
        model, None, OPTS[opt_name](model), backend=backend, parallel=parallel, **kw
    )
    losses = []
    for i, batch in enumerate(batches):
        if dropout_seeds:
            torch.manual_seed(seed(i, rank))
        losses.append(step(**rank_slice(batch, rank, world)))
    step.sync_model()
    every = [torch.empty(len(batches)) for _ in range(world)]
    dist.all_gather(every, torch.stack(losses).float())
    return {
        "state": copy.deepcopy(model.state_dict()),
        "losses": torch.stack(every, dim=1),  # [step, rank]
        "traces": [(t.number, t.reason, t.dynamic) for t in step.traces],
        "stats": step.stats(),
        "overlap": [overlap(graph) for graph in step.graphs],
        "random": any(draws_random(graph) for graph in step.graphs),
    }


def reference(
    make: Callable[[], nn.Module],
    opt_name: str,
    batches: list[dict],
    world: int,
    *,
    per_rank_dropout: bool = False,
) -> dict:
    """Eager PyTorch, one process, the global batch; losses ``[step]``. ``per_rank_dropout``:
    replay each rank's masks (reseed per slice, backward of loss / world per slice, one
    optimizer step); losses ``[step, rank]``."""
    torch.manual_seed(0)
    model = make()
    initial = copy.deepcopy(model.state_dict())
    opt = OPTS[opt_name](model)
    losses = []
    for i, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if per_rank_dropout:
            row = []
            for r in range(world):
                torch.manual_seed(seed(i, r))
                loss = loss_of(model(**rank_slice(batch, r, world)))
                (loss / world).backward()
                row.append(loss.detach())
            losses.append(torch.stack(row))
        else:
            loss = loss_of(model(**batch))
            loss.backward()
            losses.append(loss.detach())
        opt.step()
    return {
        "state": copy.deepcopy(model.state_dict()),
        "losses": torch.stack(losses),
        "initial": initial,
    }


# -- the collective-scheduling pass ----------------------------------------------------------
MOVED: list[int] = []
_real_issue_collectives_early = schedule.issue_collectives_early


def _counting_issue_collectives_early(gm):
    """The real pass, counted: compile_graph imports it from the module at each compile."""
    moved = _real_issue_collectives_early(gm)
    MOVED.append(moved)
    return moved


schedule.issue_collectives_early = _counting_issue_collectives_early

_GRADIENT_COLLECTIVES = {"all_reduce", "reduce_scatter_tensor"}
_MATMULS = {"mm", "addmm", "bmm"}


def overlap(gm: torch.fx.GraphModule) -> list[int]:
    """For each gradient reduction of the graph, how many matrix multiplies run between its
    start and its wait: communication in flight while backward still computes."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    matmuls = [i for i, n in enumerate(nodes) if getattr(n.target, "_opname", None) in _MATMULS]
    out = []
    for node in nodes:
        if getattr(node.target, "namespace", "") != "_c10d_functional":
            continue
        if node.target._opname not in _GRADIENT_COLLECTIVES:
            continue
        wait = min(position[u] for u in node.users)
        out.append(sum(position[node] < i < wait for i in matmuls))
    return out


# -- scenarios -------------------------------------------------------------------------------
def scenario_eager(out: dict) -> None:
    """HF GPT-2 (``wte`` tied to ``lm_head``), dropout on: ZeRO-3 against data parallelism;
    and the dropout MLP of the Inductor scenario on the eager backend."""
    world = dist.get_world_size()
    batches = lm_batches([10] * 4, world)

    def gpt2():
        return models.gpt2(dropout=0.1)

    out["gpt2/dp"] = train(gpt2, "adamw", batches, DataParallel(), dropout_seeds=True)
    out["gpt2/zero3"] = train(gpt2, "adamw", batches, ZeRO(3), dropout_seeds=True)
    out["gpt2/zero3_blocks"] = train(
        gpt2, "adamw", batches, ZeRO(3, wrap_layer_cls={"GPT2Block"}), dropout_seeds=True
    )
    out["gpt2/reference"] = reference(gpt2, "adamw", batches, world, per_rank_dropout=True)
    mlp_batches = vector_batches(4, world)
    for name, parallel in strategies_for_inductor().items():
        out[f"mlp/{name}"] = train(DropoutMLP, "adamw", mlp_batches, parallel, dropout_seeds=True)
    out["mlp/reference"] = reference(DropoutMLP, "adamw", mlp_batches, world, per_rank_dropout=True)


def strategies_for_inductor() -> dict[str, Any]:
    return {
        # Small buckets: several all-reduces, so the scheduling pass has something to overlap.
        "dp": DataParallel(bucket_mb=0.002),
        "zero3": ZeRO(3, wrap_layer_cls={"Linear"}),
    }


def scenario_inductor(out: dict) -> None:
    """The dropout MLP under Inductor, DP and ZeRO-3, with the scheduling pass counted."""
    world = dist.get_world_size()
    batches = vector_batches(4, world)
    for name, parallel in strategies_for_inductor().items():
        MOVED.clear()
        # No fallback_random here: functacc compiles CPU graphs with it, so the masks are
        # eager's as users get them.
        result = train(
            DropoutMLP, "adamw", batches, parallel, backend="inductor", dropout_seeds=True
        )
        out[name] = {**result, "moved": list(MOVED)}


LENGTHS = [6, 9, 12, 7, 14, 10, 8, 11]


def scenario_dynamic(out: dict) -> None:
    """A new sequence length every step, ``dynamic=None`` (and ``False`` to compare): DP,
    ZeRO-1 and ZeRO-3 on a token classifier; DP and ZeRO-3 on GPT-2 with dropout."""
    world = dist.get_world_size()
    batches = token_batches(LENGTHS, world)
    out["lengths"] = LENGTHS
    strategies = {
        "dp": DataParallel(),
        "zero1": ZeRO(1),
        "zero3": ZeRO(3, wrap_layer_cls={"Linear"}),
    }
    for name, parallel in strategies.items():
        for dynamic in (None, False):
            out[f"{name}/{dynamic}"] = train(
                TokenClassifier, "sgd", batches, parallel, dynamic=dynamic, max_traces=None
            )
    out["reference"] = reference(TokenClassifier, "sgd", batches, world)
    gpt2_batches = lm_batches(LENGTHS[:5], world)

    def gpt2():
        return models.gpt2(dropout=0.1)

    for name in ("dp", "zero3"):
        parallel = DataParallel() if name == "dp" else ZeRO(3, wrap_layer_cls={"GPT2Block"})
        out[f"gpt2/{name}"] = train(
            gpt2, "adamw", gpt2_batches, parallel, dropout_seeds=True, dynamic=None
        )
    out["gpt2/reference"] = reference(gpt2, "adamw", gpt2_batches, world, per_rank_dropout=True)


SCENARIOS = {
    "eager": scenario_eager,
    "inductor": scenario_inductor,
    "dynamic": scenario_dynamic,
}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    from worker import main

    main(SCENARIOS)
