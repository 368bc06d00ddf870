"""oneDNN's LSTM layer in a compiled step: eager's kernel, with the workspace backward needs.

On CPU, eager PyTorch runs ``nn.LSTM`` (float32 or bfloat16, no projections) with oneDNN:
``aten.lstm`` calls ``aten.mkldnn_rnn_layer`` once per layer and direction, and its
backward is ``aten.mkldnn_rnn_layer_backward``, which reads a ``workspace`` the forward
filled. A trace records both, as eager calls them. But the forward kernel fills that
workspace only while grad mode is on, and a compiled step runs with grad mode off (its
writes reach tensors that require grad): the forward returned no workspace and the backward
failed ("Expected a proper Tensor but got None ... 'workspace'").

:func:`keep_rnn_workspace` points those calls at ``functacc::mkldnn_rnn_layer``, which runs
the same kernel with grad mode on, on detached inputs (so that no autograd graph is built):
the same numbers as eager (its outputs do not depend on grad mode; checked bit for bit), and
the workspace for the backward. Being an operator with a schema, it runs under both
backends: the eager one calls it, Inductor calls it as an opaque kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx import GraphModule

__all__ = ["keep_rnn_workspace"]

_LAYER = torch.ops.aten.mkldnn_rnn_layer.default


@torch.library.custom_op("functacc::mkldnn_rnn_layer", mutates_args=())
def _mkldnn_rnn_layer(
    input: Tensor,
    w0: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    hx: Tensor,
    cx: Tensor,
    reverse: bool,
    batch_sizes: list[int],
    mode: int,
    hidden_size: int,
    num_layers: int,
    has_biases: bool,
    bidirectional: bool,
    batch_first: bool,
    train: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``aten.mkldnn_rnn_layer`` with grad mode on, so that it fills the workspace."""
    tensors = [t.detach() for t in (input, w0, w1, w2, w3, hx, cx)]
    with torch.enable_grad():
        out = _LAYER(*tensors, reverse, batch_sizes, mode, hidden_size, num_layers,
                     has_biases, bidirectional, batch_first, train)  # fmt: skip
    return tuple(out)


@_mkldnn_rnn_layer.register_fake
def _(
    input: Tensor,
    w0: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    hx: Tensor,
    cx: Tensor,
    reverse: bool,
    batch_sizes: list[int],
    mode: int,
    hidden_size: int,
    num_layers: int,
    has_biases: bool,
    bidirectional: bool,
    batch_first: bool,
    train: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = _LAYER(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size,
                 num_layers, has_biases, bidirectional, batch_first, train)  # fmt: skip
    # The workspace's size is oneDNN's to choose (aten's meta kernel says 0): a size known
    # only when the kernel has run, so that Inductor does not check it against a guess.
    workspace = input.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.uint8)
    return (*out[:3], workspace)


def keep_rnn_workspace(gm: GraphModule) -> int:
    """Make the graph's oneDNN LSTM layers that feed a backward fill their workspace (see
    the module's docstring); returns how many were changed. A layer whose workspace nothing
    reads (an LSTM under ``torch.no_grad()``) keeps eager's call."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _LAYER:
            continue
        if any(user.args[1] == 3 for user in node.users):  # getitem(node, 3): the workspace
            node.target = torch.ops.functacc.mkldnn_rnn_layer.default
            changed += 1
    if changed:
        gm.recompile()
    return changed
