"""Random 0/1 masks drawn into bytes: dropout keeps a quarter of the memory for backward.

On CPU eager PyTorch runs dropout as ``empty_like(x).bernoulli_(1 - p).div_(1 - p)`` and
autograd keeps that float mask until backward: 4 bytes per element of every dropout's input
(the bench Transformer keeps 28 MiB of them, a quarter of its step's 109 MiB peak).
functacc traces the same ops, so the compiled step kept them too. The pass runs on graphs
compiled with Inductor (``backends/compile.py``).

ATen's CPU ``bernoulli_`` draws the same numbers into a ``uint8`` tensor as into a float one
(one draw per element from the generator, then a cast; the generator ends in the same state),
so the graph draws into ``uint8`` and casts to the float mask where it is used: the values
are exactly 0.0 and 1.0 as before, and Inductor fuses the cast into the kernels that read
the mask, in forward and in backward, so only the 1-byte mask is kept between them.
(``uint8``, not ``bool``: Inductor's CPU kernels write bool vectors element by element;
measured on the bench Transformer, bool masks made the step 16% slower, uint8 3% faster.)

A mask of 4096 elements or more, with a constant probability and the default generator, is
drawn by functacc's kernel instead (``bernoulli.py``: the same bytes, eight times faster),
also with symbolic sizes where the buffer is contiguous.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ... import _compat
from . import bernoulli

__all__ = ["draw_masks_as_bytes"]

# Fresh buffers whose contents bernoulli_ overwrites; they take a dtype= keyword.
_EMPTY = (
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty.memory_format,
)
_BERNOULLI_ = torch.ops.aten.bernoulli_.float


def draw_masks_as_bytes(gm: GraphModule) -> int:
    """Rewrite every ``empty(float).bernoulli_(p)`` on CPU into a draw into a fresh ``uint8``
    buffer followed by a cast back to the float dtype; returns how many were rewritten.

    Only a buffer that nothing else reads is rewritten (its contents are the draw), and only
    on CPU, where the kernel's draws do not depend on the dtype (tested bit for bit against
    eager). The byte buffer is allocated contiguous in the float buffer's memory order and
    viewed with its strides: eager fills ``empty_like(x)`` of a transposed ``x`` in memory
    order, and so does a contiguous buffer, whatever a compiler later does with the draw (a
    functional ``bernoulli`` of a strided tensor draws in logical order).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda x: x * torch.empty_like(x).bernoulli_(0.9))(torch.ones(4))
        >>> draw_masks_as_bytes(gm)
        1
    """
    graph = gm.graph
    rewritten = 0
    for draw in list(graph.nodes):
        if draw.target is not _BERNOULLI_ or not _rewritable(draw.args[0]):
            continue
        buffer = draw.args[0]
        val = buffer.meta["val"]
        order = _memory_order(val)
        p = draw.args[1] if len(draw.args) > 1 else draw.kwargs.get("p", 0.5)
        with graph.inserting_before(draw):
            sizes = _kernel_sizes(graph, buffer, order) if _fast(val, p, draw) else None
            if sizes is not None:
                # The same draw by functacc's kernel (bernoulli.py), eight times faster, in
                # memory order like the byte buffer of eager's kernel below.
                drawn = graph.call_function(bernoulli.OP, (sizes, float(p)))
                shape = val.shape if order is None else sizes  # concrete where ordered
                drawn.meta["val"] = val.new_empty(shape, dtype=torch.uint8)
            else:
                mask = _byte_buffer(graph, buffer, order)
                drawn = graph.call_function(_BERNOULLI_, (mask, *draw.args[1:]), draw.kwargs)
                drawn.meta["val"] = mask.meta["val"]
            if order is not None and order != sorted(order):
                inverse = sorted(range(len(order)), key=order.__getitem__)
                drawn = graph.call_function(torch.ops.aten.permute.default, (drawn, inverse))
                drawn.meta["val"] = drawn.args[0].meta["val"].permute(inverse)
            values = graph.call_function(
                torch.ops.aten._to_copy.default, (drawn,), {"dtype": val.dtype}
            )
            values.meta["val"] = drawn.meta["val"].to(val.dtype)
        draw.replace_all_uses_with(values)
        graph.erase_node(draw)
        graph.erase_node(buffer)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


_FAST_MIN_ELEMENTS = 4096
"""Smaller masks keep eager's kernel: the fast one's fixed cost (reading and writing the
generator's 5 KB state) is about 7 us, eager's draw 4.6 ns per element."""


def _fast(val: torch.Tensor, p: object, draw: Node) -> bool:
    """Whether ``draw`` (of the dense buffer ``val``) can use functacc's kernel: a constant
    probability, the default generator, enough elements, and the kernel built here. With
    symbolic sizes, the count is the traced example's (a choice of speed, not of values:
    both kernels draw the same bits; no guard is added on the sizes)."""
    elements = _compat.optimization_hint(val.numel(), fallback=0)
    return (
        isinstance(p, float | int)
        and 0 <= p <= 1
        and draw.kwargs.get("generator") is None
        and elements >= _FAST_MIN_ELEMENTS
        and bernoulli.available()
    )


def _byte_buffer(graph: torch.fx.Graph, buffer: Node, order: list[int] | None) -> Node:
    """A fresh ``uint8`` buffer for eager's kernel to draw into: contiguous in ``order``
    (the float buffer's memory order) where that is known, else the float buffer's own
    allocation in bytes (symbolic or not dense)."""
    val = buffer.meta["val"]
    if order is None:
        mask = graph.call_function(
            buffer.target, buffer.args, {**buffer.kwargs, "dtype": torch.uint8}
        )
        mask.meta["val"] = val.to(torch.uint8)
        return mask
    shape = [val.shape[d] for d in order]
    mask = graph.call_function(
        torch.ops.aten.empty.memory_format,
        (shape,),
        {"dtype": torch.uint8, "device": val.device, "pin_memory": False},
    )
    mask.meta["val"] = val.new_empty(shape, dtype=torch.uint8)
    return mask


def _kernel_sizes(graph: torch.fx.Graph, buffer: Node, order: list[int] | None) -> list | None:
    """The sizes, as graph values, for functacc's kernel to draw ``buffer`` in memory order:
    the dimensions in ``order`` where it is known; with symbolic sizes, the buffer's own if
    it is contiguous (known without a guard on them) and made by ``empty_like(x)`` (its
    symbolic sizes read from ``x`` by ``sym_size`` nodes) or ``empty(sizes)``; else None."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    val = buffer.meta["val"]
    if order is not None:
        return [val.shape[d] for d in order]
    expected: object = 1
    for size, stride in reversed(list(zip(val.shape, val.stride(), strict=True))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return None
        expected = expected * size
    if buffer.target is torch.ops.aten.empty.memory_format:
        return list(buffer.args[0])
    source = buffer.args[0]
    sizes: list = []
    for d, size in enumerate(val.shape):
        if isinstance(size, int):
            sizes.append(size)
            continue
        node = graph.call_function(torch.ops.aten.sym_size.int, (source, d))
        node.meta["val"] = size
        sizes.append(node)
    return sizes


def _rewritable(buffer: object) -> bool:
    if not isinstance(buffer, Node) or buffer.target not in _EMPTY or len(buffer.users) != 1:
        return False
    val = buffer.meta.get("val")
    return (
        isinstance(val, torch.Tensor) and val.dtype.is_floating_point and val.device.type == "cpu"
    )


def _memory_order(val: torch.Tensor) -> list[int] | None:
    """The dimensions from outermost to innermost in memory, if ``val`` is dense and
    non-overlapping with concrete sizes; otherwise None."""
    sizes, strides = list(val.shape), list(val.stride())
    if not all(type(x) is int for x in (*sizes, *strides)):
        return None
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order
