"""Tensor parallelism (functacc/parallel/tensor_parallel.py): the plan, the split, the loss
over split logits, and training under torchrun on 2 and 4 gloo ranks against one process on
the whole batch (tests/dist/tp_worker.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import functacc
from functacc.parallel import TensorParallel

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


@functools.cache
def run(nproc: int, folder: Path) -> dict:
    """The worker's results on ``nproc`` ranks (tensor-parallel groups of 2); on 2 ranks
    also tp_worker.extras, with a checkpoint written here first."""
    folder.mkdir(exist_ok=True)
    extras = []
    if nproc == 2:
        for front in ("compile_step", "body", "transform"):
            one = mlp_step(front)
            for batch in tp_worker.batches()[:2]:
                one(*batch)
            functacc.save(one.compiled, folder / front / "one")
        extras = [str(folder)]
    torchrun(nproc, str(folder / "out.pt"), "2", *extras)
    return {**torch.load(folder / "out.pt", weights_only=False), "folder": folder}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> typing.Callable[[int], dict]:
    """The worker's results on 2 or 4 ranks (each run once)."""
    return lambda nproc: run(nproc, tmp_path_factory.getbasetemp() / f"tp{nproc}")


@pytest.fixture(scope="module")
def four_ranks(ranks: typing.Callable[[int], dict]) -> dict:
    return ranks(4)


@pytest.fixture(scope="module")
def two_ranks(ranks: typing.Callable[[int], dict]) -> dict:
    return ranks(2)


class mlp_step:
    """The MLP's compile_step in one process, without tensor parallelism (``"body"``: with
    RMSprop, on jit's pipeline)."""

    def __init__(self, front: str = "compile_step") -> None:
        self.model = tp_worker.mlp()
        opt = tp_worker.optimizer("mlp", self.model)
        if front == "body":
            opt = torch.optim.RMSprop(self.model.parameters(), lr=1e-3)
        if front == "transform":  # a functacc.optim transformation (as_optimizer)
            opt = functacc.optim.adamw(1e-2)
        self.compiled = functacc.compile_step(
            self.model, torch.nn.CrossEntropyLoss(), opt, backend="eager", max_grad_norm=0.5
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> float:
        return float(self.compiled(x, y))


# TP=2 on 2 ranks: every model; TP=2 x DP=2 on 4 ranks (slow on 2 cores): the MLP and the
# GPT-style stack.
RUNS = [(2, name) for name in tp_worker.MODELS] + [(4, n) for n in ("mlp", "gpt")]


@pytest.mark.distributed
@pytest.mark.parametrize("front", ["compile_step", "jit"])
@pytest.mark.parametrize(("nproc", "name"), RUNS)
def test_tensor_parallel_equals_one_process_on_the_whole_batch(
    ranks: typing.Callable[[int], dict], nproc: int, name: str, front: str
) -> None:
    # Four steps with clipping; the split layers' products are summed in another order than
    # one process's (and over replicas under 2 x 2): float32 rounding, 1e-5 relative.
    got = ranks(nproc)[name, front]
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


@pytest.mark.distributed
def test_a_functacc_optim_transformation_splits_with_the_model(two_ranks: dict) -> None:
    # compile_step(model, loss_fn, functacc.optim.adamw(...)) runs the transformation as
    # as_optimizer(...), whose state (made over the whole parameters) is made again over
    # each rank's slices after the split (before: a ValueError). Against one process with
    # torch.optim.AdamW on the whole batch, as above.
    losses, params = reference("mlp")
    # And with the clipping in the transformation, chain(clip_by_global_norm(0.5), adamw),
    # under both doors: the global norm sums the slices' squares over the group (before:
    # each rank clipped by its slices' norm, 7e-4 off one process after 4 steps, silently).
    for front in ("transform", "transform_clip", "transform_clip_jit"):
        got = two_ranks["mlp", front]
        torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0)
        close(got["params"], params, 1e-5)


def close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        scale = value.abs().max().clamp(min=1e-3)
        err = float((got[key] - value).abs().max() / scale)
        assert err < rtol, f"{key}: {err:.2e} relative"


