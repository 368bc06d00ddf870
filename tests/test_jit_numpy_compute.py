"""NumPy computed on ``tensor.numpy()`` arrays in a jitted step (core/python_numpy.py).

Training loops compute metrics with NumPy in the step: PyTorch-GAN's ACGAN,
``d_acc = np.mean(np.argmax(pred, axis=1) == gt)`` of ``np.concatenate``-d ``.numpy()``
arrays, printed with ``"%d%%" % (100 * d_acc)``; a count kept with
``self.correct += np.sum(pred == y)``. Before 2026-11-28 any computation on such an array
was a ``TraceError``. Now NumPy's functions, ufuncs, operators and methods run in the graph
(``torch._numpy``), and what the step keeps, returns, prints or formats is eager's after each
call, NumPy's types included (``np.float64``, ``np.int64``).

Tolerance: integer and boolean results, elementwise ops, max/argmax and the printed text
made of them are compared exactly; a float reduction (a float32 mean, a float64 std) is
torch's, whose summation order differs from NumPy's pairwise one, so it is compared to
eager's within a few units in the last place (rtol 1e-6 for float32, 1e-12 for float64).
"""

from __future__ import annotations

import contextlib
import io
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score
from torch import nn

import functacc


def setup() -> tuple[nn.Module, torch.optim.Optimizer, types.SimpleNamespace]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.5), types.SimpleNamespace()


