"""Buckets: pad each batch's sequence length up to one of a few fixed lengths.

A compiled step is traced once per input shape. Batches padded to the longest sequence in
each batch have a new length almost every step (a new trace each time); padding every
batch to one maximum wastes compute on padding. Buckets sit between: the last dimension of
the listed keys is padded up to the smallest bucket that holds it, so the step sees at
most ``len(buckets)`` shapes. The names and defaults are TorchAcc's
(``config.dataloader.buckets / max_length / num_buckets / pad_value_dict``).

With masked padding (``attention_mask`` 0, ``labels`` -100, which Hugging Face losses
ignore) the loss is that of the unpadded batch.

Example:
    >>> import torch
    >>> from functacc.data.buckets import make_padder
    >>> pad = make_padder(buckets=[8, 16])
    >>> batch = {"input_ids": torch.ones(2, 5, dtype=torch.long),
    ...          "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    >>> {k: tuple(v.shape) for k, v in pad(batch).items()}
    {'input_ids': (2, 8), 'attention_mask': (2, 8)}
"""

from __future__ import annotations

import bisect
import copy
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NUM_BUCKETS",
    "DEFAULT_PAD_VALUES",
    "BucketPadder",
    "geometric_buckets",
    "make_padder",
    "uniform_buckets",
]

DEFAULT_PAD_VALUES: dict[str, float] = {"input_ids": 0, "attention_mask": 0, "labels": -100}
"""TorchAcc's default ``pad_value_dict``: ``labels`` -100 is the ignore index of the
cross-entropy losses of Hugging Face models."""
DEFAULT_NUM_BUCKETS = 8
"""TorchAcc's default number of buckets built from ``max_length``."""

Spacing = Literal["uniform", "geometric"]


