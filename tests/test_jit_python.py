"""``functacc.jit`` against eager where the step body reads or writes Python state.

Each case is a body that keeps state outside tensors — a closure or global float, an
optimizer's ``param_groups``, a scheduler stepped inside, a seed, a counter on a trainer
object, a dict or list it writes, a ``torch.Generator`` it seeds, ``loss.item()`` — built
twice from the same seed: one copy runs through ``functacc.jit``, the other eagerly, call
by call with the same batches and the same global seed before each call. With
``backend="eager"`` everything is compared bit for bit after every call: the returned
values, every parameter, buffer and ``.grad``, the optimizer's ``state_dict()``, the
global RNG state, and the Python state the case names. Under Inductor the kernels are fused
and reassociated, so tensors and returned floats are compared within rtol 1e-4 / atol 1e-6
(float32 rounding of a few ops per element; a stale learning rate, seed or scale shifts the
loss by percents), and Python integers exactly. Every case gave other numbers than eager,
silently, before functacc followed Python state (47f8e2f).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import types
import warnings
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import minimize, seeded_linear
from test_jit import assert_same, tensors_of
from test_real_code_torchvision import SmoothedValue
from torch import Tensor, nn

import functacc
from functacc import _compat

SCALE = 1.0  # read by the "global" case's body; the loop changes it between calls


@dataclass
class Case:
    body: Callable[..., Any]
    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    state: Callable[[], Any] = lambda: None  # the Python state eager leaves, to compare
    between: Callable[[int], None] = lambda i: None  # what the loop does before call i
    batches: list = field(default_factory=list)
    traces: int | None = 1  # the traces the jitted step may take (None: not checked)


def net(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def data(n: int = 4) -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def standard(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


class Trainer:
    """A plain object holding step state, as trainer classes do."""

    def __init__(self) -> None:
        self.model, self.opt = net()
        self.calls = 0
        self.scale = 1.0


# -- the cases -----------------------------------------------------------------------------
def closure_scale() -> Case:
    model, opt = net()
    scale = 1.0

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * scale
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        nonlocal scale
        scale = 1.0 + 0.5 * i

    return Case(body, [model], [opt], between=between, batches=data(), traces=2)


def global_scale() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * SCALE
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        global SCALE
        SCALE = 1.0 + 0.25 * i

    return Case(body, [model], [opt], between=between, batches=data(), traces=2)


def lr_assigned() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.param_groups[0]["lr"] = 0.05
        return standard(model, opt, x, y)

    lr = lambda: opt.param_groups[0]["lr"]  # noqa: E731
    return Case(body, [model], [opt], state=lr, between=lambda i: _set_lr(opt, 0.1), batches=data())


def _set_lr(opt: torch.optim.Optimizer, value: float) -> None:
    opt.param_groups[0]["lr"] = value


def scheduler_in_body() -> Case:
    model, opt = net()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        sched.step()
        return loss

    state = lambda: (opt.param_groups[0]["lr"], sched.last_epoch, sched.get_last_lr())  # noqa: E731
    return Case(body, [model], [opt], state=state, batches=data())


def lr_read() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * opt.param_groups[0]["lr"]
        loss.backward()
        opt.step()
        return loss

    return Case(body, [model], [opt], between=lambda i: _set_lr(opt, 0.1 * (i + 1)), batches=data())


def seed_in_body() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        torch.manual_seed(0)
        return standard(model, opt, x, y)

    return Case(body, [model], [opt], batches=data())


def counter() -> Case:
    trainer = Trainer()

    def body(x: Tensor, y: Tensor) -> tuple[Tensor, int]:
        trainer.calls += 1
        return standard(trainer.model, trainer.opt, x, y), trainer.calls

    return Case(body, [trainer.model], [trainer.opt], state=lambda: trainer.calls, batches=data())


def attribute_write() -> Case:
    trainer = Trainer()

    def body(x: Tensor, y: Tensor) -> None:
        loss = standard(trainer.model, trainer.opt, x, y)
        trainer.last_loss = loss.detach()
        trainer.last_value = loss.item()
        trainer.label = "trained"

    def state() -> tuple:
        return tuple(vars(trainer).get(k) for k in ("last_loss", "last_value", "label"))

    return Case(body, [trainer.model], [trainer.opt], state=state, batches=data())


def dict_write() -> Case:
    model, opt = net()
    stats: dict[str, Any] = {"n": 0}

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        stats["loss"] = loss.item()
        stats["n"] += 1
        return loss

    return Case(body, [model], [opt], state=lambda: dict(stats), batches=data())


def generator_in_body() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        g = torch.Generator().manual_seed(5)
        return standard(model, opt, x + torch.randn(x.shape, generator=g), y)

    return Case(body, [model], [opt], batches=data())


def item_returned() -> Case:
    model, opt = net()
    return Case(lambda x, y: standard(model, opt, x, y).item(), [model], [opt], batches=data())


def list_append() -> Case:
    model, opt = net()
    history: list[float] = []

    def body(x: Tensor, y: Tensor) -> None:
        history.append(standard(model, opt, x, y).item())

    return Case(body, [model], [opt], state=lambda: list(history), batches=data())


def counter_branch() -> Case:
    trainer = Trainer()

    def body(x: Tensor, y: Tensor) -> Tensor:
        trainer.calls += 1
        loss = standard(trainer.model, trainer.opt, x, y)
        return loss * 2 if trainer.calls % 2 == 0 else loss

    # A branch on the counter: its value is guarded, each new one traces (4 calls, 4 values).
    return Case(
        body,
        [trainer.model],
        [trainer.opt],
        state=lambda: trainer.calls,
        batches=data(),
        traces=None,
    )


def last_lr_returned() -> Case:
    model, opt = net()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

    def body(x: Tensor, y: Tensor) -> tuple[Tensor, float]:
        loss = standard(model, opt, x, y)
        sched.step()
        return loss, sched.get_last_lr()[0]

    return Case(body, [model], [opt], batches=data())


def trainer_method() -> Case:
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import trainer as example

    steps = 50
    t = example.build(steps)
    return Case(
        t.train_step,
        [t.model],
        [t.opt],
        state=lambda: (t.step, t.scheduler.last_epoch, t.opt.param_groups[0]["lr"]),
        batches=example.batches(steps, batch=16),
    )


WEIGHT = 1.0  # read by a helper the "helper_reads_global" case's body calls


def weighted(loss: Tensor) -> Tensor:
    return loss * WEIGHT


def helper_reads_global() -> Case:
    model, opt = net()

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = weighted(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        global WEIGHT
        WEIGHT = 2.0 - 0.5 * i

    return Case(body, [model], [opt], between=between, batches=data(), traces=2)


def attribute_read() -> Case:
    trainer = Trainer()

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt = trainer.opt
        opt.zero_grad()
        loss = F.mse_loss(trainer.model(x), y) * trainer.scale
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        trainer.scale = 1.0 / (i + 1)

    return Case(body, [trainer.model], [trainer.opt], between=between, batches=data(), traces=2)


# Tensors kept in Python state between calls (python_tensors): fed to the graph each call.
class RecurrentTrainer:
    """Truncated backpropagation through time, the hidden state kept on the trainer
    between calls as an (h, c) tuple, detached at each call, reset to None by the loop."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.rnn, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 1)
        self.opt = torch.optim.SGD([*self.rnn.parameters(), *self.head.parameters()], lr=0.1)
        self.hidden: tuple[Tensor, Tensor] | None = None

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        if self.hidden is None:
            self.hidden = (torch.zeros(1, x.shape[0], 8), torch.zeros(1, x.shape[0], 8))
        self.hidden = tuple(h.detach() for h in self.hidden)
        out, self.hidden = self.rnn(x.unsqueeze(1), self.hidden)
        loss = F.mse_loss(self.head(out[:, -1]), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss


def hidden_on_trainer() -> Case:
    t = RecurrentTrainer()

    def between(i: int) -> None:
        if i == 2:  # a new sequence
            t.hidden = None

    # Two signatures: the hidden state None (call 0 and 2) and a tuple of two tensors.
    return Case(
        t.step,
        [t.rnn, t.head],
        [t.opt],
        state=lambda: t.hidden,
        between=between,
        batches=data(),
        traces=2,
    )


class TensorMeter:
    def __init__(self) -> None:
        self.sum, self.count = torch.zeros(()), torch.zeros((), dtype=torch.long)


def tensor_meter() -> Case:
    model, opt = net()
    meter = TensorMeter()
    first, count = meter.sum, meter.count  # eager updates these very tensors in place

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        meter.sum += loss.detach() * x.shape[0]
        meter.count += x.shape[0]
        return meter.sum / meter.count

    state = lambda: (meter.sum, meter.count, meter.sum is first, meter.count is count)  # noqa: E731
    return Case(body, [model], [opt], state=state, batches=data())


def closure_tensors() -> Case:
    model, opt = net()
    mask = torch.ones(8, 1)
    weights = {"target": torch.ones(1)}
    history = [torch.full((1,), 0.5)]

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        error = (model(x) - y * weights["target"]) * mask
        loss = error.pow(2).mean() * history[0]
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        nonlocal mask
        mask[i] = 0.0  # changed in place
        weights["target"] = torch.full((1,), 1.0 + i)  # replaced
        if i == 3:
            mask = torch.zeros(8, 1)  # replaced, same layout

    return Case(body, [model], [opt], between=between, batches=data())


# A training script's globals (CleanRL's): the body reads globals assigned only after jit()
# (``b_obs = obs.reshape(...)`` each iteration), writes one that does not exist yet, and calls
# a logger whose method appends to a list of the script.
SCRIPT = """
def body(x, y):
    global last_loss
    opt.zero_grad()
    loss = F.mse_loss(model(x), y * mask) * scale
    loss.backward()
    opt.step()
    last_loss = loss.item()
    logger.log("loss", last_loss)
    return loss


class Logger:
    def log(self, key, value):
        logged.append((key, value))
"""


def script_globals() -> Case:
    model, opt = net()
    script = {"__name__": "train_script", "F": F, "model": model, "opt": opt, "logged": []}
    exec(SCRIPT, script)
    script["logger"] = script["Logger"]()

    def between(i: int) -> None:
        script["scale"] = 1.0 + 0.5 * i
        script["mask"] = torch.full((8, 1), float(i + 1))

    state = lambda: (script.get("last_loss"), list(script["logged"]))  # noqa: E731
    return Case(script["body"], [model], [opt], state, between, batches=data(), traces=2)


# openai/baselines' logger (improved-diffusion and many RL repos copy it), its state kept on
# a class attribute: `logger.logkv_mean("loss", loss.item())` calls a function of a user
# module, which writes into defaultdicts of the object at `Logger.CURRENT`.
LOGGER = """
from collections import defaultdict

HISTORY = []


class Logger:
    CURRENT = None

    def __init__(self):
        self.name2val = defaultdict(float)
        self.name2cnt = defaultdict(int)

    def logkv(self, key, val):
        self.name2val[key] = val

    def logkv_mean(self, key, val):
        oldval, cnt = self.name2val[key], self.name2cnt[key]
        self.name2val[key] = oldval * cnt / (cnt + 1) + val / (cnt + 1)
        self.name2cnt[key] = cnt + 1

    def dumpkvs(self):
        out = dict(self.name2val)
        self.name2val.clear()
        self.name2cnt.clear()
        return out


def get_current():
    if Logger.CURRENT is None:
        Logger.CURRENT = Logger()
    return Logger.CURRENT


def logkv(key, val):
    get_current().logkv(key, val)


def logkv_mean(key, val):
    get_current().logkv_mean(key, val)
    HISTORY.append(val)
"""


def logger_module() -> types.ModuleType:
    module = types.ModuleType("train_logger")
    exec(LOGGER, module.__dict__)
    return module


def logger_module_case() -> Case:
    model, opt = net()
    logger = logger_module()
    logger.get_current()  # as the script's configure() does, before training
    dumps: list = []

    def body(x: Tensor, y: Tensor) -> None:
        loss = standard(model, opt, x, y)
        logger.logkv_mean("loss", loss.item())
        logger.logkv("scale", float(y.abs().mean()))

    def between(i: int) -> None:
        if i == 2:
            dumps.append(logger.get_current().dumpkvs())

    current = lambda: logger.Logger.CURRENT  # noqa: E731
    state = lambda: (dict(current().name2val), dict(current().name2cnt), logger.HISTORY, dumps)  # noqa: E731
    return Case(body, [model], [opt], state, between, batches=data(), traces=2)


def logger_made_in_step() -> Case:
    # baselines' get_current() makes Logger.CURRENT at the first call, in the step, its
    # defaultdicts holding the traced means: a TraceError before ("make the object before
    # the step's first call"); now made after that call from what the trace left in it,
    # as eager made it, then that one object is the logger (a second trace finds it made).
    model, opt = net()
    logger = logger_module()
    made = []

    def body(x: Tensor, y: Tensor) -> None:
        logger.logkv_mean("loss", standard(model, opt, x, y).item())

    def state() -> tuple:
        current = logger.Logger.CURRENT
        if current is None:  # before the first call
            return (None, logger.HISTORY)
        kinds = (type(current).__name__, type(current.name2val), current.name2val.default_factory)
        return (*kinds, dict(current.name2val), dict(current.name2cnt), logger.HISTORY)

    def between(i: int) -> None:
        made.append(logger.Logger.CURRENT)  # the first call made it; later calls write it
        assert made[0] is None and all(m is made[1] for m in made[1:]), made

    return Case(body, [model], [opt], state, between, batches=data(), traces=2)


class Stats:
    def __init__(self, loss: Tensor):
        self.loss = loss


def meters_made() -> Case:
    # torchvision's MetricLogger: meters a defaultdict makes on first use, a deque window
    # with a maxlen, `assert isinstance(v, float)` of an .item(), and an object made each
    # call. Before: the deque kept the trace's symbols and its appends happened at the
    # trace only (silently), the meter and the object made in the step were TraceErrors,
    # isinstance(loss.item(), float) was False, and a key found absent stayed absent.
    model, opt = net()
    meters: defaultdict = defaultdict(SmoothedValue)
    meters["lr"] = SmoothedValue(3)  # added before the loop, as train_one_epoch does
    trainer = types.SimpleNamespace(stats=None)
    firsts: list = []
    made: list = []

    def body(x: Tensor, y: Tensor) -> None:
        loss = standard(model, opt, x, y)
        value = loss.item()
        assert isinstance(value, float) and isinstance(x.shape[0], int)
        if "loss" not in meters:  # the first call only
            firsts.append(value)
        meters["loss"].update(value, n=x.shape[0])
        meters["lr"].update(opt.param_groups[0]["lr"])
        trainer.stats = Stats(loss.detach())

    def state() -> tuple:
        windows = {k: (list(m.deque), m.deque.maxlen, m.total, m.count) for k, m in meters.items()}
        stats = trainer.stats
        return windows, type(stats), stats and stats.loss, list(firsts)

    def between(i: int) -> None:  # a new Stats each call, as eager makes it
        made.append(trainer.stats)
        assert i < 2 or made[-1] is not made[-2]

    return Case(body, [model], [opt], state, between, batches=data(), traces=2)


def stepper_attributes() -> Case:
    # Attributes the step keeps on its optimizer and scheduler: before, an increment
    # happened at each trace only and a loss.item() stored there stayed the trace's symbol.
    model, opt = net()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt.updates = 0

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        opt.updates += 1
        sched.step()
        sched.last_loss = loss.item()
        return loss

    state = lambda: (  # noqa: E731
        opt.updates,
        getattr(sched, "last_loss", None),
        sched.last_epoch,
        sched.get_last_lr(),
    )
    # Their reads are unseen. One trace: the second call's new state (the gradients the
    # first call left, cleared by zero_grad() before anything read them, and last_loss,
    # written, not read) runs the first call's graph, and so does every call after it.
    return Case(body, [model], [opt], state, batches=data(), traces=1)


Running = collections.namedtuple("Running", "loss steps")


def python_containers() -> Case:
    # A Counter and an OrderedDict (dicts of classes of their own), a namedtuple replaced
    # in a dict, a set read. Before: the Counter's and the OrderedDict's entries kept the
    # trace's symbols and counted only the traces (silently); the namedtuple read was baked
    # in (silently, once it could be written); a set changed between calls was not seen.
    model, opt = net()
    counts: collections.Counter = collections.Counter()
    ordered = collections.OrderedDict(first=0.0)
    running = {"r": Running(0.0, 0)}
    skip = {"nothing"}

    def body(x: Tensor, y: Tensor) -> None:
        value = standard(model, opt, x, y).item()
        counts["steps"] += 1
        counts["loss"] += value
        ordered["first"] += value
        ordered["last"] = value
        r = running["r"]
        running["r"] = r._replace(loss=r.loss + value, steps=r.steps + 1)
        if "count" not in skip:
            counts["kept"] += 1

    def between(i: int) -> None:
        if i == 2:
            skip.add("count")  # changed in place between calls: read afresh

    def state() -> tuple:
        return dict(counts), list(ordered.items()), running["r"], type(running["r"])

    # A namedtuple's numbers are guarded, not fed as a counter's are: each call's new value
    # traces again (4 calls, 4 traces), with eager's values.
    return Case(body, [model], [opt], state, between, batches=data(), traces=4)


def list_items() -> Case:
    # A list's item read by index, changed between calls (was a TraceError saying the step
    # changed the list), and the list grown past it (no retrace: the item is what was read).
    model, opt = net()
    factors = [1.0]

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * factors[0]
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        if i == 1:
            factors.append(5.0)
        if i >= 2:
            factors[0] = 1.0 + i

    return Case(body, [model], [opt], lambda: list(factors), between, data(), traces=2)


class Totals:
    def __init__(self) -> None:
        self.loss, self.correct, self.seen = 0.0, 0, 0


def float_and_int_of_tensors() -> Case:
    # float(loss) and int(...) as eager code writes them (a TraceError before: CPython's
    # float() wants a real float, so a trace could only fix the value).
    model, opt = net()
    totals = Totals()

    def body(x: Tensor, y: Tensor) -> float:
        loss = standard(model, opt, x, y)
        totals.loss += float(loss) * x.shape[0]
        totals.correct += int((model(x) > y).sum())
        totals.seen += int(x.shape[0])  # a plain int: the builtin's
        return float(loss)

    state = lambda: (totals.loss, totals.correct, totals.seen)  # noqa: E731
    return Case(body, [model], [opt], state, batches=data())


class Anchored(nn.Module):
    """Tensors kept in a module's plain lists and dicts (torchvision's AnchorGenerator keeps
    ``cell_anchors`` as a list of tensors), and a list the forward appends to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.cell_anchors = [torch.ones(2), torch.full((2,), 2.0)]
        self.masks = {"shift": torch.full((2,), 0.5)}
        self.seen: list = []

    def forward(self, x: Tensor) -> Tensor:
        anchors = [a.to(x.dtype) for a in self.cell_anchors]
        out = self.fc(x) * anchors[0] + anchors[1] + self.masks["shift"]
        self.seen.append(out.detach().mean())
        return out


def module_containers() -> Case:
    torch.manual_seed(0)
    model = Anchored()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), torch.cat([y, y], 1))
        loss.backward()
        opt.step()
        return loss

    def between(i: int) -> None:
        if i == 2:
            model.cell_anchors[1] = torch.full((2,), 3.0)  # replaced
            model.masks["shift"].fill_(1.0)  # changed in place

    state = lambda: (model.cell_anchors, model.masks, model.seen)  # noqa: E731
    return Case(body, [model], [opt], state, between, batches=data())


class Tempered(nn.Module):
    """A learned temperature kept as a plain tensor attribute, not a Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.log_t = torch.zeros(1, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.log_t.exp()


def optimizer_only_tensors() -> Case:
    """Tensors an optimizer updates that no module owns as a parameter (SAC's
    ``log_alpha = torch.zeros(1, requires_grad=True)``): a closure's, a module attribute."""
    torch.manual_seed(0)
    model, shift = Tempered(), torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([*model.parameters(), model.log_t, shift], lr=0.1)

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x) + shift, y)
        loss.backward()
        opt.step()
        return loss

    state = lambda: (shift, shift.grad, model.log_t, model.log_t.grad)  # noqa: E731
    return Case(body, [model], [opt], state, batches=data())


