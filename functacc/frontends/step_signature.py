"""What a compiled step's graph depends on besides its inputs' shapes, checked per call.

A traced graph bakes in more than the batch: the model's train/eval mode and plain
attributes (a dropout's ``p``), which parameters are trainable, the dtypes of its tensors,
its hooks, the optimizer's structure, the parallel strategy's phase and the ambient state
(autocast, default dtype). :class:`StepSignature` reads all of it into the key the step's
programs are cached under. Each watch returns the same object while its part is unchanged,
so the common call compares a few identities and reuses the last key.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..core.diagnostics import describe_tensor
from ..core.differences import filled_settings
from ..core.functional import check_dense_gradients
from ..core.model_watch import HookWatch, ModelWatch, StructureWatch
from ..core.signature import AmbientWatch, BatchWatch, TensorSpec, hashable_constant
from ..core.tracer import Traced
from ..errors import replaced_error

__all__ = ["StepSignature", "describe_batch"]

log = logging.getLogger("functacc")


class StepSignature:
    """The signature of a ``compile_step`` call: the batch's key and the context's.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> sig = StepSignature(model, dict(model.named_parameters()),
        ...                     dict(model.named_buffers()), "cpu")
        >>> before = sig.context(hyper=(), parallel=())
        >>> _ = model.eval()
        >>> sig.context(hyper=(), parallel=()) == before
        False
    """

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        device_type: str,
    ):
        self.model = model
        named = list(model.named_modules())
        self.model_watch = ModelWatch(
            [module for _, module in named],
            params,
            [*params.values(), *buffers.values()],
            names=[f"model.{name}" if name else "model" for name, _ in named],
        )
        self.hook_watch = HookWatch(model, params)
        self.structure = StructureWatch(model)
        self.batch_watch = BatchWatch()
        self.ambient = AmbientWatch(device_type)
        self._parts: tuple | None = None
        self._key: tuple = ()

    def context(self, *, hyper: Any, parallel: Any) -> tuple:
        """The key of what besides the batch the graph depends on; ``hyper``: the
        optimizer's structure, ``parallel``: the strategy's phase."""
        # Per-call checks of what changes the graph: train/eval mode, which parameters are
        # trainable, the dtypes of the model's tensors, the optimizer structure, the
        # strategy's phase and the ambient state a trace bakes in (autocast, default dtype).
        # Each watch returns the same object while its part is unchanged, so the common call
        # compares a few identities and reuses the last key. Sizes and strides of the graph's
        # inputs are not re-read here: the compiled graph asserts them on every call
        # (Inductor's wrapper; the eager backend's ops reject other sizes), and the live
        # state keeps them.
        parts = (
            self.model_watch.key(),
            hyper,
            parallel,
            self.ambient.key(),
            self.hook_watch.key(),
        )
        if parts != self._parts:
            if self._parts is None or parts[0] is not self._parts[0]:
                # The model's tensors changed dtype, device or requires_grad: model.double()
                # and model.to() also replace its buffers, which no hook reports.
                self.structure.rescan()
                self.check_structure()
                check_dense_gradients(self.model)  # a sparse embedding unfrozen
            model, hyper, parallel, ambient, hooks = parts
            self._parts = parts
            self._key = (
                *model,
                ("optimizer hyperparameters", hyper),
                ("parallel", parallel),
                ("ambient", ambient),
                ("hooks", hooks),
            )
        return self._key

    def check_structure(self) -> None:
        if self.structure.replaced is not None:
            raise replaced_error(f"model.{self.structure.replaced}", "compile_step")

    def batch(self, args: tuple, kwargs: dict) -> tuple[list[Tensor], tuple]:
        """The batch's tensors and its signature key (its first part: the tensor specs)."""
        if not kwargs and all(type(a) is Tensor for a in args):
            # The common step(inputs, targets): no pytree walk on the hot path.
            return list(args), (("inputs", self.batch_watch.key(args)),)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        constants = [x for x in leaves if not isinstance(x, Tensor)]
        key = (
            ("inputs", tuple(TensorSpec.of(t) for t in tensors)),
            ("structure", str(spec)),
            ("constants", tuple(map(hashable_constant, constants))),
        )
        return tensors, key

    def left_behind(
        self,
        key: tuple,
        family: tuple,
        watched: tuple,
        traced: Traced,
        run_trace: Callable[[], Traced],
        meta: dict[str, Any],
        context_now: Callable[[], tuple],
    ) -> tuple[tuple, tuple]:
        """The key and family to keep a new program under: the call's own, or the
        signature the forward left behind where the trace filled in settings that were
        ``None`` or absent (Hugging Face classifiers set ``config.problem_type`` at their
        first forward, and never again). The next call has that signature; keyed on the
        call's own, it would be traced and compiled again for an identical graph.

        Only if the forward takes the same path with the new values: a forward that read
        the setting before filling it in holds another graph from its second call on (as
        eager reads the new value), and one that changes it on every call has no stable
        signature. A second trace (fake tensors, not compiled) with the new values shows
        both; the model's settings are then put back to what one forward left, as in eager.
        """
        left = self.model_watch.key()
        if left is watched or not filled_settings(watched, left):
            return key, family
        restore = self.model_watch.snapshot()
        first = dict(meta)
        try:
            again = run_trace()
            same = self.model_watch.key() == left and _same_graph(traced, again)
        except Exception:  # refused or failed with the new values: keep the call's key
            same = False
        finally:
            restore()
            meta.clear()
            meta.update(first)
        if not same:
            return key, family
        log.info(
            "functacc: the forward filled in %s while tracing, and takes the same path with "
            "the new values: the graph is kept for the signature it leaves behind",
            ", ".join(filled_settings(watched, left) or ()),
        )
        batch_key, context = key
        context = (context[0], context_now(), *context[2:])
        return (batch_key, context), (family[0], context)


def describe_batch(args: tuple, kwargs: dict) -> str:
    """The batch's leaves by name with their shapes, dtypes and devices (for messages)."""
    items = pytree.tree_flatten_with_path((args, kwargs))[0]
    parts = []
    for path, leaf in items:
        name = "args" + pytree.keystr(path[1:]) if path[0].idx == 0 else pytree.keystr(path[1:])
        if isinstance(leaf, Tensor):
            parts.append(f"{name}: {describe_tensor(leaf)}")
        else:
            parts.append(f"{name}: {leaf!r}")
    return "; ".join(parts) or "no inputs"


def _same_graph(a: Traced, b: Traced) -> bool:
    """Two traces of the step recorded the same computation: the same code, the same
    constants (a Python value turned into a tensor, ``torch.tensor(scale)``) and, with
    symbolic sizes, the same guard."""
    return a.guard == b.guard and _same_code(a.graph, b.graph)


def _same_code(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op != "get_attr":
            continue
        get = operator.attrgetter(node.target)  # a dotted name for a nested attribute
        x, y = get(a), get(b)
        if isinstance(x, torch.fx.GraphModule) and isinstance(y, torch.fx.GraphModule):
            if not _same_code(x, y):  # a higher-order op's body (remat's checkpoint)
                return False
        elif isinstance(x, Tensor) and isinstance(y, Tensor):
            if x is not y and (x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y)):
                return False
        elif x is not y and type(x) is type(y) and not isinstance(x, nn.Module) and x == y:
            continue
        elif x is not y:
            return False
    return True