def uniform_buckets(max_length: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> list[int]:
    """TorchAcc's buckets: ``max_length // num_buckets * (i + 1)``; the last one is
    ``max_length`` itself (TorchAcc's stops short of it when ``num_buckets`` does not
    divide ``max_length``), so every length up to ``max_length`` fits.

    Example:
        >>> uniform_buckets(512, 4)
        [128, 256, 384, 512]
    """
    step = max_length // num_buckets
    return [step * (i + 1) for i in range(num_buckets - 1)] + [max_length]


def geometric_buckets(max_length: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> list[int]:
    """Buckets from ``max_length // num_buckets`` to ``max_length`` in a constant ratio:
    the padding is at most a fixed fraction of a batch (uniform buckets waste up to half
    of a short batch). Fewer than ``num_buckets`` if rounding makes some equal.

    Example:
        >>> geometric_buckets(512, 4)
        [128, 204, 323, 512]
    """
    low = max(1, max_length // num_buckets)
    if num_buckets == 1:
        return [max_length]
    ratio = (max_length / low) ** (1 / (num_buckets - 1))
    sizes = {min(max_length, math.ceil(low * ratio**i - 1e-9)) for i in range(num_buckets)}
    return sorted(sizes | {max_length})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(names: Mapping[str, str] | None) -> dict[str, str]:
    fields = ("buckets", "max_length", "num_buckets", "pad_values", "bucket_spacing", "truncation")
    return {f: (names or {}).get(f, f) for f in fields}


def make_padder(
    *,
    buckets: Sequence[int] | None = None,
    max_length: int | None = None,
    num_buckets: int | None = None,
    pad_values: Mapping[str | int, float] | None = None,
    bucket_spacing: Spacing = "uniform",
    truncation: bool = False,
    pin_memory: bool = False,
    names: Mapping[str, str] | None = None,
) -> BucketPadder | None:
    """Check the bucket options and build the padder (``None`` when bucketing is off).

    ``buckets`` are used as given; else ``max_length`` with ``num_buckets`` (default 8)
    builds them with ``bucket_spacing``. ``truncation=True`` cuts a batch longer than the
    largest bucket to that bucket instead of raising. ``names`` maps the option names to
    the ones errors should name (``Config`` passes ``dataloader.buckets`` ...).
    """
    n = _names(names)
    if buckets is not None and (
        isinstance(buckets, (str, bytes))
        or not isinstance(buckets, Sequence)
        or not buckets
        or not all(_is_int(b) and b > 0 for b in buckets)
    ):
        raise ValueError(
            f"{n['buckets']} must be a non-empty list of positive ints (sequence "
            f"lengths), e.g. [128, 256, 512]; got {buckets!r}"
        )
    if max_length is not None and (not _is_int(max_length) or max_length < 1):
        raise ValueError(f"{n['max_length']} must be an int >= 1 or None; got {max_length!r}")
    if num_buckets is not None and (not _is_int(num_buckets) or num_buckets < 1):
        raise ValueError(f"{n['num_buckets']} must be an int >= 1 or None; got {num_buckets!r}")
    if bucket_spacing not in ("uniform", "geometric"):
        raise ValueError(
            f"{n['bucket_spacing']} must be 'uniform' or 'geometric'; got {bucket_spacing!r}"
        )
    if not isinstance(truncation, bool):
        raise ValueError(f"{n['truncation']} must be True or False; got {truncation!r}")
    if pad_values is not None:
        _check_pad_values(pad_values, n["pad_values"])
    if buckets is None and max_length is None:
        for field, value, default in (
            ("num_buckets", num_buckets, None),
            ("pad_values", pad_values, None),
            ("bucket_spacing", bucket_spacing, "uniform"),
            ("truncation", truncation, False),
        ):
            if value != default:
                raise ValueError(
                    f"{n[field]} is set but bucketing is off; set {n['buckets']} or "
                    f"{n['max_length']} too, or leave {n[field]} unset"
                )
        return None
    if buckets is not None:
        if max_length is not None or num_buckets is not None:
            # TorchAcc's rule: explicit buckets win.
            warnings.warn(
                f"{n['max_length']} and {n['num_buckets']} are ignored because "
                f"{n['buckets']} is set (as in TorchAcc)",
                stacklevel=3,
            )
        if bucket_spacing != "uniform":
            raise ValueError(
                f"{n['bucket_spacing']} only shapes buckets built from {n['max_length']}; "
                f"{n['buckets']} is given explicitly"
            )
        sizes = sorted(set(buckets))
    else:
        assert max_length is not None
        count = num_buckets if num_buckets is not None else DEFAULT_NUM_BUCKETS
        if count > max_length:
            raise ValueError(
                f"{n['num_buckets']} ({count}) must be <= {n['max_length']} ({max_length}): "
                "the buckets are multiples of max_length // num_buckets"
            )
        build = uniform_buckets if bucket_spacing == "uniform" else geometric_buckets
        sizes = build(max_length, count)
    return BucketPadder(
        sizes,
        dict(pad_values) if pad_values is not None else dict(DEFAULT_PAD_VALUES),
        truncation=truncation,
        pin_memory=pin_memory,
    )


def _check_pad_values(pad_values: Any, name: str) -> None:
    if not isinstance(pad_values, Mapping) or not pad_values:
        raise ValueError(
            f"{name} must be a non-empty dict of key -> pad value, e.g. "
            f"{DEFAULT_PAD_VALUES}; got {pad_values!r}"
        )
    keys = list(pad_values)
    if not (all(isinstance(k, str) for k in keys) or all(_is_int(k) for k in keys)):
        raise ValueError(
            f"{name} keys must be all str (dict batches) or all int (positions in tuple "
            f"batches); got {keys!r}"
        )
    bad = {k: v for k, v in pad_values.items() if not isinstance(v, (int, float))}
    if bad:
        raise ValueError(f"{name} values must be numbers (the pad value); got {bad!r}")


class BucketPadder:
    """Pads the last dimension of the listed entries of a batch up to its bucket.

    Dict batches (and other mappings, such as Hugging Face's ``BatchEncoding``) are keyed
    by name; tuple and list batches by position (``pad_values={0: 0, 1: -100}``). Entries
    not listed are left as they are; listed names a batch lacks are skipped. Each entry
    gets the smallest bucket that holds its own length. Returns a new batch (the input is
    not modified).
    """

    def __init__(
        self,
        buckets: Sequence[int],
        pad_values: Mapping[str | int, float],
        *,
        truncation: bool = False,
        pin_memory: bool = False,
    ):
        self.buckets = sorted(buckets)
        self.pad_values = dict(pad_values)
        self.truncation = truncation
        self.pin_memory = pin_memory
        self._by_position = all(_is_int(k) for k in self.pad_values)

    def bucket_for(self, length: int) -> int:
        """The smallest bucket >= ``length`` (the largest if truncating a longer one)."""
        i = bisect.bisect_left(self.buckets, length)
        return self.buckets[i] if i < len(self.buckets) else self.buckets[-1]

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            if self._by_position:
                raise TypeError(
                    f"pad_values is keyed by position ({list(self.pad_values)}) but the batch "
                    f"is a {type(batch).__name__} with keys {list(batch)}; key pad_values by "
                    "name, e.g. {'input_ids': 0, 'attention_mask': 0, 'labels': -100}"
                )
            keys = [k for k in self.pad_values if k in batch]
            if not keys:
                raise KeyError(
                    f"none of the keys to pad ({list(self.pad_values)}) is in the batch (keys "
                    f"{list(batch)}); set pad_values (config.dataloader.pad_value_dict) to "
                    "the batch's sequence keys"
                )
            out = copy.copy(batch)  # the same mapping type (a BatchEncoding stays one)
            for k in keys:
                out[k] = self._pad(batch[k], k)
            return out
        if isinstance(batch, (tuple, list)):
            if not self._by_position:
                raise TypeError(
                    f"the batch is a {type(batch).__name__} of {len(batch)} entries, so "
                    f"pad_values must be keyed by position, e.g. {{0: 0, 1: -100}}; got keys "
                    f"{list(self.pad_values)}"
                )
            items = list(batch)
            for i in self.pad_values:
                if not -len(items) <= i < len(items):
                    raise IndexError(
                        f"pad_values position {i} is out of range for a batch of "
                        f"{len(items)} entries"
                    )
                items[i] = self._pad(items[i], i)
            if isinstance(batch, list):
                return items
            return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
        raise TypeError(
            f"bucketing pads entries of dict or tuple batches; got a {type(batch).__name__}. "
            "Return a dict (or tuple) from the DataLoader's collate_fn"
        )

    def _pad(self, value: Any, key: str | int) -> Tensor:
        where = f"batch[{key!r}]"
        if not isinstance(value, Tensor):
            raise TypeError(f"{where} must be a tensor to pad; got {type(value).__name__}")
        if value.dim() < 2:
            raise ValueError(
                f"{where} has shape {tuple(value.shape)}: its last dimension is the batch "
                "dimension, not a sequence (sequence-classification labels?). Remove "
                f"{key!r} from pad_values (config.dataloader.pad_value_dict)"
            )
        length = value.shape[-1]
        bucket = self.bucket_for(length)
        if length > bucket:
            if not self.truncation:
                raise ValueError(
                    f"{where} has length {length} in its last dimension, longer than the "
                    f"largest bucket {bucket} (buckets {self.buckets}). Add a larger bucket "
                    "or raise max_length, or pass truncation=True "
                    f"(config.dataloader.truncation) to cut such batches to {bucket}"
                )
            return value[..., :bucket].contiguous()
        if length == bucket:
            return value
        out = torch.full(
            (*value.shape[:-1], bucket),
            self.pad_values[key],
            dtype=value.dtype,
            device=value.device,
            pin_memory=self.pin_memory and value.device.type == "cpu",
        )
        out[..., :length] = value
        return out
