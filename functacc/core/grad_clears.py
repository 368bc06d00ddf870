"""Gradients a step body clears before anything reads them: no trace for their arrival.

A first call finds no ``.grad``; the call after it finds the gradients the first one left,
a new signature that would cost a trace. A body that starts with ``opt.zero_grad()``
(``set_to_none=True``, torch's default) makes them ``None`` again before anything reads
them, so the graph traced without them computes what eager computes with them: the call
runs it, the gradients unread. While a body is traced, :class:`FirstGradAccess` tells which
parameters it traced without ``.grad`` had it first touched by torch's own ``zero_grad()``
(``Optimizer.zero_grad``, ``Module.zero_grad``); a read or write anywhere else first (a
backward hook's, ``clip_grad_norm_``, ``p.grad = ...``, an optimizer's own ``zero_grad``)
keeps the gradients part of the signature, as before.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with FirstGradAccess({id(model.weight): "grad weight"}) as seen:
    ...     opt.zero_grad()
    ...     model(torch.ones(1, 2)).sum().backward()
    >>> seen.cleared
    {'grad weight'}
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Collection, Sequence
from types import FrameType
from typing import Any

import torch
import torch.fx.experimental.proxy_tensor
from torch.overrides import TorchFunctionMode

__all__ = ["FirstGradAccess", "reuse_without_grads"]

_GRAD = torch._C.TensorBase.__dict__["grad"]  # the descriptor: p.grad reads and writes
_ZERO_GRADS = frozenset(
    inspect.unwrap(f).__code__ for f in (torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad)
)
# Frames between the code that touched .grad and this mode: functacc's own modes, and the
# dispatch of torch's (make_fx's metadata mode).
_PASSING = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.abspath(torch.overrides.__file__),
    os.path.abspath(torch.fx.experimental.proxy_tensor.__file__),
)


class FirstGradAccess(TorchFunctionMode):
    """While a body is traced: of the parameters in ``absent`` (``id`` of the traced tensor
    standing for the parameter, which holds no ``.grad``, to that ``.grad``'s state name),
    the names whose ``.grad`` torch's ``zero_grad(set_to_none=True)`` touched first."""

    def __init__(self, absent: dict[int, str], real: dict[int, str] | None = None):
        super().__init__()
        self.absent = absent
        self.real = real or {}  # the parameters themselves: their .grad is not the trace's
        self.cleared: set[str] = set()
        self._seen: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Sequence = (), kwargs: Any = None):
        grad = getattr(func, "__self__", None) is _GRAD and args
        if grad and id(args[0]) in self.real and not _from_functacc(sys._getframe(1)):
            raise _unreached(self.real[id(args[0])])
        if grad and id(args[0]) in self.absent:
            key = id(args[0])
            if key not in self._seen:
                self._seen.add(key)
                if _in_zero_grad(sys._getframe(1)):
                    self.cleared.add(self.absent[key])
        return func(*args, **(kwargs or {}))


def _in_zero_grad(frame: FrameType | None) -> bool:
    while frame is not None and frame.f_code.co_filename.startswith(_PASSING):
        frame = frame.f_back
    return (
        frame is not None
        and frame.f_code in _ZERO_GRADS
        and frame.f_locals.get("set_to_none") is True
    )


def _from_functacc(frame: FrameType | None) -> bool:
    while frame is not None and frame.f_code.co_filename.startswith(_PASSING[1:]):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_PASSING[0])


def _unreached(name: str) -> Exception:
    from ..errors import TraceError

    return TraceError(
        f"the step reads or sets the .grad of the parameter {name} itself, reached through "
        "a place functacc.jit does not follow (a list or object more than three attributes "
        "deep from the step's variables, or inside a library's object): while traced, the "
        "step's gradients are the traced parameters', so that .grad would not be the "
        "step's (None, or the last call's). Fix: reach the parameters through the module in "
        "the step (model.parameters(), model.named_parameters()), or keep the list where "
        "the step's variables or an object it uses hold it directly."
    )


def reuse_without_grads(
    names: Sequence[str],
    state_key: Sequence[Any],
    stand_ins: Collection[str],
    lookup: Callable[[tuple, tuple], Any],
) -> Any:
    """The program of the signature without the ``.grad`` entries of ``names`` (the state's
    names; ``state_key``: their specs; ``stand_ins``: parameters whose entry stays, ZeRO-2's
    stand-in for a gradient it did not keep), if its trace cleared each of them before
    reading it, made to take this call's inputs (the gradients among them unread); else
    ``None``. ``lookup(names, state_key)`` finds a program for a signature."""
    dropped = {i for i, n in enumerate(names) if n.startswith("grad ") and n[5:] not in stand_ins}
    if not dropped:
        return None
    kept = [i for i in range(len(names)) if i not in dropped]
    base = lookup(tuple(names[i] for i in kept), tuple(state_key[i] for i in kept))
    if base is None or not {names[i] for i in dropped} <= base.cleared:
        return None
    # The flat inputs are (*state, *fed, *batch): state entries move to where they are in
    # the whole state, everything after the state by the number of gradients dropped.
    used = [kept[i] if i < len(kept) else i + len(dropped) for i in base.used]
    return dataclasses.replace(base, used=used)
