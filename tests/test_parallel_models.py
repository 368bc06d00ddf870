"""Data parallelism and ZeRO on real models, 2 ranks on gloo under torchrun, against eager
PyTorch in one process (tests/dist/models_worker.py runs every scenario and its reference).

The reference with dropout. Each rank draws its masks from its own generator (seeded per
rank and step), so one process on the full batch cannot draw the same masks. The reference
replays them instead: for each rank's slice it reseeds with that rank's seed, runs forward
and backward of ``loss / world``, and takes one ``torch.optim`` step. With 2 ranks this is the
very arithmetic of data parallelism: each slice's gradient comes from the same kernels on
the same shapes, dividing by 2 is exact, and the sum of two gradients does not depend on
their order. So the eager backend is compared bit for bit.

Tolerances:
- eager backend, ZeRO against DP, symbolic against static graphs, DP against the replayed
  reference: exact (rtol = atol = 0), for the reason above;
- against one process on the literal full batch (no dropout): the gradient of the mean over
  16 samples is summed in another order than the average of two 8-sample means, so
  atol = 1e-6 (SGD with momentum, 8 steps, parameters of order 1; measured: 3e-8);
- Inductor: it fuses and reorders float32 arithmetic, rtol = 1e-4, atol = 1e-5 after 4
  steps, as tests/test_step_parity.py (measured: 3e-8 on parameters, 1.2e-7 on losses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist" / "models_worker.py"
EXACT = {"rtol": 0.0, "atol": 0.0}
FULL_BATCH = {"rtol": 0.0, "atol": 1e-6}
INDUCTOR = {"rtol": 1e-4, "atol": 1e-5}


def run_torchrun(tmp: Path, scenario: str, timeout: float = 600) -> dict:
    out = tmp / f"{scenario}.pt"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        scenario,
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist_models")


@pytest.fixture(scope="module")
def eager(workdir) -> dict:
    return run_torchrun(workdir, "eager")


@pytest.fixture(scope="module")
def inductor(workdir) -> dict:
    return run_torchrun(workdir, "inductor")


@pytest.fixture(scope="module")
def dynamic(workdir) -> dict:
    return run_torchrun(workdir, "dynamic")


def run(results: dict, key: str) -> dict:
    """One training run's results; a run that raised fails here with its traceback."""
    result = results[key]
    if "error" in result:
        pytest.fail(f"{key} raised on the ranks:\n{result['error']}", pytrace=False)
    return result


def trained(state: dict, initial: dict) -> bool:
    return any(not torch.equal(state[k], initial[k]) for k in initial)


# -- A: Hugging Face GPT-2, tied embedding, ZeRO-3 -------------------------------------------
@pytest.mark.parametrize("zero", ["zero3", "zero3_blocks"])
def test_gpt2_zero3_with_tied_embedding_equals_data_parallel(eager, zero) -> None:
    # GPT-2's `transformer.wte.weight` is `lm_head.weight`: ZeRO-3 shards it once, gathers it
    # once per unit and swaps it in under both names. As one root unit, and with each
    # GPT2Block a unit of its own (wte and lm_head stay together in the root), dropout on.
    # Measured equal bit for bit; the bound asked for is 1e-5, the arithmetic is the same.
    result, dp = run(eager, f"gpt2/{zero}"), run(eager, "gpt2/dp")
    assert result["stats"]["strategy"] == "ZeRO-3" and result["random"]  # dropout on
    assert_close(result["losses"], dp["losses"], **EXACT, what=f"GPT-2 {zero} losses")
    assert_close(result["state"], dp["state"], **EXACT, what=f"GPT-2 {zero}")
    # The tie survives training and sync_model(): one tensor under two names.
    state = result["state"]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert trained(state, run(eager, "gpt2/reference")["initial"])


def test_gpt2_data_parallel_equals_eager_with_each_ranks_dropout(eager) -> None:
    # Anchors the ZeRO-3 comparison: the DP run is eager PyTorch's training (module docstring).
    dp, ref = run(eager, "gpt2/dp"), run(eager, "gpt2/reference")
    assert_close(dp["losses"], ref["losses"], **EXACT, what="GPT-2 DP losses")
    assert_close(dp["state"], ref["state"], **EXACT, what="GPT-2 DP")


