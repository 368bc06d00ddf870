"""Activation rematerialisation: recompute chosen modules' activations in backward.

Inside the traced step, each module whose class is chosen runs under non-reentrant
``torch.utils.checkpoint``: its activations are not kept for backward; backward runs its
forward again. Random ops (dropout) must draw the same numbers the second time; a dispatch
mode records their results in forward and replays them in the recomputation, so the
gradients are exactly those of the stored-activation step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from .functional import check_module_classes

__all__ = ["rematerialize", "validate_remat"]


class _RandomReplay(TorchDispatchMode):
    """Records the results of random ops on the first run, replays them on the second."""

    def __init__(self, recorded: list, *, replaying: bool) -> None:
        super().__init__()
        self.replaying = replaying
        self.recorded = recorded
        self.position = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)
            # A clone: dropout divides its mask in place right after drawing it.
            self.recorded.append(out.clone())
            return out
        value = self.recorded[self.position]
        self.position += 1
        if func._schema.is_mutable:  # bernoulli_(self): write the recorded draw into self
            return args[0].copy_(value)
        return value.clone()


def _with_replay(module: nn.Module, forward: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        recorded: list = []
        calls = {"n": 0}
        # The tensors the forward pass reads: inside the traced step these are the step's
        # parameters, swapped in by functional_call. Backward runs after that swap has
        # ended, so the recomputation swaps the same tensors in again; otherwise it would
        # read the module's own nn.Parameters, which the trace bakes in as constants
        # (Inductor compiled their values at the first step: stale gradients afterwards).
        tensors = {
            **dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False)),
        }

        def body(*a: Any, **k: Any) -> Any:
            # The first call is the forward pass; the second, from backward, recomputes.
            replaying = calls["n"] > 0
            calls["n"] += 1
            swap = _reparametrize_module(module, tensors) if replaying else contextlib.nullcontext()
            with swap, _RandomReplay(recorded, replaying=replaying):
                return forward(*a, **k)

        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def validate_remat(model: nn.Module, classes: Collection[str] | None) -> frozenset[str]:
    if not classes:
        return frozenset()
    return frozenset(check_module_classes(model, classes, "remat"))


@contextlib.contextmanager
def rematerialize(model: nn.Module, classes: Collection[str]) -> Iterator[None]:
    """Run the outermost modules of the given classes under checkpointing (while active)."""
    if not classes:
        yield
        return
    patched: list[nn.Module] = []
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in classes:
            continue
        if any(name.startswith(p + ".") for p in prefixes):
            continue  # inside a module already recomputed as a whole
        prefixes.append(name)
        module.forward = _with_replay(module, module.forward)  # an instance attribute shadows
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
