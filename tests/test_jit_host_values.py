"""A step that turns a batch's integer vector into Python numbers (``lengths.tolist()``,
``int(lengths.max())``) and loops or sizes with them: traced with those values, once per
distinct vector, eager's numbers bit for bit (functacc/core/host_values.py).

Before 2026-11-28 each of these was a ``TraceError`` ("cannot use tensor values as Python
numbers"), although the values are the call's own arguments, known before the graph runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import show_attend_tell as sat
import torch
from helpers import assert_same_training, eager_train, functacc_train
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

import functacc

VOCAB = 20


def captioning(optimizer: type = torch.optim.Adam) -> tuple[nn.Module, nn.Module, Any, Any]:
    """The tutorial's encoder, decoder and their two Adam optimizers, as its train.py makes
    them (sizes shrunk)."""
    torch.manual_seed(0)
    decoder = sat.DecoderWithAttention(
        attention_dim=12, embed_dim=10, decoder_dim=14, vocab_size=VOCAB
    )
    decoder_optimizer = optimizer(
        params=filter(lambda p: p.requires_grad, decoder.parameters()), lr=4e-4
    )
    encoder = sat.Encoder()
    encoder_optimizer = optimizer(
        params=filter(lambda p: p.requires_grad, encoder.parameters()), lr=1e-4
    )
    return encoder, decoder, encoder_optimizer, decoder_optimizer


def caption_step(
    encoder: nn.Module, decoder: nn.Module, encoder_optimizer: Any, decoder_optimizer: Any
) -> tuple[Callable, sat.AverageMeter, sat.AverageMeter]:
    """The body of the tutorial's ``train()`` loop (train.py), as written but for
    ``pack_padded_sequence(...).data``: the script's ``scores, _ = pack_padded_sequence(...)``
    unpacked the two-field PackedSequence of torch 0.4, which has four fields now."""
    criterion = nn.CrossEntropyLoss()
    losses, top5accs = sat.AverageMeter(), sat.AverageMeter()
    grad_clip, alpha_c = 5.0, 1.0

    def train_step(imgs: Tensor, caps: Tensor, caplens: Tensor) -> None:
        imgs = encoder(imgs)
        scores, caps_sorted, decode_lengths, alphas, sort_ind = decoder(imgs, caps, caplens)  # noqa: RUF059
        targets = caps_sorted[:, 1:]
        scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
        targets = pack_padded_sequence(targets, decode_lengths, batch_first=True).data
        loss = criterion(scores, targets)
        loss += alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        decoder_optimizer.zero_grad()
        if encoder_optimizer is not None:
            encoder_optimizer.zero_grad()
        loss.backward()
        if grad_clip is not None:
            sat.clip_gradient(decoder_optimizer, grad_clip)
            if encoder_optimizer is not None:
                sat.clip_gradient(encoder_optimizer, grad_clip)
        decoder_optimizer.step()
        if encoder_optimizer is not None:
            encoder_optimizer.step()
        top5 = sat.accuracy(scores, targets, 5)
        losses.update(loss.item(), sum(decode_lengths))
        top5accs.update(top5, sum(decode_lengths))

    return train_step, losses, top5accs


def caption_batches(
    n: int, patterns: int, fixed: Tensor | None = None
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Images, captions and their lengths as the tutorial's CaptionDataset gives them
    (lengths as a (batch, 1) column); ``patterns`` lists of lengths in turn, or ``fixed``."""
    g = torch.Generator().manual_seed(1)
    lengths = [torch.randint(3, 10, (6, 1), generator=g) for _ in range(patterns)]
    lengths = lengths if fixed is None else [fixed]
    for i in range(n):
        imgs = torch.randn(6, 3, 8, 8, generator=g)
        caps = torch.randint(1, VOCAB, (6, 9), generator=g)
        yield imgs, caps, lengths[i % len(lengths)].clone()


