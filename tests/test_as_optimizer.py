"""``functacc.optim.as_optimizer``: a pure transformation as a ``torch.optim.Optimizer``.

References: ``torch.optim`` eagerly (the named transformations compute what torch.optim
computes, bit for bit), and ``compile_step`` given torch.optim's optimizer. Bit for bit on
the eager backend; under Inductor, a tolerance (below).
"""

from __future__ import annotations

import copy
import typing

import models
import pytest
import torch
from helpers import assert_close
from torch import nn

import functacc
from functacc import optim as fo

CASES = {
    "adamw": (lambda: fo.adamw(1e-3, weight_decay=0.01), torch.optim.AdamW, {"weight_decay": 0.01}),
    "sgd": (lambda: fo.sgd(0.05, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
}


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(n)
    ]


def eager_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def without(tree, name: str):
    """``tree`` with the entries keyed ``name`` left out of its dicts."""
    if isinstance(tree, dict):
        return {k: without(v, name) for k, v in tree.items() if k != name}
    if isinstance(tree, tuple):
        items = [without(v, name) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def model_with_a_frozen_layer() -> nn.Module:
    torch.manual_seed(0)
    model = models.cnn_bn()
    model[0].weight.requires_grad_(False)  # left out, as compile_step leaves it out
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_and_jitted_steps_equal_torch_optim(case) -> None:
    make, torch_cls, kwargs = CASES[case]
    model = model_with_a_frozen_layer()
    ref, jitted_model = copy.deepcopy(model), copy.deepcopy(model)
    lr = 1e-3 if case == "adamw" else 0.05
    ref_opt = torch_cls([p for p in ref.parameters() if p.requires_grad], lr=lr, **kwargs)
    opt = fo.as_optimizer(model.named_parameters(), make())
    jitted_opt = fo.as_optimizer(jitted_model.named_parameters(), make())

    def train_step(x, y):
        jitted_opt.zero_grad()
        loss = nn.functional.cross_entropy(jitted_model(x), y)
        loss.backward()
        jitted_opt.step()
        return loss.detach()

    jitted = functacc.jit(train_step, modules=jitted_model, optimizers=jitted_opt, backend="eager")
    for i, (x, y) in enumerate(batches()):
        ref_loss = eager_step(ref, ref_opt, x, y, i)
        assert torch.equal(eager_step(model, opt, x, y, i), ref_loss)
        torch.manual_seed(i)
        assert torch.equal(jitted(x, y), ref_loss)
    for trained in (model, jitted_model):
        assert_close(trained.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    assert jitted.num_traces == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_compile_step_of_the_transformation_equals_compile_step_of_torch_optim(case) -> None:
    # compile_step(model, loss_fn, transformation) runs it as as_optimizer(...): its step()
    # traced, against torch.optim's optimizer through its functional twin.
    make, torch_cls, kwargs = CASES[case]
    model = model_with_a_frozen_layer()
    twin = copy.deepcopy(model)
    lr = 1e-3 if case == "adamw" else 0.05
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), make(), backend="eager")
    twin_opt = torch_cls([p for p in twin.parameters() if p.requires_grad], lr=lr, **kwargs)
    ref = functacc.compile_step(twin, nn.CrossEntropyLoss(), twin_opt, backend="eager")
    assert isinstance(step.optimizer, fo.TransformOptimizer)
    for i, (x, y) in enumerate(batches()):
        torch.manual_seed(i)
        loss = step(x, y)
        torch.manual_seed(i)
        assert torch.equal(loss, ref(x, y))
    assert_close(model.state_dict(), twin.state_dict(), rtol=0, atol=0, what="model")
    assert step.count == 3 and step.state.count == 3


def test_a_checkpoint_resumes_bit_for_bit() -> None:
    model = model_with_a_frozen_layer()
    resumed_model = copy.deepcopy(model)
    opt = fo.as_optimizer(model.named_parameters(), fo.adamw(fo.cosine_decay(1e-3, 10)))
    (x, y), (x2, y2), (x3, y3) = batches()
    eager_step(model, opt, x, y, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    resumed_model.load_state_dict(saved[0])
    resumed = fo.as_optimizer(resumed_model.named_parameters(), fo.adamw(fo.cosine_decay(1e-3, 10)))
    resumed.load_state_dict(saved[1])
    # The leaves keep their dtypes (torch would cast floating state to the parameters').
    for a, b in zip(
        torch.utils._pytree.tree_leaves(resumed.transform_state()),
        torch.utils._pytree.tree_leaves(opt.transform_state()),
        strict=True,
    ):
        assert a.dtype == b.dtype
    for i, (xb, yb) in enumerate(((x2, y2), (x3, y3))):
        assert torch.equal(
            eager_step(model, opt, xb, yb, i), eager_step(resumed_model, resumed, xb, yb, i)
        )
    assert_close(model.state_dict(), resumed_model.state_dict(), rtol=0, atol=0, what="model")


def test_bad_uses_are_clear_errors() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"expects a functacc\.optim GradientTransformation"):
        fo.as_optimizer(model.named_parameters(), torch.optim.SGD)
    with pytest.raises(ValueError, match="no trainable parameter"):
        fo.as_optimizer(model.requires_grad_(False).named_parameters(), fo.sgd(0.1))
    model.requires_grad_(True)
    opt = fo.as_optimizer(model.named_parameters(), fo.sgd(0.1))
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    model(torch.randn(2, 4)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="instead of add_param_group"):
        opt.step()
    assert_close(model.state_dict(), before, rtol=0, atol=0, what="model")


@pytest.mark.inductor
def test_compile_step_with_it_under_inductor_matches_eager() -> None:
    # Inductor fuses the update's elementwise ops and may contract a*b+c into one FMA:
    # differences of a few ulps per step, hence rtol 1e-5 / atol 1e-6 after three steps.
    model = model_with_a_frozen_layer()
    model[9].p = 0.0  # no dropout: Inductor draws its own masks
    ref = copy.deepcopy(model)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), fo.as_optimizer(model.named_parameters(), fo.adamw(1e-3))
    )
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    for i, (x, y) in enumerate(batches()):
        torch.testing.assert_close(
            step(x, y), eager_step(ref, ref_opt, x, y, i), rtol=1e-5, atol=1e-6
        )
    assert_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6, what="model")


