"""Draws from NumPy's and Python's global generators in a jitted step (core/python_draws.py).

Eager draws new numbers at every call; a trace runs the step's Python once. Before
2026-11-29 every such draw was a ``TraceError`` advising to draw before the call and pass the
values in. Now an array handed to torch as drawn (``Tensor(np.random.normal(...))``, a view,
an ``astype``) and a drawn number used in tensor arithmetic are graph inputs, drawn again
before each call in the step's order: the losses and weights are eager's bit for bit on the
eager backend, and both generators are left where eager leaves them. What a trace cannot
follow (NumPy arithmetic on the array, a Python branch on more than 3 drawn numbers) is a
``TraceError`` that leaves everything as it was. A branch on up to 3 (``if random.random() <
p:``) is taken as eager takes it since 2026-11-28: those draws are made ahead of each call
to choose the program traced for that path.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc

Tensor, LongTensor = torch.FloatTensor, torch.LongTensor

# Each: the noise z (5 x 8) the step computes with, drawn its way.
NOISE = {
    "Tensor(normal)": lambda n: Tensor(np.random.normal(0, 1, (n, 8))),
    "from_numpy(randn).float()": lambda n: torch.from_numpy(np.random.randn(n, 8)).float(),
    "tensor(rand, dtype)": lambda n: torch.tensor(np.random.rand(n, 8), dtype=torch.float32),
    "astype(float32)": lambda n: torch.from_numpy(
        np.random.standard_normal((n, 8)).astype(np.float32)
    ),
    "a view": lambda n: Tensor(np.random.uniform(-1, 1, (n, 16))[:, ::2]),
    "reshape": lambda n: Tensor(np.random.random(n * 8).reshape(n, 8)),
    "randint, LongTensor": lambda n: F.one_hot(LongTensor(np.random.randint(0, 8, n)), 8).float(),
    "np scalar (beta)": lambda n: np.random.beta(2.0, 2.0) * torch.ones(n, 8),
    "random.uniform, randint": lambda n: (
        torch.ones(n, 8) * random.uniform(0.5, 1.5) + random.randint(0, 3)
    ),
    "two draws": lambda n: (
        Tensor(np.random.normal(0, 1, (n, 8))) * Tensor(np.random.random((n, 1)))
    ),
    "beside a NumPy constant": lambda n: (
        Tensor(np.random.normal(0, 1, (n, 8))) * torch.from_numpy(SCALES).float()
    ),
}
SCALES = np.linspace(0.5, 1.5, 8)  # a constant of the graph: the same in every trace


def to_categorical(y: np.ndarray, num_columns: int) -> torch.Tensor:
    """PyTorch-GAN's infogan.py: NumPy indexes with the drawn labels in C, where no check
    of the array sees it."""
    y_cat = np.zeros((y.shape[0], num_columns))
    y_cat[range(y.shape[0]), y] = 1.0
    return Tensor(y_cat)


def run(noise, jit: bool, backend: str = "eager", calls: int = 4) -> tuple:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = (model(noise(x.shape[0])) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
    g = torch.Generator().manual_seed(1)
    losses = [step(torch.randn(5, 3, generator=g)) for _ in range(calls)]
    generators = (np.random.get_state()[1].copy(), random.getstate())
    return losses, model.weight.detach().clone(), generators, getattr(step, "num_traces", 0)


@pytest.mark.parametrize("kind", list(NOISE))
def test_drawn_in_the_step_as_in_eager(kind) -> None:
    eager, jitted = run(NOISE[kind], False), run(NOISE[kind], True)
    assert all(torch.equal(a, b) for a, b in zip(jitted[0], eager[0], strict=True))
    assert len({float(a) for a in eager[0]}) == 4  # new numbers each call: none baked
    assert torch.equal(jitted[1], eager[1])
    assert np.array_equal(jitted[2][0], eager[2][0]) and jitted[2][1] == eager[2][1]
    assert jitted[3] == 1


@pytest.mark.inductor
def test_drawn_in_the_step_under_inductor() -> None:
    # Inductor's kernels round differently from eager's: losses within 1e-5; the draws,
    # and so the generators' states, are eager's exactly.
    noise = NOISE["two draws"]
    eager, jitted = run(noise, False), run(noise, True, backend="inductor")
    torch.testing.assert_close(torch.stack(jitted[0]), torch.stack(eager[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(jitted[1], eager[1], rtol=1e-5, atol=1e-6)
    assert np.array_equal(jitted[2][0], eager[2][0]) and jitted[2][1] == eager[2][1]


REFUSED = {
    "NumPy arithmetic": (lambda n: Tensor(np.random.randn(n, 8) * 2), r"np\.multiply"),
    "an item": (lambda n: torch.ones(n, 8) * float(np.random.rand(2)[0]), r"an item of it"),
    "a reduction": (lambda n: torch.ones(n, 8) * np.random.rand(3).mean(), r"np\.add"),
    "a cast to int": (
        lambda n: torch.from_numpy(np.random.rand(n, 8).astype(np.int64)).float(),
        r"a cast to int64",
    ),
    "NumPy indexing with it (infogan)": (
        lambda n: to_categorical(np.random.randint(0, 8, n), 8),
        r"randint\(0, 8, 5\) \(draw 1\) drew \(NumPy code reading its values, whose result "
        r"reaches torch at .*test_jit_host_draws.py:\d+",
    ),
    # A branch on 4 draws (a decision per step of a sequence): 2**4 paths, refused.
    "branches on np.random": (
        lambda n: torch.ones(n, 8) * sum(2.0 if np.random.rand() < 0.5 else 1.0 for _ in "abcd"),
        r"branches in Python on 4 numbers it drew from NumPy's np\.random.*2\*\*4",
    ),
    "branches on random": (
        lambda n: torch.ones(n, 8) * sum(2.0 if random.random() < 0.5 else 1.0 for _ in "abcd"),
        r"branches in Python on 4 numbers it drew from Python's random module.*torch\.where",
    ),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_what_a_trace_cannot_follow_is_an_error_that_changes_nothing(kind) -> None:
    noise, message = REFUSED[kind]
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = (model(noise(x.shape[0])) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = model.weight.detach().clone(), np.random.get_state()[1].copy(), random.getstate()
    with pytest.raises(functacc.TraceError, match=message):
        step(torch.randn(5, 3))
    assert torch.equal(model.weight, before[0]) and not opt.state
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]


class NoisyInput(nn.Module):
    """Adds Gaussian noise drawn with NumPy to its input in training (a denoising model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + torch.from_numpy(np.random.normal(0, 0.1, size=tuple(x.shape))).float()
        return self.fc(x)


def test_compile_step_forward_drawing_from_numpy_as_in_eager() -> None:
    def train(door: bool) -> tuple:
        torch.manual_seed(0)
        np.random.seed(0)
        model = NoisyInput()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = nn.CrossEntropyLoss()
        step = functacc.compile_step(model, loss_fn, opt, backend="eager") if door else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
            if step is not None:
                losses.append(step(x, y).detach())
                continue
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, model.fc.weight.detach().clone(), np.random.get_state()[1].copy()

    eager, compiled = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(compiled[0], eager[0], strict=True))
    assert torch.equal(compiled[1], eager[1]) and np.array_equal(compiled[2], eager[2])


