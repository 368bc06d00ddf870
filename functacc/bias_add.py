"""On CPU, add a linear layer's bias in the elementwise kernel after its matmul.

``nn.Linear`` with a bias becomes ``addmm(bias, x, weight.t())``, and Inductor calls
ATen's ``addmm`` for it. On CPU that kernel first copies the bias into every row of its
output, then runs the GEMM on top of it (``beta=1``). Where the ``addmm``'s result only
feeds elementwise ops (a ReLU or GELU after the layer, through views or not), the bias can
instead be one more term of the kernel Inductor generates for them: a plain ``mm``, then
``bias + mm`` fused into the activation. Inductor does this itself on GPUs
(``should_prefer_unfused_addmm``), not on CPU.

Measured on the bench MLP (8 x Linear(256, 256) + ReLU, batch 32, 2-core CPU,
``benchmarks/step_breakdown.py``, three runs each, interleaved): the gradients graph ran
0.65-0.67 ms instead of 0.69-0.71 ms.

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
    """An Inductor post-grad pass (``post_grad_custom_post_pass``): each ``addmm`` with a
    1-D bias whose users are all elementwise becomes ``mm`` then ``add``. Calling it returns
    how many it rewrote."""

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
    from torch._inductor.utils import is_pointwise_use

    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return False
    values = [a.meta.get("val") if isinstance(a, Node) else None for a in node.args[:3]]
    bias = values[0]
    if not all(isinstance(v, torch.Tensor) and v.dtype in _DTYPES for v in values):
        return False
    if bias.dim() != 1 or node.meta["val"].dtype != bias.dtype:
        return False
    # Every use elementwise (through views): the add then fuses into that kernel.
    return bool(node.users) and all(is_pointwise_use(user) for user in node.users)