def run_captioning(
    backend: str | None,
    n: int,
    patterns: int,
    optimizer: type = torch.optim.Adam,
    lengths: Tensor | None = None,
) -> tuple[list, list, Any]:
    """Train the tutorial's captioner eagerly (``backend=None``) or jitted; its weights,
    optimizer states, meters and the step. ``lengths``: one column of caption lengths for
    every batch instead of ``patterns`` drawn ones."""
    encoder, decoder, enc_opt, dec_opt = captioning(optimizer)
    body, losses, top5 = caption_step(encoder, decoder, enc_opt, dec_opt)
    step = body
    if backend is not None:
        step = functacc.jit(
            body, modules=[encoder, decoder], optimizers=[enc_opt, dec_opt], backend=backend
        )
    for i, batch in enumerate(caption_batches(n, patterns, lengths)):
        torch.manual_seed(i)  # the decoder's dropout
        step(*batch)
    weights = [t.detach().clone() for m in (encoder, decoder) for t in m.state_dict().values()]
    states = [
        v.clone()
        for opt in (enc_opt, dec_opt)
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, Tensor)
    ]
    meters = [losses.sum, losses.count, losses.avg, top5.sum, top5.count, top5.avg]
    return weights + states, meters, step


def test_show_attend_tell_decoder_loops_over_its_lengths_as_eager() -> None:
    # Two lists of caption lengths in turn, 6 batches, and every number eager's
    # (rtol=atol=0: the same ops on the same values in the same order). Three traces: the
    # first call (no .grad yet), then with .grad one per list of lengths. The loss's
    # pack_padded_sequence (no recurrent layer packs) runs on the host too.
    expected, expected_meters, _ = run_captioning(None, 6, 2)
    got, got_meters, step = run_captioning("eager", 6, 2)
    assert got_meters == expected_meters
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    reasons = [t.reason for t in step.traces]
    assert len(reasons) == 3, reasons
    # The reason names the line that read the values (the decoder's `.tolist()`).
    line = next(
        i
        for i, text in enumerate(Path(sat.__file__).read_text().splitlines(), 1)
        if "decode_lengths = (caption_lengths - 1).tolist()" in text
    )
    assert f"read at show_attend_tell.py:{line}" in reasons[2], reasons


@pytest.mark.inductor
def test_show_attend_tell_under_inductor() -> None:
    # Inductor reassociates float32 reductions: within rtol 1e-5 (about 100 times the
    # 1e-7 the fused reductions give; another dropout mask or a wrong gradient gives 1e-3
    # and more). The sums of the meters count tokens (integers): exact. SGD, not the
    # script's Adam: Adam's first updates are lr * g / |g|, and a gradient that is zero up
    # to rounding (the conv bias before BatchNorm, the bias before the softmax) becomes
    # a +-lr update whose sign the reduction order decides (1e-4 apart after 3 steps).
    # Two caption lengths (4 and 3): the decoder's three time steps run on two batch sizes.
    # Short: the loop is unrolled in the graph, and Inductor's compile time grows with it
    # (4 minutes cold on 2 cores with lengths 7 and 4).
    lengths = torch.tensor([[4], [3], [4], [3], [3], [4]])
    expected, expected_meters, _ = run_captioning(None, 3, 1, torch.optim.SGD, lengths)
    got, got_meters, step = run_captioning("inductor", 3, 1, torch.optim.SGD, lengths)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_meters[1] == expected_meters[1] and got_meters[4] == expected_meters[4]
    assert got_meters == pytest.approx(expected_meters, rel=1e-5)
    assert step.num_traces == 2  # the first call, then with .grad


