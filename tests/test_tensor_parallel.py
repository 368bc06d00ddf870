"""Tensor parallelism (functacc/parallel/tensor_parallel.py): the plan, the split, the loss
over split logits, and training under torchrun on 2 and 4 gloo ranks against one process on
the whole batch (tests/dist/tp_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
import tp_worker

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*cmd, f"--nproc_per_node={nproc}", str(Path(tp_worker.__file__)), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, eager PyTorch: the losses and the trained model."""
    make, _ = tp_worker.MODELS[name]
    model = make()
    opt = tp_worker.optimizer(name, model)
    losses = []
    for batch in tp_worker.batches():
        opt.zero_grad()
        loss = tp_worker.loss_of(name, model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: t.detach() for n, t in model.state_dict().items()}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp2xdp2"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "out.pt"
    torchrun(request.param, str(out), "2")
    return torch.load(out, weights_only=False)


@pytest.mark.distributed
@pytest.mark.parametrize("front", ["compile_step", "jit"])
@pytest.mark.parametrize("name", list(tp_worker.MODELS))
def test_tensor_parallel_equals_one_process_on_the_whole_batch(
    trained: dict, name: str, front: str
) -> None:
    # Four steps with clipping; the split layers' products are summed in another order than
    # one process's (and over replicas under 2 x 2): float32 rounding, 1e-5 relative.
    got = trained[name, front]
    losses, params = reference(name)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0)
    assert got["params"].keys() == params.keys()
    for key, value in params.items():
        scale = value.abs().max().clamp(min=1e-3)
        err = float((got["params"][key] - value).abs().max() / scale)
        assert err < 1e-5, f"{name} {front} {key}: {err:.2e} relative"
    # The split layers' parameters and optimizer state: half of one process's on each rank.
    whole = dict(tp_worker.MODELS[name][0]().named_parameters())
    assert got["split_numel"] * 2 == sum(whole[n].numel() for n in got["split_names"] if n in whole)
    assert got["split_state_numel"] == got["split_numel"] * (2 if name == "mlp" else 1)