def test_timms_mixup_in_the_step_says_to_run_it_before_the_call() -> None:
    # timm's Mixup decides mixup or cutmix with np.random.rand() < p, in its own code; its
    # cutmix path branches on 5 draws: the error names the line there and the step's
    # statement to run before the call instead. Done so, the numbers are eager's.
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    def train(door: str) -> tuple:
        torch.manual_seed(0)
        np.random.seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=4)
        criterion = SoftTargetCrossEntropy()

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            if door != "advice":
                x, y = mixup_fn(x, y)
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.arange(4)) for _ in range(10)]
        if door == "eager":
            return [step(x, y) for x, y in batches], model[1].weight, np.random.get_state()[1]
        jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        if door == "as written":  # mixup's paths (one draw) run; cutmix branches on 5
            done, before = [], None
            with pytest.raises(functacc.TraceError) as info:
                for x, y in batches:
                    before = np.random.get_state()[1].copy()
                    done.append(jitted(x, y))
            return str(info.value), done, before, np.random.get_state()[1]
        losses = [jitted(*mixup_fn(x, y)) for x, y in batches]
        return losses, model[1].weight, np.random.get_state()[1]

    message, done, before, generator = train("as written")
    assert "5 numbers it drew from NumPy's np.random" in message
    assert "np.random.rand() (draw 1) at mixup.py:" in message
    assert "Fix: run `x, y = mixup_fn(x, y)` before the call" in message
    eager, advised = train("eager"), train("advice")
    assert done == eager[0][: len(done)]  # the calls before it: eager's, bit for bit
    assert np.array_equal(generator, before)  # the failed call drew nothing
    assert advised[0] == eager[0] and torch.equal(advised[1], eager[1])
    assert np.array_equal(advised[2], eager[2])