class Truncated(nn.Module):
    """Runs a cell over as many time steps as the longest sequence has
    (``range(int(lengths.max()))``: a Python loop, so a number the trace must know)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        h = torch.zeros(tokens.size(0), 8)
        for t in range(int(lengths.max())):
            h = torch.tanh(self.embed(tokens[:, t]) + self.mix(h))
        return self.head(h)


def truncated_batches(steps: int) -> list:
    g = torch.Generator().manual_seed(2)
    lengths = [torch.tensor([5, 3, 2]), torch.tensor([7, 7, 1])]
    return [
        (
            (torch.randint(0, 30, (3, 8), generator=g), lengths[i % 2].clone()),
            torch.randint(0, 3, (3,), generator=g),
        )
        for i in range(steps)
    ]


def test_compile_step_model_that_sizes_by_its_lengths() -> None:
    # compile_step traces with the same tracer: two lengths vectors, two traces, eager's.
    torch.manual_seed(0)
    model = Truncated()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = truncated_batches(4)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager")
    losses = functacc_train(step, batches)
    ref_losses = eager_train(ref, ref_opt, nn.CrossEntropyLoss(), batches)
    assert_same_training(model, opt, ref, ref_opt, losses, ref_losses, rtol=0, atol=0)
    assert step.num_traces == 2


def test_a_number_read_from_lengths_that_no_size_needs_stays_a_symbol() -> None:
    # `lengths.sum().item()` only computed with and returned: the first trace succeeds
    # with a symbol, so three different lengths run one graph (no trace per value).
    model, ref = nn.Linear(4, 1), None
    ref = copy.deepcopy(model)

    def body(net: nn.Module) -> Callable:
        def step(x: Tensor, lengths: Tensor) -> tuple[float, Tensor]:
            tokens = lengths.sum().item()
            return tokens * 2, net(x).sum() / tokens

        return step

    step = functacc.jit(body(model), modules=[model], backend="eager")
    for n in ([1, 2], [3, 4], [5, 9]):
        x, lengths = torch.randn(2, 4), torch.tensor(n)
        got, expected = step(x, lengths), body(ref)(x, lengths)
        assert got[0] == expected[0] and isinstance(got[0], int)
        assert torch.equal(got[1], expected[1].detach())
    assert step.num_traces == 1, [t.reason for t in step.traces]


def test_a_batch_of_data_read_as_numbers_is_still_an_error() -> None:
    # Float data (values differ every call) and a 2-D batch of tokens are not read: a
    # branch on them is the TraceError it was, at the first call, and nothing changed.
    model = nn.Linear(4, 1)
    before = copy.deepcopy(model.state_dict())

    def on_data(x: Tensor, tokens: Tensor) -> Tensor:
        if x.tolist()[0][0] > 0:
            return model(x).sum()
        return model(x).mean()

    def on_tokens(x: Tensor, tokens: Tensor) -> Tensor:
        return model(x[: max(tokens.tolist()[0])]).sum()

    for body in (on_data, on_tokens):
        step = functacc.jit(body, modules=[model], backend="eager")
        with pytest.raises(functacc.TraceError, match="Python numbers"):
            step(torch.randn(3, 4), torch.tensor([[1, 2], [2, 1]]))
        assert step.num_traces == 0
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k])


def test_lengths_that_change_every_call_end_in_a_retrace_error_naming_the_line() -> None:
    # Each new lengths vector is a trace; past max_traces the error names the line that
    # read the values and the fix (bucket the lengths, or compute with the tensor).
    torch.manual_seed(0)
    model = Truncated()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def body(tokens: Tensor, lengths: Tensor, y: Tensor) -> Tensor:
        loss = nn.functional.cross_entropy(model(tokens, lengths), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager", max_traces=2)
    tokens, y = torch.randint(0, 30, (3, 8)), torch.tensor([0, 1, 2])
    step(tokens, torch.tensor([2, 1, 1]), y)
    step(tokens, torch.tensor([3, 1, 1]), y)
    with pytest.raises(
        functacc.RetraceError, match=r"(?s)read at test_jit_host_values\.py:\d+.*bucket"
    ):
        step(tokens, torch.tensor([4, 1, 1]), y)
