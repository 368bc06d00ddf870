"""Loader buckets: the last dimension of the listed keys padded up to a few lengths.

The reference for training is eager PyTorch on the unpadded batches (each padded only to
its own longest sequence, as a tokenizer's collator does); the bucketed batches go
through ``compile_step``. With masked padding (attention mask 0, labels -100) the loss is
the same mathematics, but not the same arithmetic: padding changes the shapes of the
reductions (attention's softmax and matmuls over longer rows, the loss's mean over more
ignored positions), so float32 sums are taken in another order. Hence 1e-5 on the losses
(about 10 float32 ulps at loss ~4) rather than bit equality.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import transformers
from helpers import assert_close
from torch.utils.data import DataLoader

import functacc
from functacc.data.buckets import (
    DEFAULT_PAD_VALUES,
    geometric_buckets,
    make_padder,
    uniform_buckets,
)

LOSS_ATOL = 1e-5
# AdamW divides each update by the gradient's running RMS, so parameters whose gradients
# are rounding-sized move by rounding-sized fractions of a step (as in test_parallel).
PARAMS = {"rtol": 1e-4, "atol": 2e-5}

# Real lengths per sample, 4 per batch; batch maxima 7, 12, 20, 8, 16, 31 fall in the
# buckets 8, 16, 32, 8, 16, 32 (8 and 16 also hit exactly).
LENGTHS = [3, 5, 7, 4, 10, 12, 6, 9, 20, 3, 17, 11, 2, 8, 5, 8, 14, 15, 16, 13, 25, 31, 9, 30]
BUCKETS = [8, 16, 32]


class Sequences(torch.utils.data.Dataset):
    """Token sequences of the given lengths (ids 1..63; 0 is the pad id)."""

    def __init__(self, lengths: list[int], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, 64, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def pad_to_longest(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tokenizer collator's "longest" padding: each batch as long as its longest."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loader(lengths: list[int] = LENGTHS) -> DataLoader:
    return DataLoader(Sequences(lengths), batch_size=4, collate_fn=pad_to_longest)


# -- building buckets ----------------------------------------------------------------------
def test_uniform_buckets_are_torchaccs() -> None:
    for max_length, n in ((512, 8), (128, 4), (64, 1)):
        assert uniform_buckets(max_length, n) == [max_length // n * (i + 1) for i in range(n)]
    # TorchAcc's last bucket stops short of max_length when n does not divide it; here the
    # last is max_length, so every length up to it fits.
    assert uniform_buckets(100, 8) == [12, 24, 36, 48, 60, 72, 84, 100]


def test_geometric_buckets_grow_by_a_constant_ratio() -> None:
    sizes = geometric_buckets(512, 8)
    assert sizes[0] == 64 and sizes[-1] == 512 and len(sizes) == 8
    ratios = [b / a for a, b in itertools.pairwise(sizes)]
    assert max(ratios) / min(ratios) < 1.05
    assert geometric_buckets(10, 8) == sorted(set(geometric_buckets(10, 8)))  # no repeats
    assert make_padder(max_length=512, bucket_spacing="geometric").buckets == sizes


# -- padding ---------------------------------------------------------------------------
def test_pads_listed_keys_to_the_smallest_bucket_and_leaves_the_rest() -> None:
    batch = pad_to_longest([torch.arange(1, 6), torch.arange(1, 4)])  # length 5
    batch["pixel_values"] = torch.randn(2, 5)  # not listed: left alone
    before = copy.deepcopy(batch)
    out = make_padder(buckets=[16, 8, 32])(batch)  # any order
    assert {k: v.shape[-1] for k, v in out.items()} == {
        "input_ids": 8,
        "attention_mask": 8,
        "labels": 8,
        "pixel_values": 5,
    }
    assert out["pixel_values"] is batch["pixel_values"]
    for key, value in DEFAULT_PAD_VALUES.items():
        assert torch.equal(out[key][:, :5], batch[key])
        assert (out[key][:, 5:] == value).all()
    assert_close(batch, before, rtol=0, atol=0, what="the input batch")  # not modified


def test_a_batch_of_bucket_length_is_not_copied() -> None:
    batch = pad_to_longest([torch.arange(1, 9)])
    out = make_padder(buckets=[8, 16])(batch)
    assert all(out[k] is batch[k] for k in batch)


def test_tuple_batches_are_keyed_by_position() -> None:
    ids, labels, weights = torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2)
    out = make_padder(buckets=[4], pad_values={0: 0, 1: -100})((ids, labels, weights))
    assert isinstance(out, tuple) and out[2] is weights
    assert out[0].tolist() == [[1, 1, 1, 0]] * 2
    assert out[1].tolist() == [[0, 0, 0, -100]] * 2
    with pytest.raises(TypeError, match="pad_values must be keyed by position"):
        make_padder(buckets=[4])((ids, labels))
    with pytest.raises(TypeError, match=r"keyed by position .* but the batch is a dict"):
        make_padder(buckets=[4], pad_values={0: 0})({"input_ids": ids})


def test_too_long_names_key_length_and_buckets_or_truncates() -> None:
    batch = pad_to_longest([torch.arange(1, 41)])  # length 40
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] has length 40 .* \[8, 16, 32\]"):
        make_padder(buckets=BUCKETS)(batch)
    out = make_padder(buckets=BUCKETS, truncation=True)(batch)
    assert all(v.shape[-1] == 32 and v.is_contiguous() for v in out.values())
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :32])
    out = make_padder(max_length=24, num_buckets=3, truncation=True)(batch)
    assert out["input_ids"].shape[-1] == 24


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"pixel_values": torch.ones(2, 3)}, "none of the keys to pad"),
        ({"input_ids": torch.ones(2, 3), "labels": torch.ones(2)}, r"has shape \(2,\)"),
        ({"input_ids": [[1, 2]]}, r"batch\['input_ids'\] must be a tensor"),
        (torch.ones(2, 3), "dict or tuple batches; got a Tensor"),
    ],
)
def test_batches_that_cannot_be_padded_are_clear_errors(batch, message) -> None:
    with pytest.raises((TypeError, ValueError, KeyError), match=message):
        make_padder(buckets=BUCKETS)(batch)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"buckets": []}, "buckets must be a non-empty list"),
        ({"buckets": [8, 0]}, "buckets must be a non-empty list"),
        ({"buckets": "8,16"}, "buckets must be a non-empty list"),
        ({"max_length": 0}, "max_length must be an int >= 1"),
        ({"max_length": 16, "num_buckets": 0}, "num_buckets must be an int >= 1"),
        ({"max_length": 4, "num_buckets": 8}, r"num_buckets \(8\) must be <= max_length"),
        ({"num_buckets": 4}, "num_buckets is set but bucketing is off"),
        ({"pad_values": {"input_ids": 0}}, "pad_values is set but bucketing is off"),
        ({"truncation": True}, "truncation is set but bucketing is off"),
        ({"buckets": [8], "pad_values": {"input_ids": "0"}}, "pad_values values must be"),
        ({"buckets": [8], "pad_values": {"a": 0, 1: 0}}, "pad_values keys must be all str"),
        ({"buckets": [8], "bucket_spacing": "geometric"}, "bucket_spacing only shapes"),
        ({"max_length": 8, "bucket_spacing": "log"}, "bucket_spacing must be 'uniform'"),
    ],
)
def test_invalid_options_name_the_argument(options, field) -> None:
    with pytest.raises(ValueError, match=field):
        functacc.DeviceLoader(loader(), **options)


def test_explicit_buckets_win_over_max_length_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="max_length and num_buckets are ignored"):
        padder = make_padder(buckets=[8, 16], max_length=512)
    assert padder is not None and padder.buckets == [8, 16]


def test_device_loader_pads_on_the_host_and_reports_errors() -> None:
    shapes = [tuple(b["input_ids"].shape) for b in functacc.DeviceLoader(loader(), buckets=BUCKETS)]
    assert shapes == [(4, 8), (4, 16), (4, 32), (4, 8), (4, 16), (4, 32)]
    with pytest.raises(ValueError, match=r"has length 20 .* largest bucket 16"):
        list(functacc.DeviceLoader(loader(), buckets=[8, 16]))  # raised on the prefetch thread


# -- training: padded batches give the unpadded loss -------------------------------------------
def gpt2(n_layer: int = 2) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=n_layer, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def eager_losses(model: torch.nn.Module, batches) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def bucketed_losses(model, backend: str, data: DataLoader) -> tuple[list[float], set, int]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # buckets: one static graph per bucket
    step = functacc.compile_step(model, None, opt, backend=backend, dynamic=False)
    losses, lengths = [], set()
    bucketed = functacc.DeviceLoader(
        data, device="cpu", buckets=BUCKETS, pad_values=DEFAULT_PAD_VALUES
    )
    for batch in bucketed:
        lengths.add(batch["input_ids"].shape[-1])
        losses.append(float(step(**batch)))
    return losses, lengths, step.num_traces


@pytest.mark.parametrize("make", [gpt2, bert], ids=["gpt2", "bert_mlm"])
def test_bucketed_training_matches_unpadded_eager(make) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    ref_losses = eager_losses(reference, loader())
    losses, lengths, traces = bucketed_losses(model, "eager", loader())
    assert lengths == set(BUCKETS)
    assert traces == len(lengths)  # one trace per bucket
    assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=LOSS_ATOL, what="losses"
    )
    assert_close(model.state_dict(), reference.state_dict(), **PARAMS, what="parameters")


@pytest.mark.inductor
def test_bucketed_training_under_inductor() -> None:
    # Inductor fuses and reorders float32 arithmetic on top of the padding's reordering:
    # losses within 1e-4, parameters as above.
    torch.manual_seed(0)
    model = gpt2(n_layer=1)
    reference = copy.deepcopy(model)
    lengths = [3, 5, 7, 4, 10, 12, 6, 9, 2, 8, 5, 8, 14, 15, 16, 13]  # buckets 8 and 16
    ref_losses = eager_losses(reference, loader(lengths))
    losses, used, traces = bucketed_losses(model, "inductor", loader(lengths))
    assert used == {8, 16} and traces == 2
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-4, what="losses")
    assert_close(model.state_dict(), reference.state_dict(), **PARAMS, what="parameters")


# -- accelerate --------------------------------------------------------------------------
def no_compile() -> functacc.Config:
    config = functacc.Config()
    config.compute.compile = False
    return config


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"buckets": [8, 16, 32]}, [8, 16, 32, 8, 16, 32]),
        ({"max_length": 32, "num_buckets": 2}, [16, 16, 32, 16, 16, 32]),
        ({"max_length": 16, "truncation": True}, [8, 12, 16, 8, 16, 16]),  # buckets of 2
    ],
)
def test_accelerate_config_dataloader_buckets_reach_the_loader(setting, expected) -> None:
    config = no_compile()
    for name, value in setting.items():
        setattr(config.dataloader, name, value)
    _, bucketed = functacc.accelerate(torch.nn.Linear(2, 2), loader(), config)
    assert [b["input_ids"].shape[-1] for b in bucketed] == expected


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("buckets", [0, 8], "dataloader.buckets must be a non-empty list"),
        ("max_length", -1, "dataloader.max_length must be an int >= 1"),
        ("num_buckets", 3, "dataloader.num_buckets is set but bucketing is off"),
        ("pad_value_dict", ["input_ids"], "dataloader.pad_value_dict must be a non-empty dict"),
        ("bucket_spacing", "cubic", "dataloader.bucket_spacing must be"),
        ("truncation", "yes", "dataloader.truncation must be True or False"),
    ],
)
def test_accelerate_invalid_bucket_config_names_the_field(field, value, message) -> None:
    config = no_compile()
    setattr(config.dataloader, field, value)
    with pytest.raises(ValueError, match=message):
        functacc.accelerate(torch.nn.Linear(2, 2), loader(), config)