@pytest.mark.distributed
def test_vocabulary_parallel_cross_entropy_equals_the_whole_logits(two_ranks: dict) -> None:
    trained = two_ranks
    got, expected = trained["vocab_ce"]
    assert abs(got - expected) <= 1e-6 * abs(expected)
    torch.testing.assert_close(*trained["vocab_ce_grads"], rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
@pytest.mark.parametrize("front", ["compile_step", "body", "transform"])
def test_checkpoints_move_between_one_process_and_tensor_parallel(
    two_ranks: dict, front: str
) -> None:
    trained = two_ranks
    batches = tp_worker.batches()
    # Written by one process after 2 steps, resumed under TP=2: the third step as one
    # process's own third step.
    one = mlp_step(front)
    for batch in batches[:3]:
        loss = one(*batch)
    got_loss, got_params = trained["resumed", "one", front]
    assert abs(got_loss - loss) <= 1e-5 * abs(loss)
    close(got_params, one.model.state_dict(), 1e-5)
    # Written under TP=2 after 2 steps, resumed in one process: its third step as TP=2's.
    resumed = mlp_step(front)
    functacc.load(resumed.compiled, trained["folder"] / front / "tp")
    loss = resumed(*batches[2])
    got_loss, got_params = trained["resumed", "tp", front]
    assert abs(got_loss - loss) <= 1e-5 * abs(loss)
    close(got_params, resumed.model.state_dict(), 1e-5)


@pytest.mark.distributed
def test_dropout_and_inductor_under_tensor_parallel(two_ranks: dict) -> None:
    trained = two_ranks
    # Dropout on the activations every rank holds whole: the masks one process draws from
    # the same seed, so the same losses.
    model = tp_worker.gpt(dropout=0.1)
    opt = tp_worker.optimizer("gpt", model)
    batches = tp_worker.batches()
    torch.manual_seed(3)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = tp_worker.loss_of("gpt", model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(float(loss.detach()))
    for front in ("compile_step", "jit"):
        torch.testing.assert_close(trained["dropout", front], losses, rtol=1e-5, atol=0)
    # Inductor (fused kernels, other summation orders): 1e-5 relative over 4 AdamW steps.
    losses, params = reference("mlp")
    torch.testing.assert_close(trained["inductor"], losses, rtol=1e-5, atol=0)
    close(trained["inductor_params"], params, 1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("front", ["compile_step", "body"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_stats_count_the_tensor_parallel_bytes_of_a_step(
    ranks: typing.Callable[[int], dict], nproc: int, front: str
) -> None:
    # body: compile_step with RMSprop, on jit's pipeline.
    trained = ranks(nproc)
    # The MLP (8 -> 32 -> 8 -> 16 -> 4) on TP=2, float32, per replica's batch of b rows: the
    # row-wise layers' outputs summed forward (b x 8 and b x 4), the second column-wise
    # layer's input gradient summed backward (b x 8; the first one's input, the batch, needs
    # none), and the clipping's squared norm (one value).
    stats = trained["mlp", front]["stats"]
    rows = tp_worker.BATCH // (1 if "vocab_ce" in trained else 2)  # 1 or 2 replicas
    assert stats["tensor_parallel_bytes"] == 4 * (rows * (8 + 4 + 8) + 1), stats
    assert stats["strategy"].startswith("tensor parallel (size 2)")


@pytest.mark.distributed
def test_a_reshape_to_the_full_head_count_names_the_module(two_ranks: dict) -> None:
    trained = two_ranks
    message = trained["full_heads"]
    assert "shape" in message and "TensorParallel: attn (Module)" in message, message
    assert "-1 or the layer's head_dim" in message


# -- one process: the plan and its errors ------------------------------------------------
def test_plan_patterns_follow_hugging_face() -> None:
    tp = TensorParallel({"layers.*.self_attn.q_proj": "colwise", "embed_tokens": "rowwise"})
    assert tp.style_of("model.layers.11.self_attn.q_proj") == "colwise"
    assert tp.style_of("layers.0.self_attn.q_proj") == "colwise"
    assert tp.style_of("model.xlayers.0.self_attn.q_proj") is None
    assert tp.style_of("model.layers.0.self_attn.q_proj.lora") is None
    assert tp.style_of("model.embed_tokens") == "rowwise"
    assert TensorParallel({"head": "colwise_rep"}).style_of("head") == "colwise_gather_output"


@pytest.mark.parametrize(
    ("plan", "error", "match"),
    [
        ({"0": "sequence_parallel"}, ValueError, "'sequence_parallel' for '0' is not one"),
        ({"7": "colwise"}, ValueError, r"plan's \['7'\] name no module of Sequential"),
        ({"1": "colwise"}, TypeError, r"Conv1D\); the plan gives it to '1', a torch"),
        ({}, TypeError, "non-empty mapping"),
    ],
)
def test_a_bad_plan_is_a_clear_error_that_leaves_the_model(plan, error, match) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        functacc.compile_step(
            model, torch.nn.MSELoss(), opt, backend="eager", parallel=TensorParallel(plan)
        )
    assert not hasattr(model, "_functacc_tensor_parallel")
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n])


def test_splits_that_cannot_work_are_clear_errors() -> None:
    from functacc.parallel.tensor_parallel import _split_dims

    with pytest.raises(ValueError, match=r"0\.weight has 6 entries along dimension 0, which 4"):
        _split_dims("0", torch.nn.Linear(3, 6), "colwise", 4)
    emb = torch.nn.Embedding(8, 4, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        _split_dims("emb", emb, "vocab", 2)
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(8, 4), "head": torch.nn.Linear(8, 4)})
    tied["head"].weight = torch.nn.Parameter(torch.randn(4, 8))
    tied["emb"].weight = tied["head"].weight
    with pytest.raises(ValueError, match="tied to a parameter split along dimension 0"):
        TensorParallel({"emb": "vocab", "head": "rowwise"}).split([tied], None)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    tp_of_root = TensorParallel({"": "colwise"})
    with pytest.raises(ValueError, match="the SGD has state already"):
        functacc.jit(
            lambda: None,
            modules=[model],
            optimizers=[opt],
            parallel=TensorParallel({"": "colwise"}),
        )
    # as_optimizer's state is made again over the slices, unless it has stepped.
    transformed = functacc.optim.as_optimizer(model.named_parameters(), functacc.optim.sgd(0.1))
    model(torch.ones(1, 4)).sum().backward()
    transformed.step()
    with pytest.raises(ValueError, match="the TransformOptimizer has state already"):
        functacc.compile_step(model, torch.nn.MSELoss(), transformed, parallel=tp_of_root)
    import timm.optim

    lamb = timm.optim.Lamb(model.parameters())
    with pytest.raises(ValueError, match="Lamb scales each parameter's update by a norm"):
        functacc.jit(lambda: None, modules=[model], optimizers=[lamb], parallel=tp_of_root)
    with pytest.raises(ValueError, match=r"TensorParallel\(size=2\) needs a world size"):
        functacc.compile_step(
            model,
            torch.nn.MSELoss(),
            torch.optim.SGD(model.parameters()),
            parallel=TensorParallel({"": "colwise"}, size=2),
        )
    # Hybrid sharding beside TensorParallel: an error, not a shard_size silently ignored.
    with pytest.raises(ValueError, match=r"ZeRO\(shard_size=2\) beside TensorParallel"):
        functacc.compile_step(
            model,
            torch.nn.MSELoss(),
            torch.optim.SGD(model.parameters()),
            parallel=[TensorParallel({"": "colwise"}), functacc.parallel.ZeRO(1, shard_size=2)],
        )
    tp = TensorParallel({"": "colwise"})
    with pytest.raises(ValueError, match="one TensorParallel and one DataParallel or ZeRO"):
        functacc.jit(lambda: None, modules=[model], parallel=[tp, tp])


def test_a_checkpoint_of_tensor_parallel_beside_zero_is_a_clear_error(tmp_path) -> None:
    # Not supported yet (the pure step refused it too): an error, nothing written.
    model = tp_worker.mlp()
    step = functacc.compile_step(
        model,
        torch.nn.CrossEntropyLoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        backend="eager",
        parallel=[TensorParallel(tp_worker.MLP_PLAN), functacc.parallel.ZeRO(1)],
    )
    x, y, _ = tp_worker.batches()[0]
    step(x, y)
    with pytest.raises(functacc.CheckpointError, match="TensorParallel and ZeRO together"):
        functacc.save(step, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_one_process_with_a_plan_trains_as_without() -> None:
    # The same program on one process as on many: size 1, nothing split, bit for bit.
    results = []
    for parallel in (None, TensorParallel(tp_worker.GPT_PLAN)):
        model = tp_worker.gpt()
        opt = tp_worker.optimizer("gpt", model)
        step = functacc.compile_step(model, None, opt, backend="eager", parallel=parallel)
        for _, _, ids in tp_worker.batches():
            step(ids, ids.roll(-1, 1))
        results.append(model.state_dict())
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "front", "stage"),
    [("mlp", "compile_step", 1), ("mlp", "compile_step", 3), ("mlp", "jit", 2), ("mlp", "jit", 3)],
)
def test_zero_across_tensor_parallel_groups(
    four_ranks: dict, name: str, front: str, stage: int
) -> None:
    # A 2 x 2 mesh: tensor parallel in pairs, ZeRO over the two pairs (each rank shards its
    # slices with the rank holding the same slices in the other pair).
    got = four_ranks[name, front, stage]
    losses, params = reference(name)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0)
    close(got["params"], params, 1e-5)
    if front == "compile_step":
        assert got["strategy"] == f"tensor parallel (size 2) x ZeRO-{stage} (2)"
    if stage == 3 and front == "jit":  # the model holds no parameter between calls
        assert got["held"] == 0, got["held"]