def data(calls: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
        for _ in range(calls)
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    return out.detach(), loss


def metrics_body(model, opt, state):
    """Metrics as loops write them: printed, kept, counted, returned."""
    state.correct, state.seen, state.accs = 0, 0, []

    def body(x, y):
        out, loss = train(model, opt, x, y)
        pred, gt = out.numpy(), y.numpy()
        hit = np.argmax(pred, axis=1) == gt
        state.correct += np.sum(hit)  # an np.int64 count, fed once it changes
        state.seen += len(hit)
        acc = np.mean(hit)  # an np.float64
        state.accs.append(acc)
        both = np.concatenate([hit, np.zeros(2, dtype=bool)])  # beside a NumPy constant
        print(f"acc {acc:.3f} {acc} {both.sum()} {pred.dtype} {pred.shape} {pred.T.shape}")
        print("[acc: %d%%] [loss %.4f]" % (100 * acc, loss.item()), acc, np.abs(pred).max())  # noqa: UP031
        print(pred[:, 0] * 2, pred.astype(np.float64)[0], int(np.sum(hit)), float(acc))
        return acc, float(acc), pred.argmax(1), np.maximum(pred, 0), (pred > 0).tolist()

    return body


def run(make_body, jit: bool, backend: str = "eager", calls: int = 4) -> tuple:
    model, opt, state = setup()
    body = make_body(model, opt, state)
    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        returned = [body(x, y) for x, y in data(calls)]
    return (
        text.getvalue(),
        returned,
        dict(vars(state)),
        [p.detach().clone() for p in model.parameters()],
    )


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (np.float64 is not a float here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_numpy_metrics_in_the_step_are_eagers_text_types_and_counts() -> None:
    eager, jitted = run(metrics_body, jit=False), run(metrics_body, jit=True)
    assert jitted[0] == eager[0]  # the printed text, "%d%%" and f"{acc:.3f}" included
    assert "[acc: " in eager[0] and eager[0].count("\n") == 12
    assert same(jitted[1], eager[1])  # returned: np.float64, float, arrays, nested bools
    assert same(jitted[2], eager[2])  # state.correct an np.int64, state.accs np.float64s
    assert type(eager[2]["correct"]) is np.int64 and eager[2]["correct"] > 0
    assert same(jitted[3], eager[3])


def test_a_numpy_count_is_fed_not_fixed_by_the_trace() -> None:
    # Before this change an attribute holding an np.int64 was neither guarded nor fed: the
    # trace fixed the value it read, and the count went wrong from the third call, silently.
    def make(model, opt, state):
        state.correct = 0

        def body(x, y):
            out, _ = train(model, opt, x, y)
            state.correct += np.sum(out.numpy().argmax(1) == y.numpy())

        return body

    counts = {}
    for jit in (False, True):
        model, opt, state = setup()
        body = make(model, opt, state)
        if jit:
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        counts[jit] = []
        for x, y in data(6):
            body(x, y)
            counts[jit].append(state.correct)
    assert same(counts[True], counts[False])
    assert len(set(counts[False])) > 2


def test_a_numpy_scalar_read_by_the_step_is_guarded() -> None:
    # A NumPy scalar the step only reads (a weight kept as np.float32): a new value is a new
    # trace (before this change: the first trace's value, silently).
    losses = {}
    for jit in (False, True):
        model, opt, state = setup()

        def body(x, y, model=model, opt=opt, state=state):
            return train(model, opt, x, y)[1] * float(state.scale)

        if jit:
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        losses[jit] = []
        for k, (x, y) in enumerate(data(3)):
            state.scale = np.float32(1.0 + k)
            losses[jit].append(body(x, y))
    assert same(losses[True], losses[False])


def float_reductions(model, opt, state):
    def body(x, y):
        out, _ = train(model, opt, x, y)
        pred = out.numpy()
        return pred.mean(), np.std(pred.astype(np.float64)), np.sum(pred, axis=0)

    return body


def test_float_reductions_are_numpys_within_rounding() -> None:
    eager, jitted = run(float_reductions, jit=False), run(float_reductions, jit=True)
    for (m0, s0, c0), (m1, s1, c1) in zip(eager[1], jitted[1], strict=True):
        assert type(m1) is np.float32 and type(s1) is np.float64 and c1.dtype == np.float32
        np.testing.assert_allclose(m1, m0, rtol=1e-6)
        np.testing.assert_allclose(s1, s0, rtol=1e-12)
        np.testing.assert_allclose(c1, c0, rtol=1e-6)
    assert same(jitted[3], eager[3])


def data_dependent_shapes(model, opt, state):
    def body(x, y):
        out, _ = train(model, opt, x, y)
        pred = out.numpy()
        return pred[pred > 0].sum() > 0, np.unique(pred.argmax(1)), pred[pred > 0].size

    return body


def test_data_dependent_shapes_in_numpy() -> None:
    eager, jitted = run(data_dependent_shapes, jit=False), run(data_dependent_shapes, jit=True)
    assert same(jitted[1], eager[1])


def counted(model, opt, state):
    state.correct = 0

    def body(x, y):
        out, loss = train(model, opt, x, y)
        pred = out.numpy()
        hit = np.argmax(pred, axis=1) == y.numpy()
        state.correct += np.sum(hit)
        acc = np.mean(hit)
        print("[acc: %d%%]" % (100 * acc), f"{acc:.3f}", acc, float(acc), int(np.sum(hit)))  # noqa: UP031
        return acc, pred.argmax(1), pred.mean(), loss

    return body


@pytest.mark.inductor
def test_numpy_under_inductor() -> None:
    eager = run(counted, jit=False, calls=3)
    jitted = run(counted, jit=True, backend="inductor", calls=3)
    # Inductor's kernels round the weights' updates their own way (within 1e-6 here): the
    # predictions, and so the accuracies and counts, are eager's on this data.
    assert jitted[0] == eager[0] and eager[0].count("%") == 3
    assert same(jitted[2], eager[2])
    for (acc0, arg0, mean0, loss0), (acc1, arg1, mean1, loss1) in zip(
        eager[1], jitted[1], strict=True
    ):
        assert same((acc1, arg1), (acc0, arg0)) and type(mean1) is np.float32
        np.testing.assert_allclose(mean1, mean0, rtol=1e-5)
        torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for a, b in zip(jitted[3], eager[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def refused():
    def branch(x, y, model, opt):
        out, _ = train(model, opt, x, y)
        if np.mean(out.numpy().argmax(1) == y.numpy()) > 0.5:
            print("good")

    def asarray(x, y, model, opt):
        return np.asarray(train(model, opt, x, y)[0].numpy()).sum()

    def sklearn_metric(x, y, model, opt):
        from sklearn.metrics import accuracy_score

        return accuracy_score(y.numpy(), train(model, opt, x, y)[0].argmax(1).numpy())

    def setitem(x, y, model, opt):
        pred = train(model, opt, x, y)[0].numpy()
        pred[0] = 1.0
        return pred

    def in_place(x, y, model, opt):
        pred = train(model, opt, x, y)[0].numpy()
        pred += 1.0
        return pred

    def reduce_method(x, y, model, opt):
        return np.add.reduce(train(model, opt, x, y)[0].numpy())

    return {
        "branch": (branch, "branch on tensor values"),
        "asarray": (asarray, r"converting it to a real array.*after the call"),
        "sklearn": (sklearn_metric, r"converting it to a real array.*functacc.host"),
        "setitem": (setitem, "changing it in place"),
        "in_place": (in_place, r"changing it in place \(add\)"),
        "np.add.reduce": (reduce_method, r"np.add.reduce, which torch._numpy does not"),
    }


@pytest.mark.parametrize("name", sorted(refused()))
def test_what_needs_the_values_is_a_clear_error_and_changes_nothing(name: str) -> None:
    body, match = refused()[name]
    model, opt, _ = setup()
    before = [p.detach().clone() for p in model.parameters()]
    step = functacc.jit(
        lambda x, y: body(x, y, model, opt), modules=[model], optimizers=[opt], backend="eager"
    )
    with pytest.raises(functacc.TraceError, match=match):
        step(*data(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert not opt.state


@pytest.mark.inductor
def test_returned_bools_compile_under_inductor() -> None:
    # (out > 0).tolist() and a bool tensor's .item() returned from the step: before this
    # change Inductor failed on the SymBool between the tensor and the returned value
    # ("unsupported operand type(s) for -: 'Equality' and 'Equality'").
    def bools(model, opt, state):
        def body(x, y):
            out, loss = train(model, opt, x, y)
            return (out > 0).tolist(), (loss > 1.0).item(), (out.numpy() > 0).tolist()

        return body

    eager = run(bools, jit=False, calls=1)
    jitted = run(bools, jit=True, backend="inductor", calls=1)
    assert same(jitted[1], eager[1])
    assert type(jitted[1][0][1]) is bool and len(jitted[1][0][0]) == 6


def test_a_loss_history_written_in_place_is_eagers() -> None:
    # hist = np.zeros(n_epochs); hist[epoch] = loss.item() in the step, and a 2-D float32
    # table written with a tensor. Before this change: a TraceError saying the array was
    # indexed with a tensor's value (it was written with one).
    runs = []
    for jit in (False, True):
        model, opt, _ = setup()
        hist, table = np.zeros(6), np.zeros((6, 2), dtype=np.float32)

        def body(i, x, y, model=model, opt=opt, hist=hist, table=table):
            out, loss = train(model, opt, x, y)
            hist[i] = loss.item()
            table[i, 0] = loss.detach()
            table[i, 1] = np.mean(out.numpy().argmax(1) == y.numpy())
            return loss

        if jit:
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        for i, (x, y) in enumerate(data(4)):
            body(i, x, y)
        runs.append((hist, table, getattr(body, "num_traces", None)))
    (hist, table, _), (jit_hist, jit_table, traces) = runs
    assert np.array_equal(jit_hist, hist) and np.array_equal(jit_table, table)
    # The first call's trace, and one with the epoch fed; none per call (its contents change).
    assert np.count_nonzero(hist) == 4 and traces == 2


def test_an_array_the_step_writes_and_reads_is_a_clear_error() -> None:
    model, opt, _ = setup()
    hist = np.zeros(6)

    def body(i, x, y):
        _, loss = train(model, opt, x, y)
        hist[i] = loss.item()
        return hist[: i + 1].mean()  # the trace's values

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(
        functacc.TraceError,
        match=r"NumPy array closure variable 'hist' and indexes it after writing",
    ):
        step(0, *data(1)[0])
    assert not hist.any() and not opt.state


def test_a_counter_array_updated_in_place_is_a_clear_error() -> None:
    # counts[k] += 1 reads the array and writes it: the trace's count would be written at
    # every call. Before this change the write happened only when the step was traced
    # (counts [0, 2, 0] after 5 calls, eager's [0, 5, 0]), silently.
    model, opt, _ = setup()
    counts = np.zeros(3, dtype=np.int64)

    def body(x, y):
        _, loss = train(model, opt, x, y)
        counts[1] += 1
        return loss

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"NumPy array .*counts.* reads it too"):
        step(*data(1)[0])
    assert not counts.any() and not opt.state


def test_plain_writes_into_an_array_are_made_at_every_call() -> None:
    # hist[i] = 0.5 * i: plain values (the index fed once it changes), made after each call
    # as eager makes them (before this change: in the traces only).
    runs = []
    for jit in (False, True):
        model, opt, _ = setup()
        hist = np.zeros(6)

        def body(i, x, y, model=model, opt=opt, hist=hist):
            _, loss = train(model, opt, x, y)
            hist[i] = 0.5 * i + 1.0
            return loss

        if jit:
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        for i, (x, y) in enumerate(data(5)):
            body(i, x, y)
        runs.append(hist)
    assert np.array_equal(runs[1], runs[0]) and np.count_nonzero(runs[0]) == 5


CHANGES = {
    # Each changes an array the step reaches other than by `arr[index] = value` on the
    # variable that holds it. Before 2026-11-28 each change was made only when the step was
    # traced, silently: `state.counts[1] += 1` gave [0, 2, 0] after 5 calls (eager [0, 5, 0]),
    # `arr.fill(arr.sum() + 1)` 56 where eager has 1406.
    "attribute": lambda s: STATE.counts.__setitem__(1, STATE.counts[1] + 1),
    "dict entry": lambda s: TABLES["counts"].fill(1.0),
    "fill": lambda s: s.fill(s.sum() + 1),
    "sort": lambda s: s.sort(),
    "copyto": lambda s: np.copyto(s, np.ones(4)),
    "shuffle": lambda s: np.random.default_rng(0).shuffle(s),
    "through a view": lambda s: s[1:3].__setitem__(0, 7.0),
}
STATE = types.SimpleNamespace(counts=np.zeros(4))
TABLES = {"counts": np.zeros(4)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_array_changed_in_place_otherwise_is_a_clear_error_and_put_back(change: str) -> None:
    model, opt, _ = setup()
    scores = np.array([3.0, 1.0, 2.0, 0.0])
    before = [a.copy() for a in (scores, STATE.counts, TABLES["counts"])]

    def body(x, y):
        _, loss = train(model, opt, x, y)
        CHANGES[change](scores)
        return loss

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"changes NumPy array .* in place.* Fix: "):
        step(*data(1)[0])
    # Nothing lost: the arrays as before the call, the optimizer not stepped.
    after = (scores, STATE.counts, TABLES["counts"])
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    assert not opt.state


class Trainer:
    def __init__(self) -> None:
        self.hist = np.zeros(6)
        self.logs = {"acc": np.zeros(6, dtype=np.float32)}


def test_writes_into_an_attributes_or_a_dicts_array_are_made_at_every_call() -> None:
    # self.hist[i] = loss.item() in a trainer's method: before 2026-11-28 a TraceError
    # (the array "used as a number"), and a plain write was made only at the trace.
    runs = []
    for jit in (False, True):
        model, opt, _ = setup()
        trainer = Trainer()

        def body(i, x, y, model=model, opt=opt, trainer=trainer):
            out, loss = train(model, opt, x, y)
            trainer.hist[i] = loss.item()
            trainer.logs["acc"][i] = np.mean(out.numpy().argmax(1) == y.numpy())
            return loss

        if jit:
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        for i, (x, y) in enumerate(data(4)):
            body(i, x, y)
        runs.append(trainer)
    assert np.count_nonzero(runs[0].hist) == 4
    assert np.array_equal(runs[1].hist, runs[0].hist)
    assert np.array_equal(runs[1].logs["acc"], runs[0].logs["acc"])


def test_a_library_metric_in_a_host_function_matches_eager_and_unwrapped_is_a_clear_error():
    # scikit-learn's accuracy_score imported at module level: following it, the trace
    # reached its thread-local config, and before 2026-11-28 failed with "can't apply this
    # __setattr__ to _thread._local object" (location unknown). Now the clear error, whose
    # advice (functacc.host) gives eager's accuracies.
    runs = {}
    for mode in ("eager", "host", "plain"):
        model, opt, _ = setup()
        accs: list[float] = []

        @functacc.host
        def log_acc(y, pred, accs=accs):
            accs.append(accuracy_score(y, pred))

        def body(x, y, model=model, opt=opt, accs=accs, mode=mode):
            out, loss = train(model, opt, x, y)
            if mode == "plain":
                accs.append(accuracy_score(y.numpy(), out.argmax(1).numpy()))
            else:
                log_acc(y.numpy(), out.argmax(1).numpy())
            return loss

        if mode != "eager":
            body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        if mode == "plain":
            with pytest.raises(functacc.TraceError, match=r"real array.*functacc.host"):
                body(*data(1)[0])
            assert not accs and not opt.state
            continue
        for x, y in data(4):
            body(x, y)
        runs[mode] = accs
    assert runs["host"] == runs["eager"] and len(set(runs["eager"])) > 1
