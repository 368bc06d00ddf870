"""Training code as public examples write it, through ``functacc.jit``, against eager.

The patterns here failed before (47f8e2f) with errors whose advice could not work: a
Transformer encoder given a causal mask (torch compares the mask's values with a causal
one), and an actor-critic update whose loss was built before the step (the advice was to
pass the tensor as an argument, which cannot help). ``return loss.item()`` and the
recurrent layers have their own tests (tests/test_jit_python.py, tests/test_recurrent.py).
With ``backend="eager"`` losses and parameters are compared bit for bit.
"""

from __future__ import annotations

import copy
import math
import random
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import functacc
from functacc import _compat


def encoder(seed: int = 0) -> tuple[nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    model = nn.ModuleDict(
        {
            "enc": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            "head": nn.Linear(16, 5),
        }
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def lm_step(model: nn.ModuleDict, opt: torch.optim.Optimizer):
    # pytorch/examples word_language_model's TransformerModel: the mask is an argument.
    def body(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        logits = model["head"](model["enc"](x, mask=mask))
        loss = F.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def test_a_causal_mask_passed_each_step_gives_eagers_numbers() -> None:
    model, opt = encoder()
    ref, ref_opt = copy.deepcopy(model), copy.deepcopy(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    step = functacc.jit(lm_step(model, opt), modules=[model], optimizers=[opt], backend="eager")
    eager = lm_step(ref, ref_opt)
    causal = nn.Transformer.generate_square_subsequent_mask(8)
    padding = torch.zeros(8, 8)
    padding[:, 6:] = float("-inf")  # not causal: torch takes the other branch
    g = torch.Generator().manual_seed(1)
    for i, mask in enumerate([causal, causal, causal.clone(), padding, causal]):
        x, y = torch.randn(4, 8, 16, generator=g), torch.randint(0, 5, (4, 8), generator=g)
        torch.manual_seed(i)
        got = step(x, y, mask)
        torch.manual_seed(i)
        assert torch.equal(got, eager(x, y, mask)), i
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    # One graph per distinct mask value: a clone of the causal mask is the same value.
    assert step.num_traces == 2, [t.reason for t in step.traces]
    assert "batch values" in step.traces[1].reason


def test_a_causal_mask_made_inside_the_step() -> None:
    model, _ = encoder()

    def body(x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return model["enc"](x, mask=mask).sum()

    # Made from the sizes alone, its value is computed at the trace (before 2026-11-28 a
    # TraceError): eager's branch.
    x = torch.randn(2, 8, 16)
    torch.manual_seed(0)  # the same dropout masks
    got = functacc.jit(body, modules=[model], backend="eager")(x)
    torch.manual_seed(0)
    assert torch.equal(got, body(x).detach())

    def from_values(x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(8, 8).masked_fill(x[0, :, :8] > 2, float("-inf"))
        return model["enc"](x, mask=mask).sum()

    with pytest.raises(functacc.TraceError, match="is_causal=True"):
        functacc.jit(from_values, modules=[model], backend="eager")(x)

    def hinted(x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return model["enc"](x, mask=mask, is_causal=True).sum()

    x = torch.randn(2, 8, 16)
    torch.manual_seed(0)
    got = functacc.jit(hinted, modules=[model], backend="eager")(x)
    torch.manual_seed(0)
    assert torch.equal(got, hinted(x).detach())


def test_a_loss_built_before_the_step_gets_advice_that_can_work() -> None:
    # pytorch/examples reinforcement_learning/actor_critic.py: the episode's log-probs are
    # computed while acting, then finish_episode() calls loss.backward() on them.
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    saved_log_probs: list[torch.Tensor] = []
    for _ in range(5):
        probs = torch.softmax(policy(torch.randn(4)), -1)
        saved_log_probs.append(torch.log(probs[torch.multinomial(probs, 1)]))

    def finish_episode(returns: torch.Tensor) -> torch.Tensor:
        loss = (-torch.cat(saved_log_probs) * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    before = [p.clone() for p in policy.parameters()]
    step = functacc.jit(finish_episode, modules=[policy], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError) as raised:
        step(torch.randn(5))
    message = str(raised.value)
    assert "autograd history" in message and "saved_log_probs" in message
    assert (
        "compute it inside the step" in message and "pass the tensor as an argument" not in message
    )
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))

    # What the advice says, done: keep the observations, recompute the log-probs inside.
    def update(states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(policy(states), -1).gather(1, actions[:, None])[:, 0]
        loss = (-log_probs * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    states, actions = torch.randn(5, 4), torch.randint(0, 2, (5,))
    returns = torch.randn(5)
    reference = copy.deepcopy(policy)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    got = functacc.jit(update, modules=[policy], optimizers=[opt], backend="eager")(
        states, actions, returns
    )
    log_probs = torch.log_softmax(reference(states), -1).gather(1, actions[:, None])[:, 0]
    expected = (-log_probs * returns).sum()
    ref_opt.zero_grad()
    expected.backward()
    ref_opt.step()
    assert torch.equal(got, expected.detach())
    assert all(
        torch.equal(a, b) for a, b in zip(policy.parameters(), reference.parameters(), strict=True)
    )


def test_a_branch_on_a_value_names_the_line_and_what_is_fine() -> None:
    model = nn.Linear(4, 1)

    def branchy(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        return loss if loss.item() > 0 else -loss

    with pytest.raises(functacc.TraceError, match=r"returning or storing\s+loss.item\(\) is fine"):
        functacc.jit(branchy, modules=[model], backend="eager")(torch.randn(2, 4))


def test_a_grad_scaler_passed_in_is_a_clear_error_that_leaves_it_as_it_was() -> None:
    # The AMP recipe's loop with the scaler as an argument of the step: functacc.jit moves
    # GradScaler.step's skip into the graph only for a scaler the body holds
    # (test_jit_amp.py). The failed trace must not leave its fake tensors in the scaler (its
    # scale is made at the first scale(), its per-optimizer state filled in place), so the
    # same loop still runs eagerly afterwards with eager's numbers.
    def build() -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

        def body(x: torch.Tensor, y: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return model, opt, scaler, body

    model, opt, scaler, body = build()
    ref_model, ref_opt, ref_scaler, ref_body = build()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"(?s)GradScaler.step\(\).*refer to it by name"):
        step(x, y, scaler)
    assert scaler._scale is None and not scaler._per_optimizer_states
    assert opt.state_dict() == ref_opt.state_dict()
    for _ in range(2):  # eagerly, as if jit had never been tried
        assert torch.equal(body(x, y, scaler), ref_body(x, y, ref_scaler))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler.get_scale() == ref_scaler.get_scale()


class MoCoQueue(nn.Module):
    """facebookresearch/moco's moco/builder.py on one process: the key encoder follows the
    query encoder by momentum and the keys of each batch replace the oldest in a queue."""

    def __init__(self, position_as_number: bool, size: int = 12, m: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.size, self.m, self.position_as_number = size, m, position_as_number
        self.encoder_q = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(4, size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        n = keys.shape[0]
        if self.position_as_number:  # as moco writes it
            ptr = int(self.queue_ptr)
            self.queue[:, ptr : ptr + n] = keys.T
            self.queue_ptr[0] = (ptr + n) % self.size
        else:  # what functacc's error advises: the position stays a tensor
            self.queue[:, (self.queue_ptr + torch.arange(n)) % self.size] = keys.T
            self.queue_ptr.add_(n).remainder_(self.size)

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            for param_q, param_k in zip(
                self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True
            ):
                param_k.mul_(self.m).add_(param_q.mul(1.0 - self.m))
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / 0.07
        self._dequeue_and_enqueue(k)
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def moco_step(model: MoCoQueue, opt: torch.optim.Optimizer):
    def body(im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        loss = model(im_q, im_k)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return body


# main_moco.py's train(): the step in a script of its own, MoCo's model in builder.py (here
# this module), whose `int(self.queue_ptr)` is then outside the body's module.
MAIN_MOCO = """
def train_step(im_q, im_k):
    loss = model(im_q, im_k)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()
"""


@pytest.mark.parametrize("as_number", [True, False], ids=["int(queue_ptr)", "tensor position"])
def test_mocos_queue_position_read_as_a_number_runs_as_in_eager(as_number: bool) -> None:
    # `ptr = int(self.queue_ptr)`, then `self.queue[:, ptr : ptr + n] = keys.T`: the int() of
    # a tensor is its .item() now, a slice the graph computes; it was a TraceError advising
    # to keep the position a tensor (that form: the other case). Over the queue's wrap.
    model = MoCoQueue(position_as_number=as_number)
    ref = MoCoQueue(position_as_number=True)  # eager runs moco's own code
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    script = {"__name__": "main_moco", "model": model, "optimizer": opt}
    exec(MAIN_MOCO, script)
    step = functacc.jit(script["train_step"], modules=[model], optimizers=[opt], backend="eager")
    eager = moco_step(ref, ref_opt)
    g = torch.Generator().manual_seed(1)
    if as_number and not _compat.make_fx_slices_by_item():
        # torch 2.11 cannot trace the slice: a TraceError whose advice is the other case's
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(functacc.TraceError, match=r"\(ptr \+ torch.arange\(n\)\) % size"):
            step(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
        after = model.state_dict().values()
        assert all(torch.equal(a, b) for a, b in zip(before.values(), after, strict=True))
        return
    for i in range(5):
        im_q, im_k = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        assert torch.equal(step(im_q, im_k), eager(im_q, im_k)), i
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert int(model.queue_ptr) == 20 % 12 and step.num_traces == 1


def nanogpt_lr(it: int, warmup: int = 3, decay_iters: int = 10) -> float:
    # karpathy/nanoGPT train.py's get_lr: linear warmup, then cosine decay to min_lr.
    if it < warmup:
        return 1e-3 * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return 1e-4
    ratio = (it - warmup) / (decay_iters - warmup)
    return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)


def nanogpt_run(jit: bool, steps: int, backend: str = "eager") -> tuple:
    # nanoGPT's loop body: the learning rate of the iteration set in every param group,
    # gradient accumulation, clipping, AdamW, the iteration counter advanced in the step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    run = {"iter_num": 0}

    def body(x: torch.Tensor, y: torch.Tensor) -> float:
        lr = nanogpt_lr(run["iter_num"])
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(x.shape[0]):
            loss = F.cross_entropy(model(x[micro]).view(-1, 50), y[micro].view(-1)) / x.shape[0]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run["iter_num"] += 1
        return loss.item() * x.shape[0]

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
    g = torch.Generator().manual_seed(2)
    losses = [
        step(
            torch.randint(0, 50, (2, 4, 8), generator=g),
            torch.randint(0, 50, (2, 4, 8), generator=g),
        )
        for _ in range(steps)
    ]
    return losses, list(model.parameters()), run, step


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_cosine_schedule_of_the_step_counter_is_computed_not_retraced(backend: str) -> None:
    # math.cos of the fed counter used to fix the counter's value in the graph: one trace
    # per step through the whole decay (9 traces in 14 steps here). Now math's functions
    # compute with the counter's symbol: traces at the first call and at each branch of
    # get_lr that turns (it < warmup, it > decay_iters).
    steps = 14 if backend == "eager" else 6
    losses, params, run, step = nanogpt_run(True, steps, backend)
    ref_losses, ref_params, ref_run, _ = nanogpt_run(False, steps)
    assert run == ref_run
    if backend == "eager":  # the FX interpreter runs eager's kernels: bit for bit
        assert losses == ref_losses
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))
        assert step.num_traces == 3, [t.reason for t in step.traces]
    else:  # Inductor's fused kernels round differently (float32; 6 steps)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert step.num_traces == 2, [t.reason for t in step.traces]


def swa_run(jit: bool, average_inside: bool) -> tuple:
    # torch.optim.swa_utils as its docs' example writes the loop: a cosine schedule first,
    # then the weights averaged and SWALR stepped after each update.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    swa_model = torch.optim.swa_utils.AveragedModel(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2)
    run = {"epoch": 0}

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if run["epoch"] >= 3:
            if average_inside:
                swa_model.update_parameters(model)
            swa_sched.step()
        else:
            sched.step()
        run["epoch"] += 1
        return loss.detach()

    modules = [model, swa_model] if average_inside else [model]
    step = functacc.jit(body, modules=modules, optimizers=[opt], backend="eager") if jit else body
    return step, model, swa_model, opt


def test_averaged_model_updated_in_the_step_runs_as_in_eager() -> None:
    # AveragedModel.update_parameters branches on n_averaged (copy the first time, average
    # after): a TraceError before, advising to average outside the step. Now a selection in
    # the graph (core/averaged_model.py): eager's numbers, no retrace as n_averaged grows.
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)) for _ in range(7)]
    step, model, swa_model, opt = swa_run(jit=True, average_inside=True)
    eager, ref_model, ref_swa, ref_opt = swa_run(jit=False, average_inside=True)
    outside, out_model, out_swa, _ = swa_run(jit=True, average_inside=False)
    for i, (x, y) in enumerate(batches):
        loss = eager(x, y)
        assert torch.equal(step(x, y), loss) and torch.equal(outside(x, y), loss), i
        if i >= 3:  # the advice given before: average after the call
            out_swa.update_parameters(out_model)
        assert torch.equal(swa_model.n_averaged, ref_swa.n_averaged), i
        averages = (m.parameters() for m in (swa_model, ref_swa, out_swa))
        for p, q, r in zip(*averages, strict=True):
            assert torch.equal(p, q) and torch.equal(r, q), i
    assert (
        int(swa_model.n_averaged) == 4
        and opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    )
    weights = (m.parameters() for m in (model, ref_model))
    assert all(torch.equal(p, q) for p, q in zip(*weights, strict=True))
    assert step.num_traces == 2  # the epoch's branch (schedule, then averaging), not n_averaged


def test_reduce_lr_on_plateau_stepped_with_the_loss_in_the_step_runs_as_in_eager() -> None:
    def build(jit: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step(loss.detach())  # float(metrics): the graph's loss, on the host
            return loss.detach()

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        return (step if jit else body), opt, sched

    step, opt, sched = build(True)
    eager, ref_opt, ref_sched = build(False)
    g = torch.Generator().manual_seed(0)
    lrs = []
    for i in range(8):
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        assert torch.equal(step(x, y), eager(x, y)), i
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], i
        assert (sched.best, sched.num_bad_epochs) == (ref_sched.best, ref_sched.num_bad_epochs)
        lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs)) > 2 and step.num_traces == 1  # the plateau lowered it, no retrace


class MinGPTTrainer:
    """karpathy/minGPT's mingpt/trainer.py run loop, one iteration as a method: the loss
    kept on the trainer, callbacks, clipping, the iteration counter and its timing."""

    def __init__(self, model: nn.Module, timed_inside: bool) -> None:
        self.model, self.timed_inside = model, timed_inside
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.iter_num, self.iter_time, self.iter_dt = 0, time.time(), 0.0
        self.callbacks = [lambda t: t.losses.append(t.loss.item()) if t.iter_num % 2 == 0 else None]
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.loss = F.cross_entropy(self.model(x), y)
        self.model.zero_grad(set_to_none=True)
        self.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        for callback in self.callbacks:
            callback(self)
        self.iter_num += 1
        if self.timed_inside:
            tnow = time.time()
            self.iter_dt = tnow - self.iter_time
            self.iter_time = tnow


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_clock_read_in_the_step_is_this_calls_time(backend: str) -> None:
    # Before, the trace's time was replayed: iter_time went back and iter_dt was negative;
    # then (2026-11-26) a RuntimeError advising to time around the call. Since 2026-11-28
    # each read is a number fed to the graph, read on the host when the call starts.
    torch.manual_seed(0)
    trainer = MinGPTTrainer(nn.Linear(4, 3), timed_inside=True)
    torch.manual_seed(0)
    reference = MinGPTTrainer(nn.Linear(4, 3), timed_inside=True)
    step = functacc.jit(
        trainer.step, modules=[trainer.model], optimizers=[trainer.optimizer], backend=backend
    )
    g = torch.Generator().manual_seed(1)
    stamps = []
    for _ in range(5):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        time.sleep(0.01)
        before = time.time()
        step(x, y)
        assert before <= trainer.iter_time <= time.time() and trainer.iter_dt >= 0.01
        stamps.append(trainer.iter_time)
        reference.step(x, y)
    assert stamps == sorted(stamps) and isinstance(trainer.iter_time, float)
    assert trainer.iter_num == reference.iter_num == 5 and step.num_traces <= 2  # iter_num % 2
    tol = {"rtol": 0, "atol": 0} if backend == "eager" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(trainer.losses, reference.losses, **tol)
    for p, q in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **tol)


def test_a_time_stamp_read_in_the_step_is_a_clear_error_and_a_given_time_is_fine() -> None:
    # pytorch/examples fast_neural_style logs "{time.ctime()}\tEpoch ..." in its loop: the
    # trace's time stamp would have been printed on every call.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.localtime(0)

    def body(x: torch.Tensor, stamp_now: bool) -> str:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        given = time.strftime("%Y", start)  # formats the time it is given: no clock read
        stamp = time.ctime() if stamp_now else given
        return "{}\t{}: {:.6f}".format(stamp, given, loss.item())  # noqa: UP032 (as it logs)

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"reads the clock \(time.ctime\(\) at .*test_real_code"):
        step(torch.randn(4, 3), True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert step(torch.randn(4, 3), False).startswith("1970\t1970: ")


def timm_run(jit: bool) -> tuple:
    # timm's train.py train_one_epoch, its pieces as timm builds them: create_optimizer_v2,
    # NativeScaler (a GradScaler kept as `_scaler`, with clipping), ModelEmaV3 with warmup.
    timm = pytest.importorskip("timm")
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3, NativeScaler

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=5, pretrained=False)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    model_ema = ModelEmaV3(model, decay=0.99, use_warmup=True)
    loss_scaler = NativeScaler(device="cpu")
    criterion = LabelSmoothingCrossEntropy(0.1)
    run = {"num_updates": 0}

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
        run["num_updates"] += 1
        model_ema.update(model, step=run["num_updates"])
        return loss.detach()

    modules = [model, model_ema]
    step = functacc.jit(body, modules=modules, optimizers=[optimizer], backend="eager")
    return (step if jit else body), model, model_ema, loss_scaler._scaler


def test_timms_native_scaler_and_model_ema_run_as_in_eager() -> None:
    # Before, the GradScaler inside timm's NativeScaler was not found: a TraceError.
    step, model, ema, scaler = timm_run(jit=True)
    eager, ref, ref_ema, ref_scaler = timm_run(jit=False)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)
        if i == 2:  # a scale that overflows the gradients: the update is skipped
            scaler._scale.fill_(2.0**127)
            ref_scaler._scale.fill_(2.0**127)
        before = [p.clone() for p in model.parameters()]
        assert torch.equal(step(x, y), eager(x, y)), i
        if i == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert scaler.get_scale() == ref_scaler.get_scale(), i
        for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b), i
        for a, b in zip(ema.state_dict().values(), ref_ema.state_dict().values(), strict=True):
            assert torch.equal(a, b), i
    # Halved at each overflow, as eager's: 2**127 overflows; whether 2**126 does too depends
    # on the machine's bf16 kernels (it does on AMD EPYC, not on a Xeon with AMX).
    assert scaler.get_scale() in (2.0**125, 2.0**126) and step.num_traces == 2


def best_loss_run(jit: bool, backend: str = "eager") -> tuple:
    # A trainer's running numbers, as loops keep them: an EMA of the loss, the best loss so
    # far with min(), a rounded history.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = types.SimpleNamespace(ema=0.0, best=float("inf"), history=[])

    def body(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        stats.ema = 0.9 * stats.ema + 0.1 * loss.item()
        stats.best = min(stats.best, loss.item())
        stats.history.append(round(loss.item(), 3))
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        step(torch.randn(4, 3, generator=g))
    return stats, step


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_min_and_max_of_the_loss_kept_in_python_are_computed_not_a_branch(backend: str) -> None:
    # min(best, loss.item()) was a TraceError (a branch on the loss): min and max in the
    # body's module compute with the symbol, as math's functions do.
    stats, step = best_loss_run(True, backend)
    ref, _ = best_loss_run(False)
    if backend == "eager":
        assert vars(stats) == vars(ref)
    else:  # Inductor's kernels may round the loss in the last bits
        assert stats.best == pytest.approx(ref.best, rel=1e-5)
        assert stats.ema == pytest.approx(ref.ema, rel=1e-5)
        assert stats.history == pytest.approx(ref.history, abs=1e-3)
    assert stats.best < stats.history[0] and step.num_traces == 1


def dcgan(jit: bool, capsys: pytest.CaptureFixture) -> tuple[str, list[torch.Tensor], int]:
    # pytorch/examples dcgan/main.py's loop body (smaller networks): two Adam optimizers,
    # the label tensor refilled in place, D(x) read with .item() between the backward
    # passes, and the losses printed with '%' formats.
    torch.manual_seed(0)
    net_g = nn.Sequential(
        nn.ConvTranspose2d(8, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip
    net_d = nn.Sequential(
        nn.Conv2d(1, 8, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(8, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0),
    )  # fmt: skip
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    criterion, real_label, fake_label = nn.BCELoss(), 1, 0

    def train(real_cpu: torch.Tensor, epoch: int, i: int, n: int) -> None:
        net_d.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = net_d(real_cpu)
        err_d_real = criterion(output, label)
        err_d_real.backward()
        d_x = output.mean().item()
        noise = torch.randn(batch_size, 8, 1, 1)
        fake = net_g(noise)
        label.fill_(fake_label)
        output = net_d(fake.detach())
        err_d_fake = criterion(output, label)
        err_d_fake.backward()
        d_g_z1 = output.mean().item()
        err_d = err_d_real + err_d_fake
        opt_d.step()
        net_g.zero_grad()
        label.fill_(real_label)
        output = net_d(fake)
        err_g = criterion(output, label)
        err_g.backward()
        d_g_z2 = output.mean().item()
        opt_g.step()
        print(
            "[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"  # noqa: UP031
            % (epoch, 2, i, n, err_d.item(), err_g.item(), d_x, d_g_z1, d_g_z2)
        )

    step = functacc.jit(train, modules=[net_g, net_d], optimizers=[opt_d, opt_g], backend="eager")
    data = [torch.randn(4, 1, 8, 8).clamp(-1, 1) for _ in range(3)]
    torch.manual_seed(1)
    capsys.readouterr()
    for epoch in range(2):
        for i, real in enumerate(data):
            (step if jit else train)(real, epoch, i, len(data))
    tensors = [*net_g.state_dict().values(), *net_d.state_dict().values()]
    return capsys.readouterr().out, tensors, step.num_traces


def test_pytorch_examples_dcgan_prints_and_trains_as_in_eager(capsys, monkeypatch) -> None:
    eager, traces = dcgan(False, capsys), count_traces(monkeypatch)
    jitted = dcgan(True, capsys)
    assert jitted[0] == eager[0] and eager[0].count("Loss_D: ") == 6
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    # i fed from the second call, epoch from the fourth (a trace per call before)
    assert len(traces) == jitted[2] == 3


class Sequence(nn.Module):
    """pytorch/examples time_sequence_prediction's model (smaller): two LSTM cells unrolled
    over the sequence, in double."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, 8), nn.LSTMCell(8, 8), nn.Linear(8, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        h_t, c_t, h_t2, c_t2 = (torch.zeros(input.size(0), 8, dtype=torch.double) for _ in "1234")
        outputs = []
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


def test_lbfgs_refused_with_advice_that_gives_eagers_time_sequence_prediction(capsys) -> None:
    data = torch.sin(torch.arange(60, dtype=torch.double).view(5, 12) / 3)
    input, target, criterion = data[:, :-1], data[:, 1:], nn.MSELoss()

    def run(jit: bool) -> tuple[str, list[torch.Tensor], int]:
        torch.manual_seed(0)
        seq = Sequence().double()
        optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)

        def closure(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            seq.zero_grad()  # the advice: the model's zero_grad, the batch as arguments
            loss = criterion(seq(input), target)
            print("loss:", loss.item())
            loss.backward()
            return loss

        run_closure = functacc.jit(closure, modules=[seq], backend="eager") if jit else closure
        capsys.readouterr()
        for i in range(3):
            print("STEP: ", i)
            optimizer.step(lambda: run_closure(input, target))
        traces = run_closure.num_traces if jit else 0
        return capsys.readouterr().out, [p.detach().clone() for p in seq.parameters()], traces

    eager, jitted = run(False), run(True)
    assert jitted[0] == eager[0] and eager[0].count("loss:") > 10  # the line search's calls
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    assert jitted[2] == 1

    # As the example writes it (opt.zero_grad() in the closure): both ways of jitting it
    # are errors that give the advice above.
    seq = Sequence().double()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)

    def example_closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = criterion(seq(input), target)
        loss.backward()
        return loss

    advice = r"model.zero_grad\(\).*opt.step\(lambda: closure\(x, y\)\)"
    with pytest.raises(TypeError, match=r"LBFGS.*line search.*" + advice):
        functacc.jit(example_closure, modules=[seq], optimizers=[optimizer])
    with pytest.raises(ValueError, match=r"holds a torch.optim.LBFGS.*" + advice):
        functacc.jit(example_closure, modules=[seq])


def gram_matrix(y: torch.Tensor) -> torch.Tensor:
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch: torch.Tensor) -> torch.Tensor:
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


def style_transfer_run(jit: str, capsys: pytest.CaptureFixture) -> tuple:
    # pytorch/examples fast_neural_style's train loop (smaller networks): a frozen VGG
    # returning a namedtuple, the style's Gram matrices computed once before the loop,
    # in-place normalization, losses summed in Python, a log line every other batch.
    torch.manual_seed(0)
    transformer = nn.Sequential(
        nn.ReflectionPad2d(1), nn.Conv2d(3, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.ReLU(),
        nn.ReflectionPad2d(1), nn.Conv2d(3, 3, 3),
    )  # fmt: skip
    vgg = nn.ModuleDict({"slice1": nn.Conv2d(3, 4, 3, padding=1), "slice2": nn.Conv2d(4, 4, 3)})
    vgg.requires_grad_(False)
    outputs = types.SimpleNamespace  # stands in for the example's namedtuple

    def features(x: torch.Tensor) -> types.SimpleNamespace:
        h1 = F.relu(vgg["slice1"](x))
        return outputs(relu1_2=h1, relu2_2=F.relu(vgg["slice2"](h1)))

    optimizer = torch.optim.Adam(transformer.parameters(), 1e-3)
    style = features(normalize_batch(torch.rand(2, 3, 8, 8) * 255))
    gram_style = [gram_matrix(y) for y in (style.relu1_2, style.relu2_2)]
    agg = {"content": 0.0, "style": 0.0, "count": 0}

    def train(batch_id: int, x: torch.Tensor, gram_style: list[torch.Tensor]) -> None:
        n_batch = len(x)
        agg["count"] += n_batch
        optimizer.zero_grad()
        y = normalize_batch(transformer(x))
        x = normalize_batch(x)
        features_y, features_x = features(y), features(x)
        content_loss = 1e5 * F.mse_loss(features_y.relu2_2, features_x.relu2_2)
        style_loss = 0.0
        for ft_y, gm_s in zip((features_y.relu1_2, features_y.relu2_2), gram_style, strict=True):
            style_loss += F.mse_loss(gram_matrix(ft_y), gm_s[:n_batch, :, :])
        style_loss *= 1e10
        (content_loss + style_loss).backward()
        optimizer.step()
        agg["content"] += content_loss.item()
        agg["style"] += style_loss.item()
        if (batch_id + 1) % 2 == 0:
            print(
                "[{}]\tcontent: {:.6f}\tstyle: {:.6f}".format(
                    agg["count"], agg["content"] / (batch_id + 1), agg["style"] / (batch_id + 1)
                )
            )

    modules = [transformer] if jit == "transformer only" else [transformer, vgg]
    step = (
        train
        if not jit
        else functacc.jit(train, modules=modules, optimizers=[optimizer], backend="eager")
    )
    data = [torch.rand(2, 3, 8, 8) * 255 for _ in range(4)]
    capsys.readouterr()
    for batch_id, x in enumerate(data):
        step(batch_id, x, gram_style)
    return capsys.readouterr().out, [p.detach().clone() for p in transformer.parameters()], agg


def test_fast_neural_style_with_its_frozen_vgg_given_trains_as_in_eager(capsys) -> None:
    eager = style_transfer_run("", capsys)
    # The frozen VGG not given: the error names what to do (it named the input's grad_fn,
    # "computed before the call", whose advice could not work).
    with pytest.raises(functacc.TraceError, match=r"(?s)none of its inputs.*modules=\(\.\.\.\)"):
        style_transfer_run("transformer only", capsys)
    jitted = style_transfer_run("all", capsys)
    assert jitted[0] == eager[0] and eager[0].count("content: ") == 2
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    assert jitted[2] == eager[2]


class AverageMeter:
    """pytorch/examples imagenet/main.py's meter (its summary left out)."""

    def __init__(self, name: str, fmt: str = ":f") -> None:
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
        return fmtstr.format(**self.__dict__)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [
            correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0))
            for k in topk
        ]


def imagenet_run(jit: bool, capsys: pytest.CaptureFixture, as_number: bool) -> tuple:
    # pytorch/examples imagenet/main.py's train loop, its meters and progress line (the
    # clock meters left out: a clock read in the step is an error, tested above).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    losses = AverageMeter("Loss", ":.4e")
    top1, top5 = AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")

    def train(i: int, images: torch.Tensor, target: torch.Tensor) -> None:
        output = model(images)
        loss = F.cross_entropy(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0].item() if as_number else acc1[0], images.size(0))
        top5.update(acc5[0].item() if as_number else acc5[0], images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 2 == 0:
            print("\t".join([f"Epoch: [0][{i + 1}/6]", str(losses), str(top1), str(top5)]))

    step = functacc.jit(train, modules=[model], optimizers=[optimizer], backend="eager")
    g = torch.Generator().manual_seed(1)
    capsys.readouterr()
    for i in range(6):
        images, target = torch.randn(8, 3, 4, generator=g), torch.randint(0, 10, (8,), generator=g)
        (step if jit else train)(i, images, target)
    meters = [(m.val, m.sum, m.count, m.avg) for m in (losses, top1, top5)]
    return capsys.readouterr().out, [p.detach().clone() for p in model.parameters()], meters


@pytest.mark.parametrize("as_number", [True, False], ids=["item", "as_written"])
def test_imagenet_meters_run_as_in_eager(capsys, as_number: bool) -> None:
    # As written, the example's meters keep the accuracy tensor (top1.update(acc1[0], n)):
    # their running sums are tensors between calls, fed to the graph (a number at the first
    # call, a tensor from the second). With .item(), numbers fed and written back.
    eager = imagenet_run(False, capsys, as_number)
    jitted = imagenet_run(True, capsys, as_number)
    assert jitted[0] == eager[0] and eager[0].count("Acc@5") == 3
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    flat = [v for meter in eager[2] for v in meter]
    assert as_number or any(isinstance(v, torch.Tensor) for v in flat)  # the case it claims
    for got, want in zip([v for m in jitted[2] for v in m], flat, strict=True):
        assert type(got) is type(want)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


def cosine_scheduler(base: float, final: float, epochs: int, per_epoch: int, warmup: int = 0):
    """facebookresearch/dino's utils.cosine_scheduler: the schedule as a NumPy array."""
    warmup_schedule = np.linspace(0, base, warmup * per_epoch) if warmup else np.array([])
    iters = np.arange(epochs * per_epoch - warmup * per_epoch)
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup_schedule, schedule))


def dino_run(jit: bool) -> tuple:
    # facebookresearch/dino's train_one_epoch, its Python: the global iteration `it` as an
    # argument, NumPy schedules indexed by it (lr, weight decay, teacher momentum), the last
    # layer's gradients cancelled in the first epoch, the teacher an EMA of the student.
    torch.manual_seed(0)
    student = nn.ModuleDict({"body": nn.Linear(4, 8), "last_layer": nn.Linear(8, 3)})
    teacher = copy.deepcopy(student).requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters())
    lr_schedule = cosine_scheduler(5e-4, 1e-6, 2, 4, warmup=1)
    wd_schedule = cosine_scheduler(0.04, 0.4, 2, 4)
    momentum_schedule = cosine_scheduler(0.996, 1, 2, 4)

    def forward(m: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        return m["last_layer"](F.gelu(m["body"](x)))

    def train_one(images: torch.Tensor, it: int, epoch: int) -> float:
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
        teacher_output = forward(teacher, images[:2]).softmax(-1)
        loss = -(teacher_output.repeat(2, 1) * forward(student, images).log_softmax(-1)).sum(-1)
        loss = loss.mean()
        optimizer.zero_grad()
        loss.backward()
        if epoch < 1:  # utils.cancel_gradients_last_layer
            for n, p in student.named_parameters():
                if "last_layer" in n:
                    p.grad = None
        optimizer.step()
        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters(), strict=True):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        return loss.item()

    modules, optimizers = [student, teacher], [optimizer]
    step = functacc.jit(train_one, modules=modules, optimizers=optimizers, backend="eager")
    losses = []
    g = torch.Generator().manual_seed(1)
    for epoch in range(2):
        for i in range(4):
            images = torch.randn(4, 4, generator=g)
            losses.append((step if jit else train_one)(images, 4 * epoch + i, epoch))
    tensors = [*student.parameters(), *teacher.parameters()]
    return losses, [t.detach().clone() for t in tensors], optimizer.param_groups[0]["lr"]


