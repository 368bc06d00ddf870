"""``functacc.jit`` against the same step body run eagerly.

The reference for every case is the body itself, called on deep copies of the same modules
and optimizers, with the same seed before each step. With ``backend="eager"`` the jitted
step runs eager's kernels in eager's order, so everything is compared bit for bit: the
returned values, every parameter, buffer and ``.grad`` (``None`` where eager leaves
``None``), the optimizers' ``state_dict()`` and the global RNG state. Under Inductor the
kernels are fused and reassociated, so the returned losses are compared within 1e-4
relative after three steps (float32 rounding of a few ops per element, far below what a
wrong gradient or a skipped update would give).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, run_torchrun_worker
from torch import Tensor, nn

import functacc

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the examples share examples/_race.py
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the cases: (objects, body, modules, optimizers, batches) for one run ------------------
def classifier(seed: int = 0) -> tuple:
    """BatchNorm, dropout, a tied weight, a frozen layer and a parameter that gets no
    gradient, under AdamW."""
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16, bias=False)
            self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2))
            self.frozen = nn.Linear(16, 16).requires_grad_(False)
            self.unused = nn.Parameter(torch.randn(3))
            self.head = nn.Linear(16, 8, bias=False)
            self.head.weight = self.embed.weight  # tied (transposed use below)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.relu(self.body(self.embed(x)))
            return F.linear(self.frozen(h), self.embed.weight.t())

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(seed + 1)
    data = [
        (torch.randn(16, 8, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(3)
    ]
    return (model, opt), body, [model], [opt], data


def from_example(name: str, modules: Callable, optimizers: Callable, steps: int = 3) -> Callable:
    def build(seed: int = 0) -> tuple:
        ex = example(name)
        objects = ex.build(seed)
        batches = ex.batches(steps)
        if name == "wgan_gp":
            batches = [(r[:64], z[:64]) for r, z in batches]
        if name == "distillation":
            batches = [(x[:32], y[:32]) for x, y in batches]
        return objects, ex.make_step(*objects), modules(objects), optimizers(objects), batches

    return build


CASES = {
    "classifier": classifier,
    "wgan_gp": from_example("wgan_gp", lambda o: o[:2], lambda o: o[2:]),
    "distillation": from_example("distillation", lambda o: o[:2], lambda o: o[2:]),
    "ema_sam": from_example("ema_sam", lambda o: o[:2], lambda o: o[2:]),
}


def tensors_of(modules: list[nn.Module], optimizers: list) -> dict[str, Any]:
    """Everything eager leaves behind that the jitted step must leave too."""
    out: dict[str, Any] = {}
    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            out[f"{i}.{n}"] = p.detach().clone()
            out[f"{i}.{n}.grad"] = None if p.grad is None else p.grad.clone()
            out[f"{i}.{n}.requires_grad"] = p.requires_grad
        for n, b in m.named_buffers():
            out[f"{i}.{n}"] = b.clone()
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        for k, state in sd["state"].items():
            for field, value in state.items():
                out[f"opt{i}.{k}.{field}"] = value.clone() if isinstance(value, Tensor) else value
        out[f"opt{i}.groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]
        ]
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (k, (x - y).abs().max())
        else:
            assert x == y, (k, x, y)


def run_both(case: str, backend: str) -> tuple[list, list, Any]:
    _objects, body, modules, optimizers, data = CASES[case]()
    _ref_objects, ref_body, ref_modules, ref_optimizers, _ = CASES[case]()
    step = functacc.jit(body, modules=modules, optimizers=optimizers, backend=backend)
    got, expected = [], []
    for i, batch in enumerate(data):
        torch.manual_seed(100 + i)
        got.append(step(*batch))
        rng = torch.get_rng_state()
        torch.manual_seed(100 + i)
        expected.append(ref_body(*batch))
        assert torch.equal(rng, torch.get_rng_state()), "the RNG advanced differently"
        if backend == "eager":
            assert_same(tensors_of(modules, optimizers), tensors_of(ref_modules, ref_optimizers))
    return got, expected, step


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_bit_for_bit(case: str) -> None:
    got, expected, step = run_both(case, "eager")
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(
            torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True
        ):
            assert not x.requires_grad and torch.equal(x, y.detach())
    assert step.num_traces == 1, [t.reason for t in step.traces]


@pytest.mark.inductor
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_under_inductor(case: str) -> None:
    got, expected, step = run_both(case, "inductor")
    for a, b in zip(got[-1:], expected[-1:], strict=True):
        for x, y in zip(
            torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True
        ):
            torch.testing.assert_close(x, y.detach(), rtol=1e-4, atol=1e-6)
    assert step.num_traces == 1, [t.reason for t in step.traces]


# -- the pure form -------------------------------------------------------------------------
def test_pure_loop_matches_eager_and_donates() -> None:
    ex = example("pure_loop")
    apply_fn, opt, state = ex.build()
    train_step = ex.make_step(apply_fn, opt)
    reference = ex.build()[2]
    step = functacc.jit(train_step, donate=(0,), backend="eager")
    for batch in ex.batches(3):
        old = state["params"]["0.weight"]
        address = old.data_ptr()
        state, metrics = step(state, batch)
        reference, expected = train_step(reference, batch)
        # The new state lives in the donated state's memory, and the old handle is dead.
        assert state["params"]["0.weight"].data_ptr() == address
        with pytest.raises(RuntimeError, match=r"donated to a functacc\.jit step"):
            old.sum()
        for x, y in zip(
            torch.utils._pytree.tree_leaves((state, metrics)),
            torch.utils._pytree.tree_leaves((reference, expected)),
            strict=True,
        ):
            assert torch.equal(x, y)
    assert step.num_traces == 1


@pytest.mark.inductor
def test_pure_loop_under_inductor() -> None:
    ex = example("pure_loop")
    apply_fn, opt, state = ex.build()
    train_step = ex.make_step(apply_fn, opt)
    reference = ex.build()[2]
    step = functacc.jit(train_step, donate=(0,))
    for batch in ex.batches(3):
        state, metrics = step(state, batch)
        reference, expected = train_step(reference, batch)
    torch.testing.assert_close(metrics["loss"], expected["loss"], rtol=1e-4, atol=1e-6)
    assert step.num_traces == 1


def test_pure_form_without_donation_leaves_its_inputs_alone() -> None:
    def body(state: dict, x: Tensor) -> tuple[dict, Tensor]:
        w = state["w"]
        return {"w": w - 0.1 * torch.func.grad(lambda w: (x @ w).square().sum())(w)}, x.sum()

    step = functacc.jit(body, backend="eager")
    state = {"w": torch.ones(3)}
    new, _ = step(state, torch.ones(2, 3))
    assert torch.equal(state["w"], torch.ones(3)) and not torch.equal(new["w"], state["w"])
    with pytest.raises(ValueError, match="passed once only"):
        functacc.jit(body, donate=(0,), backend="eager")({"w": state["w"]}, state["w"])


# -- edges eager users hit -----------------------------------------------------------------
def linear_case(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def accumulate(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    # No zero_grad: the gradients pile up across calls, as eager's do.
    def body(x: Tensor) -> Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return body


def test_gradients_accumulate_across_calls_like_eager() -> None:
    model, opt = linear_case()
    ref, ref_opt = linear_case()
    step = functacc.jit(accumulate(model, opt), modules=[model], backend="eager")
    for _i in range(3):
        x = torch.randn(5, 4)
        step(x)
        accumulate(ref, ref_opt)(x)
        assert_same(tensors_of([model], []), tensors_of([ref], []))
    # Call 1 came with no .grad, the later ones with one that the body adds to.
    assert step.num_traces == 2, [t.reason for t in step.traces]


def test_learning_rate_schedule_does_not_retrace() -> None:
    model, opt = linear_case()
    ref, ref_opt = linear_case()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)

    def body_for(m: nn.Module, o: torch.optim.Optimizer) -> Callable:
        def body(x: Tensor) -> Tensor:
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            o.step()
            return loss

        return body

    step = functacc.jit(body_for(model, opt), modules=[model], optimizers=[opt], backend="eager")
    for _ in range(4):
        x = torch.randn(5, 4)
        step(x)
        sched.step()
        body_for(ref, ref_opt)(x)
        ref_sched.step()
        assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
    assert step.num_traces == 1


def test_ambient_autocast_is_part_of_the_signature() -> None:
    model, _opt = linear_case()
    ref, _ref_opt = linear_case()

    def body_for(m: nn.Module) -> Callable:
        return lambda x: m(x).float().square().mean()

    step = functacc.jit(body_for(model), modules=[model], backend="eager")
    x = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(step(x), body_for(ref)(x))
    assert torch.equal(step(x), body_for(ref)(x))
    assert step.num_traces == 2 and "autocast" in step.traces[1].reason


def test_new_sizes_retrace_then_go_symbolic(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = linear_case()
    step = functacc.jit(accumulate(model, opt), modules=[model], backend="eager")
    for n in (5, 5, 6, 7, 9):
        step(torch.randn(n, 4))
    # 5: first call; 5 again: .grad exists now; 6: symbolic batch size; 7, 9: that graph.
    reasons = [t.reason for t in step.traces]
    assert step.num_traces == 3, reasons
    # The batch is named by the body's own parameter (x), as the body reads it.
    assert "x dim 0: 5 -> 6" in reasons[2] and step.traces[2].dynamic


@pytest.mark.inductor
def test_symbolic_sizes_under_inductor() -> None:
    """A batch size that keeps changing goes symbolic, and the symbolic graph compiled by
    Inductor (dropout included) follows eager within 1e-4 at every size."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def body(x: Tensor, y: Tensor) -> Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return model, opt, body

    model, opt, body = build()
    ref_model, _, ref_body = build()
    step = functacc.jit(body, modules=[model], optimizers=[opt])
    for i, n in enumerate((8, 12, 16, 20, 9)):
        x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
        torch.manual_seed(i)
        got = step(x, y)
        torch.manual_seed(i)
        expected = ref_body(x, y)
        torch.testing.assert_close(got, expected.detach(), rtol=1e-4, atol=1e-6)
    # 8: first call (no .grad yet); 12: .grad present, a new family, static; 16: that
    # family's sizes differ, symbolic; 20 and 9: the symbolic graph.
    assert step.num_traces == 3, [t.reason for t in step.traces]
    assert step.traces[-1].dynamic == {"x": [0], "y": [0]}
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_trace_budget_raises_and_changes_nothing() -> None:
    model, opt = linear_case()
    step = functacc.jit(
        accumulate(model, opt), modules=[model], backend="eager", dynamic=False, max_traces=1
    )
    step(torch.randn(5, 4))
    before = tensors_of([model], [])
    with pytest.raises(functacc.RetraceError, match="max_traces=1"):
        step(torch.randn(5, 4))  # .grad now exists: a new signature
    assert_same(before, tensors_of([model], []))


