"""``python -m functacc bench``: the competitors train the same workload, and the report
says what the measurements say."""

from __future__ import annotations

import json
import math

import pytest

from functacc.bench.cli import main


@pytest.mark.inductor
def test_bench_competitors_train_the_same_model_and_report_consistent_ratios(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    argv = ["--model", "mlp", "--competitors", "eager,functacc", "--steps", "3", "--rounds", "2"]
    assert main([*argv, "--warmup", "1", "--no-progress", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
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