def count_traces(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every trace of a jitted body, a graph compiled or not (one identical to a compiled
    one is reused, and ``num_traces`` does not count it)."""
    from functacc.core.engine import Engine

    traces, real = [], Engine.trace
    monkeypatch.setattr(Engine, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    return traces


def test_dinos_numpy_schedules_indexed_by_the_iteration_are_looked_up_not_retraced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: `it` was a constant of the graph and lr_schedule[it] a constant too: a trace
    # per step, each a compile (the graphs differ), a RetraceError after 32 steps.
    eager, traces = dino_run(False), count_traces(monkeypatch)
    jitted = dino_run(True)
    assert jitted[0] == eager[0] and jitted[2] == eager[2]
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    # The first call; `it` fed; epoch changed, fed, then found branched on (traced again,
    # guarded); 8 traces before, each a compile.
    assert len(traces) == 4


@pytest.mark.parametrize("front_door", ["jit", "compile_step"])
def test_a_torch_compiled_model_and_loss_in_the_step_are_traced_through(front_door: str) -> None:
    # Code moving from torch.compile keeps `model = torch.compile(model)`: the trace failed
    # ("using FX to symbolically trace a dynamo-optimized function"); now the compiled
    # module and function run their Python in functacc's trace (the whole step compiles).
    def run(jit: bool) -> tuple:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        model = torch.compile(net, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = torch.compile(lambda out, y: (out - y).pow(2).mean(), backend="eager")

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = body
        if jit and front_door == "jit":
            step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        elif jit:
            step = functacc.compile_step(model, loss_fn, opt, backend="eager")
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in "abc"]
        losses = [step(x, y) for x, y in batches]
        return losses, [p.detach().clone() for p in model.parameters()]

    eager, jitted = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(jitted[0], eager[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))


def mixup_run(jit: bool, inside: bool) -> tuple:
    # facebookresearch/mixup-cifar10's mixup_data draws lam from NumPy in the step
    # (``inside``); or, as the error's advice said before 2026-11-29, before the call, passed
    # in (fed, not a trace per value).
    torch.manual_seed(0)
    np.random.seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor, y: torch.Tensor, lam: float | None = None) -> float:
        if lam is None:
            lam = np.random.beta(1.0, 1.0)
        index = torch.randperm(x.size()[0])
        out = model(lam * x + (1 - lam) * x[index, :])
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        if inside:
            losses.append(step(x, y))
        else:
            losses.append(step(x, y, np.random.beta(1.0, 1.0)))
    after = np.random.get_state()[1].copy()  # where the draws left NumPy's generator
    return losses, model.weight.detach().clone(), getattr(step, "num_traces", 0), after


@pytest.mark.parametrize("inside", [True, False], ids=["drawn in the step", "passed in"])
def test_mixups_numpy_draw_matches_eager(inside) -> None:
    # Before 2026-11-29 ``lam = np.random.beta(a, a)`` in the step was a TraceError: a trace
    # would have drawn lam once for every call. It is now fed, drawn again before each call
    # from NumPy's global generator: eager's lam, losses and weights, and NumPy's generator
    # left where eager leaves it.
    eager, jitted = mixup_run(False, inside), mixup_run(True, inside)
    assert jitted[0] == eager[0] and torch.equal(jitted[1], eager[1])
    assert np.array_equal(jitted[3], eager[3])
    assert len(set(eager[0])) == 5  # a new lam each call (a baked one would not match)
    assert jitted[2] == (1 if inside else 2)  # passed in: the first call, then lam fed


class TextSampler(torch.utils.data.Dataset):
    """x-transformers' enwik8 example's dataset: a random window of a token tensor, drawn
    with the global generator."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return self.data.size(0) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = torch.randint(0, self.data.size(0) - self.seq_len - 1, (1,))
        return self.data[start : start + self.seq_len + 1].long()


def cycle(loader):
    while True:
        yield from loader


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        x, y = seq[:, :-1], seq[:, 1:]
        return F.cross_entropy(self.out(self.embed(x)).transpose(1, 2), y)


def test_a_batch_drawn_inside_the_step_is_a_clear_error_whose_advice_works(capsys) -> None:
    # lucidrains/x-transformers' enwik8 loop draws its batches in the step:
    # `loss = model(next(train_loader))` for each accumulation step. Jitted as written, this
    # was an error advising torch.where (the window's start is a tensor), advice that cannot
    # help; a batch made by torch.from_numpy was a constant of the graph (next test).
    def setup():
        torch.manual_seed(0)
        data = torch.randint(0, 16, (400,), dtype=torch.uint8)
        loader = torch.utils.data.DataLoader(TextSampler(data, 12), batch_size=4, drop_last=True)
        model = TinyLM()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), cycle(loader)

    model, optim, train_loader = setup()

    def written(i: int) -> None:  # the loop's body, as the example writes it
        model.train()
        for __ in range(2):
            loss = model(next(train_loader))
            (loss / 2).backward()
        print(f"training loss: {loss.item()}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()

    before = copy.deepcopy(model.state_dict())
    step = functacc.jit(written, modules=[model], optimizers=[optim], backend="eager")
    with pytest.raises(functacc.TraceError) as info:
        step(0)
    message = str(info.value)
    assert "draws from closure variable 'train_loader' (a generator) with next()" in message
    assert "`batch = next(train_loader); step(batch)`" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The advice: the batches drawn before the call, passed in. Bit for bit with eager, the
    # written body run eagerly (it reads the names rebound here).
    model, optim, train_loader = setup()
    capsys.readouterr()
    for i in range(3):
        written(i)
    eager_text, eager_state = capsys.readouterr().out, copy.deepcopy(model.state_dict())
    model, optim, train_loader = setup()

    def advised(*batches: torch.Tensor) -> None:
        model.train()
        for batch in batches:
            loss = model(batch)
            (loss / 2).backward()
        print(f"training loss: {loss.item()}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()

    step = functacc.jit(advised, modules=[model], optimizers=[optim], backend="eager")
    for _call in range(3):
        step(*[next(train_loader) for _ in range(2)])
    assert capsys.readouterr().out == eager_text
    assert all(torch.equal(v, eager_state[k]) for k, v in model.state_dict().items())
    assert step.num_traces == 1


@pytest.mark.parametrize("how", ["loader", "for"])
def test_a_loader_iterated_or_a_generator_looped_in_the_step_is_a_clear_error(how: str) -> None:
    # The other ways to draw in the step: a DataLoader iterated inside it (before: an error
    # advising to pass its tensor in), and `for batch in gen: ... break` over a generator
    # made outside, here of NumPy batches (before: no error, the same batch at every call).
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(16, 3), batch_size=4)
    arrays = np.random.default_rng(0).standard_normal((8, 4, 3)).astype(np.float32)
    gen = (torch.from_numpy(a) for a in arrays)
    next(gen)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body() -> torch.Tensor:
        source = loader if how == "loader" else gen
        for x in source:
            loss = model(x).square().mean()
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    expected = "iterates a DataLoader" if how == "loader" else "closure variable 'gen'"
    with pytest.raises(functacc.TraceError, match=expected) as info:
        step()
    assert "pass" in str(info.value) and "before" in str(info.value)


class YoloModelEMA:
    """ultralytics/yolov5's ModelEMA (utils/torch_utils.py), as written there."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates=0):
        self.ema = copy.deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def test_yolov5s_model_ema_ramps_its_decay_in_the_graph() -> None:
    # Its decay ramps with the update count through math.exp, of a counter the jitted step
    # feeds: math.exp fixed the count to its value, so every call traced and compiled again
    # (5 compiles in 5 calls); now exp is computed in the graph, in double as math.exp.
    def run(jitted: bool) -> tuple[list[torch.Tensor], int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        ema = YoloModelEMA(model, tau=5)

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update(model)
            return loss.detach()

        modules = [model, ema.ema]
        step = functacc.jit(body, modules=modules, optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            (step if jitted else body)(torch.randn(6, 4, generator=g), torch.arange(6) % 2)
        return list(ema.ema.state_dict().values()), ema.updates, step.num_traces

    eager, jitted = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(jitted[0], eager[0], strict=True))
    assert jitted[1] == eager[1] == 5 and jitted[2] == 1


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_ema_pytorch_updated_in_the_step_matches_eager(backend: str) -> None:
    # lucidrains' ema_pytorch (its trainers call `self.ema.update()` after each optimizer
    # step) reads its buffers with .item() and branches on them: `step % update_every`,
    # `step <= update_after_step`, `not self.initted.item()`, and in get_current_decay
    # `epoch.item() <= 0` of `epoch = (self.step - update_after_step - 1).clamp(min=0.)`.
    # Before 2026-11-28 a TraceError (advising to update after each call); now the buffers'
    # numbers are fed and each branch is a guard: one trace per branch taken, not per value,
    # and eager's EMA weights (bit for bit on the eager backend; Inductor within float32
    # rounding of its fused Adam and lerp).
    from ema_pytorch import EMA

    def run(jit: bool) -> tuple[list[float], list[torch.Tensor], int, bool, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ema = EMA(model, beta=0.9, update_after_step=2, update_every=2)

        def written(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update()
            return loss.item()

        step = written
        if jit:
            step = functacc.jit(written, modules=[model, ema], optimizers=[opt], backend=backend)
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(14):
            losses.append(step(torch.randn(6, 4, generator=g), torch.arange(6) % 2))
            if jit and i == 9:
                traced = len(step.traces)
        later = len(step.traces) - traced if jit else 0
        weights = [p.detach().clone() for p in ema.ema_model.parameters()]
        return losses, weights, int(ema.step), bool(ema.initted), later

    eager, jitted = run(False), run(True)
    assert jitted[2:] == (eager[2], True, 0) and eager[2] == 14  # no trace after call 10
    if backend == "eager":
        assert jitted[0] == eager[0]
        assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    else:
        torch.testing.assert_close(jitted[0], eager[0], rtol=1e-4, atol=1e-5)
        for a, b in zip(jitted[1], eager[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_distributions_built_in_the_step_check_their_arguments_in_the_graph() -> None:
    # A policy-gradient update builds its distributions in the step (Categorical for the
    # discrete head, Normal for the continuous one); each checks its arguments on the host
    # by default, a branch the trace could not take (an error advising torch.where). The
    # check is now asserted in the graph: eager's numbers and samples bit for bit, and a
    # call with an invalid scale fails, where eager raises, changing nothing.
    from torch.distributions import Categorical, Normal

    def setup():
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 5))
        return policy, torch.optim.Adam(policy.parameters(), lr=1e-2)

    def make_body(policy, opt):
        def body(obs: torch.Tensor, ret: torch.Tensor, scale: torch.Tensor) -> tuple:
            out = policy(obs)
            # validate_args=True: torch's default, which importing torch._dynamo turns off
            # for the whole process (another test may have compiled something)
            discrete = Categorical(logits=out[:, :3], validate_args=True)
            continuous = Normal(out[:, 3], scale * out[:, 4].exp(), validate_args=True)
            action, value = discrete.sample(), continuous.rsample()
            log_prob = discrete.log_prob(action) + continuous.log_prob(value)
            entropy = discrete.entropy() + continuous.entropy()
            loss = -(log_prob * ret).mean() - 0.01 * entropy.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item(), action

        return body

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, generator=g)) for _ in range(3)]
    results = []
    for jitted in (False, True):
        policy, opt = setup()
        body = make_body(policy, opt)
        step = functacc.jit(body, modules=[policy], optimizers=[opt], backend="eager")
        torch.manual_seed(7)
        run = [(step if jitted else body)(obs, ret, torch.tensor(1.0)) for obs, ret in batches]
        results.append((run, [p.detach().clone() for p in policy.parameters()]))
    (eager, eager_params), (jitted, jitted_params) = results
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(eager, jitted, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, jitted_params, strict=True))
    # A negative scale: eager's ValueError; the jitted call fails in the graph's check.
    obs, ret = batches[0]
    with pytest.raises(ValueError, match="scale"):
        make_body(*setup())(obs, ret, torch.tensor(-1.0))
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(RuntimeError, match=r"torch\.distributions argument"):
        step(obs, ret, torch.tensor(-1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_clip_grad_norm_with_error_if_nonfinite_checks_in_the_graph() -> None:
    # clip_grad_norm_(..., error_if_nonfinite=True) checks the norm on the host: the trace
    # failed, advising torch.where. The check is asserted in the graph: eager's numbers, and
    # a batch with an inf fails the call where eager raises, changing nothing.
    def setup():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def make_body(model, opt):
        def body(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=True)
            opt.step()
            opt.zero_grad()
            return norm

        return body

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=g) for _ in range(3)]
    eager_model, eager_opt = setup()
    eager = [make_body(eager_model, eager_opt)(x) for x in batches]
    model, opt = setup()
    step = functacc.jit(make_body(model, opt), modules=[model], optimizers=[opt], backend="eager")
    assert all(torch.equal(step(x), e) for x, e in zip(batches, eager, strict=True))
    pairs = zip(model.parameters(), eager_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    bad = batches[0].clone()
    bad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        make_body(*setup())(bad)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="non-finite"):
        step(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_parameters_updated_by_assigning_data_as_in_eager() -> None:
    # Tutorial-style code updates and clips weights by assigning .data (`p.data = p.data -
    # lr * p.grad.data`; torch.nn.utils.vector_to_parameters does `param.data = ...`).
    # The jitted step ignored those assignments, silently: the weights went un-updated.
    def run(jitted: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        params = list(model.parameters())

        def body(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.mse_loss(model(x), y)
            model.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.data = p.data - 0.1 * p.grad.data
                p.data = p.data.clamp(-0.3, 0.3)
            flat = torch.nn.utils.parameters_to_vector(model.parameters())
            torch.nn.utils.vector_to_parameters(flat * 0.99, model.parameters())
            return loss.item()

        step = functacc.jit(body, modules=[model], backend="eager") if jitted else body
        g = torch.Generator().manual_seed(1)
        losses = [
            step(torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)) for _ in range(4)
        ]
        return losses, [p.detach().clone() for p in params]

    eager, jitted = run(False), run(True)
    assert jitted[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    # Another shape: an error that says so, the model unchanged.
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()

    def reshaped(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        model.weight.data = model.weight.data[:1]
        return loss

    with pytest.raises(functacc.TraceError, match=r"assigns \.data of a \(2, 3\)"):
        functacc.jit(reshaped, modules=[model], backend="eager")(torch.randn(2, 3))
    assert torch.equal(model.weight, before)


def test_this_sessions_checks_and_writes_under_inductor(capsys) -> None:
    # Under Inductor, in one step: an observation read from a NumPy array in the closure
    # (guarded by contents), Categorical and Normal checking their arguments in the graph,
    # clip_grad_norm_(error_if_nonfinite=True), weights clipped by assigning .data, and the
    # learning rate printed after the scheduler's step. Against the same body run eagerly:
    # Inductor fuses and orders float32 sums its own way, 1e-5 relative; the sampled actions
    # and the printed rates are eager's exactly.
    from torch.distributions import Categorical, Normal

    def run(jitted: bool) -> tuple:
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 5))
        opt = torch.optim.SGD(policy.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        obs = np.zeros((6, 4), dtype=np.float32)

        def body(ret: torch.Tensor, scale: torch.Tensor) -> tuple:
            out = policy(torch.tensor(obs))
            discrete = Categorical(logits=out[:, :3], validate_args=True)
            continuous = Normal(out[:, 3], scale * out[:, 4].exp(), validate_args=True)
            action = discrete.sample()
            log_prob = discrete.log_prob(action) + continuous.log_prob(continuous.rsample())
            loss = -(log_prob * ret).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0, error_if_nonfinite=True)
            opt.step()
            for p in policy.parameters():
                p.data = p.data.clamp(-0.5, 0.5)
            sched.step()
            print(f"lr {opt.param_groups[0]['lr']:.5f}")
            return loss.item(), action

        step = functacc.jit(body, modules=[policy], optimizers=[opt], backend="inductor")
        g = torch.Generator().manual_seed(1)
        capsys.readouterr()
        torch.manual_seed(7)
        results = []
        for _ in range(3):
            obs[...] = torch.randn(6, 4, generator=g).numpy()
            ret = torch.randn(6, generator=g)
            results.append((step if jitted else body)(ret, torch.tensor(1.0)))
        text = capsys.readouterr().out
        bad = None
        if jitted:  # an invalid scale: the call fails in the graph's check, changing nothing
            before = [p.detach().clone() for p in policy.parameters()]
            with pytest.raises(RuntimeError, match=r"torch\.distributions argument"):
                step(torch.randn(6, generator=g), torch.tensor(-1.0))
            bad = all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
        return results, text, list(policy.parameters()), bad

    eager, jitted = run(False), run(True)
    torch.testing.assert_close(
        [r[0] for r in jitted[0]], [r[0] for r in eager[0]], rtol=1e-5, atol=1e-6
    )
    assert all(torch.equal(a[1], b[1]) for a, b in zip(jitted[0], eager[0], strict=True))
    assert jitted[1] == eager[1] and "lr 0.00625" in eager[1]
    for a, b in zip(jitted[2], eager[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert jitted[3] is True


class ImagePool:
    """junyanz/pytorch-CycleGAN-and-pix2pix util/image_pool.py: a history of generated
    images, each query returning, with probability 1/2, a stored one in place of a new."""

    def __init__(self, pool_size: int):
        self.pool_size = pool_size
        if self.pool_size > 0:
            self.num_imgs = 0
            self.images: list[torch.Tensor] = []

    def query(self, images: torch.Tensor) -> torch.Tensor:
        if self.pool_size == 0:
            return images
        return_images = []
        for image in images:
            image = torch.unsqueeze(image.data, 0)
            if self.num_imgs < self.pool_size:
                self.num_imgs = self.num_imgs + 1
                self.images.append(image)
                return_images.append(image)
            elif random.uniform(0, 1) > 0.5:
                random_id = random.randint(0, self.pool_size - 1)
                tmp = self.images[random_id].clone()
                self.images[random_id] = image
                return_images.append(tmp)
            else:
                return_images.append(image)
        return torch.cat(return_images, 0)


class CycleGAN:
    """models/cycle_gan_model.py's optimize_parameters, with small networks: both
    generators' step with the discriminators frozen (set_requires_grad), then both
    discriminators' step on images from the pools."""

    def __init__(self, pool_size: int):
        torch.manual_seed(0)
        self.netG_A, self.netG_B = (
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)
        )
        self.netD_A, self.netD_B = (
            nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)) for _ in range(2)
        )
        g_params = [*self.netG_A.parameters(), *self.netG_B.parameters()]
        d_params = [*self.netD_A.parameters(), *self.netD_B.parameters()]
        self.optimizer_G = torch.optim.Adam(g_params, lr=2e-3, betas=(0.5, 0.999))
        self.optimizer_D = torch.optim.Adam(d_params, lr=2e-3, betas=(0.5, 0.999))
        self.fake_A_pool, self.fake_B_pool = ImagePool(pool_size), ImagePool(pool_size)

    @property
    def modules(self) -> list[nn.Module]:
        return [self.netG_A, self.netG_B, self.netD_A, self.netD_B]

    def gan_loss(self, prediction: torch.Tensor, target_is_real: bool) -> torch.Tensor:
        target = torch.ones_like(prediction) if target_is_real else torch.zeros_like(prediction)
        return F.mse_loss(prediction, target)  # lsgan

    @staticmethod
    def set_requires_grad(nets: list[nn.Module], requires_grad: bool = False) -> None:
        for net in nets:
            for param in net.parameters():
                param.requires_grad = requires_grad

    def backward_D_basic(self, netD: nn.Module, real: torch.Tensor, fake: torch.Tensor):
        loss_D = (self.gan_loss(netD(real), True) + self.gan_loss(netD(fake.detach()), False)) * 0.5
        loss_D.backward()
        return loss_D

    def forward_and_backward_G(self, real_A: torch.Tensor, real_B: torch.Tensor) -> None:
        self.fake_B, self.fake_A = self.netG_A(real_A), self.netG_B(real_B)
        rec_A, rec_B = self.netG_B(self.fake_B), self.netG_A(self.fake_A)
        self.set_requires_grad([self.netD_A, self.netD_B], False)
        self.optimizer_G.zero_grad()
        idt_A, idt_B = self.netG_A(real_B), self.netG_B(real_A)
        self.loss_G = (
            self.gan_loss(self.netD_A(self.fake_B), True)
            + self.gan_loss(self.netD_B(self.fake_A), True)
            + F.l1_loss(rec_A, real_A) * 10.0
            + F.l1_loss(rec_B, real_B) * 10.0
            + F.l1_loss(idt_A, real_B) * 5.0
            + F.l1_loss(idt_B, real_A) * 5.0
        )
        self.loss_G.backward()
        self.optimizer_G.step()
        self.set_requires_grad([self.netD_A, self.netD_B], True)

    def backward_and_step_D(self, real_A, real_B, fake_A, fake_B) -> None:
        self.optimizer_D.zero_grad()
        self.loss_D_A = self.backward_D_basic(self.netD_A, real_B, fake_B)
        self.loss_D_B = self.backward_D_basic(self.netD_B, real_A, fake_A)
        self.optimizer_D.step()

    def optimize_parameters(self, real_A: torch.Tensor, real_B: torch.Tensor) -> None:
        self.forward_and_backward_G(real_A, real_B)
        fake_B, fake_A = self.fake_B_pool.query(self.fake_B), self.fake_A_pool.query(self.fake_A)
        self.backward_and_step_D(real_A, real_B, fake_A, fake_B)


