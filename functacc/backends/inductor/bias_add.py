"""On CPU, add a linear layer's bias in a kernel Inductor generates, not in ATen's ``addmm``.

``nn.Linear`` with a bias becomes ``addmm(bias, x, weight.t())``, and Inductor calls
ATen's ``addmm`` for it. On CPU that kernel first copies the bias into every row of its
output, then runs the GEMM on top of it (``beta=1``). Written as a plain ``mm`` then
``bias + mm``, the addition joins the kernel Inductor generates for what reads the result
(the activation after the layer, the softmax of a classifier); where a matmul reads it, the
addition is a kernel of its own, which costs what ``addmm``'s copy cost (eager
``mm(...).add_(bias)`` against ``addmm``, 2-core CPU: 21.0 vs 22.5 us at 32x256x256,
1048 vs 1048 us at 1024x256x768). Inductor unfuses ``addmm`` itself on GPUs, where only
elementwise users pay (``should_prefer_unfused_addmm``), and not on CPU.

Measured on the bench MLP (8 x Linear(256, 256) + ReLU, then Linear(256, 10) into
cross-entropy; batch 32, 2-core CPU, ``benchmarks/experiments/step_breakdown.py``): the
hidden layers' matmuls went from 28.9 to 23.9 us each and the classifier's from 24.6 to 6.4 us.

It is done for float32 and float64 only: in bf16 or fp16, rounding the product before the
bias is added would round twice where ``addmm`` rounds once. The sum itself is the same
operation, but MKL may split a long inner dimension and add the bias to a partial sum, so
results can differ from eager's ``addmm`` in the last bit, within the tolerance of every
Inductor step (Inductor reorders float arithmetic anyway).

Example:
    >>> import torch
    >>> x, w, b = torch.randn(4, 3), torch.randn(5, 3), torch.randn(5)
    >>> g = torch.fx.symbolic_trace(lambda x, w, b: torch.relu(torch.addmm(b, x, w.t())))
    >>> gm = torch.fx.experimental.proxy_tensor.make_fx(g)(x, w, b)
    >>> BiasAfterMatmul()(gm.graph)
    1
    >>> torch.allclose(gm(x, w, b), torch.relu(x @ w.t() + b))
    True
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

__all__ = ["BiasAfterMatmul"]

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float64)


class BiasAfterMatmul(CustomGraphPass):
    """An Inductor post-grad pass (``post_grad_custom_post_pass``): each float32 or float64
    ``addmm`` of a 1-D bias becomes ``mm`` then ``add``. Calling it returns how many it
    rewrote."""

    def __call__(self, graph: Graph) -> int:
        rewritten = 0
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            if _bias_can_follow(node):
                bias, left, right = node.args
                with graph.inserting_before(node):
                    product = graph.call_function(aten.mm.default, (left, right))
                    total = graph.call_function(aten.add.Tensor, (product, bias))
                product.meta["val"] = total.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(total)
                graph.erase_node(node)
                rewritten += 1
        return rewritten

    def uuid(self) -> bytes:
        # Part of Inductor's cache key: a change to this file compiles afresh.
        return get_hash_for_files((__file__,))


def _bias_can_follow(node: Node) -> bool:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return False
    values = [a.meta.get("val") if isinstance(a, Node) else None for a in node.args[:3]]
    bias = values[0]
    if not all(isinstance(v, torch.Tensor) and v.dtype in _DTYPES for v in values):
        return False
    return bias.dim() == 1 and node.meta["val"].dtype == bias.dtype
