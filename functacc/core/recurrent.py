"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) in a traced step, as eager runs them.

Eager PyTorch runs these layers with C++ composites (oneDNN's layer for an LSTM on CPU,
the cells unrolled over time otherwise). Those read the sizes of their input as plain
numbers: traced with a symbolic size, an LSTM fails (``Cannot call numel() on tensor with
symbolic sizes``), a GRU fixes the sequence length anyway and fails on a symbolic batch;
torch's Python decompositions, which accept symbols, compute other numbers and draw the
dropout between layers otherwise (measured: the loss and the RNG state left eager's at the
first symbolic step). So a step whose model holds one is traced with static sizes, one
graph per input size (:func:`static_sizes`).
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["recurrent_layers", "static_sizes"]


def recurrent_layers(holder: nn.Module) -> list[str]:
    """The names of the recurrent layers (``nn.RNNBase``: LSTM, GRU, RNN) in ``holder``.

    Example:
        >>> recurrent_layers(nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2)))
        ['1']
    """
    return [name for name, m in holder.named_modules() if isinstance(m, nn.RNNBase)]


def static_sizes(holder: nn.Module, dynamic: bool | None) -> bool:
    """Whether the step of ``holder`` must trace static sizes only (it holds a recurrent
    layer); warns that ``dynamic=True`` is ignored if it was asked for."""
    layers = recurrent_layers(holder)
    if layers and dynamic:
        warnings.warn(
            f"dynamic=True is ignored: the model holds recurrent layers ({', '.join(layers)}), "
            "whose eager kernels take concrete sizes (oneDNN's LSTM on CPU, the unrolled "
            "cells), so each new input size is traced again with static sizes, to keep "
            "eager's numbers. Pad or bucket the batches to a few sizes to trace less often.",
            stacklevel=3,
        )
    return bool(layers)