def cyclegan_run(pool_size: int, how: str) -> list[torch.Tensor]:
    gan = CycleGAN(pool_size)
    if how == "one step":
        step = functacc.jit(
            gan.optimize_parameters,
            modules=gan.modules,
            optimizers=[gan.optimizer_G, gan.optimizer_D],
            backend="eager",
        )
    elif how == "pools between":  # the advice: the pools queried outside, between two steps
        optimizers = [gan.optimizer_G, gan.optimizer_D]  # the object holds both
        g_step, d_step = (
            functacc.jit(f, modules=gan.modules, optimizers=optimizers, backend="eager")
            for f in (gan.forward_and_backward_G, gan.backward_and_step_D)
        )

        def step(real_A: torch.Tensor, real_B: torch.Tensor) -> None:
            g_step(real_A, real_B)
            fake_B, fake_A = gan.fake_B_pool.query(gan.fake_B), gan.fake_A_pool.query(gan.fake_A)
            d_step(real_A, real_B, fake_A, fake_B)
    else:
        step = gan.optimize_parameters
    g = torch.Generator().manual_seed(1)
    random.seed(0)  # the pools' draws
    losses = []
    for _ in range(4):
        step(torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g))
        losses += [gan.loss_G.detach(), gan.loss_D_A.detach(), gan.loss_D_B.detach()]
    assert all(p.requires_grad for m in gan.modules for p in m.parameters())
    return losses + [p.detach().clone() for m in gan.modules for p in m.parameters()]


