"""A module that fills a cache of its own in its forward: a dict keyed by the sequence
length, the pattern of lucidrains' rotary-embedding-torch before 0.5 (``if cache_key in
self.cache: return self.cache[cache_key]`` ... ``self.cache[cache_key] = freqs``, with
``cache_key=seq_len``), copied into many models since, often as ``self._cache``.

Before 2026-11-29: the first trace wrote its fake tensor into a private attribute's dict
(``self._cache``), and the next trace read it ("Mixing fake modes NYI", blamed on the
inputs), leaving the fake tensor there; a second length, traced with symbolic sizes,
failed hashing the size ("unhashable type: non-nested SymInt"), whatever the name.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import functacc


class RotaryCache(nn.Module):
    """Rotary frequencies per position, kept per sequence length in a plain dict, under
    the attribute ``name`` (``cache`` as lucidrains', ``_cache`` as many others')."""

    def __init__(self, dim: int, name: str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
        self.name = name
        setattr(self, name, {})

    def freqs(self, seq_len: int) -> Tensor:
        cache = getattr(self, self.name)
        if seq_len in cache:
            return cache[seq_len]
        angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * self.inv_freq
        freqs = torch.cat([angles, angles], dim=-1)
        cache[seq_len] = freqs
        return freqs

    def rotate(self, x: Tensor) -> Tensor:
        freqs = self.freqs(x.shape[-2])
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * freqs.cos() + turned * freqs.sin()


class Attention(nn.Module):
    def __init__(self, cache: str, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.rotary = RotaryCache(d // heads, cache)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = self.rotary.rotate(qkv[0]), self.rotary.rotate(qkv[1]), qkv[2]
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, n, d))


def language_model(cache: str = "_cache") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), Attention(cache), nn.Linear(16, 20))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    def step(tokens: Tensor) -> float:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def token_batches(lengths: list[int]) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 20, (2, n), generator=g) for n in lengths]


@pytest.mark.parametrize(
    ("dynamic", "name"), [(None, "cache"), (True, "_cache"), (False, "_cache")]
)
def test_a_cache_dict_filled_in_the_forward_holds_eagers_tensors(
    dynamic: bool | None, name: str
) -> None:
    # Lengths 6, 6, 9, 6, 12: the cache gains an entry per new length and is read for a
    # length seen before; every loss, weight and cached tensor eager's (rtol=atol=0). Under
    # dynamic=None the third call's trace would make the length symbolic, and True makes
    # it so from the start: a size hashed (a dict key) is traced static instead, and said.
    # A private attribute (`_cache`) is not recorded by the first trace: the dict is then
    # put back after it and followed from the next.
    batches = token_batches([7, 7, 10, 7, 13])
    model, opt = language_model(name)
    ref_model, ref_opt = copy.deepcopy(model), copy.deepcopy(opt)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    expected = [train_step(ref_model, ref_opt)(t) for t in batches]
    step = functacc.jit(
        train_step(model, opt), modules=[model], optimizers=[opt], backend="eager", dynamic=dynamic
    )
    assert [step(t) for t in batches] == expected
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    cache, ref_cache = getattr(model[1].rotary, name), getattr(ref_model[1].rotary, name)
    assert list(cache) == list(ref_cache) == [6, 9, 12]
    for key, value in cache.items():
        assert type(value) is Tensor and torch.equal(value, ref_cache[key]), key
    reasons = " | ".join(t.reason for t in step.traces)
    if dynamic is not False:
        assert "a size hashed at test_jit_module_caches.py:" in reasons, reasons


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.transpose(1, 2), targets)


def test_compile_step_of_the_model_trains_and_caches_as_eager() -> None:
    # The same model through compile_step (the standard step over the same capture).
    model, opt = language_model()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    compiled = functacc.compile_step(model, cross_entropy, opt, backend="eager")
    for tokens in token_batches([5, 5, 7, 5]):
        ref_opt.zero_grad()
        expected = cross_entropy(ref_model(tokens), tokens)
        expected.backward()
        ref_opt.step()
        assert torch.equal(compiled(tokens, tokens), expected.detach())
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    cache, ref_cache = model[1].rotary._cache, ref_model[1].rotary._cache
    assert list(cache) == list(ref_cache) == [5, 7]
    assert all(type(v) is Tensor and torch.equal(v, ref_cache[k]) for k, v in cache.items())


def test_a_failed_call_leaves_the_modules_cache_as_it_was() -> None:
    # The step fails after the forward filled the cache (a branch on a loss's value): the
    # model, its cache and the optimizer are as before the call, under both front doors.
    model, opt = language_model()
    before = copy.deepcopy(model.state_dict())

    def branchy_loss(logits: Tensor, targets: Tensor) -> Tensor:
        loss = cross_entropy(logits, targets)
        return loss * 2 if loss.item() > 0 else loss  # data-dependent: the trace cannot

    def branchy(tokens: Tensor) -> Tensor:
        loss = branchy_loss(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    tokens = token_batches([5])[0]
    for step in (
        functacc.jit(branchy, modules=[model], optimizers=[opt], backend="eager"),
        lambda t: functacc.compile_step(model, branchy_loss, opt, backend="eager")(t, t),
    ):
        with pytest.raises(functacc.TraceError, match="data-dependent"):
            step(tokens)
        assert model[1].rotary._cache == {}
        assert all(torch.equal(a, before[k]) for k, a in model.state_dict().items())
        assert opt.state == {}


def test_replacing_a_cached_tensor_under_a_key_it_had_is_eagers() -> None:
    # The same key, a tensor where None was: the dict's size does not change (before
    # 2026-11-29 the only change looked for), so the trace's fake tensor stayed in the
    # module after every call, silently (the losses were eager's).
    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self._seen: dict[str, Tensor | None] = {"last": None}

        def forward(self, x: Tensor) -> Tensor:
            out = self.lin(x)
            self._seen["last"] = out.detach().mean(0)
            return out

    torch.manual_seed(0)
    model = Last()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    compiled = functacc.compile_step(model, nn.functional.mse_loss, opt, backend="eager")
    for _ in range(3):
        x = torch.randn(3, 4)
        ref_opt.zero_grad()
        expected = nn.functional.mse_loss(ref(x), x)
        expected.backward()
        ref_opt.step()
        assert torch.equal(compiled(x, x), expected.detach())
        assert type(model._seen["last"]) is Tensor
        assert torch.equal(model._seen["last"], ref._seen["last"])


@functools.lru_cache(maxsize=8)
def causal_mask(n: int) -> Tensor:
    return torch.full((n, n), float("-inf")).triu(1)


class MaskedMixer(nn.Module):
    """Attention-like mixing over positions with a memoized mask (a global function) and
    memoized positions (a method under ``@functools.cache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @functools.cache  # noqa: B019 (the pattern under test: a method memoized per instance)
    def positions(self, n: int) -> Tensor:
        return torch.arange(n, dtype=torch.float32)[:, None] / n

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) + self.positions(x.shape[0])
        return (h @ h.T + causal_mask(x.shape[0])).softmax(-1) @ h


