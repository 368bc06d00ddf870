"""``python -m functacc bench``: the competitors train the same workload, and the report
says what the measurements say."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from functacc.bench.cli import main
from functacc.bench.competitors import Eager
from functacc.bench.models import POOL, _pool_size, build


@pytest.mark.inductor
def test_bench_competitors_train_the_same_model_and_report_consistent_ratios(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    argv = ["--model", "mlp", "--competitors", "eager,functacc", "--steps", "3", "--rounds", "2"]
    argv += ["--device", "cpu"]  # host overhead and page faults are measured on CPU runs
    assert main([*argv, "--warmup", "1", "--no-progress", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["batches"] == POOL
    eager, functacc = payload["results"]
    assert (eager["name"], functacc["name"]) == ("eager", "functacc")
    # Same weights, data and number of steps (1 + 1 warm-up + 2 rounds x 3) before the last
    # loss: Inductor's fused AdamW step vs torch.optim's, float32 rounding only.
    assert math.isclose(eager["final_loss"], functacc["final_loss"], rel_tol=1e-4)
    assert 0 < functacc["host_overhead_us"] < 1000
    assert eager["host_overhead_us"] is None
    for r in (eager, functacc):
        assert len(r["round_samples_per_s"]) == 2
        assert r["page_faults_per_step"] is not None and r["page_faults_per_step"] >= 0
        assert 0 < r["peak_fraction"] < 1
    # The printed ratio is the JSON's throughput ratio.
    row = next(line for line in capsys.readouterr().out.splitlines() if "| functacc |" in line)
    ratio = float(row.split("|")[3].strip().rstrip("x"))
    assert ratio == pytest.approx(functacc["samples_per_s"] / eager["samples_per_s"], abs=0.006)


@pytest.mark.inductor
def test_bench_background_competitor_compiles_cold_into_its_own_cache(
    tmp_path, capsys, monkeypatch
):
    import os

    from functacc.bench import competitors

    # --cold points this process at fresh caches; put them back after the test.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(competitors.FunctaccBackground, "cold", False)
    path = tmp_path / "mlp.json"
    argv = ["--model", "mlp", "--competitors", "eager,functacc:background", "--cold"]
    argv += ["--steps", "2", "--rounds", "1", "--warmup", "0", "--no-progress"]
    assert main([*argv, "--json", str(path)]) == 0
    eager, background = json.loads(path.read_text())["results"]
    assert background["name"] == "functacc:background"
    # The runner waited for the workers' compile before the timed rounds, and reports when.
    assert 0 < background["first_step_s"] < background["ready_s"]
    assert eager["ready_s"] is None
    assert math.isclose(eager["final_loss"], background["final_loss"], rel_tol=1e-4)
    row = next(line for line in capsys.readouterr().out.splitlines() if "background |" in line)
    assert f"(compiled at {background['ready_s']:.1f})" in row
    # The bench's cold cache is back in place, not the background competitor's own.
    assert "functacc-bench-" in os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert "background" not in os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_workloads_cycle_through_a_pool_of_distinct_batches() -> None:
    w = build("mlp")
    assert len(w.batches) == POOL
    assert w.batches[0][0] is w.inputs and w.batches[0][1] is w.targets
    assert all(x.shape == w.inputs.shape and y.shape == w.targets.shape for x, y in w.batches)
    assert not torch.equal(w.batches[1][0], w.inputs)
    # Every competitor steps through the same sequence: two eager loops stay identical.
    a, b = Eager(w), Eager(w)
    for _ in range(POOL + 3):
        assert torch.equal(a.step(), b.step())
    # A big batch (ResNet-50 at 224x224, batch 64: 38.5 MB) is not copied 64 times.
    assert _pool_size(torch.empty(64, 3, 224, 224), torch.empty(64, dtype=torch.long)) == 1


def test_the_pool_keeps_the_mlp_from_memorising_its_batch() -> None:
    # Why the pool exists: on one fixed batch the MLP's loss collapses within a hundred
    # steps, its gradients underflow to denormals and the bench would time those.
    w = build("mlp")
    fixed = Eager(dataclasses.replace(w, batches=[(w.inputs, w.targets)]))
    pooled = Eager(w)
    for _ in range(150):
        fixed_loss, pooled_loss = fixed.step(), pooled.step()
    assert float(fixed_loss) < 1e-2
    assert float(pooled_loss) > 1.0


@pytest.mark.distributed
@pytest.mark.inductor
def test_bench_tensor_parallel_against_data_parallel_on_two_ranks() -> None:
    import subprocess
    import sys

    argv = ["--model", "mlp", "--nproc", "2", "--tp", "2", "--steps", "1", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "functacc", "bench", *argv, "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and "samples/s" not in line
    }
    assert list(rows) == ["functacc tp2", "functacc dp", "torch DDP", "torch.compile DDP"]
    # Per step, data parallel sends the gradients of all 8 x 256 x 257 + 2570 parameters,
    # tensor parallel activations (sums of the 256-wide layers' outputs and inputs' gradients).
    sent = {name: int(row[-1].replace(",", "")) for name, row in rows.items()}
    assert sent["functacc dp"] == sent["torch DDP"] == 4 * (8 * 256 * 257 + 2570)
    assert 0 < sent["functacc tp2"] < sent["functacc dp"] / 4
