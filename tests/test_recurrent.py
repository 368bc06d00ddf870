"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN and their cells) through both front doors.

The reference is the same training run eagerly on a copy, with the same seed before each
step (dropout between layers draws eager's masks). With ``backend="eager"`` everything is
compared bit for bit: losses, the carried hidden state, every parameter, buffer and
``.grad``, the optimizers' state and the global RNG state. On CPU eager PyTorch runs an
``nn.LSTM`` with oneDNN (``aten.mkldnn_rnn_layer`` and its backward); the traced step calls
the same kernels (docs/recurrent.md), which is what makes it exact.

Under Inductor the ops around the recurrent kernels (embedding, decoder, log-softmax,
clipping, the update) are fused and their float32 reductions reassociated, so a few
rounding errors per element enter each step; the word language model below trains at
``lr=5`` with its gradients clipped to 0.25, which carries them along. Measured after 5
steps: losses within 1.3e-7 relative, hidden state and parameters within 1.2e-7 absolute
(through jit and compile_step alike). The tolerance (``rtol=1e-5, atol=1e-6``) is about ten
times that, and far below what a wrong gradient, a skipped update or another dropout mask
gives (1e-3 and more at the first step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_training, eager_train, functacc_train
from test_jit import assert_same, tensors_of
from torch import Tensor, nn

import functacc

INDUCTOR = {"rtol": 1e-5, "atol": 1e-6}


# -- pytorch/examples word_language_model: truncated BPTT, tied weights, manual SGD ---------
def word_lm(seed: int = 0) -> tuple[nn.Module, Callable]:
    """The example's model and the body of its ``train()`` loop, as one step."""
    torch.manual_seed(seed)
    model = models.WordLM()
    lr, clip = 5.0, 0.25

    def body(data: Tensor, targets: Tensor, hidden: tuple[Tensor, Tensor]) -> tuple:
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = F.nll_loss(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return loss, hidden

    return model, body


def corpus_batches(steps: int = 5, bptt: int = 7, batch: int = 4) -> list[tuple[Tensor, Tensor]]:
    """``get_batch`` over a random corpus batchified into ``batch`` columns."""
    g = torch.Generator().manual_seed(1)
    source = torch.randint(0, models.WordLM.VOCAB, (steps * bptt + 1, batch), generator=g)
    return [
        (source[i : i + bptt], source[i + 1 : i + 1 + bptt].reshape(-1))
        for i in range(0, steps * bptt, bptt)
    ]


def run_word_lm(backend: str) -> tuple[list, list, Any]:
    """Five steps through ``functacc.jit`` and eagerly, hidden state detached and carried
    (``repackage_hidden``); compared after every step where the backend is exact."""
    model, body = word_lm()
    ref, ref_body = word_lm()
    step = functacc.jit(body, modules=[model], backend=backend)
    hidden, ref_hidden = model.init_hidden(4), ref.init_hidden(4)
    got, expected = [], []
    for i, (data, targets) in enumerate(corpus_batches()):
        hidden = tuple(h.detach() for h in hidden)
        ref_hidden = tuple(h.detach() for h in ref_hidden)
        torch.manual_seed(100 + i)
        loss, hidden = step(data, targets, hidden)
        rng = torch.get_rng_state()
        torch.manual_seed(100 + i)
        ref_loss, ref_hidden = ref_body(data, targets, ref_hidden)
        assert torch.equal(rng, torch.get_rng_state()), "the RNG advanced differently"
        got.append((loss, *hidden))
        expected.append((ref_loss.detach(), *(h.detach() for h in ref_hidden)))
        if backend == "eager":
            assert all(map(torch.equal, got[-1], expected[-1])), i
            assert_same(tensors_of([model], []), tensors_of([ref], []))
    return got, expected, (step, model, ref)


def test_word_lm_through_jit_is_eager_bit_for_bit() -> None:
    # Before: ValueError, "the forward changed the model's Python attributes
    # ['m.rnn._flat_weight_refs', 'm.rnn._flat_weights']"; past it, the graph's
    # mkldnn_rnn_layer_backward got no workspace (the forward fills it only in grad mode).
    _, _, (step, model, _) = run_word_lm("eager")
    assert [t.reason for t in step.traces] == ["first call"]
    # torch's weight cache points at the model's own parameters again, not the trace's.
    rnn = model.rnn
    names = rnn._flat_weights_names
    assert all(w is getattr(rnn, n) for w, n in zip(rnn._flat_weights, names, strict=True))


@pytest.mark.inductor
def test_word_lm_through_jit_under_inductor() -> None:
    got, expected, (step, model, ref) = run_word_lm("inductor")
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **INDUCTOR)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), **INDUCTOR)
    assert step.num_traces == 1