def test_cyclegan_trains_as_in_eager_and_its_image_pool_is_refused_with_advice_that_works() -> None:
    # Without pools (--pool_size 0), the whole of optimize_parameters, set_requires_grad
    # included, is one step, bit for bit with eager.
    for a, b in zip(cyclegan_run(0, "one step"), cyclegan_run(0, "eager"), strict=True):
        assert torch.equal(a, b)
    # With pools: a query assigns into the pool's list at random once it is full, which a
    # step cannot replay: a TraceError naming the list, nothing changed by that call.
    gan = CycleGAN(3)
    step = functacc.jit(
        gan.optimize_parameters,
        modules=gan.modules,
        optimizers=[gan.optimizer_G, gan.optimizer_D],
        backend="eager",
    )
    x = torch.randn(3, 8)
    random.seed(0)
    step(x, x)  # the pools fill up
    before = [p.detach().clone() for m in gan.modules for p in m.parameters()]
    with pytest.raises(
        functacc.TraceError, match=r"(?s)list self\.fake_\w_pool\.images.*outside the step"
    ):
        step(x, x)
    assert all(
        torch.equal(a, p)
        for a, p in zip(before, [p for m in gan.modules for p in m.parameters()], strict=True)
    )
    # Its advice, done: the pools queried between a generator step and a discriminator step.
    for a, b in zip(cyclegan_run(3, "pools between"), cyclegan_run(3, "eager"), strict=True):
        assert torch.equal(a, b)