def test_one_module_and_one_optimizer_are_taken_without_a_list() -> None:
    # jit(body, modules=model, optimizers=opt), as compile_step takes them (a module that
    # is not iterable was a TypeError; a Sequential was taken as its children).
    results = []
    for jitted in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)

        def body(x: Tensor, y: Tensor, model=model, opt=opt) -> Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        step = (
            functacc.jit(body, modules=model, optimizers=opt, backend="eager") if jitted else body
        )
        torch.manual_seed(1)
        losses = [step(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        results.append((losses, tensors_of([model], [opt])))
    assert [float(x) for x in results[0][0]] == [float(x) for x in results[1][0]]
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize(
    ("opt_cls", "entry", "reason"),
    [
        (torch.optim.SGD, "nesterov", "optimizer hyperparameters opt nesterov: False -> True"),
        (torch.optim.RMSprop, "maximize", "python opt.param_groups[0]['maximize']: False -> True"),
    ],
    ids=["twin", "own step"],
)
def test_retrace_reasons_name_what_changed(opt_cls, entry, reason) -> None:
    # Each used to print the whole tuple of state names, or "False -> True" alone.
    model = nn.Linear(4, 2)
    opt = opt_cls(model.parameters(), lr=0.1, momentum=0.9)

    def body(x: Tensor) -> Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step = functacc.jit(body, modules=model, optimizers=opt, backend="eager")
    step(torch.randn(3, 4))
    step(torch.randn(3, 4))
    opt.param_groups[0][entry] = True
    step(torch.randn(3, 4))
    assert step.traces[-1].reason == reason


def test_a_retrace_for_new_state_names_it() -> None:
    # The gradients a call leaves are state the next call takes (the body may read them).
    model = nn.Linear(4, 2)
    step = functacc.jit(lambda x: model(x).sum().backward(), modules=model, backend="eager")
    step(torch.randn(3, 4))
    step(torch.randn(3, 4))
    assert step.traces[-1].reason == "state: grad model.weight, grad model.bias added"


def test_a_failed_trace_names_the_body_as_the_eager_reference() -> None:
    # compile_step's advice (loss_fn(model(inputs), targets)) does not fit a jitted body.
    model = nn.Linear(4, 2)

    def train_step(x: Tensor) -> Tensor:
        return model(x).sum()

    step = functacc.jit(train_step, modules=model, backend="eager")
    with pytest.raises(functacc.TraceError) as info:
        step(torch.randn(3, 5))
    message = str(info.value)
    assert "train_step(...) run eagerly" in message and "loss_fn(" not in message, message


def test_a_module_not_given_is_an_error_not_a_constant() -> None:
    student, teacher, opt = example("distillation").build()
    body = example("distillation").make_step(student, teacher, opt)
    step = functacc.jit(body, modules=[student], optimizers=[opt], backend="eager")
    before = tensors_of([student, teacher], [opt])
    with pytest.raises(functacc.TraceError, match=r"none of its inputs[\s\S]*modules="):
        step(torch.randn(8, 64), torch.randint(0, 10, (8,)))
    assert_same(before, tensors_of([student, teacher], [opt]))
    assert not opt.state


def test_a_parameter_list_taken_outside_reads_the_traced_parameters() -> None:
    # Before 2026-11-29 a TraceError ("none of its inputs"): the list held the real
    # parameters while traced. Now it holds the traced ones (tests/test_jit_held_tensors.py).
    model, _opt = linear_case()
    params = list(model.parameters())

    def body(x: Tensor) -> Tensor:
        return (model(x).sum() + params[0].sum()) * 1

    x = torch.randn(2, 4)
    out = functacc.jit(body, modules=[model], backend="eager")(x)
    assert torch.equal(out, body(x)) and params[0] is model[0].weight


def test_data_dependent_control_flow_is_a_clear_error() -> None:
    model, _opt = linear_case()

    def body(x: Tensor) -> Tensor:
        loss = model(x).sum()
        return loss if loss.item() > 0 else -loss

    with pytest.raises(functacc.TraceError, match="data-dependent"):
        functacc.jit(body, modules=[model], backend="eager")(torch.randn(2, 4))


def test_bad_optimizers_are_clear_errors() -> None:
    model, _ = linear_case()
    other = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"\[0\] \(shape \(2, 2\)\) is not a parameter of the step.s modules"
    ):
        functacc.jit(
            lambda: None, modules=[model], optimizers=[torch.optim.SGD(other.parameters(), 0.1)]
        )
    # Any optimizer's own step() is traced (tests/test_optimizers.py); these two cannot be.
    with pytest.raises(TypeError, match=r"LBFGS.*line search"):
        functacc.jit(
            lambda: None, modules=[model], optimizers=[torch.optim.LBFGS(model.parameters())]
        )
    with pytest.raises(TypeError, match=r"SparseAdam.*sparse=False"):
        functacc.jit(
            lambda: None, modules=[model], optimizers=[torch.optim.SparseAdam(model.parameters())]
        )


@pytest.mark.parametrize("kind", ["SGD", "Adam", "RMSprop"])
def test_opt_step_with_a_closure_calls_it_once_first_as_torch_does(kind: str) -> None:
    # skorch's train_step: optimizer.step(step_fn), the closure computing loss and backward.
    # Before 2026-11-28 a ValueError (for functacc's twins, SGD and Adam; RMSprop's own step
    # too); torch's optimizers but LBFGS call the closure once, with grad on, and return it.
    results = []
    for jit in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = getattr(torch.optim, kind)(model.parameters(), lr=0.05)

        def body(x: Tensor, y: Tensor, model=model, opt=opt) -> Tensor:
            def closure() -> Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            return opt.step(closure).detach()

        step = functacc.jit(body, modules=model, optimizers=opt, backend="eager") if jit else body
        g = torch.Generator().manual_seed(1)
        losses = [
            step(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)
        ]
        results.append((torch.stack(losses), model.weight.detach().clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_failing_call_changes_nothing() -> None:
    model, opt = linear_case()

    def step_body(x: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.dropout(model(x), 0.5).square().mean()
        loss.backward()
        opt.step()
        return loss

    step = functacc.jit(step_body, modules=[model], optimizers=[opt], backend="eager")
    step(torch.randn(3, 4))
    wrong = torch.randn(3, 5)  # a wrong feature size: fails while tracing
    before, rng = tensors_of([model], [opt]), torch.get_rng_state()
    with pytest.raises(functacc.TraceError, match=r"mat1 and mat2|shape"):
        step(wrong)
    assert_same(before, tensors_of([model], [opt]))
    assert torch.equal(rng, torch.get_rng_state())


def test_public_api_and_logging(caplog: pytest.LogCaptureFixture) -> None:
    assert "jit" in functacc.__all__ and functacc.jit.__doc__
    model, opt = linear_case()
    with caplog.at_level(logging.INFO, logger="functacc"):
        functacc.jit(accumulate(model, opt), modules=[model], backend="eager")(torch.randn(2, 4))
    assert "traced the jitted step" in caplog.text


# -- data parallel under torchrun ----------------------------------------------------------
@pytest.mark.distributed
def test_data_parallel_equals_one_process_on_the_full_batch(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "dist"))
    import jit_worker

    got = run_torchrun_worker("jit_worker", tmp_path / "jit.pt")
    for name, (objects, make_step) in jit_worker.SCENARIOS.items():
        first, second, opt = objects(seed=0)
        opts = opt if isinstance(opt, tuple) else (opt,)
        body = make_step(first, second, opt)
        for x, y in jit_worker.batches(2):
            body(x, y)
        for layout in jit_worker.LAYOUTS:
            run, what = got[layout, name], f"{layout} {name}"
            # Sums over ranks in another order than over one batch: 4 steps of AdamW/SGD.
            for label, module in (("first", first), ("second", second)):
                assert_close(
                    run[label], module.state_dict(), rtol=1e-5, atol=2e-5, what=f"{what} {label}"
                )
            for state_dict, o in zip(run["optimizer"], opts, strict=True):
                assert_close(
                    state_dict["state"],
                    o.state_dict()["state"],
                    rtol=1e-5,
                    atol=2e-5,
                    what=f"{what} optimizer state",
                )
                assert state_dict["param_groups"] == o.state_dict()["param_groups"]
            # A bare tensor the optimizer trains (the temperature): rank 0's, then trained.
            assert_close(run["bare"], jit_worker.bare_tensors(opt), rtol=1e-5, atol=2e-5, what=what)
            assert run["traces"] == 1
            if layout in ("dp", "zero1"):
                assert run["all_reduces"] >= 1  # the gradients' all-reduce is in the graph
        dp, zero1, zero2, zero3 = (got[layout, name] for layout in jit_worker.LAYOUTS)
        # ZeRO-1/2: each rank updated its half and all-gathered the parameters, and the torch
        # optimizer holds no full copy of the state between calls.
        assert zero1["all_gathers"] >= 1 and dp["all_gathers"] == 0
        assert zero1["torch_state_between_calls"] == zero2["torch_state_between_calls"] == 0
        assert zero3["torch_state_between_calls"] == 0
        assert dp["torch_state_between_calls"] == sum(len(o.state) for o in opts)
        # ZeRO-2/3: each backward reduce-scatters the student's gradients (no all-reduce is
        # left: the teacher and the EMA copy are frozen, and no buffer is written).
        for zero in (zero2, zero3):
            assert zero["reduce_scatters"] >= 1 and zero["all_reduces"] == 0
        assert dp["reduce_scatters"] == zero1["reduce_scatters"] == 0
        # The gradients do not outlive the call: None where eager leaves them.
        eager_grads = [p.grad is not None for p in first.parameters()]
        assert dp["grads_after_call"] == zero1["grads_after_call"] == eager_grads
        assert not any(zero2["grads_after_call"]) and not any(zero3["grads_after_call"])
        # ZeRO-3: between calls the optimized modules hold empty placeholders, and each
        # step gathers them (so does data parallel's, whole), then reads its own chunk of
        # the update (no gather of the new parameters where the body reads none).
        whole = [tuple(p.shape) for p in first.parameters()]
        assert dp["placeholders"] == zero2["placeholders"] == whole
        assert zero3["placeholders"] == [(0,)] * len(whole)
        assert zero3["all_gathers"] >= 1
    # ZeRO-3 gathers each unit where the step first reads it and again in backward where
    # autograd saved its weights; the new parameters only where the body reads them after
    # the update. The distillation and edge bodies: one unit, gathered for forward and
    # backward (ZeRO-2 gathers its update once). WGAN-GP: each model for the critic step
    # (the critic's kept for the double backward), the updated critic for the generator
    # step, the generator again in its backward.
    gathers = {name: got["zero3", name]["all_gathers"] for name in ("distill", "edges", "wgan_gp")}
    assert gathers == {"distill": 2, "edges": 2, "wgan_gp": 5}, gathers
    # With each Linear a unit: the teacher's products, then each student layer gathered
    # just before its product, the last one again in backward (the first layer's input
    # needs no gradient, so its weight is not saved), then the gradients reduce-scattered.
    assert re.fullmatch(r"MMGMGMGM+R+", got["zero3_order"]), got["zero3_order"]
    # PowerSGD: the jitted standard body equals compile_step's PowerSGD step (the same
    # compression, tested there against the uncompressed loss and its bytes), traces once
    # more when the 2 warm-up calls end, and trains otherwise than uncompressed.
    psgd = got["powersgd"]
    assert psgd["jit"]["traces"] == 2 and psgd["jit_plain"]["traces"] == 1
    for key in ("model", "losses"):
        assert_close(
            psgd["jit"][key],
            psgd["compile_step"][key],
            rtol=1e-5,
            atol=1e-6,
            what=f"PowerSGD {key}",
        )
    assert_close(
        psgd["jit"]["losses"][:3], psgd["jit_plain"]["losses"][:3], rtol=0, atol=0, what="warm-up"
    )
    assert not torch.allclose(psgd["jit"]["losses"][3:], psgd["jit_plain"]["losses"][3:], rtol=1e-3)
    # Adding to the .grad a previous call left is an error under ZeRO-2 that changes nothing.
    refused = got["accumulating"]
    assert "reads the gradient that its previous call left on 'model.0.weight'" in (
        refused["error"] or ""
    ), refused["error"]
    assert "use parallel=functacc.parallel.ZeRO(1)" in refused["error"]
    assert refused["unchanged"] and all(g is None for g in refused["grads"])
    # ZeRO-1/2 under Inductor, resumed from the gathered state_dict() after 2 of 4 steps.
    student, teacher, opt = jit_worker.distill_objects(seed=0)
    body = jit_worker.distill_step(student, teacher, opt)
    for x, y in jit_worker.batches(2):
        body(x, y)
    for stage in (1, 2, 3):
        resume, what = got["resume", stage], f"ZeRO-{stage}"
        # Inductor's kernels and the ranks' sums reorder float32 arithmetic.
        assert_close(resume["student"], student.state_dict(), rtol=1e-4, atol=1e-5, what=what)
        for key in ("state", "param_groups"):
            assert_close(
                resume["optimizer"][key], opt.state_dict()[key], rtol=1e-4, atol=1e-5, what=key
            )
        # The same graph on the same state: the resumed steps equal the uninterrupted ones.
        exact = {"rtol": 0, "atol": 0}
        assert_close(resume["resumed_losses"], resume["losses"][2:], **exact, what=what)
        assert_close(resume["resumed_student"], resume["student"], **exact, what=what)
        assert_close(resume["resumed_optimizer"], resume["optimizer"], **exact, what=what)


def test_zero2_on_one_process_keeps_the_gradients_to_the_call() -> None:
    # As under torchrun (tests/dist/jit_worker.py): the optimizer's gradients do not outlive
    # the call, and a body that would read those of its previous call is an error.
    sys.path.insert(0, str(Path(__file__).parent / "dist"))
    import jit_worker

    student, teacher, opt = jit_worker.distill_objects()
    ref_student, ref_teacher, ref_opt = jit_worker.distill_objects()
    step = functacc.jit(
        jit_worker.distill_step(student, teacher, opt),
        modules=[student, teacher],
        optimizers=[opt],
        backend="eager",
        parallel=functacc.parallel.ZeRO(2),
    )
    body = jit_worker.distill_step(ref_student, ref_teacher, ref_opt)
    for x, y in jit_worker.batches(1):
        assert torch.equal(step(x, y), body(x, y))
    assert all(p.grad is None for p in student.parameters())
    assert all(p.grad is not None for p in ref_student.parameters())
    for p in ref_student.parameters():
        p.grad = None
    assert_same(tensors_of([student], [opt]), tensors_of([ref_student], [ref_opt]))
    assert step.num_traces == 1

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulating(x: Tensor) -> Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step = functacc.jit(
        accumulating,
        modules=[model],
        optimizers=[opt],
        backend="eager",
        parallel=functacc.parallel.ZeRO(2),
    )
    step(torch.ones(3, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(functacc.TraceError, match=r"previous call left on 'model.weight'"):
        step(torch.ones(3, 4))
    assert_same({k: v.clone() for k, v in model.state_dict().items()}, before)  # nothing changed


def test_pure_form_with_vmap_per_sample_gradients() -> None:
    # DP-SGD's per-sample clipping: vmap(grad(...)) inside the jitted pure step.
    def per_sample_loss(w: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return ((x @ w - y) ** 2).sum()

    def body(state: dict, x: Tensor, y: Tensor) -> tuple[dict, Tensor]:
        g = torch.func.vmap(torch.func.grad(per_sample_loss), in_dims=(None, 0, 0))(
            state["w"], x, y
        )
        norms = g.flatten(1).norm(dim=1).clamp(min=1.0)
        return {"w": state["w"] - 0.1 * (g / norms[:, None, None]).mean(0)}, norms.mean()

    torch.manual_seed(0)
    w, x, y = torch.randn(5, 3), torch.randn(8, 5), torch.randn(8, 3)
    got = functacc.jit(body, backend="eager")({"w": w.clone()}, x, y)
    expected = body({"w": w.clone()}, x, y)
    assert torch.equal(got[0]["w"], expected[0]["w"]) and torch.equal(got[1], expected[1])


def test_gradient_hooks_run_as_in_eager() -> None:
    model, opt = linear_case()
    ref, ref_opt = linear_case()
    seen: list[tuple[int, ...]] = []
    for m in (model, ref):
        m[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        m[2].bias.register_post_accumulate_grad_hook(lambda p: seen.append(tuple(p.grad.shape)))
    step = functacc.jit(accumulate(model, opt), modules=[model], backend="eager")
    for _ in range(2):
        x = torch.randn(5, 4)
        step(x)
        accumulate(ref, ref_opt)(x)
        assert_same(tensors_of([model], []), tensors_of([ref], []))
    assert model[0].weight.grad.abs().max() <= 0.02  # clamped twice, accumulated


def test_python_side_effects_outside_the_modules_happen_on_every_call() -> None:
    # Once errors (the trace would have run them once); now replayed as eager runs them:
    # tests/test_jit_python.py has the whole table.
    model, _opt = linear_case()
    history: list[Tensor] = []
    calls = 0

    def appends(x: Tensor) -> Tensor:
        loss = model(x).sum()
        history.append(loss)
        return loss

    def counts(x: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        return model(x).sum()

    appending = functacc.jit(appends, modules=[model], backend="eager")
    counting = functacc.jit(counts, modules=[model], backend="eager")
    xs = [torch.randn(2, 4) for _ in range(3)]
    returned = [appending(x) for x in xs]
    for x in xs:
        counting(x)
    assert calls == 3 and len(history) == 3
    assert all(
        torch.equal(h, r) and not h.requires_grad for h, r in zip(history, returned, strict=True)
    )
    assert all(torch.equal(h, model(x).sum().detach()) for h, x in zip(history, xs, strict=True))


def test_doctests() -> None:
    import doctest

    import functacc.core.python_effects
    import functacc.frontends.jit

    for module in (functacc.frontends.jit, functacc.core.python_effects):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_a_replaced_layer_is_an_error_not_a_silent_miss() -> None:
    model, opt = linear_case()
    step = functacc.jit(accumulate(model, opt), modules=[model], backend="eager")
    step(torch.randn(2, 4))
    model[2] = nn.Linear(8, 2)
    with pytest.raises(RuntimeError, match=r"model\.2 was replaced"):
        step(torch.randn(2, 4))


def test_a_forward_hook_added_later_retraces() -> None:
    model, _opt = linear_case()
    step = functacc.jit(lambda x: model(x).sum(), modules=[model], backend="eager")
    x = torch.randn(2, 4)
    before = step(x)
    model[2].register_forward_hook(lambda m, i, o: o * 2)
    assert torch.equal(step(x), 2 * before) and step.num_traces == 2
    assert "hooks" in step.traces[1].reason


def test_unread_ops_are_dropped_but_asserts_writes_and_draws_stay() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from functacc.core.graph_passes import drop_unread_ops

    def fn(x: Tensor, out: Tensor) -> Tensor:
        x.cos().exp()  # read by nothing
        torch.rand(3)  # read by nothing, but it advances the generator as eager does
        torch._assert_async(x.sum() > -1.0e9)
        out.copy_(x)  # a write into an input
        return x * 2

    gm = make_fx(fn)(torch.randn(3), torch.zeros(3))
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cos.default in before
    assert drop_unread_ops(gm) == 0  # no collectives among them
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert aten.cos.default not in after and aten.exp.default not in after
    for kept in (
        aten.rand.default,
        aten._assert_async.default,
        aten.copy_.default,
        aten.mul.Tensor,
    ):
        assert kept in after, (kept, after)


@pytest.mark.distributed
def test_c10d_collectives_in_the_step_run_in_the_graph(tmp_path: Path) -> None:
    # apex's ImageNet example averages its loss and accuracy in the step with
    # dist.all_reduce (in place); traced, that failed ("'__eq__' is not implemented for
    # ProcessGroup", location unknown). all_reduce, all_gather into a list, broadcast and
    # barrier now run as graph collectives: the same values as the body under DDP, eagerly
    # (the gradients averaged in another order: 1e-6 relative), on 2 ranks, the jitted body
    # calling the module DDP wraps, as the error for a DDP given to jit advises.
    got = run_torchrun_worker("c10d_worker", tmp_path / "c10d.pt")
    for eager, jitted in zip(got["eager"]["steps"], got["jit"]["steps"], strict=True):
        assert jitted[0] == pytest.approx(eager[0], rel=1e-6)  # the reduced loss
        assert jitted[1] == eager[1]  # accuracy: counts, averaged
        assert torch.equal(jitted[2], eager[2]) and float(jitted[3]) == float(eager[3]) == 2.0
    for a, b in zip(got["jit"]["params"], got["eager"]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    errors = got["errors"]
    assert "torch.distributed.reduce() in the step" in errors["reduce"]
    assert "async_op=True" in errors["async"] and "leave out async_op" in errors["async"]
    assert "op=RedOpType.BAND" in errors["band"] or "BAND" in errors["band"]
    # A DDP-wrapped model: the advice (the wrapped module, called itself) is the jitted run
    # above, equal to the body under DDP.
    assert "DistributedDataParallel" in errors["ddp"] and "ddp.module" in errors["ddp"]


@pytest.mark.parametrize("name", ["forward", "training", "modules"])
def test_a_model_in_a_variable_named_like_a_module_attribute_trains(name: str) -> None:
    # The body's name for a module labels it; `forward = model if jitted else ddp(model)`
    # (a DDP script) gave the label "forward", which nn.ModuleDict refused: a KeyError
    # ("attribute 'forward' already exists") when the step was built.
    torch.manual_seed(0)
    scope: dict = {name: nn.Linear(3, 1), "torch": torch}
    exec(
        f"def body(x):\n    loss = {name}(x).square().mean()\n    loss.backward()\n    return loss",
        scope,
    )
    model = scope[name]
    step = functacc.jit(scope["body"], modules=[model], backend="eager")
    x = torch.randn(4, 3)
    loss = step(x)
    expected = model(x).square().mean()
    assert torch.equal(loss, expected.detach())
