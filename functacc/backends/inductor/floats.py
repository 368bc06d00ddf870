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
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

__all__ = [
    "float_symbols_in_double",
    "floats_as_tensors",
    "lerp_weights_as_tensors",
    "no_tensorify",
]


def floats_as_tensors(gm: GraphModule, fakes: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Rewrite ``gm`` (in place) so that each ``SymFloat`` input is a float64 0-dim tensor;
    returns the new example inputs and the positions to wrap at run time."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out, positions, replaced = list(fakes), [], set()
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
        replaced.add(fake.node.expr)
    if replaced:
        _drop_checks_on(replaced, _fake_mode(fakes).shape_env)
    gm.recompile()
    return out, positions


def _drop_checks_on(symbols: set, shape_env: Any) -> None:
    """Forget the trace's run-time checks that name the replaced float symbols (``0 <= 1 +
    lambd * lr * step``, noted where ``pow`` took such a base): Inductor would emit them with
    a name its code no longer defines. They check assumptions of the trace's algebra on the
    numbers, not what the graph computes; the guards on the fed numbers stay the step's."""
    asserts = getattr(shape_env, "deferred_runtime_asserts", None)
    if not asserts:
        return
    for key in list(asserts):
        kept = [a for a in asserts[key] if not (a.expr.free_symbols & symbols)]
        if kept:
            asserts[key] = kept
        else:
            del asserts[key]


def lerp_weights_as_tensors(gm: GraphModule) -> None:
    """``lerp`` with a Python-number weight the graph computes (``1 - beta1``) as ``lerp``
    with a 0-dim tensor weight: Inductor's decomposition of the first branches on the
    weight's value (``weight >= 0.5``), which a number computed at run time does not have
    while compiling; that of the second selects with ``where``. ``_foreach_lerp`` too
    (schedulefree's ``torch._foreach_lerp_(y, z, weight=ckp1)``), with a weight per tensor."""
    lerps = (torch.ops.aten.lerp.Scalar, torch.ops.aten._foreach_lerp.Scalar)
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in lerps or not isinstance(node.args[2], torch.fx.Node):
            continue
        start, end, weight = node.args
        foreach = node.target is not torch.ops.aten.lerp.Scalar
        with gm.graph.inserting_before(node):
            weights = [_scalar_tensor(gm, weight, s) for s in (start if foreach else [start])]
        node.target = torch.ops.aten._foreach_lerp.List if foreach else torch.ops.aten.lerp.Tensor
        node.args = (start, end, weights if foreach else weights[0])
        changed = True
    if changed:
        gm.recompile()


def _scalar_tensor(gm: GraphModule, weight: torch.fx.Node, like: torch.fx.Node) -> Any:
    """A 0-dim tensor of ``weight`` in ``like``'s dtype (its value only known at run time)."""
    val = like.meta["val"]
    tensor = gm.graph.call_function(
        torch.ops.aten.scalar_tensor.default, (weight,), {"dtype": val.dtype}
    )
    with val.fake_mode:
        tensor.meta["val"] = torch.scalar_tensor(0.0, dtype=val.dtype, device=val.device)
    return tensor


def _fake_mode(fakes: Sequence[Any]) -> Any:
    return next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))


@contextlib.contextmanager
def no_tensorify() -> Iterator[None]:
    """While compiling: Inductor leaves float arithmetic on the host (as eager does it).
    The pass's switch differs between torch releases (2.14 reads an environment variable
    and a knob through ``torch._dynamo.utils``; 2.11 has no such function in the pass's
    module), so the pass itself is replaced, for this compile only, wherever torch's
    modules hold it (AOTAutograd imports it by name)."""
    from torch.fx.passes import _tensorify_python_scalars as tensorify

    original = tensorify.tensorify_python_scalars
    holders = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torch.") and getattr(m, "tensorify_python_scalars", None) is original
    ]
    for module in holders:
        module.tensorify_python_scalars = _skip_tensorify
    try:
        yield
    finally:
        for module in holders:
            module.tensorify_python_scalars = original


def _skip_tensorify(gm: GraphModule, shape_env: Any, fake_mode: Any) -> None:
    """The pass, off: it changes nothing, as with its switch off."""


@contextlib.contextmanager
def float_symbols_in_double() -> Iterator[None]:
    """While compiling: a float symbol reaches Inductor's C++ kernels as a ``double``, where
    Inductor declares it ``const float`` (``KernelArgs.cpp_argdefs``). Eager computes with
    Python floats in double: in float, a time stamp (1.8e9) kept steps of 128 seconds and a
    loss summed over the calls (``self.total += loss.item()``) drifted. A float tensor's
    arithmetic with it rounds to float at the end, as eager's float ops do with a scalar."""
    from torch._inductor import codecache
    from torch._inductor.codegen import common

    original = getattr(common.KernelArgs, "cpp_argdefs", None)
    bindings = getattr(codecache, "CppPythonBindingsCodeCache", None)
    if original is None or bindings is None:  # another torch's code generation: as it is
        yield
        return
    parse = vars(bindings).get("extra_parse_arg", "")

    def argdefs(self: Any, *args: Any, **kwargs: Any) -> Any:
        defs, calls, types = original(self, *args, **kwargs)
        defs = [_double(d) for d in defs]
        types = ["const double" if t == "const float" else t for t in types]
        return defs, calls, types

    common.KernelArgs.cpp_argdefs = argdefs
    bindings.extra_parse_arg = parse + _PARSE_DOUBLE  # the binding reads a double
    try:
        yield
    finally:
        common.KernelArgs.cpp_argdefs = original
        bindings.extra_parse_arg = parse


# A specialization beside Inductor's parse_arg<float> (a str.format template: braces doubled).
_PARSE_DOUBLE = """
template <> inline double parse_arg<double>(PyObject* args, size_t n) {{
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if(result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return result;
}}
"""


def _double(definition: str) -> str:
    scalar = definition.startswith("const float ") and "*" not in definition
    return "const double " + definition[len("const float ") :] if scalar else definition
