"""The example scripts run end to end (at tiny sizes, eager backend where it saves time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(args: list[str], timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_demo() -> None:
    # `make demo` at a tiny size: the three loops train and the table comes out.
    out = run([str(EXAMPLES / "demo.py"), "--rounds", "1", "--steps", "2", "--width", "32"])
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["eager", "torch.compile", "functacc"]
    assert "first step" in rows[0]


def test_quickstart() -> None:
    out = run(
        [
            str(EXAMPLES / "resnet_quickstart.py"),
            "--steps",
            "4",
            "--log-every",
            "2",
            "--batch-size",
            "4",
            "--image-size",
            "16",
            "--backend",
            "eager",
        ]
    )
    assert "[eager] Epoch: 0, Step: 4" in out and "[functacc] Epoch: 0, Step: 4" in out
    assert "samples/s" in out.splitlines()[-1]


@pytest.mark.distributed
def test_data_parallel_example() -> None:
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLES / "train_data_parallel.py"),
            "--samples",
            "128",
            "--backend",
            "eager",
        ]
    )
    assert "Epoch: 1, Step: 2" in out and "(2 ranks, data parallel)" in out


@pytest.mark.distributed
def test_tensor_parallel_example() -> None:
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLES / "train_tensor_parallel.py"),
            "--steps",
            "10",
            "--backend",
            "eager",
        ]
    )
    assert "Step: 10, Loss:" in out
    # Every projection, the embedding and the output layer split in two; the norms whole.
    assert "tensor parallel (size 2): 427,136 of 853,120 parameters on this rank" in out


@pytest.mark.distributed
def test_zero3_example() -> None:
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLES / "train_zero3.py"),
            "--steps",
            "10",
            "--backend",
            "eager",
        ]
    )
    assert "Step: 10, Loss:" in out
    assert "ZeRO-3: per-rank state" in out and "full model restored: 924,672 parameters" in out


@pytest.mark.distributed
def test_resumable_example_resumes_across_layouts(tmp_path) -> None:
    script = str(EXAMPLES / "train_resumable.py")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    first = run([*torchrun, script, "--ckpt", str(tmp_path), "--steps", "10", "--every", "5"])
    assert "Step: 10" in first and "resumed" not in first
    second = run(
        [*torchrun, script, "--ckpt", str(tmp_path), "--steps", "15", "--every", "5", "--zero", "3"]
    )
    assert "resumed at step 10" in second and "Step: 15" in second
    third = run([script, "--ckpt", str(tmp_path), "--steps", "20", "--every", "5"])
    assert "resumed at step 15" in third and (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["wgan_gp", "distillation", "ema_sam", "pure_loop"])
def test_jit_examples(name: str) -> None:
    # Eager backend: the jitted step is eager's kernels in eager's order, so the example's
    # two runs from the same start print the same final losses.
    out = run([str(EXAMPLES / f"{name}.py"), "--steps", "4", "--backend", "eager"])
    jitted = next(line for line in out.splitlines() if line.startswith("[functacc.jit]"))
    eager = next(line for line in out.splitlines() if line.startswith("[eager]"))
    assert jitted.removeprefix("[functacc.jit]") == eager.removeprefix("[eager]"), out
    assert any(line.endswith(", 1 trace") for line in out.splitlines()), out
