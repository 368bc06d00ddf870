"""Python float inputs of a graph, handed to Inductor as 0-dim tensors.

A jitted step feeds the Python numbers its body reads and writes (a counter, a scale that
changed) as inputs, traced as symbols with their values as hints, so that a branch on one
is a guard. Inductor keeps a float symbol in its kernels but does not pass it to them (seen
on torch 2.14: ``error: 'zf89' was not declared in this scope``): Dynamo never gives it one,
it feeds floats as 0-dim tensors read with ``.item()``. :func:`floats_as_tensors` rewrites
the graph that way — each float placeholder becomes a float64 tensor placeholder whose
``_local_scalar_dense`` is the very symbol the trace used — and says which inputs to wrap.
Inductor's own pass that turns such float arithmetic into tensor arithmetic
(``tensorify_python_scalars``) is off for these compiles (:func:`no_tensorify`): it asks
Dynamo to restart, which a make_fx graph cannot.

Example:
    >>> with no_tensorify():
    ...     pass  # compile_fx(...) of a graph from floats_as_tensors
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

__all__ = ["floats_as_tensors", "no_tensorify"]


def floats_as_tensors(gm: GraphModule, fakes: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Rewrite ``gm`` (in place) so that each ``SymFloat`` input is a float64 0-dim tensor;
    returns the new example inputs and the positions to wrap at run time."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out, positions = list(fakes), []
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for i, (node, fake) in enumerate(zip(placeholders, fakes, strict=True)):
        if not isinstance(fake, torch.SymFloat):
            continue
        mode = _fake_mode(fakes)
        with gm.graph.inserting_before(node):
            tensor = gm.graph.placeholder(f"{node.name}_as_tensor")
        tensor.meta["val"] = mode.from_tensor(
            torch.scalar_tensor(fake.node.hint, dtype=torch.float64), static_shapes=True
        )
        with gm.graph.inserting_before(first):
            item = gm.graph.call_function(torch.ops.aten._local_scalar_dense.default, (tensor,))
        item.meta["val"] = fake  # the same symbol: the graph's guards and kernels use it
        node.replace_all_uses_with(item)
        gm.graph.erase_node(node)
        out[i] = tensor.meta["val"]
        positions.append(i)
    gm.recompile()
    return out, positions


def _fake_mode(fakes: Sequence[Any]) -> Any:
    return next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))


@contextlib.contextmanager
def no_tensorify() -> Iterator[None]:
    """While compiling: Inductor leaves float arithmetic on the host (as eager does it)."""
    old = os.environ.get("TENSORIFY_PYTHON_SCALARS")
    os.environ["TENSORIFY_PYTHON_SCALARS"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TENSORIFY_PYTHON_SCALARS"]
        else:
            os.environ["TENSORIFY_PYTHON_SCALARS"] = old