@pytest.mark.parametrize(
    ("door", "kind"), [("compile_step", "adamw"), ("jit", "adamw"), ("jit", "partition")]
)
def test_zero3_with_a_transformation_equals_eager_on_one_process(door: str, kind: str) -> None:
    # ZeRO-3 keeps the parameters as chunks of flat units and steps the transformation on
    # this rank's segments (2 ranks: tests/test_parallel.py); on one process the segments
    # are the whole flattened parameters, so eager's as_optimizer loop, bit for bit
    # (clip_by_global_norm's norm over the flat segments included). The frozen layer stays
    # whole and untouched. Before: a ValueError advising ZeRO(1) or ZeRO(2). With a
    # partition (AdamW for the first half of the parameters, SGD for the rest: two states in
    # one flat unit), state_dict() failed gathering the state (a KeyError), before the
    # parameters a state lacks were zeros in its gather.
    def transform() -> fo.GradientTransformation:
        if kind == "partition":
            model = model_with_a_frozen_layer()
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            half = len(names) // 2
            parts = fo.partition(
                [fo.adamw(1e-3), fo.sgd(0.05, momentum=0.9)], [names[:half], names[half:]]
            )
            return fo.chain(fo.clip_by_global_norm(0.5), parts)
        return fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-3, weight_decay=0.01))

    ref = model_with_a_frozen_layer()
    ref_opt = fo.as_optimizer(ref.named_parameters(), transform())
    model = model_with_a_frozen_layer()
    zero3 = functacc.parallel.ZeRO(3)
    if door == "compile_step":
        step = functacc.compile_step(
            model, nn.CrossEntropyLoss(), transform(), backend="eager", parallel=zero3
        )
        opt, sync = step.optimizer, step.sync_model
    else:
        opt = fo.as_optimizer(model.named_parameters(), transform())

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(
            body, modules=[model], optimizers=[opt], backend="eager", parallel=zero3
        )
        sync = step.sync_modules
    for i, (x, y) in enumerate(batches()):
        torch.manual_seed(i)
        torch.testing.assert_close(step(x, y), eager_step(ref, ref_opt, x, y, i), rtol=0, atol=0)
    sync()
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    # state_dict() gathers the state whole, keyed as eager's.
    assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=0, what="optimizer")


