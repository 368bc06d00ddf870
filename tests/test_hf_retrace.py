"""A setting that the forward fills in once, on its first call, costs no second trace.

Hugging Face's sequence and image classifiers set ``config.problem_type`` from ``None`` at
their first forward and never again. The step keys its graph on the signature the forward
leaves behind once a second, uncompiled trace with the new value gives the same graph;
a forward that changes a setting on every call is traced again as before. The reference
is the same training as a plain eager loop on a copy of the model.
"""

from __future__ import annotations

import copy
import functools
import logging
import types

import pytest
import torch
import transformers
from helpers import assert_close, seed_for
from torch import nn

import functacc


def bert() -> tuple[nn.Module, list[dict]]:
    config = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
        num_labels=3,
        pad_token_id=0,
    )
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "input_ids": torch.randint(1, 64, (4, 12), generator=g),
            "attention_mask": torch.ones(4, 12, dtype=torch.long),
            "labels": torch.randint(0, 3, (4,), generator=g),
        }
        for _ in range(3)
    ]
    return transformers.BertForSequenceClassification(config), batches


def image_batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "pixel_values": torch.randn(2, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 3, (2,), generator=g),
        }
        for _ in range(3)
    ]


def vit() -> tuple[nn.Module, list[dict]]:
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config), image_batches()


def swin() -> tuple[nn.Module, list[dict]]:
    config = transformers.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=3,
    )
    return transformers.SwinForImageClassification(config), image_batches()


MODELS = {"bert": bert, "vit": vit, "swin": swin}


def train_like_eager(make, make_opt, *, backend: str, rtol: float, atol: float) -> functacc.Step:
    """Three steps of the compiled step and of the eager loop on a copy (the RNG reseeded
    before each, for dropout), compared after every step; returns the step."""
    torch.manual_seed(0)
    model, batches = make()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    step = functacc.compile_step(model, None, opt, backend=backend)
    assert model.config.problem_type is None  # set by the first forward
    for i, batch in enumerate(batches):
        torch.manual_seed(seed_for(i))
        loss = step(**batch)
        torch.manual_seed(seed_for(i))
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol, what=f"loss {i}")
        assert_close(model.state_dict(), ref.state_dict(), rtol=rtol, atol=atol, what=f"model {i}")
        assert model.config.problem_type == ref.config.problem_type
    assert model.config.problem_type == "single_label_classification"
    return step


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_classifier_traces_once_and_matches_eager_exactly(name) -> None:
    # Before: 2 traces, the second for "module attributes model.config problem_type:
    # None -> 'single_label_classification'", a graph identical to the first.
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    step = train_like_eager(MODELS[name], adamw, backend="eager", rtol=0, atol=0)
    assert [r.reason for r in step.traces] == ["first call"]


@pytest.mark.inductor
def test_hf_classifier_compiles_once_under_inductor() -> None:
    # Under Inductor the second trace was a second full compile (about 2 minutes on a
    # loaded 2-core CPU). Inductor fuses and reorders float32 reductions, so the results
    # are not bit-exact: losses measured equal, parameters within 6e-9. SGD, not AdamW:
    # Adam divides by the gradients' size, so where a gradient is zero but for rounding
    # (the attention key's bias, which the softmax ignores) it steps on that rounding,
    # 1.6e-6 apart after three steps.
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    step = train_like_eager(bert, sgd, backend="inductor", rtol=1e-5, atol=1e-6)
    assert step.num_traces == 1


class FillsSetting(nn.Module):
    """A forward that adds a setting to its config on the first call (absent before) and
    reads it afterwards, as a lazily resolved option."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.config = types.SimpleNamespace(scale=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self.config, "mode"):
            self.config.mode = "scaled"
        h = self.lin(x)
        return h * self.config.scale if self.config.mode == "scaled" else h


class ReadsBeforeFilling(nn.Module):
    """A forward whose first call takes another path than the later ones: it reads the
    setting before it fills it in. Eager scales by 1 at the first step, by 3 after."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.config = types.SimpleNamespace(warmed=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if self.config.warmed is None else 3.0
        self.config.warmed = True
        return self.lin(x) * scale


class FlipsFlag(nn.Module):
    """A forward that changes its setting on every call: None, True, False, True, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.config = types.SimpleNamespace(flag=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.config.flag = not self.config.flag
        return self.lin(x)


def train_plain(model: nn.Module, steps: int, caplog) -> tuple[functacc.Step, list]:
    """``steps`` steps against the eager loop on a copy, exactly; the model's config after
    each step must be eager's too. Returns the step and the warnings it logged."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = functacc.compile_step(model, nn.MSELoss(), opt, backend="eager")
    caplog.set_level(logging.INFO, logger="functacc")
    for i in range(steps):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        loss = step(x, y)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss, ref_loss.detach()), i
        assert vars(model.config) == vars(ref.config), i
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return step, warnings


def test_a_setting_added_by_the_first_forward_costs_no_trace(caplog) -> None:
    # Before: 2 traces, the second for "module attributes model.config mode added".
    step, _ = train_plain(FillsSetting(), 3, caplog)
    assert step.num_traces == 1


def test_a_forward_that_reads_a_setting_before_filling_it_traces_again(caplog) -> None:
    # Its first graph (scale 1) is not the later one (scale 3): the second trace shows it,
    # and the step is traced again at the second call, as eager reads the new value.
    step, _ = train_plain(ReadsBeforeFilling(), 3, caplog)
    assert step.num_traces == 2
    assert step.traces[1].reason == "module attributes model.config warmed: None -> True"


def test_a_forward_that_changes_a_setting_every_call_replays_it_without_retracing(caplog) -> None:
    # The step follows the forward's Python write (flag = not flag) and replays it after
    # every call, so the config holds what eager leaves after each step (train_plain checks
    # it) with one trace and no warning. (The pure step watched the config as a signature and
    # retraced on every call, with a warning from the third trace on.)
    step, warnings = train_plain(FlipsFlag(), 3, caplog)
    assert step.num_traces == 1
    assert warnings == []