def test_a_draw_sized_by_a_batch_that_changes_size(caplog) -> None:
    # Under dynamic=True a batch size is a symbol; a NumPy draw sized by it cannot be drawn
    # before the call from a symbol, so that trace fixes its sizes: one trace per size, each
    # eager's numbers, and the retrace warning says why and what keeps sizes symbolic.
    def train(jit: bool) -> tuple:
        torch.manual_seed(0)
        np.random.seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def body(x: torch.Tensor) -> torch.Tensor:
            loss = (model(Tensor(np.random.normal(0, 1, (x.shape[0], 8)))) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager", dynamic=True)
        g = torch.Generator().manual_seed(1)
        losses = [(step if jit else body)(torch.randn(n, 3, generator=g)) for n in (6, 4, 5, 3)]
        return losses, model.weight.detach().clone(), step.num_traces

    eager = train(False)
    with caplog.at_level("WARNING", logger="functacc"):
        jitted = train(True)
    assert all(torch.equal(a, b) for a, b in zip(jitted[0], eager[0], strict=True))
    assert torch.equal(jitted[1], eager[1]) and jitted[2] == 4
    assert "(sizes fixed: np.random.normal draws with one of them)" in caplog.text
    assert "Fix: draw with torch (torch.randn(x.shape[0], d): symbolic sizes)" in caplog.text


def test_a_call_that_fails_after_its_draws_puts_the_generators_back() -> None:
    # The draws are made before the graph runs; a run that fails (here clipping's check of a
    # non-finite norm, asserted in the graph) leaves NumPy's and Python's generators, like
    # the model, as they were: the next call draws what eager's would.
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        z = Tensor(np.random.normal(0, 1, (x.shape[0], 8))) * random.uniform(0.5, 1.5)
        loss = (model(z) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    step(torch.randn(5, 3))
    before = model.weight.detach().clone(), np.random.get_state()[1].copy(), random.getstate()
    with pytest.raises(RuntimeError, match="non-finite"):
        step(torch.full((5, 3), float("nan")))
    assert torch.equal(model.weight, before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]


def test_a_drawn_array_returned_kept_or_printed_is_the_calls_draw(capsys) -> None:
    # Eager returns, stores and prints the array it drew at that call. Before this, the
    # trace's array was a constant of the program (a TraceError from its repr).
    def train(jit: bool) -> tuple:
        torch.manual_seed(0)
        np.random.seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history: list = []

        def body(x: torch.Tensor) -> tuple:
            z = np.random.normal(0, 1, (x.shape[0], 8))
            w = np.random.rand(x.shape[0], 8).astype(np.float32)
            history.append(z[:, :2])
            print("w", w)
            loss = (model(Tensor(z) * torch.from_numpy(w)) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach(), z, w

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        capsys.readouterr()
        out = [(step if jit else body)(torch.randn(2, 3, generator=g)) for _ in range(3)]
        return out, history, capsys.readouterr().out

    (eager, eager_kept, eager_out), (jitted, kept, out) = train(False), train(True)
    for (loss, z, w), (ref_loss, ref_z, ref_w) in zip(jitted, eager, strict=True):
        assert torch.equal(loss, ref_loss) and np.array_equal(z, ref_z)
        assert np.array_equal(w, ref_w) and w.dtype == np.float32 and type(z) is np.ndarray
    assert all(np.array_equal(a, b) for a, b in zip(kept, eager_kept, strict=True))
    assert out == eager_out and out.count("w [[") == 3


GENERATORS = {
    "np.random.default_rng": lambda: np.random.default_rng(0),
    "np.random.RandomState": lambda: np.random.RandomState(0),
    "random.Random": lambda: random.Random(0),
}


def generator_body(made, holder, held_in, model, opt):
    def body(x: torch.Tensor) -> torch.Tensor:
        rng = made if held_in == "variable" else holder["rng"] if held_in == "dict" else holder.rng
        if isinstance(rng, random.Random):
            scale = torch.full((1, 8), rng.random()) + rng.gauss(0.0, 1.0)
        else:
            scale = torch.as_tensor(rng.uniform(0.5, 1.5, (1, 8))).float()
        loss = (model(torch.ones(x.shape[0], 8) * scale) - x).pow(2)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
        return loss.detach()

    return body


@pytest.mark.parametrize("kind", list(GENERATORS))
@pytest.mark.parametrize("held_in", ["variable", "dict", "object"])
def test_a_generator_object_the_step_reaches_draws_as_in_eager(kind, held_in) -> None:
    # `rng = np.random.default_rng(seed)` at script level (NumPy's recommended style), drawn
    # from in the step. Before 2026-11-29 the trace's draw was a constant of the graph, every
    # call training on it, silently; then a TraceError. Now each draw is fed, drawn from that
    # generator before every call: eager's numbers, and the generator left as eager leaves it
    # (isinstance(rng, random.Random) holds in the trace too).
    runs = []
    for jit in (False, True):
        made = GENERATORS[kind]()
        holder = {"rng": made} if held_in == "dict" else types.SimpleNamespace(rng=made)
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = generator_body(made, holder, held_in, model, opt)
        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        losses = [step(torch.randn(5, 3, generator=g)) for _ in range(3)]
        runs.append((losses, model.weight.detach().clone(), made.random(), step))
    (eager, weight, after, _), (losses, jit_weight, jit_after, step) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, eager, strict=True))
    assert torch.equal(jit_weight, weight) and jit_after == after  # the generator's next number
    assert step.num_traces == 1


def test_a_generator_object_reassigned_between_calls_is_drawn_from_anew() -> None:
    # Eager draws from whatever the variable holds at each call.
    runs = []
    for jit in (False, True):
        holder = types.SimpleNamespace(rng=np.random.default_rng(0))
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = generator_body(None, holder, "object", model, opt)
        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
        losses = [step(x)]
        holder.rng = np.random.default_rng(7)
        losses += [step(x), step(x)]
        runs.append(losses)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))


