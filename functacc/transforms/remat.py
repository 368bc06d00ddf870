"""Activation rematerialisation: recompute chosen modules' activations in backward.

Inside the traced step, each module whose class is chosen runs under non-reentrant
``torch.utils.checkpoint``: its activations are not kept for backward; backward runs its
forward again. Random ops (dropout) must draw the same numbers the second time; a dispatch
mode records their results in forward and replays them in the recomputation, so the
gradients are exactly those of the stored-activation step.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ..core.functional import check_module_classes

__all__ = [
    "FORWARD",
    "POLICIES",
    "RECOMPUTE",
    "RematPolicy",
    "rematerialize",
    "validate_remat",
]


class _RandomReplay(TorchDispatchMode):
    """Records the results of random ops on the first run, replays them on the second.

    Bernoulli draws (dropout masks) are 0 or 1: they are kept as ``uint8``, a quarter of
    the float mask's memory, and turned back into the same values exactly.
    """

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
            # A copy: dropout divides its mask in place right after drawing it. Some ops
            # that may draw return several tensors (fused attention with dropout_p).
            zero_one = func._overloadpacket in _BERNOULLI
            self.recorded.append(pytree.tree_map_only(torch.Tensor, _keep(zero_one), out))
            return out
        value = self.recorded[self.position]
        self.position += 1
        if func._schema.is_mutable:  # bernoulli_(self): write the recorded draw into self
            return args[0].copy_(value.stored)
        return pytree.tree_map_only(_Draw, lambda d: d.stored.to(d.dtype, copy=True), value)


_BERNOULLI = (torch.ops.aten.bernoulli, torch.ops.aten.bernoulli_)


@dataclass(frozen=True)
class _Draw:
    """One recorded random tensor and the dtype it had (a leaf for pytree, unlike a
    NamedTuple, which would be flattened into its fields)."""

    stored: torch.Tensor
    dtype: torch.dtype


def _keep(zero_one: bool) -> Callable[[torch.Tensor], _Draw]:
    """How to record a random result. Bernoulli draws are 0 or 1, so a byte holds them
    exactly in a quarter of a float mask's memory (``uint8``, not ``bool``: Inductor's CPU
    kernels store and load bool vectors element by element; see
    ``backends/inductor/masks.py``)."""

    def keep(t: torch.Tensor) -> _Draw:
        return _Draw(t.to(torch.uint8) if zero_one else t.clone(), t.dtype)

    return keep


# Node metadata: which module call's forward pass, or recomputation, an FX node belongs to.
FORWARD = "functacc_remat_forward"
RECOMPUTE = "functacc_recompute"
_calls = itertools.count()

RematPolicy = Literal["full", "save_matmuls", "selective"]
POLICIES = ("full", "save_matmuls", "selective")


def _traced_graph() -> torch.fx.Graph | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


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

        call = next(_calls)  # names this call's forward and recomputation in the graph

        def body(*a: Any, **k: Any) -> Any:
            # The first call is the forward pass; the second, from backward, recomputes.
            replaying = calls["n"] > 0
            calls["n"] += 1
            swap = _reparametrize_module(module, tensors) if replaying else contextlib.nullcontext()
            graph = _traced_graph()
            last = next(iter(reversed(graph.nodes)), None) if graph is not None else None
            try:
                with swap, _RandomReplay(recorded, replaying=replaying):
                    return forward(*a, **k)
            finally:
                # Also when checkpoint stops the recomputation early (by raising) once it
                # has every value backward needs.
                if graph is not None:
                    key = RECOMPUTE if replaying else FORWARD
                    for node in reversed(graph.nodes):
                        if node is last:
                            break
                        node.meta[key] = call

        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def validate_remat(
    model: nn.Module, classes: Collection[str] | None, policy: str = "full", *, stacklevel: int = 4
) -> frozenset[str]:
    """The class names to recompute (each must be a class in ``model``), after checking
    ``policy`` (warns where it has no effect; ``stacklevel`` points at the user's call)."""
    if policy not in POLICIES:
        raise ValueError(
            f"remat_policy must be one of {POLICIES}; got {policy!r}. 'full' "
            "recomputes the whole module in backward (least memory); 'save_matmuls' keeps "
            "the matmul and convolution results and recomputes the rest (less compute); "
            "'selective' keeps those with weights and recomputes attention's (between)."
        )
    if policy != "full" and not classes:
        warnings.warn(
            f"remat_policy={policy!r} has no effect without remat=...: no module "
            "is recomputed. Name the modules to recompute, e.g. remat={'Block'}.",
            stacklevel=stacklevel,
        )
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
