"""One C++ check, per call, that nothing the model's part of the signature is made of changed.

What the step must notice between calls: a module switched between ``train()`` and
``eval()`` or any other of its attributes given another value (a dropout's ``p``), a
parameter's ``requires_grad`` or dtype changed in place (``requires_grad_``,
``param.data = ...``, which ``Module._apply`` does), and a tensor replaced in a module's
``_parameters`` or ``_buffers`` table (``Module._apply`` does that without any hook:
``submodule.double()`` on buffers, ``model.to(device)`` and
``torch.__future__.set_overwrite_module_params_on_conversion(True)`` on parameters).

Dynamo checks such things before every call of a ``torch.compile``'d function with a tree of
C++ guards (``torch._C._dynamo.guards.RootGuardManager``); :func:`model_guard` builds one
tree for the model: per module, its ``__dict__`` and its two tables have not been written
since (CPython's per-dict version, which a write of another object bumps; writing the same
object, as ``model.train()`` on a training model does, leaves it); per parameter,
Dynamo's tensor match without sizes (dtype, device, dispatch keys, ``requires_grad``). On
ResNet-50 (151 modules, 161 parameters; 2-core CPU) the check takes 9.0 us, against
15.5 us for the earlier checks made from Python with C-level maps
(``benchmarks/experiments/host_overhead.py``). A failed
check says only "something may have changed": the caller re-reads everything and builds a
new tree. The API is private; without it (or if the dict-version check does not work on
this Python), :func:`model_guard` returns ``None`` and the caller re-reads every call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["ModelGuard", "model_guard"]


class ModelGuard:
    """A built check: :meth:`passes` is ``True`` while nothing it watches has changed."""

    def __init__(self, root: Any, watched: list[Any]):
        self._root = root
        self._watched = watched  # what the tree's accessors index: w[0], w[1], ...

    def passes(self) -> bool:
        return self._root.check(self._watched)


def model_guard(
    modules: Sequence[nn.Module], params: Sequence[Tensor], contents: Sequence[Any] = ()
) -> ModelGuard | None:
    """The check for these modules and parameters as they are now (``None`` where Dynamo's
    guard managers are unavailable). ``contents``: dicts, lists and plain objects (their
    ``__dict__``) the modules hold whose insides are part of the signature; writes to them
    fail the check too.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> guard = model_guard(list(model.modules()), list(model.parameters()))
        >>> guard.passes(), model.eval() is model, guard.passes()
        (True, True, False)
    """
    if not _dict_versions_work():
        return None
    from torch._C import _dispatch_keys
    from torch._C._dynamo.guards import RootGuardManager
    from torch._dynamo.guards import GuardManagerType

    plain = GuardManagerType.GUARD_MANAGER
    root = RootGuardManager()
    watched: list[Any] = []

    def watch(value: Any, what: str) -> Any:
        watched.append(value)
        i = len(watched) - 1
        return root.list_getitem_manager(
            key=i, source=f"{what} (w[{i}])", example_value=value, guard_manager_enum=plain
        )

    for i, module in enumerate(modules):
        where = f"module {i} ({type(module).__name__})"
        fields = vars(module)
        # Any attribute written with another value: ``training`` (train()/eval()), a
        # dropout's ``p``, a user's flag. Writing the same object leaves the version alone.
        watch(fields, where).add_dict_version_guard(fields, [f"{where} attributes"], None)
        if "training" not in fields or hasattr(type(module), "training"):
            # A class that defines ``training`` itself (a property): read it as Python does.
            flag = watch(module, where).getattr_manager(
                attr="training",
                source=f"{where}.training",
                example_value=module.training,
                guard_manager_enum=plain,
            )
            flag.add_equals_match_guard(module.training, [f"{where}.training"], None)
        for table in ("_parameters", "_buffers"):
            entries = fields[table]
            if not entries:
                # Nothing to replace in an empty table (what ``Module._apply`` does), and an
                # entry added goes through ``register_parameter``/``register_buffer``, whose
                # global hooks ``signature.StructureWatch`` installs. A check skipped is a
                # cache miss saved: the step's checks run with cold caches (after the
                # update streamed the optimizer state), and half the tables are empty.
                continue
            watch(entries, f"{where}.{table}").add_dict_version_guard(
                entries, [f"{where}.{table} unchanged"], None
            )
    for i, value in enumerate(contents):
        where = f"{type(value).__name__} {i} held by the model"
        if isinstance(value, list):
            # A list has no version: its length, and each item by value (numbers, strings)
            # or by identity (what it holds is in ``contents`` itself), up to a bound.
            items = watch(value, where)
            items.add_length_check_guard(len(value), [f"len({where})"], None)
            for k, item in enumerate(value[:_LIST_ITEMS_CHECKED]):
                entry = items.list_getitem_manager(
                    key=k, source=f"{where}[{k}]", example_value=item, guard_manager_enum=plain
                )
                if item is None or isinstance(item, (bool, int, float, str)):
                    entry.add_equals_match_guard(item, [f"{where}[{k}] == {item!r}"], None)
                else:
                    entry.add_id_match_guard(id(item), [f"{where}[{k}] is the same"], None)
        else:
            fields = value if isinstance(value, dict) else vars(value)
            watch(fields, where).add_dict_version_guard(fields, [f"{where} unchanged"], None)
    for i, p in enumerate(params):
        unchecked = [None] * p.dim()  # sizes and strides: the compiled graph asserts them
        watch(p, f"parameter {i}").add_tensor_match_guard(
            p,
            unchecked,
            unchecked,
            f"parameter {i}",
            [f"parameter {i}"],
            None,
            type(p),
            _dispatch_keys(p),
        )
    return ModelGuard(root, watched)


# Items of a list checked one by one per call; a longer list's later items are read only
# when something else fails the check (a per-call cost that grows with the list otherwise).
_LIST_ITEMS_CHECKED = 64


@functools.cache
def _dict_versions_work() -> bool:
    """Whether this torch and Python have the guard managers, and a dict version guard
    fails after a write (CPython deprecated the version tag in 3.12)."""
    try:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        table = {"a": 1}
        root = RootGuardManager()
        root.list_getitem_manager(
            key=0,
            source="probe",
            example_value=table,
            guard_manager_enum=GuardManagerType.GUARD_MANAGER,
        ).add_dict_version_guard(table, ["probe"], None)
        before = root.check([table])
        table["a"] = 2
        return before and not root.check([table])
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False
