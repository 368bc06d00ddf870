"""Packed sequences (``pack_padded_sequence``) in a traced step: their batch sizes on the host.

A ``PackedSequence`` keeps, next to its data, ``batch_sizes``: how many sequences are
still running at each time step, a CPU tensor that PyTorch reads as plain numbers (the
recurrent layers' C++ code loops over it, ``nn.GRU`` reads ``batch_sizes[0]``). In a trace
every tensor is a fake without values, so these reads failed. The packing only depends on
the sequences' lengths; given as a Python list, those are constants of the call (part of
its signature: other lengths are another trace) and of the graph.

:class:`HostPacking`, active while tracing any step (a loss packs predictions too),
therefore computes the packing on the host, as eager does: ``_pack_padded_sequence`` gets
the lengths' values from the graph's constants and returns real ``batch_sizes``;
arithmetic on them alone (``batch_sizes[0]``, ``int(...)``) runs eagerly; the recurrent
layers' C++ code reads them as eager's does; ``_pad_packed_sequence`` is the C++ code's
own copies, written out. The data moves with the ops eager's kernels use (slices, ``cat``
and, for the gradient, ``_pack_padded_sequence_backward`` itself), so the step computes
eager's numbers bit for bit.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import TraceError
from .constant_values import known_value

__all__ = ["HostPacking"]

_VF = torch._C._VariableFunctions
# The packed forms of the recurrent layers: C++ code that reads batch_sizes (argument 1)
# as numbers, with the data and hidden state traced.
_READ_ON_HOST = frozenset({_VF.lstm, _VF.gru, _VF.rnn_tanh, _VF.rnn_relu})


class HostPacking(TorchFunctionMode):
    """Packed sequences' batch sizes as host tensors while tracing (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref] = {}
        # host tensor id -> (the host tensor, its constant in the graph)
        self._constants: dict[int, tuple[weakref.ref, Tensor]] = {}

    def _is_host(self, value: Any) -> bool:
        ref = self._host.get(id(value)) if isinstance(value, Tensor) else None
        return ref is not None and ref() is value

    def _keep(self, value: Any) -> Any:
        for t in pytree.tree_leaves(value):
            if isinstance(t, Tensor):
                self._host[id(t)] = weakref.ref(t)
        return value

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Pack and pad on the host; what reads only host tensors runs eagerly; an op that
        mixes them with traced tensors is traced, the host tensors as constants."""
        kwargs = kwargs or {}
        if func is _VF._pack_padded_sequence:
            return self._pack(*args, **kwargs)
        if not self._host:
            return func(*args, **kwargs)
        if func is _VF._pad_packed_sequence and self._is_host(_arg(args, kwargs, 1, "batch_sizes")):
            return self._pad(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        host = [self._is_host(t) for t in tensors]
        if not any(host):
            return func(*args, **kwargs)
        if not all(host):
            if func in _READ_ON_HOST and self._is_host(_arg(args, kwargs, 1, "batch_sizes")):
                # the recurrent layers' C++ code reads batch_sizes
                args = (args[0], args[1], *self._traced((args[2:], {}))[0])
                return func(*args, **kwargs)
            args, kwargs = self._traced((args, kwargs))
            return func(*args, **kwargs)
        method = bool(args) and self._is_host(args[0]) and _is_method(func)
        if not method and all(t.dim() == 0 for t in tensors):
            # torch.zeros(layers, batch_sizes[0], hidden): a size, not a tensor to trace
            args, kwargs = pytree.tree_map_only(Tensor, lambda t: t.item(), (args, kwargs))
            return func(*args, **kwargs)
        with _disable_current_modes():  # values of the host alone: computed as eager does
            return self._keep(func(*args, **kwargs))

    def _traced(self, tree: Any) -> Any:
        """``tree`` with each host tensor as a constant of the graph (as
        ``torch.tensor(values)`` in the step would make it), for an op with traced tensors."""

        def constant(t: Tensor) -> Tensor:
            if not self._is_host(t):
                return t
            ref, made = self._constants.get(id(t), (None, None))
            if ref is None or ref() is not t:
                made = torch.tensor(t.tolist(), dtype=t.dtype, device=t.device)
                self._constants[id(t)] = (weakref.ref(t), made)
            return made

        return pytree.tree_map_only(Tensor, constant, tree)

    def _pack(self, input: Tensor, lengths: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
        values = self._value(lengths)
        if values is None:
            raise TraceError(
                "pack_padded_sequence(..., lengths) got lengths that are not known when the "
                "step is traced (computed in the step from a batch of data, such as "
                "(tokens != pad).sum(1), whose values change every call). The packing (how "
                "many sequences run at each time step) decides the graph, so pass the lengths "
                "as an argument of the step, a tensor of integers or a Python list (computed "
                "before the call). Each new list of lengths is one more trace; sorting or "
                "bucketing batches by length keeps them few."
            )
        sizes = [int(n) for n in values.tolist()]
        if sizes and sizes[-1] <= 0:
            raise ValueError("Length of all samples has to be greater than 0")
        if any(a < b for a, b in itertools.pairwise(sizes)):
            raise ValueError(
                "`lengths` array must be sorted in decreasing order when `enforce_sorted` is "
                "True. You can pass `enforce_sorted=False` to pack_padded_sequence and/or "
                "pack_sequence to sidestep this requirement if you do not need ONNX "
                "exportability."
            )
        counts = [sum(n > t for n in sizes) for t in range(sizes[0] if sizes else 0)]
        with _disable_current_modes():  # a real CPU tensor, like eager's
            batch_sizes = self._keep(torch.tensor(counts, dtype=torch.int64))
        data = _Pack.apply(input, sizes, batch_sizes, batch_first)
        return data, batch_sizes

    def _pad(
        self,
        data: Tensor,
        batch_sizes: Tensor,
        batch_first: bool,
        padding_value: float,
        total_length: int,
    ) -> tuple[Tensor, Tensor]:
        """ATen's ``_pad_packed_sequence`` (PackedSequence.cpp), its copies written out in
        the same ops, the lengths counted on the host."""
        sizes = batch_sizes.tolist()
        max_batch, steps = sizes[0], len(sizes)
        output = data.new_full([total_length, max_batch, *data.shape[1:]], padding_value)
        lengths = [0] * max_batch
        offset, prev_batch, prev_i = 0, max_batch, 0
        for i in range(steps + 1):
            batch = sizes[i] if i != steps else 0
            if batch != prev_batch:
                n = prev_batch * (i - prev_i)
                chunk = data[offset : offset + n].view(i - prev_i, prev_batch, *data.shape[1:])
                output[prev_i:i, :prev_batch].copy_(chunk)
                offset, prev_i = offset + n, i
            for j in range(batch, prev_batch):
                lengths[j] = i
            prev_batch = batch
        if batch_first:
            output = output.transpose(0, 1)
        with _disable_current_modes():
            counted = torch.tensor(lengths, dtype=torch.int64)
        return output, self._keep(counted)

    def _value(self, t: Tensor) -> Tensor | None:
        """The values of ``t``: its own if it is real, else those known at the trace (a
        tensor argument's, or of the graph's constants it was computed from,
        ``torch.as_tensor(lengths)``, sorted: :func:`~.constant_values.known_value`)."""
        from torch._subclasses.fake_tensor import is_fake

        return known_value(t, computed=True) if is_fake(t) else t


class _Pack(torch.autograd.Function):
    """ATen's ``_pack_padded_sequence`` over lengths known on the host: the forward is its
    kernel's ops (a slice per run of equal batch sizes, ``cat``), the backward is its own
    backward (``_pack_padded_sequence_backward``)."""

    @staticmethod
    def forward(
        ctx: Any, input: Tensor, sizes: list[int], batch_sizes: Tensor, batch_first: bool
    ) -> Tensor:
        ctx.input_size = list(input.shape)
        ctx.batch_sizes, ctx.batch_first = batch_sizes, batch_first
        steps = input.transpose(0, 1) if batch_first else input
        batch, pieces, prev = len(sizes), [], 0
        for i in range(batch):
            length = sizes[batch - 1 - i]
            if length > prev:
                piece = steps[prev:length, : batch - i].contiguous()
                pieces.append(piece.view(-1, *steps.shape[2:]))
                prev = length
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = torch.ops.aten._pack_padded_sequence_backward.default
        return back(grad, ctx.input_size, ctx.batch_sizes, ctx.batch_first), None, None, None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _is_method(func: Any) -> bool:
    """A ``Tensor`` method or dunder (``__getitem__``, ``__int__``, ``size``), or an
    attribute's getter (``t.shape``: its descriptor's ``__get__``)."""
    name = getattr(func, "__qualname__", "")
    return name.startswith(("Tensor.", "TensorBase.")) or name.endswith(".__get__")
