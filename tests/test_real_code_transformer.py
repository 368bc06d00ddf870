"""sgrvinod's Transformer tutorial (tests/sgrvinod_transformer.py), its train loop jitted as
written: eager's numbers bit for bit on the eager backend.

The loop body of its ``train()``: forward, label-smoothed loss over packed sequences, the
loss divided by ``batches_per_step`` and backward; every ``batches_per_step`` batches
``optimizer.step()``, ``zero_grad()``, ``step += 1`` and
``change_lr(optimizer, get_lr(step, ...))``; ``losses.update(loss.item(), n_tokens)``.

What it met in functacc before 2026-11-29, in order: ``torch.equal`` of the attention's
inputs (a ``TraceError``), ``pack_padded_sequence(enforce_sorted=False)`` with no recurrent
layer in the model (a ``RuntimeError`` from torch's fake kernels) and ``math.pow`` of the
step counter, which fixed the counter: one trace per optimizer step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import sgrvinod_transformer as tfm
import torch
from torch import Tensor, nn

import functacc

VOCAB, D_MODEL, WARMUP = 50, 16, 8


def tutorial(optimizer: str = "adam", layers: int = 2) -> tuple[nn.Module, Any, nn.Module]:
    """The tutorial's model, optimizer and loss as its train.py makes them (sizes shrunk)."""
    tfm.device = torch.device("cpu")  # the tutorial's masks go to CUDA where there is one
    torch.manual_seed(0)
    encoding = tfm.get_positional_encoding(d_model=D_MODEL, max_length=40)
    model = tfm.Transformer(
        vocab_size=VOCAB,
        positional_encoding=encoding,
        d_model=D_MODEL,
        n_heads=2,
        d_queries=8,
        d_values=8,
        d_inner=32,
        n_layers=layers,
        dropout=0.1,
    )
    lr = tfm.get_lr(step=1, d_model=D_MODEL, warmup_steps=WARMUP)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adam":
        opt = torch.optim.Adam(params=params, lr=lr, betas=(0.9, 0.98), eps=1e-9)
    else:
        opt = torch.optim.SGD(params=params, lr=lr)
    return model, opt, tfm.LabelSmoothedCE(eps=0.1)