def carried_lm_training(backend: str) -> None:
    """The same model through ``compile_step``: torch.optim.SGD and ``max_grad_norm`` are the
    example's update and clipping; the hidden state is carried in buffers (detached)."""
    torch.manual_seed(0)
    model = models.CarriedLM(batch=4)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=5.0)
    step = functacc.compile_step(model, F.nll_loss, opt, backend=backend, max_grad_norm=0.25)
    batches = corpus_batches()
    losses = functacc_train(step, batches)
    ref_losses = eager_train(ref, ref_opt, F.nll_loss, batches, max_grad_norm=0.25)
    tol = INDUCTOR if backend == "inductor" else {"rtol": 0, "atol": 0}
    assert_same_training(model, opt, ref, ref_opt, losses, ref_losses, **tol)
    assert step.num_traces == 1


def test_word_lm_through_compile_step_is_eager_bit_for_bit() -> None:
    carried_lm_training("eager")


@pytest.mark.inductor
def test_word_lm_through_compile_step_under_inductor() -> None:
    carried_lm_training("inductor")


# -- a GRU classifier over packed sequences ------------------------------------------------
def length_batches(
    patterns: int = 3, steps: int = 6, as_tensor: bool = False, two_lengths: bool = False
) -> list[tuple[tuple, Tensor]]:
    """Padded token batches with their lengths as a Python list (or a tensor); ``patterns``
    different lists of lengths, in turn (``two_lengths``: orders of 4, 4, 2, 2, 2)."""
    g = torch.Generator().manual_seed(3)
    lengths = [torch.randint(1, 9, (5,), generator=g) for _ in range(patterns)]
    if two_lengths:
        lengths = [torch.tensor([4, 2, 4, 2, 2]).roll(i) for i in range(patterns)]
    out = []
    for i in range(steps):
        n = lengths[i % patterns]
        tokens = torch.randint(1, 30, (5, 8), generator=g) * (torch.arange(8) < n[:, None])
        out.append(
            ((tokens, n if as_tensor else n.tolist()), torch.randint(0, 3, (5,), generator=g))
        )
    return out


@pytest.mark.parametrize("lengths_as", ["list", "tensor"])
@pytest.mark.parametrize("front_door", ["jit", "compile_step"])
def test_packed_gru_classifier_is_eager_bit_for_bit(front_door: str, lengths_as: str) -> None:
    # Three lists of lengths in turn: three traces. The packing (how many sequences run at
    # each time step) decides the graph, so each new list of lengths is a new trace; one
    # seen before reuses its graph. Before: TypeError, zeros() got a FakeTensor as a size.
    # Lengths given as a tensor (as data loaders give them) are read at the trace, their
    # values part of the signature (before 2026-11-28 a TraceError advising .tolist()).
    torch.manual_seed(0)
    model = models.PackedClassifier(nn.GRU)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    batches = length_batches(as_tensor=lengths_as == "tensor")
    if front_door == "compile_step":
        step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager")
        losses = functacc_train(step, batches)
        ref_losses = eager_train(ref, ref_opt, nn.CrossEntropyLoss(), batches)
        assert_same_training(model, opt, ref, ref_opt, losses, ref_losses, rtol=0, atol=0)
    else:
        body, ref_body = classify(model, opt), classify(ref, ref_opt)
        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        for i, ((tokens, lengths), y) in enumerate(batches):
            torch.manual_seed(i)
            loss = step(tokens, lengths, y)
            torch.manual_seed(i)
            assert torch.equal(loss, ref_body(tokens, lengths, y)), i
            assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
    assert step.num_traces == 3, [t.reason for t in step.traces]


def classify(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    def body(*args: Any) -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(*args[:-1]), args[-1])
        loss.backward()
        opt.step()
        return loss.detach()

    return body


@pytest.mark.inductor
def test_packed_gru_with_tensor_lengths_under_inductor() -> None:
    torch.manual_seed(0)
    model = models.PackedClassifier(nn.GRU)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    body, ref_body = classify(model, opt), classify(ref, ref_opt)
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="inductor")
    # Two lengths in every batch, in another order per pattern: each time step runs 5 or 2
    # sequences (two sets of kernels to compile, not one per time step), and the packing
    # is the same for both orders, so one trace serves both: the sorting is the graph's.
    # Short (4 and 2): the time steps are unrolled in the graph, and Inductor's compile
    # time grows with it (over 2 minutes cold on 2 cores with 8 and 3).
    batches = length_batches(2, 4, as_tensor=True, two_lengths=True)
    for i, ((tokens, lengths), y) in enumerate(batches):
        torch.manual_seed(i)
        loss = step(tokens, lengths, y)
        torch.manual_seed(i)
        torch.testing.assert_close(loss, ref_body(tokens, lengths, y), **INDUCTOR)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, **INDUCTOR)
    assert step.num_traces == 1