# -- B: Inductor, dropout on, the collective-scheduling pass ---------------------------------
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_eager_backend_with_dropout_equals_eager_pytorch(eager, strategy) -> None:
    # The reference the Inductor test leans on: the same ranks and seeds on the eager backend.
    result, ref = run(eager, f"mlp/{strategy}"), run(eager, "mlp/reference")
    assert_close(result["losses"], ref["losses"], **EXACT, what=f"{strategy} losses")
    assert_close(result["state"], ref["state"], **EXACT, what=strategy)
    assert trained(result["state"], ref["initial"])


@pytest.mark.inductor
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_inductor_with_dropout_equals_eager(inductor, eager, strategy) -> None:
    # functacc compiles CPU graphs with fallback_random: Inductor draws dropout's masks with
    # eager's kernel from eager's generator in eager's order. The same seeds give the same
    # masks, and only the float32 arithmetic differs (different masks would move the losses
    # by ~0.1, not 1e-7).
    result = run(inductor, strategy)
    assert result["traces"] == [(1, "first call", {})]
    assert result["random"]  # the compiled graph draws dropout masks
    for what, expected in (
        ("eager backend, same ranks and seeds", run(eager, f"mlp/{strategy}")),
        ("eager PyTorch, one process", run(eager, "mlp/reference")),
    ):
        assert_close(result["losses"], expected["losses"], **INDUCTOR, what=f"{what}: losses")
        assert_close(result["state"], expected["state"], **INDUCTOR, what=what)


@pytest.mark.inductor
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_inductor_graph_was_scheduled_for_overlap(inductor, strategy) -> None:
    # functacc.parallel.schedule.issue_collectives_early ran on the graph Inductor compiled
    # (the worker counts its calls and moves), and it did what it is for: at least one
    # gradient reduction starts before a backward matrix multiply and is waited for after
    # it. In the graph as traced every reduction follows the whole backward and is waited for
    # at once (measured with the pass disabled: 0 matmuls inside every reduction).
    result = run(inductor, strategy)
    assert len(result["moved"]) == 1 and result["moved"][0] > 0, result["moved"]
    (overlap,) = result["overlap"]
    assert overlap and max(overlap) > 0, overlap


# -- C: a new sequence length every step -----------------------------------------------------
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero3"])
def test_varying_lengths_take_two_traces_and_match_one_process(dynamic, strategy) -> None:
    result, ref = run(dynamic, f"{strategy}/None"), run(dynamic, "reference")
    # First call static; the second length retraces once with the length symbolic, and that
    # graph serves the six lengths after it.
    assert [(n, d) for n, _, d in result["traces"]] == [(1, {}), (2, {"input_ids": [1]})]
    # One process on the full batch computes the mean over both ranks' samples.
    assert_close(result["losses"].mean(dim=1), ref["losses"], **FULL_BATCH, what="losses")
    assert_close(result["state"], ref["state"], **FULL_BATCH, what=strategy)
    assert trained(result["state"], ref["initial"])


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero3"])
def test_varying_lengths_symbolic_graph_equals_static_graphs(dynamic, strategy) -> None:
    symbolic, static = run(dynamic, f"{strategy}/None"), run(dynamic, f"{strategy}/False")
    assert len(static["traces"]) == len(set(dynamic["lengths"]))  # one per length
    assert_close(symbolic["losses"], static["losses"], **EXACT, what="losses")
    assert_close(symbolic["state"], static["state"], **EXACT, what=strategy)
    # And ZeRO is data parallelism's arithmetic with symbolic sizes too.
    assert_close(symbolic["state"], run(dynamic, "dp/None")["state"], **EXACT, what="vs DP")


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_gpt2_varying_lengths_with_dropout(dynamic, strategy) -> None:
    result, ref = run(dynamic, f"gpt2/{strategy}"), run(dynamic, "gpt2/reference")
    symbolic = {"input_ids": [1], "labels": [1]}
    assert [(n, d) for n, _, d in result["traces"]] == [(1, {}), (2, symbolic)]
    assert result["random"]  # dropout on
    assert_close(result["losses"], ref["losses"], **EXACT, what=f"GPT-2 {strategy} losses")
    assert_close(result["state"], ref["state"], **EXACT, what=f"GPT-2 {strategy}")