def batches(n: int) -> list[tuple[Tensor, ...]]:
    """The tutorial's SequenceLoader batches: source and target tokens padded to their
    longest, with their lengths. Two patterns of lengths in turn, one whose source and
    target pad lengths are equal (the cross-attention's torch.equal then compares two
    different tensors of one shape) and one whose are not."""
    g = torch.Generator().manual_seed(3)
    patterns = [
        (torch.tensor([6, 4, 3, 6]), torch.tensor([6, 5, 6, 2])),
        (torch.tensor([5, 7, 3, 4]), torch.tensor([4, 3, 6, 5])),
    ]
    out = []
    for i in range(n):
        source_lengths, target_lengths = patterns[(i // 2) % 2]
        source = torch.randint(1, VOCAB, (4, int(source_lengths.max())), generator=g)
        target = torch.randint(1, VOCAB, (4, int(target_lengths.max())), generator=g)
        out.append((source, target, source_lengths.clone(), target_lengths.clone()))
    return out


def train(
    backend: str | None, n: int, optimizer: str = "adam", layers: int = 2
) -> tuple[list, list, Any]:
    """Runs the tutorial's train loop body over ``n`` batches, eagerly (``backend=None``)
    or jitted; returns the weights and optimizer state, the Python numbers the loop keeps
    (the step counter, the learning rate, the loss meter) and the step."""
    model, optimizer_, criterion = tutorial(optimizer, layers)
    model.train()
    losses = tfm.AverageMeter()
    batches_per_step, step = 2, 1

    def train_batch(
        i: int,
        source_sequences: Tensor,
        target_sequences: Tensor,
        source_sequence_lengths: Tensor,
        target_sequence_lengths: Tensor,
    ) -> None:
        nonlocal step
        predicted_sequences = model(
            source_sequences, target_sequences, source_sequence_lengths, target_sequence_lengths
        )
        loss = criterion(
            inputs=predicted_sequences,
            targets=target_sequences[:, 1:],
            lengths=target_sequence_lengths - 1,
        )
        (loss / batches_per_step).backward()
        losses.update(loss.item(), (target_sequence_lengths - 1).sum().item())
        if (i + 1) % batches_per_step == 0:
            optimizer_.step()
            optimizer_.zero_grad()
            step += 1
            tfm.change_lr(
                optimizer_, new_lr=tfm.get_lr(step=step, d_model=D_MODEL, warmup_steps=WARMUP)
            )

    run = train_batch
    if backend is not None:
        run = functacc.jit(train_batch, modules=[model], optimizers=[optimizer_], backend=backend)
    for i, batch in enumerate(batches(n)):
        torch.manual_seed(100 + i)  # dropout
        run(i, *batch)
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    tensors += [
        v.clone() for s in optimizer_.state.values() for v in s.values() if isinstance(v, Tensor)
    ]
    numbers = [step, optimizer_.param_groups[0]["lr"], losses.sum, losses.count, losses.avg]
    return tensors, numbers, run


def test_sgrvinod_transformer_train_loop_is_eager_bit_for_bit() -> None:
    # 8 batches, 4 optimizer steps, every number eager's (rtol=atol=0: the same ops in the
    # same order; the learning rate is computed by the graph in double, as math.pow and
    # min compute it on the host). Traces: the first call (no .grad), then with .grad one
    # per branch of (i + 1) % 2 and pattern of lengths: not one per step counter.
    expected, expected_numbers, _ = train(None, 8)
    got, got_numbers, step = train("eager", 8)
    assert got_numbers == expected_numbers
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    reasons = [t.reason for t in step.traces]
    assert len(reasons) <= 5, reasons
    assert not any("'step' ==" in r for r in reasons), reasons


@pytest.mark.inductor
def test_sgrvinod_transformer_under_inductor() -> None:
    # Inductor reassociates float32 reductions: rtol 1e-5 (about 100 times what the fused
    # reductions give here). SGD, not the tutorial's Adam: the keys' bias gets a gradient
    # that is zero up to rounding (a softmax does not see a shift common to its inputs),
    # which Adam's first steps turn into +-lr updates whose sign the rounding decides.
    # Two batches: the two traces of `(i + 1) % batches_per_step` (accumulate; then step
    # and schedule); the lengths' patterns and the counter are the eager test's. One layer
    # each side, not two: each trace is a cold Inductor compile of the whole model, whose
    # time grows with the graph (nearly 4 minutes with two layers on 2 cores).
    expected, expected_numbers, _ = train(None, 2, "sgd", layers=1)
    got, got_numbers, step = train("inductor", 2, "sgd", layers=1)
    assert step.num_traces == 2
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_numbers[:2] == expected_numbers[:2] and got_numbers[3] == expected_numbers[3]
    assert got_numbers == pytest.approx(expected_numbers, rel=1e-5)


@pytest.mark.parametrize("case", ["same tensor", "another shape", "different tensors"])
def test_torch_equal_takes_eager_branch(case: str) -> None:
    # The three answers a trace can give, each eager's (rtol=atol=0), one trace each.
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def body(net: nn.Module, o: Any) -> Any:
        def step(x: Tensor) -> Tensor:
            h = net(x)
            other = {"same tensor": h, "another shape": h[:1], "different tensors": h + 1}[case]
            loss = (h * 2 if torch.equal(h, other) else h - 1).square().mean()
            o.zero_grad()
            loss.backward()
            o.step()
            return loss.detach()

        return step

    jitted = functacc.jit(body(model, opt), modules=[model], optimizers=[opt], backend="eager")
    for _ in range(3):
        x = torch.randn(2, 3)
        assert torch.equal(jitted(x), body(ref, ref_opt)(x))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["nan", "equal by chance"])
def test_torch_equal_answer_that_does_not_hold_fails_the_call(case: str) -> None:
    # The trace's answer rests on values: True for the same tensor (eager: False where it
    # holds a NaN), False for two tensors (eager: True where their values happen to be
    # equal). The graph checks it: a call where it does not hold fails, naming the line,
    # and leaves weights and optimizer state as they were; a call where it holds runs.
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: Tensor, y: Tensor) -> Tensor:
        h = model(x) * y
        other = h if case == "nan" else y
        loss = (h * 2 if torch.equal(h, other) else h - 1).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    x = torch.randn(2, 3)
    jitted(x, torch.ones(2, 3))
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    bad = torch.full((2, 3), float("nan")) if case == "nan" else torch.zeros(2, 3)
    if case == "equal by chance":
        x = torch.zeros(2, 3)  # h = model(0) * 0 = 0 = y
    with pytest.raises(RuntimeError, match=r"torch\.equal.*test_real_code_transformer\.py:\d+"):
        jitted(x, bad)
    after = (model.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k])
    for k, s in before[1]["state"].items():
        assert torch.equal(s["momentum_buffer"], after[1]["state"][k]["momentum_buffer"])
