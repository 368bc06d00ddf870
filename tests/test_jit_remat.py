"""``functacc.jit(remat=)``: a step body recomputes the chosen modules' activations in
backward, with the same results as keeping them (bit for bit on the eager backend: the
recomputation replays the forward's dropout masks) and less memory under Inductor."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from test_remat import Block, TokenModel, deep_mlp
from torch import nn

import functacc
from functacc.bench.memory import peak_memory
from functacc.transforms.remat import POLICIES, RECOMPUTE


def objects(make_model=deep_mlp) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def body_of(model: nn.Module, opt: torch.optim.Optimizer):
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return train_step


def mlp_batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 128, generator=g), torch.randint(0, 10, (32,), generator=g))] * n


def token_batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 100, (8, 16), generator=g), torch.randint(0, 10, (8,), generator=g))
        for _ in range(n)
    ]


def train(remat, *, make_model=deep_mlp, batches=None, backend="eager", policy="full"):
    model, opt = objects(make_model)
    step = functacc.jit(
        body_of(model, opt),
        modules=[model],
        optimizers=[opt],
        backend=backend,
        remat=remat,
        remat_policy=policy,
    )
    losses = []
    for i, (x, y) in enumerate(batches or mlp_batches()):
        torch.manual_seed(100 + i)  # the same dropout masks in every run
        losses.append(step(x, y))
    return torch.stack(losses), model, opt, step


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "case", ["mlp_blocks", "transformer_layers"], ids=["mlp_blocks", "transformer_layers"]
)
def test_recomputed_body_equals_the_kept_one_bit_for_bit(case: str, policy: str) -> None:
    make, batches, classes = {
        "mlp_blocks": (deep_mlp, mlp_batches(), {"Block"}),
        "transformer_layers": (TokenModel, token_batches(), {"TransformerEncoderLayer"}),
    }[case]
    kept = train(None, make_model=make, batches=batches)
    recomputed = train(classes, make_model=make, batches=batches, policy=policy)
    assert torch.equal(recomputed[0], kept[0])
    assert_close(recomputed[1].state_dict(), kept[1].state_dict(), rtol=0, atol=0, what="model")
    assert_close(recomputed[2].state_dict(), kept[2].state_dict(), rtol=0, atol=0, what="optimizer")
    graph = recomputed[3].graphs[-1].graph
    regions = {n.meta[RECOMPUTE] for n in graph.nodes if RECOMPUTE in n.meta}
    # Every outermost module of the class is recomputed once in backward.
    expected = sum(type(m).__name__ in classes for m in recomputed[1].modules())
    assert len(regions) == expected, (len(regions), expected)
    assert not any(RECOMPUTE in n.meta for n in kept[3].graphs[-1].graph.nodes)


def test_the_eager_body_is_the_reference() -> None:
    # The same steps eagerly, dropout drawn from the same seeds: the recomputing jit step
    # leaves what eager leaves.
    model, opt = objects()
    body = body_of(model, opt)
    expected = []
    for i, (x, y) in enumerate(mlp_batches()):
        torch.manual_seed(100 + i)
        expected.append(body(x, y))
    losses, jitted, jitted_opt, _ = train({"Block"})
    assert torch.equal(losses, torch.stack(expected))
    assert_close(jitted.state_dict(), model.state_dict(), rtol=0, atol=0, what="model")
    assert_close(jitted_opt.state_dict(), opt.state_dict(), rtol=0, atol=0, what="optimizer")


@pytest.mark.inductor
def test_under_inductor_it_matches_and_keeps_less() -> None:
    # Inductor fuses and reorders float32 arithmetic, the recomputed graph differently from
    # the kept one: rtol 1e-4 after 3 AdamW steps, as for compile_step(remat=). Batch 512:
    # the 8 blocks' 4x-wide activations dominate the step's memory.
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 128, generator=g), torch.randint(0, 10, (512,), generator=g))]
    runs = {}
    for remat in (None, {"Block"}):
        losses, model, _, step = train(remat, batches=batches * 3, backend="inductor")
        torch.manual_seed(0)
        peak = peak_memory(lambda step=step: step(*batches[0]))
        runs[bool(remat)] = losses, model, peak
    (kept, kept_model, kept_peak), (losses, model, peak) = runs[False], runs[True]
    torch.testing.assert_close(losses, kept, rtol=1e-4, atol=1e-6)
    assert_close(model.state_dict(), kept_model.state_dict(), rtol=1e-4, atol=1e-5, what="model")
    assert peak < 0.8 * kept_peak, (peak, kept_peak)


def test_an_unknown_class_is_an_error_that_lists_the_modules_classes() -> None:
    model, opt = objects()
    with pytest.raises(ValueError, match=r"(?s)remat.*'Blok'.*Block"):
        functacc.jit(body_of(model, opt), modules=[model], optimizers=[opt], remat={"Blok"})
    body = body_of(model, opt)
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        functacc.jit(body, modules=[model], optimizers=[opt], remat={"Block"}, remat_policy="x")
    with pytest.warns(UserWarning, match="has no effect without remat") as record:
        functacc.jit(body, modules=[model], optimizers=[opt], remat_policy="selective")
    assert record[0].filename == __file__  # the warning points at the user's call


def test_blocks_of_two_modules_recompute_in_both() -> None:
    # A distillation-style body: the student's and the teacher's blocks, one root for both.
    torch.manual_seed(0)
    student = nn.Sequential(Block(128), nn.Linear(128, 10))
    teacher = nn.Sequential(Block(128), Block(128), nn.Linear(128, 10)).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def distill(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(student(x), target)
        loss.backward()
        opt.step()
        return loss.detach()

    step = functacc.jit(
        distill, modules=[student, teacher], optimizers=[opt], backend="eager", remat={"Block"}
    )
    x = torch.randn(16, 128)
    step(x)
    graph = step.graphs[-1].graph
    # The teacher runs without gradients: nothing of it to recompute; the student's block is.
    assert len({n.meta[RECOMPUTE] for n in graph.nodes if RECOMPUTE in n.meta}) == 1
    assert not hasattr(student[0], "forward") or "forward" not in vars(student[0])


def test_compile_step_with_an_optimizer_traced_whole_takes_remat() -> None:
    # compile_step with RMSprop (no twin) is the standard body on jit: remat= goes through.
    def run(remat):
        model, _ = objects()
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
        step = functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, backend="eager", remat=remat
        )
        losses = []
        for i, (x, y) in enumerate(mlp_batches()):
            torch.manual_seed(100 + i)
            losses.append(step(x, y))
        return torch.stack(losses), model, opt, step

    kept, recomputed = run(None), run({"Block"})
    assert torch.equal(recomputed[0], kept[0])
    assert_close(recomputed[1].state_dict(), kept[1].state_dict(), rtol=0, atol=0, what="model")
    assert str(recomputed[2].state_dict()) == str(kept[2].state_dict())
    graph = recomputed[3]._jitted.graphs[-1].graph
    assert len({n.meta[RECOMPUTE] for n in graph.nodes if RECOMPUTE in n.meta}) == 8
