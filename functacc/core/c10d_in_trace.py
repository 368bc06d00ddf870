"""``torch.distributed``'s in-place collectives called by a step body, as graph ops.

DDP training scripts average a metric over the ranks inside their step (NVIDIA apex's
ImageNet example: ``reduced_loss = reduce_tensor(loss.data)``, whose ``dist.all_reduce(rt)``
sums in place). Traced as they are, those c10d calls fail on the process group object
("'__eq__' is not implemented for ... ProcessGroup"). While a step body is traced,
``all_reduce``, ``all_gather`` (into a list), ``broadcast`` and ``barrier`` are their
functional forms (``torch.distributed._functional_collectives``), written back in place, so
the graph runs them on every call as eager does; any other c10d collective there is a
:class:`~functacc.errors.TraceError` naming it.

Example:
    >>> with collectives_in_graph():
    ...     pass
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..errors import TraceError

__all__ = ["collectives_in_graph"]

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max"}
# c10d functions of a step body refused while traced (the rest are not collectives).
_REFUSED = (
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


@contextlib.contextmanager
def collectives_in_graph() -> Iterator[None]:
    """While inside (a step body traced): c10d's in-place collectives run as functional
    collectives of the graph (see the module docstring)."""
    if not dist.is_available():
        yield
        return
    c10d = dist.distributed_c10d
    patched: list[tuple[str, Any]] = []

    def patch(name: str, value: Callable) -> None:
        patched.append((name, getattr(c10d, name)))
        for owner in (c10d, dist):
            setattr(owner, name, value)

    patch("all_reduce", _all_reduce)
    patch("all_gather", _all_gather)
    patch("broadcast", _broadcast)
    patch("barrier", _barrier)
    for name in _REFUSED:
        if hasattr(c10d, name):
            patch(name, _refused(name))
    try:
        yield
    finally:
        for name, value in reversed(patched):
            for owner in (c10d, dist):
                setattr(owner, name, value)


def _funcol() -> Any:
    from torch.distributed import _functional_collectives as funcol

    return funcol


def _group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _no_async(name: str, async_op: bool) -> None:
    if async_op:
        raise TraceError(
            f"torch.distributed.{name}(..., async_op=True) in the step: functacc.jit runs the "
            "collective inside the graph, which waits where its result is first read. Fix: "
            "leave out async_op (and the work's .wait())."
        )


def _all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    _no_async("all_reduce", async_op)
    name = getattr(op, "name", None) if op is not None else "SUM"
    if name not in _OPS:
        raise TraceError(
            f"torch.distributed.all_reduce with op={op} in the step: functacc.jit runs it "
            f"inside the graph, which takes {sorted(_OPS)}. Fix: use one of those, or reduce "
            "outside the step."
        )
    funcol = _funcol()
    tensor.copy_(funcol.wait_tensor(funcol.all_reduce(tensor, _OPS[name], _group(group))))


def _all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False) -> None:
    _no_async("all_gather", async_op)
    funcol = _funcol()
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(tensor, 0, _group(group)))
    for out, part in zip(tensor_list, gathered.chunk(len(tensor_list)), strict=True):
        out.copy_(part.view_as(out))


def _broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> None:
    _no_async("broadcast", async_op)
    funcol = _funcol()
    tensor.copy_(funcol.wait_tensor(funcol.broadcast(tensor, src, _group(group))))


def _barrier(*args: Any, **kwargs: Any) -> None:
    """Nothing to do in a graph: its collectives already wait for every rank."""


def _refused(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TraceError(
            f"torch.distributed.{name}() in the step: functacc.jit runs the step as one graph, "
            "where it runs all_reduce, all_gather (into a list), broadcast and barrier as "
            "graph collectives. Fix: use one of those, the functional collectives "
            "(torch.distributed._functional_collectives), or call it outside the step."
        )

    return refuse
