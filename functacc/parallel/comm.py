"""Collectives inside the traced step, and what a traced step communicates.

The collectives are ``torch.distributed._functional_collectives``: traced, they become
``_c10d_functional.*`` and ``wait_tensor`` nodes of the step graph, which Inductor schedules
and a CUDA graph captures, running on gloo (CPU) or NCCL (CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.fx import GraphModule

from .. import _compat

__all__ = [
    "CommStats",
    "all_gather",
    "all_reduce",
    "average_written",
    "bucketed_all_reduce",
    "comm_stats",
    "reduce_scatter",
    "written_tensors",
]

Group = dist.ProcessGroup


def all_reduce(t: Tensor, group: Group) -> Tensor:
    """Sum over ``group``."""
    return funcol.all_reduce(t, "sum", group)


def reduce_scatter(t: Tensor, group: Group) -> Tensor:
    """Sum over ``group`` of a 1-D tensor; this rank keeps its contiguous chunk."""
    return _compat.reduce_scatter_single(t, "sum", 0, group)


def all_gather(t: Tensor, group: Group) -> Tensor:
    """Concatenate the 1-D chunks of ``group`` in rank order."""
    return _compat.all_gather_single(t, 0, group)


def bucketed_all_reduce(
    tensors: Mapping[str, Tensor],
    group: Group,
    *,
    scale: float,
    bucket_bytes: float,
    wire_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """``scale * sum over group`` of every tensor, in ``ceil(bytes / bucket_bytes)``
    all-reduces per dtype.

    The tensors are laid end to end, last first (the last layers' gradients are ready first
    in backward, as DDP orders its buckets), and cut into buckets of ``bucket_bytes``; a
    tensor may straddle two buckets. Each bucket is built from its own tensors only, so its
    all-reduce can start as soon as they exist (see :mod:`functacc.parallel.schedule`).
    ``scale`` is applied first (DDP divides by the world size first), which keeps a bucket
    sent as ``wire_dtype`` (bfloat16 compression) from overflowing.
    """
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in reversed(list(tensors)):
        by_dtype.setdefault(tensors[name].dtype, []).append(name)
    pieces: dict[str, list[Tensor]] = {n: [] for n in tensors}
    for dtype, names in by_dtype.items():
        capacity = max(
            1, int(bucket_bytes // torch.empty((), dtype=wire_dtype or dtype).element_size())
        )
        bucket: list[tuple[str, Tensor]] = []
        room = capacity
        for name in names:
            flat = tensors[name].reshape(-1)
            start = 0
            while start < flat.numel():
                take = min(room, flat.numel() - start)
                bucket.append((name, flat[start : start + take]))
                start += take
                room -= take
                if room == 0:
                    _reduce_bucket(bucket, group, scale, wire_dtype, dtype, pieces)
                    bucket, room = [], capacity
        if bucket:
            _reduce_bucket(bucket, group, scale, wire_dtype, dtype, pieces)
    return {
        n: torch.cat(pieces[n]).view_as(t) if len(pieces[n]) > 1 else pieces[n][0].view_as(t)
        for n, t in tensors.items()
    }


def _reduce_bucket(
    bucket: list[tuple[str, Tensor]],
    group: Group,
    scale: float,
    wire_dtype: torch.dtype | None,
    dtype: torch.dtype,
    pieces: dict[str, list[Tensor]],
) -> None:
    flat = torch.cat([piece for _, piece in bucket]) * scale
    if wire_dtype is not None:
        flat = flat.to(wire_dtype)
    reduced = all_reduce(flat, group).to(dtype)
    for (name, _), piece in zip(bucket, reduced.split([p.numel() for _, p in bucket]), strict=True):
        pieces[name].append(piece)


def average_written(
    tensors: Mapping[str, Tensor], group: Group, *, world: int, bucket_bytes: float
) -> dict[str, Tensor]:
    """Average over ``group`` the floating-point tensors the traced step wrote (BatchNorm
    running statistics): summed, then divided by ``world``, so every rank holds the same
    correctly rounded mean whatever the world size. Tensors that were only read keep their
    exact bits; integer ones (``num_batches_tracked``) are the same on every rank."""
    written = written_tensors(tensors)
    floating = {n: t for n, t in tensors.items() if t.is_floating_point() and n in written}
    if not floating:
        return dict(tensors)
    summed = bucketed_all_reduce(floating, group, scale=1.0, bucket_bytes=bucket_bytes)
    return {**tensors, **{n: t / world for n, t in summed.items()}}


# Batch-norm kernels that update running_mean / running_var (arguments 3 and 4) in place
# when training (argument 5) without declaring the write in their schema.
_BATCH_NORMS = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")


def written_tensors(tensors: Mapping[str, Tensor]) -> set[str]:
    """The names of ``tensors`` (new buffers of a step being traced by ``make_fx``) whose
    value the step may have changed, read off the graph recorded so far.

    A buffer reaches the model as a ``clone`` of its state tensor (once per micro-batch);
    it is written if an op writes into that clone or into a view of it (an in-place op, a
    ``copy_``, a batch norm's running statistics). Outside a trace, or for a tensor the
    graph does not know, every tensor counts as written (safe: it is then averaged).

    Example:
        >>> import torch
        >>> sorted(written_tensors({"a": torch.ones(2)}))  # not tracing: all written
        ['a']
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return set(tensors)
    out = set()
    for name, t in tensors.items():
        slot = get_proxy_slot(t, mode.tracer, None)
        if slot is None or _chain_written(slot.proxy.node):
            out.add(name)
    return out


def _chain_written(node: torch.fx.Node) -> bool:
    aten = torch.ops.aten
    while True:
        if node.op == "placeholder":
            return False  # the state's own tensor, unchanged
        if node.target is not aten.clone.default:
            # An in-place op rebinds the tensor to its own node; any other producer is
            # unknown here, so the tensor counts as written.
            return True
        if writers(node):
            return True
        node = node.args[0]


def writers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that write into the tensor of ``node`` (or into a view of it) in place,
    including batch norms updating running statistics they do not declare as written; the
    graph's data edges do not order these writes before later reads of ``node``."""
    out = []
    for user in node.users:
        op = user.target
        if not isinstance(op, torch._ops.OpOverload):
            continue
        schema = op._schema
        written = False
        for i, arg in enumerate(user.args):
            if arg is not node:
                continue
            batch_norm = schema.name.split("::")[-1] in _BATCH_NORMS and i in (3, 4)
            if batch_norm and len(user.args) > 5 and user.args[5]:
                written = True
            alias = schema.arguments[i].alias_info if i < len(schema.arguments) else None
            written = written or (alias is not None and alias.is_write)
        for key, arg in user.kwargs.items():
            if arg is node:
                alias = next((a.alias_info for a in schema.arguments if a.name == key), None)
                written = written or (alias is not None and alias.is_write)
        if written:
            out.append(user)
        elif any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            out.extend(writers(user))  # a view: writes into it write into node
    return out


_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "broadcast": "broadcast",
}


