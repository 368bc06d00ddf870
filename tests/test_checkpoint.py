"""Checkpoints: exact resume, resharding, crash and restart, atomic writes, safe loading,
and clear errors for bad checkpoints."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from test_parallel import REDUCTION, TORCHRUN, WORKER, env, run_torchrun, workdir  # noqa: F401
from torch import nn

import functacc
from functacc import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "ckpt_job.py"


def job(mode: str, directory: Path, steps: int, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(JOB), mode, str(directory), str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env() | extra_env,
    )


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_resume_in_a_new_process_is_bit_exact(tmp_path, backend) -> None:
    # 10 steps straight, against 5 steps + save, then a new process that loads and trains
    # 5 more: dropout, BatchNorm, a shuffling loader mid-epoch and an LR scheduler.
    for mode, steps in (("full", 10), ("first", 5), ("resume", 5)):
        proc = job(mode, tmp_path, steps, BACKEND=backend)
        assert proc.returncode == 0, proc.stderr[-4000:]
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert first["losses"] + resumed["losses"] == full["losses"]
    assert_close(resumed["model"], full["model"], rtol=0, atol=0, what="model")
    assert_close(resumed["opt"], full["opt"], rtol=0, atol=0, what="optimizer")


def test_resume_of_an_optimizer_traced_whole_with_fp16_is_bit_exact(tmp_path) -> None:
    # compile_step with RMSprop runs on jit's pipeline; its checkpoint is the model's, the
    # optimizer's own state_dict() and the GradScaler's: the same job, resumed in a new
    # process, continues bit for bit (losses, model, optimizer, scale, step count).
    options = {"OPTIMIZER": "RMSprop", "PRECISION": "fp16"}
    for mode, steps in (("full", 8), ("first", 4), ("resume", 4)):
        proc = job(mode, tmp_path, steps, **options)
        assert proc.returncode == 0, proc.stderr[-4000:]
    full, first, resumed = (
        torch.load(tmp_path / f"{m}.pt", weights_only=True) for m in ("full", "first", "resume")
    )
    assert first["losses"] + resumed["losses"] == full["losses"]
    assert_close(resumed["model"], full["model"], rtol=0, atol=0, what="model")
    assert_close(resumed["opt"]["state"], full["opt"]["state"], rtol=0, atol=0, what="optimizer")
    assert resumed["opt"]["param_groups"] == full["opt"]["param_groups"]
    assert (resumed["scale"], resumed["count"]) == (full["scale"], 8) and full["scale"] > 0
    assert resumed["skipped"] == full["skipped"]


def test_kill_while_writing_leaves_the_previous_checkpoint(tmp_path) -> None:
    proc = job("kill_while_saving", tmp_path, 0)
    assert proc.returncode == -9  # SIGKILL in the middle of the second save
    assert (tmp_path / "step_00000004.partial").is_dir()  # the half-written one ...
    manager = functacc.CheckpointManager(tmp_path, every_steps=2)
    assert [Path(p).name for p in manager.checkpoints()] == ["step_00000002"]  # ... is ignored
    model = models.cnn_bn()
    step = functacc.compile_step(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        backend="eager",
    )
    assert manager.restore_latest(step) and step.count == 2


def small_step(hidden: int = 32, dtype=torch.float32, opt_cls=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 5)).to(dtype)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt_cls(model.parameters(), lr=1e-3), backend="eager"
    )
    step(torch.randn(4, 16, dtype=dtype), torch.randint(0, 5, (4,)))
    return model, step


@pytest.fixture
def saved(tmp_path) -> Path:
    _, step = small_step()
    functacc.save(step, tmp_path / "ckpt")
    return tmp_path / "ckpt"


class Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_malicious_metadata_is_refused_and_does_not_run(saved, tmp_path) -> None:
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    _, step = small_step()
    with pytest.raises(CheckpointError, match=r"refusing to load .*os\.makedirs.*could run code"):
        functacc.load(step, saved)
    assert not marker.exists()


def test_malicious_data_file_is_refused_and_does_not_run(saved, tmp_path) -> None:
    marker = tmp_path / "pwned"
    data = next(saved.glob("*.distcp"))
    data.write_bytes(pickle.dumps(Payload(str(marker))) * 50)
    _, step = small_step()
    with pytest.raises(CheckpointError, match="could not be read"):
        functacc.load(step, saved)
    assert not marker.exists()


def test_missing_checkpoint(tmp_path) -> None:
    _, step = small_step()
    with pytest.raises(CheckpointError, match="the directory does not exist"):
        functacc.load(step, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"\.metadata file is missing"):
        functacc.load(step, tmp_path / "empty")


def params_of(step) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in step.state.params.items()}


def overwrite_fails(tmp_path, monkeypatch, break_save) -> tuple[Path, dict]:
    """Save a checkpoint, train a step, save over it with ``break_save`` making that save
    fail; return the path and the parameters of the first checkpoint."""
    _, step = small_step()
    path = tmp_path / "ckpt"
    functacc.save(step, path)
    old = params_of(step)
    step(torch.randn(4, 16), torch.randint(0, 5, (4,)))
    assert not all(torch.equal(old[k], v) for k, v in params_of(step).items())
    with monkeypatch.context() as m:
        break_save(m, path)
        with pytest.raises((OSError, CheckpointError), match=r"injected|File exists"):
            functacc.save(step, path)
    return path, old


def load_params(path, **kwargs) -> dict[str, torch.Tensor]:
    _, fresh = small_step()
    functacc.load(fresh, path, **kwargs)
    return params_of(fresh)


def test_failed_atomic_swap_keeps_the_old_checkpoint(tmp_path, monkeypatch) -> None:
    def break_exchange(m, path):
        def exchange(a, b):
            raise OSError("injected failure of the swap")

        m.setattr(functacc.state.checkpoint, "_exchange", exchange, raising=False)

    path, old = overwrite_fails(tmp_path, monkeypatch, break_exchange)
    assert_close(load_params(path), old, rtol=0, atol=0, what="the old checkpoint")


def test_crash_between_renames_keeps_the_old_checkpoint_loadable(tmp_path, monkeypatch) -> None:
    # A file system without an atomic directory swap: old -> backup, then new -> path; the
    # second rename fails (a crash there). The old checkpoint must still load.
    real_replace = os.replace

    def break_rename(m, path):
        def replace(src, dst):
            if os.fspath(dst) == os.fspath(path):
                raise OSError("injected failure installing the new checkpoint")
            real_replace(src, dst)

        m.setattr(functacc.state.checkpoint, "_exchange", lambda a, b: False, raising=False)
        m.setattr(os, "replace", replace)

    path, old = overwrite_fails(tmp_path, monkeypatch, break_rename)
    with pytest.warns(UserWarning, match="a save over it was interrupted"):
        assert_close(load_params(path), old, rtol=0, atol=0, what="the old checkpoint")
    # The next save completes and leaves no backup behind.
    _, step = small_step(hidden=32)
    step(torch.randn(4, 16), torch.randint(0, 5, (4,)))
    functacc.save(step, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_close(load_params(path), params_of(step), rtol=0, atol=0, what="the new checkpoint")


def test_failed_write_keeps_the_old_checkpoint(tmp_path, monkeypatch) -> None:
    # A real failure inside torch.distributed.checkpoint's writer: a file stands where it
    # must create its directory.
    def block_directory(m, path):
        Path(f"{path}.partial").write_text("in the way")

    path, old = overwrite_fails(tmp_path, monkeypatch, block_directory)
    assert_close(load_params(path), old, rtol=0, atol=0, what="the old checkpoint")


def test_save_over_a_checkpoint_replaces_it(tmp_path) -> None:
    _, step = small_step()
    path = tmp_path / "ckpt"
    functacc.save(step, path)
    step(torch.randn(4, 16), torch.randint(0, 5, (4,)))
    functacc.save(step, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_close(load_params(path), params_of(step), rtol=0, atol=0, what="the new checkpoint")


def test_truncated_shard(saved) -> None:
    data = next(saved.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    model, step = small_step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        functacc.load(step, saved)
    del before  # a failed read may have filled some tensors: the message says use another


def test_shape_mismatch_names_parameter_and_both_shapes(saved) -> None:
    _, step = small_step(hidden=24)
    with pytest.raises(
        CheckpointError,
        match=r"'params.0.weight' has shape \(32, 16\) in the "
        r"checkpoint but torch.Size\(\[24, 16\]\) in the model",
    ):
        functacc.load(step, saved)


def test_dtype_mismatch(saved) -> None:
    _, step = small_step(dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"float32 in the checkpoint but torch\.float64"):
        functacc.load(step, saved)


def test_different_model_lists_names(saved) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5), nn.Linear(5, 5))
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters()), backend="eager"
    )
    with pytest.raises(CheckpointError, match=r"missing from it: 3.bias, 3.weight; .* none"):
        functacc.load(step, saved)


def test_checkpoint_manager_keeps_the_last_k(tmp_path) -> None:
    _, step = small_step()
    manager = functacc.CheckpointManager(tmp_path, every_steps=2, keep=2)
    saved = []
    for _ in range(6):  # small_step() took one already: counts 2 to 7
        step(torch.randn(4, 16), torch.randint(0, 5, (4,)))
        saved.append(manager.maybe_save(step))
    assert [Path(p).name for p in saved if p] == [f"step_0000000{i}" for i in (2, 4, 6)]
    assert [Path(p).name for p in manager.checkpoints()] == ["step_00000004", "step_00000006"]
    _, fresh = small_step()
    assert functacc.CheckpointManager(tmp_path, every_steps=2).restore_latest(fresh)
    assert fresh.count == 6


def test_save_model_and_load_model(tmp_path) -> None:
    torch.manual_seed(0)
    model = models.Tied()  # tied weights are stored once
    functacc.save_model(model, tmp_path / "model.safetensors")
    other = models.Tied()
    functacc.load_model(other, tmp_path / "model.safetensors")
    assert_close(other.state_dict(), model.state_dict(), rtol=0, atol=0, what="weights")
    assert other.out.weight is other.embed.weight
    with pytest.raises(CheckpointError, match="different model"):
        functacc.load_model(models.mlp(), tmp_path / "model.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        functacc.load_model(other, tmp_path / "bad.safetensors")


@pytest.fixture(scope="session")
def zero3_checkpoint(workdir):  # noqa: F811
    reference = run_torchrun(workdir, "reshard_save", 2, CKPT=str(workdir / "zero3_ckpt"))
    return workdir / "zero3_ckpt", reference["state"]


@pytest.mark.distributed
def test_zero3_checkpoint_loads_into_one_process(zero3_checkpoint) -> None:
    import dist.worker as worker

    path, reference = zero3_checkpoint
    torch.manual_seed(0)
    model = models.mlp()
    step = functacc.compile_step(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        backend="eager",
    )
    functacc.load(step, path)
    assert step.count == 5
    for x, y in worker.batches("vector", world=1, n=10)[5:]:
        step(x, y)
    assert_close(model.state_dict(), reference, **REDUCTION, what="1 process after ZeRO-3")


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "nproc"), [("dp", 2), ("zero1", 4)])
def test_zero3_checkpoint_loads_into_other_layouts(zero3_checkpoint, workdir, layout, nproc):  # noqa: F811
    path, reference = zero3_checkpoint
    result = run_torchrun(workdir, "reshard_load", nproc, CKPT=str(path), LAYOUT=layout)
    assert result["count"] == 5
    assert_close(result["state"], reference, **REDUCTION, what=f"{layout} on {nproc} ranks")


@pytest.fixture(scope="session")
def body_zero2_checkpoint(workdir):  # noqa: F811
    # compile_step with RMSprop runs on jit's pipeline; its ZeRO checkpoint holds the whole
    # tensors (gathered while saving), so any layout loads it.
    folder = workdir / "body_zero2_ckpt"
    reference = run_torchrun(
        workdir, "reshard_save", 2, CKPT=str(folder), OPT="RMSprop", SAVE="zero2"
    )
    return folder, reference["state"]


@pytest.mark.distributed
def test_a_zero_checkpoint_of_an_optimizer_traced_whole_loads_anywhere(
    body_zero2_checkpoint,
    workdir,  # noqa: F811
) -> None:
    import dist.worker as worker

    path, reference = body_zero2_checkpoint
    torch.manual_seed(0)
    model = models.mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager")
    functacc.load(step, path)
    assert step.count == 5
    for x, y in worker.batches("vector", world=1, n=10)[5:]:
        step(x, y)
    assert_close(model.state_dict(), reference, **REDUCTION, what="1 process after ZeRO-2")
    result = run_torchrun(workdir, "reshard_load", 4, CKPT=str(path), LAYOUT="zero1", OPT="RMSprop")
    assert result["count"] == 5
    assert_close(result["state"], reference, **REDUCTION, what="ZeRO-1 on 4 ranks")


@pytest.mark.distributed
def test_a_zero3_checkpoint_of_a_transformation_loads_into_one_process(workdir) -> None:  # noqa: F811
    # A functacc.optim transformation under ZeRO-3 keeps its state as segments of flat units;
    # its checkpoint holds it whole (state_dict() gathers), so one process resumes it: the
    # five steps after it as the two ranks' own five (the reference trajectory).
    import dist.worker as worker

    folder = workdir / "transform_zero3_ckpt"
    reference = run_torchrun(workdir, "reshard_save", 2, CKPT=str(folder), OPT="transform")
    torch.manual_seed(0)
    model = models.mlp()
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), worker.transform_clip_adamw(), backend="eager"
    )
    functacc.load(step, folder)
    assert step.count == 5
    assert int(step.optimizer.transform_state()[1].count) == 5
    for x, y in worker.batches("vector", world=1, n=10)[5:]:
        step(x, y)
    assert_close(model.state_dict(), reference["state"], **REDUCTION, what="1 process")
    # And into ZeRO-3 on 2 ranks again (one unit now: the checkpoint's state is resharded).
    result = run_torchrun(
        workdir, "reshard_load", 2, CKPT=str(folder), LAYOUT="zero3", OPT="transform"
    )
    assert result["count"] == 5
    assert_close(result["state"], reference["state"], **REDUCTION, what="ZeRO-3, one unit")


@pytest.mark.distributed
def test_crash_and_restart_under_torchrun(tmp_path) -> None:
    def launch(name: str, crash: bool) -> dict:
        ckpt = tmp_path / name
        extra = {"CKPT": str(ckpt)} | ({"CRASH": "1"} if crash else {})
        out = tmp_path / f"{name}.pt"
        cmd = [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=1",
            str(WORKER),
            "crash",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env() | extra)
        assert proc.returncode == 0, proc.stderr[-5000:]
        return torch.load(out, weights_only=False)

    uninterrupted = launch("plain", crash=False)
    crashed = launch("crashed", crash=True)
    assert uninterrupted["restored_at"] is None and uninterrupted["attempt"] == 0
    # Rank 1 was SIGKILLed at step 7; torchrun restarted both; they resumed from step 6.
    assert crashed["attempt"] == 1 and crashed["restored_at"] == 6
    assert_close(crashed["state"], uninterrupted["state"], rtol=0, atol=0, what="final params")


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.NAdam])
def test_resume_with_tensor_hyperparameters_keeps_them_tensors(tmp_path, opt_cls) -> None:
    # lr=torch.tensor(...) changes how torch.optim.Adam rounds its step size; a loaded
    # checkpoint must leave it a tensor (filled in place, as torch's schedulers do), or the
    # resumed run would round as with a float lr and drift from the uninterrupted one.
    # NAdam: compile_step on jit's pipeline (whose load replaced the tensor).
    def build():
        torch.manual_seed(0)
        model = models.mlp()
        opt = opt_cls(model.parameters(), lr=torch.tensor(2e-3), betas=(0.8, 0.99))
        return model, opt, functacc.compile_step(model, nn.MSELoss(), opt, backend="eager")

    filled = []

    def before_load(resumed: tuple) -> None:
        filled.append(resumed[1].param_groups[0]["lr"])
        filled[0].fill_(0.5)  # the checkpoint's value must replace it

    first, (resumed_model, resumed_opt, _) = saved_and_resumed(build, tmp_path, before_load)
    model, lr = first[0], filled[0]
    assert resumed_opt.param_groups[0]["lr"] is lr and float(lr) == float(torch.tensor(2e-3))
    assert_close(resumed_model.state_dict(), model.state_dict(), rtol=0, atol=0, what="model")


def saved_and_resumed(build, tmp_path, before_load=lambda resumed: None) -> tuple:
    """``build()`` -> (model, extra, step): 3 steps, a checkpoint, 3 more; then a second
    build() loaded from the checkpoint (``before_load`` first) and run the same 3 steps.
    Returns both builds."""
    batches = [(torch.randn(8, 16), torch.randn(8, 5)) for _ in range(6)]
    first = build()
    for x, y in batches[:3]:
        first[2](x, y)
    functacc.save(first[2], tmp_path / "ckpt")
    for x, y in batches[3:]:
        first[2](x, y)
    resumed = build()
    before_load(resumed)
    functacc.load(resumed[2], tmp_path / "ckpt")
    for x, y in batches[3:]:
        resumed[2](x, y)
    return first, resumed


class LearnedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(1))

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets) / self.log_t.squeeze().exp() + self.log_t.squeeze()


@pytest.mark.parametrize("trained", ["loss module", "bare tensor"])
def test_resume_of_what_the_optimizer_trains_beside_the_model_is_bit_exact(
    tmp_path, trained: str
) -> None:
    # A learnable loss module's parameter, a bare temperature tensor in the optimizer: both
    # stored (by their place in the optimizer) and loaded in place; save() was a KeyError.
    def build():
        torch.manual_seed(0)
        model = models.mlp()
        log_t = torch.zeros(1, requires_grad=True)
        if trained == "loss module":
            loss_fn = LearnedScale()
            log_t = loss_fn.log_t
        else:

            def loss_fn(outputs, targets):
                return F.mse_loss(outputs, targets) / log_t.squeeze().exp() + log_t.squeeze()

        opt = torch.optim.Adam([*model.parameters(), log_t], lr=0.05)
        return model, log_t, functacc.compile_step(model, loss_fn, opt, backend="eager")

    (model, log_t, _), (resumed_model, resumed_t, _) = saved_and_resumed(build, tmp_path)
    assert_close(resumed_model.state_dict(), model.state_dict(), rtol=0, atol=0, what="model")
    assert torch.equal(resumed_t, log_t) and not torch.equal(log_t, torch.zeros(1))


def test_model_files_and_errors_of_steps_on_jits_pipeline(tmp_path) -> None:
    model, step = small_step(opt_cls=torch.optim.RMSprop)
    functacc.save_model(step, tmp_path / "m.safetensors")
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    step(torch.randn(4, 16), torch.randint(0, 5, (4,)))
    functacc.load_model(step, tmp_path / "m.safetensors")
    assert_close(model.state_dict(), trained, rtol=0, atol=0, what="model")
    jitted = functacc.jit(lambda: None, backend="eager")
    with pytest.raises(TypeError, match="state_dict"):
        functacc.save(jitted, tmp_path / "ckpt")