@pytest.mark.parametrize(
    ("filled", "backend"),
    [
        (False, "eager"),
        (True, "eager"),
        pytest.param(False, "inductor", marks=pytest.mark.inductor),
    ],
)
def test_memoized_functions_run_uncached_in_the_step_and_their_caches_stay_eagers(
    filled: bool, backend: str
) -> None:
    # Before 2026-11-29 a cache filled while traced kept the trace's fake tensor (after
    # the calls, causal_mask(6) gave eager code a FakeTensor, silently); one filled before
    # handed the trace a real tensor none of its inputs (a TraceError). Now the trace runs
    # the functions themselves: losses and weights eager's (rtol=atol=0), the caches as
    # they were, and what they give afterwards real tensors. Sizes 6, 6, 9 traced symbolic
    # (dynamic=True; a symbolic size has no hash, so a cache would have failed on it).
    torch.manual_seed(0)
    model = MaskedMixer()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def body(net: nn.Module, o: torch.optim.Optimizer) -> Any:
        def step(x: Tensor) -> float:
            loss = net(x).square().mean()
            o.zero_grad()
            loss.backward()
            o.step()
            return loss.item()

        return step

    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(n, 4, generator=g) for n in (6, 6, 9)]
    causal_mask.cache_clear()
    expected = [body(ref, ref_opt)(x) for x in batches]
    if not filled:
        causal_mask.cache_clear()
        MaskedMixer.positions.cache_clear()
    before = (causal_mask.cache_info(), MaskedMixer.positions.cache_info())
    step = functacc.jit(
        body(model, opt), modules=[model], optimizers=[opt], backend=backend, dynamic=True
    )
    got = [step(x) for x in batches]
    if backend == "eager":
        assert got == expected
    else:  # Inductor's fused float32 kernels round in another order: a few ulps
        assert got == pytest.approx(expected, rel=1e-5)
    exact = {"rtol": 0, "atol": 0} if backend == "eager" else {"rtol": 1e-5, "atol": 1e-6}
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, **exact)
    assert (causal_mask.cache_info(), MaskedMixer.positions.cache_info()) == before
    assert type(causal_mask(6)) is Tensor and type(model.positions(6)) is Tensor
    assert all(t.dynamic for t in step.traces), [t.reason for t in step.traces]


@functools.lru_cache
def running_total(n: int) -> Tensor:
    return torch.zeros(n)


def test_a_tensor_from_a_cache_written_in_place_is_a_clear_error_and_changes_nothing() -> None:
    # Eager's cache hands every call the same tensor, so an in-place write accumulates
    # across calls; run uncached, the trace would start from zeros at every call, silently.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())

    def step(x: Tensor) -> float:
        out = model(x)
        total = running_total(4)
        total.add_(out.detach().mean(0))
        loss = (out + total).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    running_total.cache_clear()
    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"memoized function running_total\(\)"):
        jitted(torch.randn(2, 4))
    assert running_total.cache_info().currsize == 0 and opt.state == {}
    assert all(torch.equal(a, before[k]) for k, a in model.state_dict().items())
