"""Call an Inductor-compiled step graph directly, without the runtime wrappers around it.

``torch._inductor.compile_fx.compile_fx`` returns what Dynamo would call: Dynamo's
``disable`` around AOTAutograd's runtime wrappers around Inductor's ``CompiledFxGraph``
around the generated ``call``. For functacc's graphs those wrappers have nothing to do: the
graph already contains its backward, its inputs are plain tensors compiled as
inference inputs, so AOTAutograd dedupes nothing, regenerates no aliases that a caller could
tell apart, and keeps every input mutation inside the graph. They still cost time: on the
bench MLP (2-core CPU) each graph ran 25-35 us slower through them than called directly
(about 60 us of a 1.1 ms step; ``benchmarks/experiments/step_breakdown.py``), more than their Python
alone, as their code and data push the step's weights out of the core's caches.

:func:`direct_call` finds the generated function and returns a caller that does what the
wrappers would do for such a graph (grad mode off, autocast off), or ``None`` where a
condition for that does not hold, and the wrappers are kept. The conditions are those under
which AOTAutograd's inference path adds nothing (``torch/_functorch/_aot_autograd``):

- the graph holds no parameters or buffers (AOTAutograd would pass them in front of the
  inputs), every tensor input is a plain dense tensor (no subclass to flatten) and no two
  share memory (no duplicate to drop, no synthetic base for aliased inputs);
- the graph changes no input's shape or strides (``inplace_view`` ops, ``set_``,
  ``resize_``: AOTAutograd would replay those outside the graph);
- no op with side effects that AOTAutograd threads tokens through, and no grad-mode
  switch inside the graph;
- AOTAutograd's debug asserts and RNG functionalization are off;
- the graph runs on the CPU (a CUDA step replays a CUDA graph, where the wrappers cost
  nothing).

The wrappers also turn grad mode off around the graph; functacc's step does that around
both of its graphs already (``compile.Compiled``), so the direct call does not repeat it.

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x * 2)(torch.ones(2))
    >>> direct_call(lambda *args: gm(*args), gm, [torch.ones(2)]) is None  # no Inductor graph
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

__all__ = ["direct_call"]

_UNWRAP_DEPTH = 8
"""How many wrappers deep to look for the compiled graph (torch 2.14 nests 4)."""

_STORAGE_CHANGES = {
    torch.ops.aten.set_,
    torch.ops.aten.resize_,
    torch.ops.aten.resize_as_,
    torch.ops.aten.as_strided_,
}


def direct_call(
    compiled: Callable[..., Any], gm: GraphModule, example_inputs: Sequence[Any]
) -> Callable[[list], Any] | None:
    """A function of the graph's input list (which it empties) that runs ``compiled``'s
    generated code directly, to be called with grad mode off (``compile.Compiled``); ``None``
    where AOTAutograd's wrappers may have work to do for ``gm`` or the generated code cannot
    be found. ``gm`` must have static sizes (the generated code of a graph with symbolic
    sizes takes extra size inputs that the wrappers supply)."""
    if not _wrappers_idle(gm, example_inputs):
        return None
    found = _output_codes(compiled)
    if len(found) != 1:
        return None
    call = found[0].current_callable
    if call is None:
        return None
    no_autocast = torch._C._DisableAutocast

    def run(args: list) -> Any:
        # What AOTAutograd's inference wrapper does around the graph besides turning grad
        # mode off (the step already has): the extern kernels it calls must not be recast
        # by an ambient torch.autocast. The generated code empties the list it is given,
        # freeing each input after its last use where that was the last reference.
        with no_autocast():
            return call(args)

    return run


def _wrappers_idle(gm: GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd's runtime wrappers would do nothing for ``gm`` on these inputs."""
    from torch._functorch import config as aot_config
    from torch._higher_order_ops.effects import has_effects

    if aot_config.debug_assert or aot_config.functionalize_rng_ops:
        return False
    # Tensors the graph holds as parameters or buffers: AOTAutograd passes them as inputs
    # in front of the caller's.
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return False
    storages: set[int] = set()
    for value in example_inputs:
        if not isinstance(value, Tensor):
            return False  # Python numbers: the wrappers pass them as the generated code expects
        if type(value) not in (Tensor, torch.nn.Parameter) or value.layout != torch.strided:
            return False
        # CPU only: a CUDA step replays a captured CUDA graph, where the wrappers' Python
        # does not run, and their other work there was not measured.
        if value.device.type != "cpu":
            return False
        if value.numel():
            storage = value.untyped_storage().data_ptr()
            if storage in storages:
                return False
            storages.add(storage)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is torch._C._set_grad_enabled:
            return False
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.inplace_view in target.tags or target.overloadpacket in _STORAGE_CHANGES:
                return False
            if has_effects(target):
                return False
        elif isinstance(target, torch._ops.HigherOrderOperator):
            return False
    return True


def _output_codes(compiled: Callable[..., Any]) -> list[Any]:
    """The Inductor ``OutputCode`` objects that ``compiled`` calls, found through its
    wrappers (``__wrapped__`` and closure cells, a few levels deep)."""
    from torch._inductor.output_code import OutputCode

    found: list[Any] = []
    seen: set[int] = set()
    frontier: list[Any] = [compiled]
    for _ in range(_UNWRAP_DEPTH):
        following: list[Any] = []
        for item in frontier:
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, OutputCode):
                found.append(item)
                continue
            if not callable(item):
                continue
            wrapped = getattr(item, "__wrapped__", None)
            if wrapped is not None:
                following.append(wrapped)
            for cell in getattr(item, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    following.append(cell.cell_contents)
        frontier = following
    return found