def dp_sgd_run(jit: bool) -> tuple[Tensor, Tensor]:
    """PyTorch's per-sample-gradients tutorial (torch.func: ``vmap(grad(compute_loss))``
    over ``functional_call``), made a DP-SGD step: each sample's gradient clipped to norm 1,
    Gaussian noise drawn with ``randn_like``, ``p.grad`` assigned, ``opt.step()``."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def compute_loss(params, buffers, sample, target):
        batch, targets = sample.unsqueeze(0), target.unsqueeze(0)
        predictions = functional_call(model, (params, buffers), (batch,))
        return F.cross_entropy(predictions, targets)

    per_sample_grads = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))

    def step(x: Tensor, y: Tensor, clip: float = 1.0, sigma: float = 0.5) -> Tensor:
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        g = per_sample_grads(params, buffers, x, y)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        factor = (clip / (norms + 1e-6)).clamp(max=1.0)
        opt.zero_grad()
        for name, p in model.named_parameters():
            clipped = (g[name] * factor.view(-1, *[1] * (g[name].dim() - 1))).sum(0)
            p.grad = (clipped + sigma * clip * torch.randn_like(clipped)) / x.shape[0]
        opt.step()
        return norms.mean()

    if jit:
        step = functacc.jit(step, modules=model, optimizers=opt, backend="eager")
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(5)  # the noise
    norms = [step(torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data))]
    norms += [step(torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data))]
    return torch.stack(norms), model[0].weight.detach().clone()


def test_per_sample_gradients_with_torch_func_in_a_dp_sgd_step_match_eager() -> None:
    # Checked on 2026-11-28 and equal with no library change: a test that it stays so.
    (norms, weight), (ref_norms, ref_weight) = dp_sgd_run(True), dp_sgd_run(False)
    assert torch.equal(norms, ref_norms) and torch.equal(weight, ref_weight)


def test_a_best_loss_check_in_the_step_is_an_error_whose_advice_keeps_eagers_numbers() -> None:
    # `if loss.item() < best: best = loss.item(); torch.save(...)`, common at the end of a
    # step: the branch is decided on the host. The error names the line and says to return
    # the value and branch after the call, which gives eager's numbers; nothing changed.
    def run(jit: bool, advised: bool) -> tuple[list, Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        best, saved = [float("inf")], []

        def step(x: Tensor) -> float:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not advised and loss.item() < best[0]:
                best[0] = loss.item()
                saved.append(best[0])
            return loss.item()

        step = functacc.jit(step, modules=model, optimizers=opt, backend="eager") if jit else step
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            loss = step(torch.randn(8, 4, generator=g))
            if advised and loss < best[0]:  # the check, after the call
                best[0] = loss
                saved.append(loss)
        return saved, model.weight.detach().clone()

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def as_written(x: Tensor) -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1.0:
            print("best so far")

    with pytest.raises(
        functacc.TraceError,
        match=r"(?s)branches on a tensor.s value.*return the value from the step",
    ):
        functacc.jit(as_written, modules=model, optimizers=opt, backend="eager")(torch.ones(2, 4))
    assert torch.equal(model.weight, before) and model.weight.grad is None
    eager, advised = run(False, False), run(True, True)
    assert eager[0] == advised[0] and len(eager[0]) >= 2 and torch.equal(eager[1], advised[1])


def mae_run(jit: bool, bad_at: int | None = None, backend: str = "eager") -> tuple:
    # facebookresearch/mae's engine_pretrain.train_one_epoch (DeiT's and DINO's have the
    # same check): loss_value = loss.item(); if not math.isfinite(loss_value): print, exit.
    import math
    import sys

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(model(x), y)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss_value

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(4):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        if i == bad_at:
            x[0, 0] = float("nan")
            before = [
                t.clone() for t in [*model.parameters(), *opt.state_dict()["state"][0].values()]
            ]
            with pytest.raises(
                functacc.TraceError, match=r"math\.isfinite\(\) at .*changing nothing"
            ):
                step(x, y)
            after = [*model.parameters(), *opt.state_dict()["state"][0].values()]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            continue
        losses.append(step(x, y))
    return losses, model.weight.detach().clone(), step


def test_maes_loss_check_runs_as_eager_and_a_non_finite_loss_fails_changing_nothing() -> None:
    # Before 2026-11-28 the check was a TraceError advising to move it out of the step.
    losses, weight, step = mae_run(True)
    ref_losses, ref_weight, _ = mae_run(False)
    assert losses == ref_losses and torch.equal(weight, ref_weight)
    assert step.num_traces <= 2  # no .grad yet, then with it: the check is no branch
    mae_run(True, bad_at=2)  # eager would exit there; the jitted call raises, state kept


def test_a_loss_check_on_the_tensor_says_what_works() -> None:
    model = nn.Linear(4, 1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        if not torch.isfinite(loss):
            raise SystemExit(1)
        return loss.detach()

    with pytest.raises(
        functacc.TraceError, match=r"(?s)checks a value on the host.*math\.isfinite"
    ):
        functacc.jit(step, modules=[model], backend="eager")(torch.randn(2, 4))


@pytest.mark.inductor
def test_maes_loss_check_under_inductor() -> None:
    losses, weight, _ = mae_run(True, backend="inductor")
    ref_losses, ref_weight, _ = mae_run(False)
    # Inductor reorders float32 sums: a few ulps over four AdamW steps of a 4x1 layer.
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
    mae_run(True, bad_at=2, backend="inductor")