def test_packed_lengths_computed_from_the_tokens_say_to_pass_them() -> None:
    # Their values come from the batch of data: a trace per call if read, so refused.
    model = models.PackedClassifier(nn.GRU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    body = classify(model, opt)
    step = functacc.jit(
        lambda tokens, y: body(tokens, (tokens != 0).sum(1), y),
        modules=[model],
        optimizers=[opt],
        backend="eager",
    )
    (tokens, _), y = length_batches(1, 1)[0]
    with pytest.raises(functacc.TraceError, match=r"argument of the step, a tensor"):
        step(tokens, y)


# -- a bidirectional LSTM tagger, cells ----------------------------------------------------
def tag_batches(lengths: tuple[int, ...] = (9, 9, 9)) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, 40, (4, n), generator=g), torch.randint(0, 5, (4, n), generator=g))
        for n in lengths
    ]


def tag_loss(scores: Tensor, tags: Tensor) -> Tensor:
    return F.cross_entropy(scores.flatten(0, 1), tags.flatten())


@pytest.mark.parametrize(
    "make", [models.BiLSTMTagger, models.CellTagger], ids=["bilstm_tagger", "cells"]
)
def test_taggers_through_both_front_doors_are_eager_bit_for_bit(make: Callable) -> None:
    # CellTagger: an LSTMCell, a GRUCell and an RNNCell unrolled over time. Through jit the
    # GRU and LSTM cells left eager's numbers by 3e-8 before (functionalization ran their
    # in-place sigmoid_ on a contiguous copy, core/eager_inplace.py).
    for front_door in ("compile_step", "jit"):
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        batches = tag_batches()
        if front_door == "compile_step":
            step = functacc.compile_step(model, tag_loss, opt, backend="eager")
            losses = functacc_train(step, batches)
        else:
            body = tag_step(model, opt)
            step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
            losses = []
            for i, (x, y) in enumerate(batches):
                torch.manual_seed(1000 + i)  # helpers.seed_for, as eager_train seeds
                losses.append(step(x, y))
        ref_losses = eager_train(ref, ref_opt, tag_loss, batches)
        assert_same_training(model, opt, ref, ref_opt, losses, ref_losses, rtol=0, atol=0)
        assert step.num_traces == 1, (front_door, [t.reason for t in step.traces])


def tag_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = tag_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def test_new_lengths_retrace_with_static_sizes_and_eager_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # eager's LSTM kernels take concrete sizes: a third length is a third static trace,
    # not a symbolic one (which failed, or took torch's decompositions: other numbers).
    torch.manual_seed(0)
    model = models.BiLSTMTagger()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = functacc.compile_step(model, tag_loss, opt, backend="eager")
    batches = tag_batches((9, 7, 5, 9))
    with caplog.at_level("WARNING", logger="functacc"):
        losses = functacc_train(step, batches)
    ref_losses = eager_train(ref, ref_opt, tag_loss, batches)
    assert_same_training(model, opt, ref, ref_opt, losses, ref_losses, rtol=0, atol=0)
    assert step.num_traces == 3 and not any(t.dynamic for t in step.traces)
    # The third trace warns, with advice that works here: buckets, not dynamic=True.
    (warning,) = [r.getMessage() for r in caplog.records if "trace #3" in r.getMessage()]
    assert "buckets=" in warning and "dynamic=True" not in warning, warning
    with pytest.warns(UserWarning, match="dynamic=True is ignored"):
        functacc.compile_step(model, tag_loss, opt, backend="eager", dynamic=True)


# -- from the ecosystem: Hugging Face's Parakeet RNN-T heads -------------------------------
def test_parakeet_rnnt_heads_through_jit_are_eager_bit_for_bit() -> None:
    # transformers' ParakeetRNNTDecoder (nn.LSTM, batch first) and its joint network,
    # trained on random acoustic frames with a cross entropy per (frame, token) pair.
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
        torch.manual_seed(0)
        heads = models.rnnt_heads()
        opt = torch.optim.Adam(heads.parameters(), lr=1e-3)

        def body(tokens: Tensor, frames: Tensor, targets: Tensor) -> Tensor:
            opt.zero_grad()
            predicted = heads["decoder"](tokens)
            logits = heads["joint"](
                decoder_hidden_states=predicted[:, None], encoder_hidden_states=frames[:, :, None]
            )
            loss = F.cross_entropy(logits.flatten(0, 2), targets.flatten())
            loss.backward()
            opt.step()
            return loss.detach()

        return heads, opt, body

    heads, opt, body = build()
    ref, ref_opt, ref_body = build()
    step = functacc.jit(body, modules=[heads], optimizers=[opt], backend="eager")
    g = torch.Generator().manual_seed(4)
    for i in range(3):
        tokens = torch.randint(1, 20, (3, 5), generator=g)
        frames = torch.randn(3, 7, 16, generator=g)
        targets = torch.randint(0, 20, (3, 7, 5), generator=g)
        loss = step(tokens, frames, targets)
        assert torch.equal(loss, ref_body(tokens, frames, targets)), i
        assert_same(tensors_of([heads], [opt]), tensors_of([ref], [ref_opt]))
    assert step.num_traces == 1, [t.reason for t in step.traces]