def refused_generator_uses():
    def shuffles(rng, x):
        order = np.arange(x.shape[0])
        rng.shuffle(order)  # in place, into an array of the step: not a fed draw
        return x[torch.from_numpy(order)]

    def branches(rng, x):
        return x * sum(2 if rng.random() < 0.5 else 1 for _ in range(4))

    def chooses(rng, x):
        return x * rng.choice(np.array([0.5, 2.0]))  # an array argument: not plain

    return {
        "shuffle": (shuffles, r"from closure variable 'rng' \(Generator\) while .*a shuffle in"),
        "branches": (branches, r"branches in Python on 4 numbers it drew from the generator clos"),
        "choice(array)": (chooses, r"from closure variable 'rng' \(Generator\) while"),
    }


@pytest.mark.parametrize("name", list(refused_generator_uses()))
def test_what_a_generator_object_cannot_feed_is_an_error_that_changes_nothing(name) -> None:
    use, match = refused_generator_uses()[name]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = model(use(rng, x)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = model.weight.detach().clone()
    with pytest.raises(functacc.TraceError, match=match):
        step(torch.randn(5, 3))
    assert not opt.state and torch.equal(model.weight, before)
    assert rng.random() == np.random.default_rng(0).random()  # its state put back


def test_a_call_that_fails_puts_a_generator_objects_state_back() -> None:
    rng = np.random.default_rng(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = (model(Tensor(rng.normal(0, 1, (x.shape[0], 8)))) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    step(torch.randn(5, 3))
    state = rng.bit_generator.state
    with pytest.raises(RuntimeError, match="non-finite"):
        step(torch.full((5, 3), float("nan")))
    assert rng.bit_generator.state == state


def branching_step(jit: str | None, calls: int = 24) -> tuple:
    """Teacher forcing decided once per batch (``random.random() < ratio``), a flip
    augmentation on ``np.random.rand() < 0.3`` and a generator object's noise: the losses,
    what the step logged, the generators' states after the run and the trace count."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(5)
    log = []

    def step(x: torch.Tensor, y: torch.Tensor, ratio: float) -> torch.Tensor:
        teacher = random.random() < ratio
        inp = y if teacher else x
        flip = np.random.rand() < 0.3
        if flip:
            inp = inp.flip(0)
        noise = rng.normal(0, 0.1)
        loss = (model(inp) - y).pow(2).mean() + noise
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append((teacher, bool(flip), noise))
        return loss.detach()

    if jit is not None:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=jit)
    g = torch.Generator().manual_seed(1)
    losses = [
        step(torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), 0.5)
        for _ in range(calls)
    ]
    after = (random.random(), np.random.rand(), rng.random())
    return torch.stack(losses), log, after, len(step.traces) if jit else 0


def test_a_branch_on_drawn_numbers_takes_eagers_path_at_every_call() -> None:
    # Before 2026-11-28 a TraceError: the trace would have taken one path for every call.
    (losses, log, after, _), (jit_losses, jit_log, jit_after, traces) = (
        branching_step(None),
        branching_step("eager"),
    )
    assert {(t, f) for t, f, _ in log} == {(a, b) for a in (True, False) for b in (True, False)}
    assert jit_log == log and jit_after == after
    assert torch.equal(jit_losses, losses)  # the same ops in the same order: bit for bit
    assert traces == 4  # one per path taken, no trace per call


@pytest.mark.inductor
def test_a_branch_on_drawn_numbers_under_inductor() -> None:
    # Inductor's kernels round differently from eager's: losses within 1e-5; the draws,
    # the paths and the generators' states are eager's exactly.
    (losses, log, after, _), (jit_losses, jit_log, jit_after, _) = (
        branching_step(None, calls=8),
        branching_step("inductor", calls=8),
    )
    assert [(t, f) for t, f, _ in jit_log] == [(t, f) for t, f, _ in log]
    assert jit_after == after
    torch.testing.assert_close(jit_losses, losses, rtol=1e-5, atol=1e-6)


def test_draw_inside_a_called_method_names_the_call_to_run_before() -> None:
    """A NumPy draw with an array argument, two calls deep (improved-diffusion's
    ``schedule_sampler.sample`` in ``forward_backward``): the advice names the call that
    draws and the step's statement that leads there."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = np.ones(10) / 10

    def sample(n: int) -> Tensor:
        return torch.from_numpy(np.random.choice(len(weights), size=(n,), p=weights))

    def forward_backward(x: Tensor, y: Tensor) -> None:
        t = sample(x.shape[0])
        F.mse_loss(model(x) * t[:, None], y).backward()

    def body(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        forward_backward(x, y)
        opt.step()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    state = np.random.get_state()[1].copy()
    with pytest.raises(functacc.TraceError) as info:
        step(torch.randn(6, 5), torch.randn(6, 2))
    assert "run `t = sample(x.shape[0])` (which the step reaches through" in str(info.value)
    assert "`forward_backward(x, y)`" in str(info.value)
    assert np.array_equal(np.random.get_state()[1], state)


class _Buffer:
    """A replay buffer as Stable-Baselines3 writes one (``ReplayBuffer.sample`` returning
    its base class's, which draws the positions with ``np.random.randint`` and indexes
    its NumPy storage with them)."""

    def __init__(self) -> None:
        self.observations = np.random.default_rng(0).standard_normal((32, 5)).astype(np.float32)

    def sample(self, batch_size: int) -> Tensor:
        positions = np.random.randint(0, len(self.observations), size=batch_size)
        return torch.as_tensor(self.observations[positions])


class _ReplayBuffer(_Buffer):
    def sample(self, batch_size: int) -> Tensor:
        return super().sample(batch_size)


def test_drawn_positions_indexing_a_buffer_name_the_sample_call() -> None:
    """The draw's positions index host data (a computation on them): a TraceError whose
    advice names the step's own assignment that samples (not the buffer's inner
    ``return super().sample(...)``), before 2026-11-29 only "hand the array to torch"."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = _ReplayBuffer()

    def train(batch_size: int) -> None:
        opt.zero_grad()
        observations = buffer.sample(batch_size)
        model(observations).square().mean().backward()
        opt.step()

    step = functacc.jit(train, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError) as info:
        step(16)
    assert "Fix: run `observations = buffer.sample(batch_size)` before the call" in str(info.value)
