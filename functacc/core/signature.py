"""What makes one compiled graph of the step different from another: its signature.

A call's signature has two parts:

- **the batch**: each input tensor's shape, dtype, device and layout, the batch's structure
  (tuple, dict, keys) and its Python constants;
- **the context**: train/eval mode of every module, which parameters are trainable, the
  model's dtypes and shapes, the optimizer's structure, the parallel strategy's phase, and
  the ambient state that changes which ops a trace records (``torch.autocast``, the default
  dtype).

A graph traced with symbolic dimensions serves a *family*: every batch whose signature
differs only in those sizes (:func:`family_key` erases sizes, keeps the rest).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .mapping_args import carried

__all__ = [
    "AmbientWatch",
    "BatchWatch",
    "LayoutSpec",
    "TensorSpec",
    "ambient_key",
    "batch_names",
    "family_key",
    "hashable_constant",
    "kinds_key",
    "positional_names",
]


class TensorSpec(NamedTuple):
    """What a static graph assumes about one input tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, t.device, t.stride())

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.shape} {dtype} on {self.device} (stride {self.stride})"


class LayoutSpec(NamedTuple):
    """What a graph with symbolic sizes assumes about one input tensor: everything but
    the sizes. Contiguous tensors (the rule for batches) have size-independent layout;
    other layouts are kept exactly (their graphs stay static)."""

    ndim: int
    dtype: torch.dtype
    device: torch.device
    layout: str | tuple[int, ...]


class BatchWatch:
    """The signature key of a plain ``step(inputs, targets)`` batch (a sequence of
    tensors): the *same* tuple object while the tensors' shapes, strides, dtypes and
    devices are those of the last call. One C++ check (Dynamo's ``TensorGuards``, sizes and
    strides checked) instead of building a :class:`TensorSpec` per tensor (about 1.6 us
    each); only a changed batch rebuilds the key and the check.

    ``TensorGuards`` fails a tensor passed twice, which is how a language model is often
    called (``step(tokens, tokens)``: the targets are the inputs): there the check runs on
    the distinct tensors and the repeats are compared by identity (GPT-2 bench: 4.2 us per
    call rebuilding the key before, under 1 us after).
    """

    def __init__(self) -> None:
        self._guards: Any = None
        self._count = -1
        self._distinct: list[int] | None = None  # positions to check, when some repeat
        self._repeats: list[tuple[int, int]] = []  # (first position, repeat position)
        self._key: tuple = ()

    def key(self, tensors: Sequence[Tensor]) -> tuple[TensorSpec, ...]:
        if len(tensors) == self._count and self._guards is not None:
            if self._distinct is None:
                if self._guards.check(*tensors):
                    return self._key
            elif all(tensors[i] is tensors[j] for i, j in self._repeats) and self._guards.check(
                *[tensors[i] for i in self._distinct]
            ):
                return self._key
        first: dict[int, int] = {}
        for i, t in enumerate(tensors):
            first.setdefault(id(t), i)
        self._repeats = [(first[id(t)], i) for i, t in enumerate(tensors) if first[id(t)] != i]
        self._distinct = sorted(first.values()) if self._repeats else None
        self._key = tuple(map(TensorSpec.of, tensors))
        self._guards = _tensor_guards([tensors[i] for i in sorted(first.values())])
        self._count = len(tensors)
        return self._key


def _tensor_guards(tensors: Sequence[Tensor]) -> Any:
    """A C++ check of the tensors' dtype, device, ``requires_grad``, dispatch keys, sizes and
    strides; ``None`` without Dynamo's guards."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # a torch without Dynamo's C++ guards: re-read in Python each call
        return None
    return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


def family_key(tensors: Sequence[Tensor]) -> tuple[LayoutSpec, ...]:
    """The batch tensors' signature with sizes erased."""
    return tuple(
        LayoutSpec(
            t.dim(), t.dtype, t.device, "contiguous" if t.is_contiguous() else tuple(t.stride())
        )
        for t in tensors
    )


def ambient_key(device_type: str) -> tuple:
    """The ambient state a trace bakes into the graph: autocast on the model's device and
    on CPU (enabled, dtype), and the default dtype (``torch.zeros(n)`` in a forward)."""
    autocast = tuple(
        (d, torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else (d, None)
        for d in dict.fromkeys(("cpu", device_type))
    )
    return (("autocast", autocast), ("default dtype", torch.get_default_dtype()))


class AmbientWatch:
    """:func:`ambient_key`, returning the same tuple object while it is unchanged. Without
    autocast, one check per device and the default dtype (no tuples built)."""

    def __init__(self, device_type: str):
        self.devices = tuple(dict.fromkeys(("cpu", device_type)))
        self._dtype: torch.dtype | None = None
        self._key = ambient_key(device_type)
        self._plain = False  # the last key had no autocast

    def key(self) -> tuple:
        dtype = torch.get_default_dtype()
        if (
            self._plain
            and dtype is self._dtype
            and not any(map(torch.is_autocast_enabled, self.devices))
        ):
            return self._key
        key = ambient_key(self.devices[-1])
        if key != self._key:
            self._key = key
        self._dtype = dtype
        self._plain = all(d is None for _, d in key[0][1])
        return self._key


def batch_names(args: tuple, kwargs: dict, positional: Sequence[str] = ()) -> list[str]:
    """A readable name for each tensor of a call's batch, in flattening order: the body's
    own parameter names for its positional arguments (``inputs['input_ids']`` and
    ``targets`` for ``step(inputs, targets)``), ``args[i]`` past them, and the keyword."""
    names = []
    for path, leaf in pytree.tree_flatten_with_path(carried(args, kwargs))[0]:  # a UserDict's too
        if not isinstance(leaf, Tensor):
            continue
        top, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 0:  # positional
            head = positional[top.idx] if top.idx < len(positional) else f"args[{top.idx}]"
        else:
            head = str(top.key)
        names.append(head + rest)
    return names


def positional_names(fn: Any) -> tuple[str, ...]:
    """The names of ``fn``'s positional parameters, up to a ``*args`` (none if its
    signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = []
    for p in params:
        if p.kind not in kinds:
            break
        names.append(p.name)
    return tuple(names)


def hashable_constant(x: Any) -> Any:
    if type(x).__module__ == "numpy" and hasattr(x, "tobytes"):  # repr elides the middle
        from .lookup_tables import table_key

        return table_key(x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return (type(x), x)


def kinds_key(kinds: list[Any]) -> tuple:
    """A step's output kinds (``"tensor"``, ``("donated", i)``, a constant) as a hashable key."""
    return tuple(
        k if isinstance(k, str) or k[0] == "donated" else ("constant", hashable_constant(k[1]))
        for k in kinds
    )