@dataclass
class CommStats:
    """What one step communicates, read off its graph.

    ``payload_bytes`` counts the tensor each collective works on: the input of an all-reduce
    or reduce-scatter, the output of an all-gather. ``sent_bytes`` estimates what one rank
    sends on a ring: ``2 (n-1)/n`` of the payload for an all-reduce, ``(n-1)/n`` for a
    reduce-scatter or an all-gather, over a group of ``n`` ranks.
    """

    collectives: dict[str, int] = field(default_factory=dict)
    payload_bytes: dict[str, int] = field(default_factory=dict)
    sent_bytes: dict[str, float] = field(default_factory=dict)
    group_bytes: dict[str, int] = field(default_factory=dict)
    """Payload per process group name (tensor parallel's group apart from data parallel's)."""

    def add(self, kind: str, payload: int, group_size: int, group: str = "") -> None:
        self.group_bytes[group] = self.group_bytes.get(group, 0) + payload
        factor = (
            2 * (group_size - 1) / group_size
            if kind == "all_reduce"
            else ((group_size - 1) / group_size)
        )
        self.collectives[kind] = self.collectives.get(kind, 0) + 1
        self.payload_bytes[kind] = self.payload_bytes.get(kind, 0) + payload
        self.sent_bytes[kind] = self.sent_bytes.get(kind, 0.0) + factor * payload


def _nbytes(value: object) -> int:
    return value.numel() * value.element_size() if isinstance(value, Tensor) else 0


def comm_stats(graph: GraphModule) -> CommStats:
    """Count the collectives of a traced step and their sizes."""
    stats = CommStats()
    for node in graph.graph.nodes:
        if (
            node.op != "call_function"
            or getattr(node.target, "namespace", "") != "_c10d_functional"
        ):
            continue
        kind = _KINDS.get(node.target._opname)
        if kind is None:
            continue
        group_name = node.args[-1]
        group_size = dist.distributed_c10d._get_group_size_by_name(group_name)
        if kind == "all_gather":
            payload = _nbytes(node.meta.get("val"))
        else:
            payload = _nbytes(node.args[0].meta.get("val"))
        stats.add(kind, payload, group_size, group_name)
    return stats