def rollout_lists() -> Case:
    # An agent's rollout buffer, read as PPO-PyTorch reads it (tests/test_real_code_rl.py):
    # torch's C++ takes the lists (torch.tensor(rewards), torch.stack(states)), a Python
    # loop goes over reversed() of them; the step then empties them. Before 2026-11-28 the
    # rewards were baked into the graph (the first rollout's on every call, silently) and
    # the stacked states were a TraceError.
    model, opt = net()
    buffer = SimpleNamespace(rewards=[], states=[])

    def body(x: Tensor, y: Tensor) -> Tensor:
        returns, running = [], 0.0
        for reward in reversed(buffer.rewards):
            running = reward + 0.9 * running
            returns.insert(0, running)
        weights = torch.tensor(buffer.rewards) + torch.tensor(returns)
        states = torch.stack(buffer.states)
        opt.zero_grad()
        loss = F.mse_loss(model(x + states), y) * weights.mean()
        loss.backward()
        opt.step()
        del buffer.states[:]
        buffer.rewards.clear()
        return loss

    def between(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        buffer.rewards[:] = torch.rand(5, generator=g, dtype=torch.float64).tolist()
        buffer.states[:] = list(torch.randn(8, 4, generator=g).unbind())

    state = lambda: (list(buffer.rewards), list(buffer.states))  # noqa: E731
    # Two traces: the first bakes the rewards in, the second (they changed) feeds them.
    return Case(body, [model], [opt], state=state, between=between, batches=data(), traces=2)


class Counted(nn.Module):
    """A model of the user's that counts its steps (halving its output on every third)
    and keeps a running loss that starts as ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.net, _ = net()
        self.calls = 0
        self.running: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        out = self.net(x)
        return out * 0.5 if self.calls % 3 == 0 else out


def module_counter() -> Case:
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        d = loss.detach()
        model.running = d if model.running is None else 0.9 * model.running + 0.1 * d
        model.calls += 1
        return loss

    state = lambda: (model.calls, model.running)  # noqa: E731
    # Traces: the first writes the counter (then followed), the second has no .grad yet,
    # the third the branch's other side; no trace per count (before 2026-11-28 the counter
    # and the running loss were part of the model's key: a trace on every call).
    return Case(body, [model], [opt], state=state, batches=data(7), traces=None)


class AnnealedDropout(nn.Dropout):
    """A dropout of the user's class whose ``p`` (read in torch's forward) the step sets."""


def dropout_annealed() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), AnnealedDropout(0.0), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: Tensor, y: Tensor) -> Tensor:
        model[1].p = min(0.5, model[1].p + 0.1)  # guarded: one trace per value, eager's masks
        return standard(model, opt, x, y)

    return Case(body, [model], [opt], state=lambda: model[1].p, batches=data(7), traces=None)


CASES = {
    f.__name__: f
    for f in (
        module_counter,
        dropout_annealed,
        rollout_lists,
        script_globals,
        list_items,
        module_containers,
        float_and_int_of_tensors,
        logger_module_case,
        logger_made_in_step,
        meters_made,
        python_containers,
        stepper_attributes,
        optimizer_only_tensors,
        helper_reads_global,
        attribute_read,
        closure_scale,
        global_scale,
        lr_assigned,
        scheduler_in_body,
        lr_read,
        seed_in_body,
        counter,
        attribute_write,
        dict_write,
        generator_in_body,
        item_returned,
        list_append,
        counter_branch,
        last_lr_returned,
        trainer_method,
        hidden_on_trainer,
        tensor_meter,
        closure_tensors,
    )
}


def run_both(
    name: str, backend: str, compare: Callable[[Any, Any, str], None], warm: bool = False
) -> Case:
    global SCALE, WEIGHT
    SCALE = WEIGHT = 1.0
    jitted_case, eager_case = CASES[name](), CASES[name]()
    step = functacc.jit(
        jitted_case.body,
        modules=jitted_case.modules,
        optimizers=jitted_case.optimizers,
        backend=backend,
    )
    if warm:  # traced and compiled ahead: nothing runs, no Python state or RNG moves
        rng, state = torch.get_rng_state(), copy.deepcopy(jitted_case.state())
        tensors = tensors_of(jitted_case.modules, jitted_case.optimizers)
        assert len(step.warmup(jitted_case.batches[:1], progress=False)) == 1
        assert torch.equal(rng, torch.get_rng_state())
        compare(jitted_case.state(), state, "Python state after warmup()")
        assert_same(tensors_of(jitted_case.modules, jitted_case.optimizers), tensors)
    for i, batch in enumerate(jitted_case.batches):
        jitted_case.between(i)
        torch.manual_seed(100 + i)
        got = step(*batch)
        rng = torch.get_rng_state()
        eager_case.between(i)
        torch.manual_seed(100 + i)
        expected = eager_case.body(*batch)
        assert torch.equal(rng, torch.get_rng_state()), f"call {i}: the RNG advanced differently"
        compare(got, expected, f"call {i}: returned")
        compare(jitted_case.state(), eager_case.state(), f"call {i}: Python state")
        compare(
            tensors_of(jitted_case.modules, jitted_case.optimizers),
            tensors_of(eager_case.modules, eager_case.optimizers),
            f"call {i}: modules and optimizers",
        )
    if jitted_case.traces is not None and not warm:
        assert step.num_traces == jitted_case.traces, [t.reason for t in step.traces]
    return jitted_case


def exactly(got: Any, expected: Any, what: str) -> None:
    got, expected = _detached(got), _detached(expected)
    if isinstance(got, dict) and set(got) == set(expected) and any(".grad" in k for k in got):
        assert_same(got, expected)
        return
    assert type(got) is type(expected), (what, got, expected)
    flat_got = torch.utils._pytree.tree_leaves(got)
    flat_expected = torch.utils._pytree.tree_leaves(expected)
    assert len(flat_got) == len(flat_expected), (what, got, expected)
    for a, b in zip(flat_got, flat_expected, strict=True):
        assert type(a) is type(b), (what, a, b)
        assert torch.equal(a, b) if isinstance(a, Tensor) else a == b, (what, a, b)


def closely(got: Any, expected: Any, what: str) -> None:
    flat_got = torch.utils._pytree.tree_leaves(_detached(got))
    flat_expected = torch.utils._pytree.tree_leaves(_detached(expected))
    assert len(flat_got) == len(flat_expected), (what, got, expected)
    for a, b in zip(flat_got, flat_expected, strict=True):
        if isinstance(a, (Tensor, float)) and not isinstance(a, bool):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what}: {m}")
        else:
            assert a == b, (what, a, b)


def _detached(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, tree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_python_state_matches_eager_bit_for_bit(name: str) -> None:
    if name == "generator_in_body" and not _compat.make_fx_traces_generators():
        # torch 2.11 (the GPU machines' torch): a TraceError that says so, tested in
        # test_errors.test_an_own_generator_on_a_torch_that_cannot_trace_it_is_a_clear_error
        pytest.skip(f"torch {torch.__version__}'s make_fx cannot trace a torch.Generator")
    run_both(name, "eager", exactly)


@pytest.mark.parametrize(
    "name",
    [
        "counter",
        "counter_branch",
        "scheduler_in_body",
        "list_append",
        "trainer_method",
        "meters_made",
        "logger_made_in_step",
        "python_containers",
        "stepper_attributes",
    ],
)
def test_warmup_runs_nothing_then_the_calls_match_eager(name: str) -> None:
    run_both(name, "eager", exactly, warm=True)


# Inductor compiles a torch.Generator into its code as a copy (backends.check_generators):
# a generator the body seeds cannot be reset there, which is a clear error, not a difference.
INDUCTOR_REFUSES = {"generator_in_body": "torch.Generator"}


@pytest.mark.inductor
@pytest.mark.parametrize("name", sorted(CASES))
def test_python_state_matches_eager_under_inductor(name: str) -> None:
    if name not in INDUCTOR_REFUSES:
        run_both(name, "inductor", closely)
        return
    case = CASES[name]()
    before = tensors_of(case.modules, case.optimizers)
    rng = torch.get_rng_state()
    step = functacc.jit(case.body, modules=case.modules, optimizers=case.optimizers)
    with pytest.raises(functacc.TraceError, match=INDUCTOR_REFUSES[name]):
        step(*case.batches[0])
    assert_same(tensors_of(case.modules, case.optimizers), before)
    assert torch.equal(torch.get_rng_state(), rng)


# -- what is an error: nothing changed ---------------------------------------------------------
def refused_bodies() -> dict[str, tuple[Callable, type[Exception], str]]:
    trainer = Trainer()
    trainer.seen, trainer.window = {1}, deque([0.5], maxlen=3)
    trainer.losses = [torch.tensor(0.5)]
    model, opt = trainer.model, trainer.opt
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    history: list[float] = [0.0]

    def set_state(x: Tensor, y: Tensor) -> Tensor:
        torch.set_rng_state(torch.get_rng_state())
        return standard(model, opt, x, y)

    def seed_after_draws(x: Tensor, y: Tensor) -> Tensor:
        h = model(x)  # dropout draws
        torch.manual_seed(0)
        return F.mse_loss(h, y)

    def pops(x: Tensor, y: Tensor) -> Tensor:
        history.pop()
        return standard(model, opt, x, y)

    def scheduler_between(x: Tensor, y: Tensor) -> Tensor:
        standard(model, opt, x, y)
        sched.step()
        return standard(model, opt, x, y)

    def computes_with_lr(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        sched.step()
        return loss * sched.get_last_lr()[0]

    def structure(x: Tensor, y: Tensor) -> Tensor:
        opt.param_groups[0]["nesterov"] = True
        return standard(model, opt, x, y)

    def counts_by_length(x: Tensor, y: Tensor) -> None:
        torch.manual_seed(len(history))  # len() read at the trace, where eager reads it anew
        history.append(standard(model, opt, x, y).item())

    def deque_appendleft(x: Tensor, y: Tensor) -> Tensor:
        loss = standard(model, opt, x, y)
        trainer.window.appendleft(loss.item())  # only appends are replayed
        return loss

    def deque_mean(x: Tensor, y: Tensor) -> float:
        trainer.window.append(standard(model, opt, x, y).item())
        return sum(trainer.window) / len(trainer.window)  # read at its trace-time length

    def stacks_what_it_appends(x: Tensor, y: Tensor) -> Tensor:
        # torch.stack reads the list in C++, unseen: before 2026-11-28 the third call
        # stacked the items of the second's length, silently.
        trainer.losses.append(standard(model, opt, x, y).detach())
        return torch.stack(trainer.losses).mean()

    def saves_optimizer(x: Tensor, y: Tensor) -> Tensor:
        # A checkpoint in the step: before 2026-11-28 a KeyError from inside torch.optim.
        loss = standard(model, opt, x, y)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, io.BytesIO())
        return loss

    def saves_scheduler(x: Tensor, y: Tensor) -> Tensor:
        # Before 2026-11-28 its state was saved one step behind eager's, silently (the
        # scheduler's step is replayed after the call).
        loss = standard(model, opt, x, y)
        sched.step()
        torch.save({"model": model.state_dict(), "sched": sched.state_dict()}, io.BytesIO())
        return loss

    def set_add(x: Tensor, y: Tensor) -> Tensor:
        trainer.seen.add(x.shape[0])  # a set: what the step read of it would be fixed
        return standard(model, opt, x, y)

    def seed_from_data(x: Tensor, y: Tensor) -> Tensor:
        torch.manual_seed(int(x.abs().sum().item()))
        return standard(model, opt, x, y)

    return {
        "set_rng_state": (set_state, functacc.TraceError, "set_rng_state"),
        "seed_after_draws": (seed_after_draws, functacc.TraceError, "after it has drawn"),
        "list_pop": (pops, functacc.TraceError, "other than by appending"),
        "scheduler_between": (scheduler_between, functacc.TraceError, "between two steps"),
        "computes_with_lr": (computes_with_lr, functacc.TraceError, "get_last_lr"),
        "structure": (structure, ValueError, "nesterov"),
        "seed_from_data": (seed_from_data, functacc.TraceError, "computed from tensor values"),
        "deque_appendleft": (deque_appendleft, functacc.TraceError, "deque .*window.*appendleft"),
        "deque_mean": (deque_mean, functacc.TraceError, "reads the deque .*window.*appends"),
        "set_add": (set_add, functacc.TraceError, r"changes the set .*seen.*seen\[k\] = True"),
        "saves_optimizer": (saves_optimizer, functacc.TraceError, r"SGD\.state_dict\(\).*after"),
        "saves_scheduler": (saves_scheduler, functacc.TraceError, r"StepLR\.state_dict\(\)"),
        "stacks_appended": (stacks_what_it_appends, functacc.TraceError, "reads the list .*losses"),
        "counts_by_length": (counts_by_length, functacc.TraceError, "keep a counter"),
    }, (trainer, sched, history)


@pytest.mark.parametrize("name", sorted(refused_bodies()[0]))
def test_what_cannot_be_replayed_is_a_clear_error_and_changes_nothing(name: str) -> None:
    bodies, (trainer, sched, history) = refused_bodies()
    body, error, match = bodies[name]
    before = tensors_of([trainer.model], [trainer.opt])
    python = (dict(vars(trainer)), dict(vars(sched)), list(history))
    rng = torch.get_rng_state()
    step = functacc.jit(body, modules=[trainer.model], optimizers=[trainer.opt], backend="eager")
    with pytest.raises(error, match=match):
        step(*data(1)[0])
    assert_same(tensors_of([trainer.model], [trainer.opt]), before)
    assert (dict(vars(trainer)), dict(vars(sched)), list(history)) == python
    assert len(trainer.losses) == 1 and len(trainer.window) == 1
    assert torch.equal(torch.get_rng_state(), rng)


# -- donation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        lambda s: {"a": s["b"] + 1, "b": s["a"]},  # swapped: each output reads the other input
        lambda s: {"a": s["a"] + 1, "b": s["a"]},  # an output that is a donated input as is
        lambda s: {"a": s["a"] * 2, "b": s["a"].view(3)},  # a view of a donated input
        lambda s: {"a": s["b"] - 1, "b": s["b"].view(3) + s["a"]},
    ],
)
def test_donated_outputs_read_every_input_before_writing(body: Callable) -> None:
    def state() -> dict[str, Tensor]:
        return {"a": torch.arange(3.0), "b": torch.full((3,), 10.0)}

    step = functacc.jit(body, donate=(0,), backend="eager")
    s = state()
    for _ in range(3):
        expected = body({k: v.clone() for k, v in s.items()})
        s = step(s)
        assert all(torch.equal(s[k], expected[k]) for k in expected), (s, expected)


def test_a_donated_tensor_others_still_reach_is_refused_before_the_run() -> None:
    step = functacc.jit(lambda s: {"a": s["a"] + 1, "b": s["b"] * 2}, donate=(0,), backend="eager")
    s = {"a": torch.zeros(3), "b": torch.ones(3)}
    view = s["a"][:2]  # alive: the call would overwrite what it shows
    with pytest.raises(ValueError, match=r"donated tensor .* is shared"):
        step(s)
    assert torch.equal(s["a"], torch.zeros(3)) and torch.equal(view, torch.zeros(2))
    del view
    base = torch.zeros(6)
    with pytest.raises(ValueError, match="is a view of another tensor"):
        step({"a": base[:3], "b": torch.ones(3)})
    assert torch.equal(base, torch.zeros(6))
    w = torch.ones(3, requires_grad=True)
    a = w * 2
    kept = a.sin()  # autograd saved a for sin's backward
    with pytest.raises(ValueError, match="autograd holds it"):
        step({"a": a, "b": torch.ones(3)})
    kept.sum().backward()
    assert torch.equal(w.grad, 2 * torch.cos(2 * torch.ones(3)))
    out = step(s)  # nothing else holds it now
    assert torch.equal(out["a"], torch.ones(3))


def test_an_optimizer_missing_from_optimizers_is_a_clear_error_not_lost_steps() -> None:
    # Unlisted, an optimizer's zero_grad() and step() reached the real parameters at the
    # trace: the first call never stepped (their .grad was None, so step() skipped them)
    # and, with step() after the call, the second call traced a body that left .grad None.
    # Both silently. Now jit() refuses the body; listed, it equals eager.
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def body_of(model: nn.Module, opt: torch.optim.Optimizer, step: bool) -> Callable:
        def body(x: Tensor, y: Tensor) -> Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if step:
                opt.step()
            return loss.detach()

        return body

    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    model, opt = make()
    for stepped in (True, False):
        with pytest.raises(ValueError, match=r"holds a SGD .* not in optimizers="):
            functacc.jit(body_of(model, opt, stepped), modules=[model], backend="eager")
    for stepped in (True, False):  # the advice works, step() inside the body or after it
        model, opt = make()
        ref, ref_opt = make()
        step = functacc.jit(
            body_of(model, opt, stepped), modules=[model], optimizers=[opt], backend="eager"
        )
        eager = body_of(ref, ref_opt, stepped)
        for _ in range(3):
            assert torch.equal(step(x, y), eager(x, y))
            if not stepped:
                opt.step(), ref_opt.step()
        assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
        assert step.num_traces == 1


def test_clearing_gradients_through_a_list_taken_before_is_eagers() -> None:
    # A list of the parameters taken before the call: before 2026-11-29 it held the real
    # tensors while traced, so clearing their .grad there was a ValueError (it would have
    # happened once, at the trace). Now the list holds the traced parameters: cleared at
    # every call, as eager's (tests/test_jit_held_tensors.py).
    def run(jit: bool) -> list[Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        params = list(model.parameters())

        def body(x: Tensor, y: Tensor) -> Tensor:
            for p in params:
                p.grad = None
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()

        step = functacc.jit(body, modules=[model], backend="eager") if jit else body
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            step(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


def test_a_scheduler_of_an_optimizer_traced_whole_keeps_its_step_wrapper() -> None:
    # The trace put RMSprop's own step() back by deleting the instance attribute, which
    # also deleted the wrapper an lr_scheduler installs there: torch then warned "Seems
    # like optimizer.step() has been overridden" at the scheduler's first replayed step.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def body(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for _ in range(2):
            step(torch.randn(3, 4))
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def lazy_scheduler_run(jit: bool, lazy: bool) -> list:
    # A trainer that makes its scheduler at the first step (`if self.sched is None:`), or,
    # as the error advises, where the optimizer is made.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = SimpleNamespace(sched=None)

    def make() -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)

    if not lazy:
        trainer.sched = make()

    def body(x: torch.Tensor, y: torch.Tensor) -> list:
        if trainer.sched is None:
            trainer.sched = make()
        loss = F.cross_entropy(model(x), y)
        minimize(opt, loss)
        trainer.sched.step()
        return [loss.detach(), opt.param_groups[0]["lr"]]

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
    g = torch.Generator().manual_seed(1)
    return [
        step(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(5)
    ]


def test_a_scheduler_made_in_the_step_is_a_clear_error_whose_advice_works() -> None:
    # Before 2026-11-30: "AttributeError: 'SGD' object has no attribute 'linked'" (the new
    # scheduler wrapped the optimizer's step as the trace had it).
    with pytest.raises(
        functacc.TraceError, match=r"creates a learning-rate scheduler \(OneCycleLR"
    ):
        lazy_scheduler_run(True, lazy=True)
    got, expected = lazy_scheduler_run(True, lazy=False), lazy_scheduler_run(False, lazy=True)
    for (loss, lr), (ref_loss, ref_lr) in zip(got, expected, strict=True):
        assert torch.equal(loss, ref_loss) and lr == ref_lr


def arguments_run(jit: bool, branch: bool) -> tuple:
    # A step counter, a float and a NumPy warmup table passed in as arguments; the table
    # written into between calls (eager reads it afresh); optionally a branch on the counter.
    import numpy as np

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table = np.linspace(0.1, 1.0, 10)

    def body(x: Tensor, step: int, scale: float, table: Any) -> float:
        opt.param_groups[0]["lr"] = 0.1 * table[step]
        opt.zero_grad()
        loss = model(x).pow(2).mean() * scale * min(1.0, (step + 1) / 4)
        loss.backward()
        opt.step()
        return loss.item() + (1.0 if branch and step % 3 == 0 else 0.0)

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
    out = []
    for i in range(8):
        if i == 5:
            table[6] = 7.0  # eager's next call reads it
        out.append(step(torch.ones(2, 3) * (i + 1), i, 0.5 + i, table))
    return out, model.weight.detach().clone()


@pytest.mark.parametrize("branch", [False, True])
def test_number_arguments_are_fed_once_they_change(
    monkeypatch: pytest.MonkeyPatch, branch: bool
) -> None:
    # Before: a number passed in was a constant of the graph: a trace per new value (about
    # a second each for a small model; identical graphs were not counted by num_traces).
    from functacc.core.engine import Engine

    traces, real = [], Engine.trace
    monkeypatch.setattr(Engine, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    eager, jitted = arguments_run(False, branch), arguments_run(True, branch)
    assert jitted[0] == eager[0]
    assert torch.equal(jitted[1], eager[1])
    if not branch:  # the first call; step and scale fed; the table written into
        assert len(traces) == 3


def test_a_counter_a_module_of_the_users_keeps_costs_no_trace_per_call() -> None:
    case = module_counter()
    step = functacc.jit(
        case.body, modules=case.modules, optimizers=case.optimizers, backend="eager"
    )
    for x, y in case.batches:
        step(x, y)
    assert case.state()[0] == 7
    # Three compiles (see module_counter); before 2026-11-28 every call from the third on
    # traced again (5 reuses), before 2026-11-29 the branch's first side once more, under
    # the fed counter (1; its program is now reused: its conditions hold).
    assert step.num_traces <= 3 and step._engine.engine.reused == 0, [t.reason for t in step.traces]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_two_paths_that_read_different_numbers_alternate_without_tracing_again(
    backend: str,
) -> None:
    # A step that smooths its loss every other call reads state.smooth on one path only.
    # Each trace's new reads (the counter fed, its branch) grow the signature, so before
    # 2026-11-29 the path seen first traced again on its next turn (a host trace with the
    # graph of an earlier one); its program, whose own conditions hold, is now reused.
    def run(jit: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = types.SimpleNamespace(i=0, smooth=0.0)

        def body(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if state.i % 2 == 1:
                state.smooth = 0.9 * state.smooth + 0.1 * loss.item()
            state.i += 1
            return loss.detach()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
        step = step if jit else body
        g = torch.Generator().manual_seed(1)
        losses = [step(torch.randn(4, 3, generator=g)) for _ in range(8)]
        return losses, state, model.weight.detach().clone(), step

    losses, state, weight, step = run(True)
    eager_losses, eager_state, eager_weight, _ = run(False)
    if backend == "eager":  # eager's kernels: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
        assert state == eager_state and torch.equal(weight, eager_weight)
    else:  # Inductor's fused kernels round float32 differently: 8 steps of a linear model
        torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weight, eager_weight, rtol=1e-5, atol=1e-6)
        assert state.i == eager_state.i == 8
        assert state.smooth == pytest.approx(eager_state.smooth, rel=1e-5)
    # the first call; the counter fed (the odd path); the even path under the fed counter
    assert step.num_traces == 3 and step._engine.engine.reused == 0, [t.reason for t in step.traces]


def test_an_optimizer_whose_own_step_is_traced_refuses_its_state_dict_too() -> None:
    model, _ = net()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    before = tensors_of([model], [opt])

    def body(x: Tensor, y: Tensor) -> dict:
        standard(model, opt, x, y)
        return opt.state_dict()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"RMSprop\.state_dict\(\)"):
        step(*data(1)[0])
    assert_same(tensors_of([model], [opt]), before)
    assert set(opt.state_dict()) == {"state", "param_groups"}  # after the call: torch's own


def test_traces_that_reuse_a_compile_are_said(caplog: pytest.LogCaptureFixture) -> None:
    # A value in the signature that the graph does not read (a run label passed in) traced
    # again on every call, silently: num_traces counts compiles, and none was needed.
    model = nn.Linear(3, 1)
    step = functacc.jit(lambda x, label: model(x).sum(), modules=[model], backend="eager")
    with caplog.at_level("INFO", logger="functacc"):
        for i in range(4):
            step(torch.ones(2, 3), f"run{i}")
    again = [r for r in caplog.records if "again" in r.getMessage()]
    assert step.num_traces == 1 and len(again) == 3
    assert again[-1].levelname == "WARNING" and "'run2' -> 'run3'" in again[-1].getMessage()


@pytest.mark.parametrize("change", ["reassigned", "filled"])
def test_a_numpy_array_read_from_a_closure_is_guarded_by_its_contents(
    change: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An RL-style loop keeps the observation in a variable the step converts:
    # `x = torch.tensor(obs)`. A new array in the variable between calls kept the trace's
    # values in the graph (torch.tensor copies), silently; now the array is guarded by its
    # contents like a number: a new one traces again, said with the advice that works.
    def run(jitted: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        obs = np.zeros((4, 3), dtype=np.float32)

        def body() -> float:
            loss = model(torch.tensor(obs)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        losses, source = [], np.random.default_rng(1)
        for _ in range(4):
            new = source.standard_normal((4, 3)).astype(np.float32)
            if change == "filled":
                obs[...] = new
            else:
                obs = new
            losses.append(step() if jitted else body())
        return losses

    with caplog.at_level("INFO", logger="functacc"):
        assert run(True) == run(False)
    said = [
        r.getMessage() for r in caplog.records if "NumPy array (4, 3) float32" in r.getMessage()
    ]
    assert len(said) == 3 and "step(torch.from_numpy(obs))" in said[-1], said
    # The advice: the data passed as a tensor, one trace.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def advised(x: torch.Tensor) -> float:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    step = functacc.jit(advised, modules=[model], optimizers=[opt], backend="eager")
    source = np.random.default_rng(1)
    losses = [
        step(torch.from_numpy(source.standard_normal((4, 3)).astype(np.float32))) for _ in range(4)
    ]
    assert losses == run(False) and step.num_traces == 1


def test_a_tensor_of_the_python_state_updated_in_place_stays_that_tensor() -> None:
    # Eager's `meter.sum += x` updates the tensor itself: a reference taken before sees it,
    # and returning meter.sum returns that object. The fed input is written in place.
    results = []
    for jit in (False, True):
        model, opt = net()
        meter = TensorMeter()
        before = meter.sum

        def body(x: Tensor, y: Tensor, model=model, opt=opt, meter=meter) -> Tensor:
            meter.sum += standard(model, opt, x, y).detach()
            return meter.sum

        step = (
            functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
        )
        returned = [step(*batch) for batch in data(3)]
        assert all(r is before for r in returned) and meter.sum is before
        results.append(before.clone())
    assert torch.equal(*results)


def test_a_tensor_that_requires_grad_in_python_state_is_named_with_advice_that_works() -> None:
    # SAC's temperature kept as a bare tensor, its optimizer not given: eager's backward()
    # reaches it and fills its .grad, which a graph input cannot keep (since 2026-11-29 it
    # is fed, and the gradient the trace computes for it is the error). Both pieces of
    # advice (its optimizer given, or a parameter of a module given) run as eager.
    model, opt = net()
    log_alpha = torch.zeros(1, requires_grad=True)
    alpha_opt = torch.optim.SGD([log_alpha], lr=0.1)

    def body(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y) * log_alpha.exp()
        opt.zero_grad()
        alpha_opt.zero_grad()
        loss.backward()
        opt.step()
        alpha_opt.step()
        return loss

    before = tensors_of([model], [opt])
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(
        functacc.TraceError,
        match=r"(?s)gradient for the tensor at .*'log_alpha'.*optimizers=.*nn\.Parameter",
    ):
        step(*data(1)[0])
    assert_same(tensors_of([model], [opt]), before)

    def advised(seed: int, jit: bool, parameter: bool) -> list[Tensor]:
        model, opt = net(seed)
        if parameter:
            temperature: Any = nn.Module()
            temperature.log_alpha = nn.Parameter(torch.zeros(1))
            modules = [model, temperature]
        else:  # a bare tensor still, on a plain object; alpha_opt given in optimizers=
            temperature = SimpleNamespace(log_alpha=torch.zeros(1, requires_grad=True))
            modules = [model]
        alpha_opt = torch.optim.SGD([temperature.log_alpha], lr=0.1)

        def body(x: Tensor, y: Tensor) -> Tensor:
            loss = F.mse_loss(model(x), y) * temperature.log_alpha.exp()
            opt.zero_grad()
            alpha_opt.zero_grad()
            loss.backward()
            opt.step()
            alpha_opt.step()
            return loss

        opts = [opt, alpha_opt]
        step = (
            functacc.jit(body, modules=modules, optimizers=opts, backend="eager") if jit else body
        )
        for i, batch in enumerate(data(3)):
            torch.manual_seed(i)
            step(*batch)
        return [t.detach().clone() for t in [*model.parameters(), temperature.log_alpha]]

    for parameter in (True, False):
        for a, b in zip(advised(0, True, parameter), advised(0, False, parameter), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(advised(0, True, False)[-1], torch.zeros(1))  # it did train


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_numpy_arrays_made_in_the_step_are_eagers_after_each_call(backend: str) -> None:
    # A loop keeping predictions for metrics computed later (scikit-learn's F1, a confusion
    # matrix): tensor.numpy() in the step failed ("not supported for tensor subclasses",
    # advising to check the inputs); the arrays are now made after each call.
    def run(jit: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        preds: list = []
        labels: list = []
        kept: dict = {}

        def body(x: Tensor, y: Tensor) -> tuple:
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            preds.extend(out.argmax(1).cpu().numpy())  # NumPy scalars, as eager's
            labels.append(y.cpu().numpy())  # an argument's array
            kept["probs"] = out.softmax(1).detach().numpy()
            return loss.item(), out.detach().numpy()

        step = (
            functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
        )
        g = torch.Generator().manual_seed(1)
        returned = [
            step(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(3)
        ]
        assert not jit or step.num_traces == 1
        return returned, preds, labels, kept["probs"]

    (got, preds, labels, probs), (want, preds0, labels0, probs0) = run(True), run(False)
    tol = {} if backend == "eager" else {"rtol": 1e-5, "atol": 1e-6}
    assert [type(p) for p in preds] == [type(p) for p in preds0] and preds == preds0
    assert all(np.array_equal(a, b) for a, b in zip(labels, labels0, strict=True))
    np.testing.assert_allclose(probs, probs0, **tol)
    for (loss, out), (loss0, out0) in zip(got, want, strict=True):
        assert type(out) is type(out0) and out.dtype == out0.dtype
        np.testing.assert_allclose(out, out0, **tol)
        assert loss == pytest.approx(loss0, rel=1e-5) if tol else loss == loss0


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_an_ema_of_many_tensors_kept_in_a_dict_or_list_is_fed_at_once(kind: str) -> None:
    # An EMA kept as {name: tensor} (or a list, as diffusers' EMAModel.shadow_params), 20
    # tensors updated in place in the step. Before 2026-11-28 each tensor took a trace of
    # its own and the 17th failed: "its Python state kept changing shape".
    def run(jit: bool) -> tuple[list[float], list[Tensor], int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kept = {n: p.detach().clone() for n, p in model.named_parameters()}
        ema: Any = kept if kind == "dict" else list(kept.values())

        def body(x: Tensor) -> float:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for i, (n, p) in enumerate(model.named_parameters()):
                    ema[n if kind == "dict" else i].mul_(0.9).add_(p, alpha=0.1)
            return loss.item()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        losses = [(step if jit else body)(torch.full((2, 4), 0.5 * i)) for i in range(3)]
        return losses, list(kept.values()), step.num_traces

    (got, got_ema, traces), (want, want_ema, _) = run(True), run(False)
    assert got == want and traces <= 2
    assert all(torch.equal(a, b) for a, b in zip(got_ema, want_ema, strict=True))


@pytest.mark.inductor
def test_python_floats_the_graph_computes_are_doubles_under_inductor() -> None:
    # Inductor declares a float symbol of its C++ kernels as a 32-bit float: before
    # 2026-11-28 a time stamp kept in the step (state["t"] = now) came back rounded to 128
    # seconds and the differences were 0.0. Eager computes Python floats in double.
    model = nn.Linear(2, 1)
    state = {"t": 1795819255.5602171, "dt": 0.0, "total": 0.0}

    def body(x: Tensor, now: float) -> Tensor:
        state["dt"] = now - state["t"]
        state["t"] = now
        state["total"] += 0.1
        return model(x).sum()

    step = functacc.jit(body, modules=[model], backend="inductor")
    total, previous = 0.0, state["t"]
    for i in range(4):
        now = 1795819255.5602171 + i * 1.25
        step(torch.ones(1, 2), now)
        total += 0.1
        assert (state["t"], state["dt"], state["total"]) == (now, now - previous, total)
        previous = now


@pytest.mark.inductor
def test_an_ema_in_a_dict_and_stream_writes_under_inductor(capsys) -> None:
    # This session's host-side features under Inductor: a 20-tensor EMA in a dict fed at
    # once, sys.stdout.write and tqdm.write of the loss made after each call.
    import sys

    from tqdm import tqdm

    def run(jit: bool) -> tuple[list[float], list[Tensor], list[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}

        def body(x: Tensor) -> float:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    ema[n].mul_(0.9).add_(p, alpha=0.1)
            sys.stdout.write(f"write {loss.item():.6e}\n")
            tqdm.write(f"tqdm {loss.item():.6e}")
            return loss.item()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="inductor")
        capsys.readouterr()
        losses = [(step if jit else body)(torch.full((2, 4), 0.5 * i)) for i in range(3)]
        return losses, list(ema.values()), capsys.readouterr().out.splitlines()

    (got, got_ema, lines), (want, want_ema, want_lines) = run(True), run(False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_ema, want_ema, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [line.split()[0] for line in lines] == [line.split()[0] for line in want_lines]
    assert len(lines) == 6 and [float(line.split()[1]) for line in lines] == pytest.approx(
        [float(line.split()[1]) for line in want_lines], rel=1e-5
    )


def test_a_list_of_tensors_stacked_in_the_step_is_read_whole_at_every_length() -> None:
    # torch.stack(buffer) reads the list in C++: before 2026-11-28 a TraceError, and a list
    # read so kept the first trace's length (a longer one stacked its first items, silently).
    losses = []
    for jit in (True, False):
        model, opt = net()
        buffer: list[Tensor] = []

        def body(y: Tensor, model=model, opt=opt, buffer=buffer) -> Tensor:
            x = torch.stack(buffer)
            opt.zero_grad()
            loss = F.mse_loss(model(x).mean(0), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(body, modules=model, optimizers=opt, backend="eager") if jit else body
        g, run = torch.Generator().manual_seed(0), []
        for n in (3, 3, 4, 5, 5, 3):
            buffer[:] = list(torch.randn(n, 4, generator=g).unbind())
            run.append(step(torch.randn(1, generator=g)))
        losses.append(torch.stack(run))
        if jit:  # one per length (and the first .grad): no more
            assert step.num_traces <= 5, [t.reason for t in step.traces]
    assert torch.equal(losses[0], losses[1])


@pytest.mark.parametrize("how", ["kwargs", "dict", "merge", "copy", "values", "tensor"])
def test_a_config_dict_unpacked_or_copied_in_the_step_is_read_every_call(how: str) -> None:
    # f(**cfg), dict(cfg), {**cfg} and cfg.copy() are read by CPython's own fast path,
    # past the recording dict's methods: before 2026-11-28 the first traces' values were
    # kept, silently (from the third call on). A key added between calls traces again.
    def run(jit: bool) -> Tensor:
        model, opt = net()
        cfg = {"scale": 1.0, "shift": 0.0}

        def loss_fn(out: Tensor, scale: float, shift: float, **extra: float) -> Tensor:
            return (out * scale + shift).pow(2).mean() * extra.get("weight", 1.0)

        def body(x: Tensor) -> Tensor:
            out = model(x)
            if how == "kwargs":
                loss = loss_fn(out, **cfg)
            elif how == "values":
                loss = loss_fn(out, *cfg.values())
            elif how == "tensor":
                loss = loss_fn(out, *torch.tensor(list(cfg.values()))[:2])
            else:
                c = {"dict": dict, "merge": lambda d: {**d}, "copy": dict.copy}[how](cfg)
                loss = loss_fn(out, **c)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(body, modules=model, optimizers=opt, backend="eager") if jit else body
        losses = []
        for i, (x, _) in enumerate(data(5)):
            cfg["scale"], cfg["shift"] = 1.0 + i, 0.5 * i
            if i == 3 and how not in ("tensor", "values"):  # positional: 2 entries
                cfg["weight"] = 2.0
            losses.append(step(x))
        return torch.stack(losses)

    assert torch.equal(run(True), run(False))


@dataclass
class ScaleConfig:
    scale: float = 1.0
    shift: float = 0.0


@pytest.mark.parametrize("how", ["vars", "namespace", "__dict__", "asdict", "copy", "deepcopy"])
def test_a_config_object_read_whole_in_the_step_is_read_every_call(how: str) -> None:
    # hparams = vars(args), cfg.__dict__[...], copy.copy(cfg): read past the recording
    # object's attribute reads. Before 2026-11-28 vars() and __dict__ kept the first traces'
    # values, silently, and copy.copy() was a KeyError.
    def run(jit: bool) -> Tensor:
        model, opt = net()
        cfg = SimpleNamespace(scale=1.0, shift=0.0) if how == "namespace" else ScaleConfig()

        def body(x: Tensor) -> Tensor:
            if how in ("vars", "namespace"):
                h = vars(cfg)
            elif how == "__dict__":
                h = cfg.__dict__
            elif how == "asdict":
                h = dataclasses.asdict(cfg)
            else:
                h = vars(getattr(copy, how)(cfg))
            loss = (model(x) * h["scale"] + h["shift"]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(body, modules=model, optimizers=opt, backend="eager") if jit else body
        losses = []
        for i, (x, _) in enumerate(data(4)):
            cfg.scale, cfg.shift = 1.0 + i, 0.5 * i
            losses.append(step(x))
        return torch.stack(losses)

    assert torch.equal(run(True), run(False))


def test_tensors_read_from_a_deque_are_fed_at_every_call() -> None:
    # Frame stacking (an RL agent's `frames = deque(maxlen=3)`, appended between calls) read
    # by torch's C++ in the step: before 2026-11-28 a TraceError saying the step changed the
    # deque (putting the graph's inputs there was taken for the body's write).
    runs = []
    for jit in (False, True):
        model, opt = seeded_linear(6)
        frames = deque([torch.zeros(1, 2)] * 3, maxlen=3)

        def step(frames=frames, model=model, opt=opt) -> Tensor:
            loss = minimize(opt, model(torch.cat(tuple(frames), dim=1)).pow(2).mean())
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            frames.append(torch.randn(1, 2, generator=g))
            losses.append(step())
        runs.append((torch.stack(losses), getattr(step, "num_traces", 0)))
    assert torch.equal(runs[1][0], runs[0][0]) and runs[1][1] == 1


def test_a_frozen_dataclass_config_is_read_as_in_eager() -> None:
    # A frozen dataclass cannot have its class swapped for recording (FrozenInstanceError,
    # before 2026-11-28 a TraceError "tracing the training step failed"): its numbers are
    # guarded instead, and a config replaced between calls traces again.
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        scale: float = 1.0

    runs = []
    for jit in (False, True):
        model, opt = seeded_linear()
        holder = types.SimpleNamespace(cfg=Config())

        def step(x: Tensor, model=model, opt=opt, holder=holder) -> Tensor:
            loss = minimize(opt, model(x).pow(2).mean() * holder.cfg.scale)
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(4):
            holder.cfg = dataclasses.replace(holder.cfg, scale=1.0 + (i >= 2))
            losses.append(step(torch.randn(4, 3, generator=g)))
        runs.append(torch.stack(losses))
    assert torch.equal(runs[1], runs[0])


class SlottedMeter:
    """A meter of a class with __slots__ (no __dict__)."""

    __slots__ = ("count", "total")

    def __init__(self) -> None:
        self.count, self.total = 0, 0.0


def test_an_object_with_slots_keeps_its_counts_as_in_eager() -> None:
    # Before 2026-11-28 an object without a __dict__ was not followed: meter.count += 1 was
    # made at the traces only (2 after 4 calls), and meter.total kept the trace's loss.
    runs = []
    for jit in (False, True):
        model, opt = seeded_linear()
        meter = SlottedMeter()

        def step(x: Tensor, model=model, opt=opt, meter=meter) -> Tensor:
            loss = minimize(opt, model(x).pow(2).mean())
            meter.count += 1
            meter.total += loss.item()
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            step(torch.randn(4, 3, generator=g))
        runs.append((meter.count, meter.total))
    assert runs[1] == runs[0] and runs[0][0] == 4