def test_its_state_is_kept_per_parameter_as_torch_keeps_it() -> None:
    # Adam's moments under each parameter, the step count and hyperparameters in the group:
    # what lets ZeRO give each rank its parameters' state, and state_dict() look like torch's.
    model = model_with_a_frozen_layer()
    opt = fo.as_optimizer(
        model.named_parameters(), fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3))
    )
    eager_step(model, opt, *batches(1)[0], 0)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert [sorted(opt.state[p]) for p in trained] == [
        ["[1].exp_avg", "[1].exp_avg_sq", "[1].step"]
    ] * len(trained)
    group = opt.param_groups[0]
    assert group["state[1].count"].dtype == torch.int64 and int(group["state[1].count"]) == 1
    assert group["state[1].hyperparams['lr']"].dtype == torch.float64
    saved = opt.state_dict()
    other = fo.as_optimizer(model.named_parameters(), fo.adamw(1e-3))  # another transformation
    kept = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"lacks \['state.count'.*same functacc.optim trans"):
        other.load_state_dict(saved)
    assert_close(other.state_dict(), kept, rtol=0, atol=0, what="the optimizer, unchanged")


def test_compile_step_of_a_transformation_checks_its_model_first() -> None:
    # The transformation becomes as_optimizer(model.named_parameters(), ...): a model that is
    # no module is compile_step's own error, not an AttributeError from that call.
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module; got str"):
        functacc.compile_step("model", nn.CrossEntropyLoss(), fo.sgd(0.1))
    # A wrapped model: the state is keyed by the inner module's names, as the step's are.
    model = model_with_a_frozen_layer()
    step = functacc.compile_step(
        torch.compile(model), nn.CrossEntropyLoss(), fo.sgd(0.1), backend="eager"
    )
    step(*batches(1)[0])
    assert step.optimizer.names == [n for n, p in model.named_parameters() if p.requires_grad]


def test_a_step_a_grad_scaler_skips_leaves_its_count_and_state_as_eager() -> None:
    # The step count lives in the param group: the skipped step must leave it too.
    def build() -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(768, 16), nn.ReLU(), nn.Linear(16, 5))
        opt = fo.as_optimizer(model.named_parameters(), fo.adamw(fo.cosine_decay(1e-3, 10)))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return model, opt, scaler, body

    model, opt, scaler, body = build()
    ref, ref_opt, ref_scaler, eager = build()
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:  # a non-finite input: the gradients are NaN, this update is skipped
            x = x.clone()
            x[0, 0, 0, 0] = float("inf")
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=0, atol=0, equal_nan=True)
        assert scaler.get_scale() == ref_scaler.get_scale(), i
    assert int(opt.param_groups[0]["state.count"]) == int(ref_opt.param_groups[0]["state.count"])
    assert int(opt.param_groups[0]["state.count"]) < 4  # a step was skipped
    assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=0, what="optimizer")
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")


def test_zero3_with_a_transformation_and_a_math_exp_ema_under_inductor() -> None:
    # This session's features under Inductor, in one step: ZeRO(3) stepping a transformation
    # on its segments (clip_by_global_norm's norm summed over them), and YOLOv5's EMA whose
    # decay ramp math.exp computes in the graph. Against eager's loop: Inductor fuses and
    # orders the float32 sums its own way, 1e-5 relative (measured: 1.2e-7 at most).
    from test_real_code import YoloModelEMA

    def transform() -> fo.GradientTransformation:
        return fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2, weight_decay=0.01))

    def run(jitted: bool) -> tuple[list[float], dict, dict, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = fo.as_optimizer(model.named_parameters(), transform())
        ema = YoloModelEMA(model, tau=5)

        def body(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update(model)
            return loss.item()

        step: typing.Any = body
        if jitted:  # ZeRO-3 empties the modules when the step is built
            step = functacc.jit(
                body,
                modules=[model, ema.ema],
                optimizers=[opt],
                backend="inductor",
                parallel=functacc.parallel.ZeRO(3),
            )
        g = torch.Generator().manual_seed(1)
        losses = [step(torch.randn(8, 4, generator=g), torch.arange(8) % 2) for _ in range(5)]
        if jitted:
            step.sync_modules()
        return losses, model.state_dict(), ema.ema.state_dict(), getattr(step, "num_traces", 0)

    eager, jitted = run(False), run(True)
    torch.testing.assert_close(jitted[0], eager[0], rtol=1e-5, atol=1e-6)
    assert_close(jitted[1], eager[1], rtol=1e-5, atol=1e-6, what="model")
    assert_close(jitted[2], eager[2], rtol=1e-5, atol=1e-6, what="EMA")
    assert jitted[3] == 1
