"""The context part of a signature that the model holds: what a traced forward bakes in.

A trace records the forward's Python once, with the values it read from the model's
modules: train/eval mode, plain attributes (a dropout's ``p``, a config's settings),
which parameters are trainable, its tensors' dtypes and devices, the hooks on modules and
parameters. :class:`ModelWatch` reads those into a key that changes when any of them does
(one C++ check per call: :mod:`.guards`); :class:`HookWatch` keys the hooks;
:class:`StructureWatch` notices a layer or tensor replaced after the step was built.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .guards import ModelGuard, model_guard

__all__ = ["HELD_DEPTH", "HookWatch", "ModelWatch", "StructureWatch", "held_items"]


class ModelWatch:
    """The model's part of the signature, cheap to re-check on every call: which modules are
    in training mode, which parameters are trainable, the dtypes of the model's tensors,
    which tensors sit in the modules' parameter and buffer tables, and the modules' plain
    attributes (``dropout.p``, ``bn.momentum``, a user's ``self.use_relu``).

    A traced forward bakes in every Python value it read; eager PyTorch reads them again on
    each call. So a changed attribute makes another graph (as ``torch.compile`` recompiles
    on its guards): the old one would go on computing with the old value.

    :meth:`key` returns the *same* tuple object while nothing changed, so the step compares
    its whole signature by identity. Per call it runs one C++ check (:mod:`functacc.guards`:
    the version of each module's ``__dict__`` and of its two tables, the parameters' dtype,
    device and ``requires_grad``; ResNet-50: 9 us). Parameters change in place
    (``requires_grad_``, and ``Module._apply`` sets ``param.data``); table entries are
    replaced without any hook: ``submodule.double()`` or ``.to()`` puts new buffers straight
    into ``_buffers``, also in a module without parameters, and ``model.to(device)`` (or the
    ``overwrite_module_params_on_conversion`` future) new parameters into ``_parameters``.
    When the check fails, everything is re-read from Python; the key changes only if a
    value did (``model.train()`` on a training model writes the same ``True``, which leaves
    a dict's version alone). Without Dynamo's guard managers, everything is re-read on
    every call.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        params: dict[str, Tensor],
        tensors: Sequence[Tensor],
        names: Sequence[str] | None = None,
    ):
        self.modules = list(modules)
        self.names = (
            list(names) if names is not None else [f"module {i}" for i in range(len(modules))]
        )
        self.params = list(params.values())
        self.tensors = list(tensors)
        self._guard: ModelGuard | None = None
        self._key: tuple = ()
        # Attributes the body's Python state follows instead, fed or guarded (a counter that
        # a module of the user's code keeps, written by the step): PythonState.unkeyed.
        self.unkeyed: set[tuple[int, str]] = set()
        # The plain attributes the modules have now. One that a forward adds later (a cache
        # it builds once, which the trace allows) is not part of the signature.
        self._attributes = [
            (f"{name}.{attr}", module, attr)
            for name, module in zip(self.names, self.modules, strict=True)
            for attr, value in vars(module).items()
            if _plain_attribute(attr, value)
        ]

    def key(self) -> tuple:
        if self._guard is not None and self._guard.passes():
            return self._key
        contents: dict[int, Any] = {}
        key = self._read(contents)
        if key != self._key:  # a table written with the same tensors keeps the key
            self._key = key
        self._guard = model_guard(self.modules, self.params, list(contents.values()))
        return self._key

    def _read(self, contents: dict[int, Any]) -> tuple:
        """The key as the model is now; ``contents`` receives the containers and objects
        whose insides the key holds, for the check to watch."""
        tables = [table for m in self.modules for table in (m._parameters, m._buffers) if table]
        return (
            ("train mode", tuple(m.training for m in self.modules)),
            ("requires_grad", tuple(p.requires_grad for p in self.params)),
            ("model dtypes", tuple(t.dtype for t in self.tensors)),
            # Which tensors sit in the tables: a replaced one changes the key, and the
            # step then looks for what was replaced (StructureWatch.rescan).
            ("tensors", tuple(id(t) for table in tables for t in table.values())),
            # A forward assigned to a module (model.forward = new) between calls, which the
            # attributes below, fixed when the step was built, would not show.
            ("forwards", tuple(_value_key(vars(m).get("forward")) for m in self.modules)),
            (
                "module attributes",
                tuple(
                    (name, _value_key(vars(module).get(attr, _MISSING), contents))
                    for name, module, attr in self._attributes
                    if (id(module), attr) not in self.unkeyed
                ),
            ),
        )


def _plain_attribute(attr: str, value: Any) -> bool:
    """A module attribute that is part of the signature: public, not ``training`` (its own
    part), not a tensor (read afresh on every call as a graph input)."""
    return not attr.startswith("_") and attr != "training" and not isinstance(value, Tensor)


def _value_key(value: Any, contents: dict[int, Any] | None = None, depth: int = 0) -> Any:
    """``value`` as a key: numbers, strings and the like by value (NaN as a string, since
    NaN != NaN), sequences element by element, and what a forward may read inside a plain
    container or object (a ``dict`` of options, a ``types.SimpleNamespace`` or dataclass
    of settings, a Hugging Face ``config``) by value too, ``HELD_DEPTH`` levels deep: eager
    reads ``self.config.scale`` again on every call, a trace once. Modules, tensors,
    functions and classes, and anything deeper, by identity. Each container or object
    looked into goes into ``contents`` by id (the check watches it for writes)."""
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, float):
        return value if value == value else "nan"
    if value is _MISSING:
        return "(deleted)"
    if isinstance(value, Tensor) and depth == 0:
        # An attribute that was no tensor when the step was made and is one now (a running
        # loss that starts as None): the body's Python state feeds it (python_tensors), so
        # its kind is the key, not which tensor it is (a new one each call).
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, enum.Enum):
        return ("enum", str(value))
    inside = held_items(value) if depth < HELD_DEPTH else None
    if inside is None or (contents is not None and id(value) in contents):
        # Too deep, opaque, or met before (a cycle, or one object reached twice): by identity.
        return ("object", type(value).__qualname__, id(value))
    kind, items = inside
    if contents is not None and kind != "tuple":  # a tuple cannot change; its items can
        contents[id(value)] = value
    inner = tuple((label, _value_key(v, contents, depth + 1)) for label, v in items)
    if kind == "object":
        # And by identity: another object in its place is another setting even where their
        # public fields agree (an enum member's are all private).
        return (type(value).__qualname__, ("object", id(value)), inner)
    return (type(value).__name__, inner)


HELD_DEPTH = 3
"""How deep functacc looks into the containers and objects a module holds (a module's
``config``, a sub-config in it, the dict in that): for settings in the signature, for
generators a forward must not draw from. Deeper values are keyed by identity."""

# What holds no setting a forward reads, or is watched elsewhere: keyed by identity.
_OPAQUE = (
    nn.Module,
    # An optimizer or scheduler a module keeps (Tent's self.optimizer): its state is the
    # step's, followed where the step is given it; its values are no setting of a forward.
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
)


def held_items(value: Any, *, private: bool = False) -> tuple[str, list[tuple[str, Any]]] | None:
    """What a container or plain object held by a module holds: its kind (``"tuple"``,
    ``"list"``, ``"dict"`` or ``"object"``) and its entries as ``(label, value)``, labelled
    ``[0]``, ``['key']`` or by attribute name (private attributes only with ``private``).
    ``None`` for what is not looked into (modules, tensors, functions, scalars).

    Example:
        >>> import types
        >>> held_items(types.SimpleNamespace(scale=2.0, _cache=None))
        ('object', [('scale', 2.0)])
        >>> held_items({"p": 0.1}), held_items(print)
        (('dict', [("['p']", 0.1)]), None)
    """
    if type(value) is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return "tuple", [(f"[{i}]", v) for i, v in enumerate(value)]  # named tuples too
    if type(value) is list:
        return "list", [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict):  # a tensor key by identity (its repr shows its values)
        return "dict", [(f"[{_label(k)}]", v) for k, v in value.items()]
    fields = getattr(value, "__dict__", None)
    if isinstance(value, _OPAQUE) or not isinstance(fields, dict):
        return None
    return "object", [(k, v) for k, v in fields.items() if private or not k.startswith("_")]


def _label(key: Any) -> str:
    return f"tensor at {id(key):#x}" if isinstance(key, Tensor) else repr(key)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _MODULE_HOOKS)
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


class HookWatch:
    """The hooks a trace runs or must refuse: the modules' forward, pre-forward and backward
    hooks (and the global ones), and the parameters' gradient hooks
    (``p.register_hook``, ``p.register_post_accumulate_grad_hook``).

    Eager PyTorch runs the hooks registered at the time of each call; a compiled graph
    holds those of its trace. Every registration creates a
    ``torch.utils.hooks.RemovableHandle``, whose class counter ``next_id`` grows, so per
    call the step reads that counter and the sizes of the hook dicts that were non-empty
    at the last scan (a removal shrinks one); only when either moved does it re-read every
    module and parameter. :meth:`key` returns the same tuple object while nothing changed.
    """

    def __init__(self, model: nn.Module, params: dict[str, Tensor]):
        from torch.utils.hooks import RemovableHandle

        self._handles = RemovableHandle
        self.modules = [(name or "model", m) for name, m in model.named_modules()]
        self.params = params
        self._next_id = -1
        self._dicts: list[dict] = []
        self._sizes: tuple[int, ...] = ()
        self._key: tuple = ()

    def key(self) -> tuple:
        if self._handles.next_id == self._next_id and tuple(map(len, self._dicts)) == self._sizes:
            return self._key
        self._next_id = self._handles.next_id
        from torch.nn.modules import module as module_api

        found = [(f"global {name}", getattr(module_api, name)) for name in _GLOBAL_HOOKS]
        for where, module in self.modules:
            found += [(f"{where}.{name}", vars(module).get(name)) for name in _MODULE_HOOKS]
        for where, p in self.params.items():
            found += [(f"{where}.{name}", getattr(p, name)) for name in _TENSOR_HOOKS]
        live = [(where, hooks) for where, hooks in found if hooks]
        self._dicts = [hooks for _, hooks in live]
        self._sizes = tuple(map(len, self._dicts))
        # The handles' ids (the dicts' keys): unique per registration, never reused.
        key = tuple((where, tuple(hooks)) for where, hooks in live)
        if key != self._key:
            self._key = key
        return self._key


class StructureWatch:
    """Notices a parameter, buffer or submodule of the model being replaced or added after
    the step was built (``model.bn.running_mean = torch.zeros(4)``, ``model.fc =
    nn.Linear(...)``): the step trains the tensors it was built with, so it would silently
    keep updating the old ones while eager PyTorch uses the new.

    PyTorch calls its global registration hooks
    (``torch.nn.modules.module.register_module_{parameter,buffer,module}_registration_hook``)
    on every such assignment; functacc installs one, which only looks the module up among
    the watched ones, while any ``StructureWatch`` is alive: the last one to be garbage
    collected removes it. Per call the step reads one attribute (:attr:`replaced`); in-place
    changes (``copy_``, ``load_state_dict``, ``model.to()``) keep the tensors and are not
    replacements.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> watch = StructureWatch(model)
        >>> model.bias = torch.nn.Parameter(torch.zeros(2))
        >>> watch.replaced
        'bias'
    """

    def __init__(self, model: nn.Module):
        self.replaced: str | None = None
        self._model = weakref.ref(model)
        self._tensors = self._registered(model)
        self._names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        _install_registration_hooks()
        # Not at exit: the process is ending, and torch's tables with it.
        weakref.finalize(self, _release_registration_hooks).atexit = False
        for module in model.modules():
            watchers = _WATCHED.setdefault(module, [])
            watchers[:] = [ref for ref in watchers if ref() is not None]  # steps since dropped
            watchers.append(weakref.ref(self))

    def rescan(self) -> None:
        """Compare every registered tensor with the one the step was built with. Catches
        what bypasses the registration hooks: ``Module._apply`` (``model.double()``,
        ``model.to(device)``) puts new buffers straight into ``module._buffers``. The step
        calls it whenever the model's tensors changed dtype, device or ``requires_grad``
        (what ``_apply`` also does to the parameters), not on every call."""
        model = self._model()
        if self.replaced is not None or model is None:
            return
        for name, tensor in self._registered(model).items():
            if self._tensors.get(name) is not tensor:
                self.replaced = name
                return

    @staticmethod
    def _registered(model: nn.Module) -> dict[str, Tensor]:
        return {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }

    def _note(self, module: nn.Module, name: str) -> None:
        if self.replaced is None:
            prefix = self._names.get(id(module), "")
            self.replaced = f"{prefix}.{name}" if prefix else name


_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MISSING = object()
# The registration hooks run on every parameter, buffer and submodule assignment in the
# process (every model being built, functacc's or not), so they stay only while a
# StructureWatch needs them: their handles, and how many watches are alive.
_handles: list[Any] = []
_live = 0


def _install_registration_hooks() -> None:
    global _live
    # Counted before installing: a dying watch's finalizer, run by a garbage collection in
    # between, then sees this one alive and leaves the hooks.
    _live += 1
    if _handles:
        return
    from torch.nn.modules import module as module_api

    _handles.append(module_api.register_module_parameter_registration_hook(_on_registration))
    _handles.append(module_api.register_module_buffer_registration_hook(_on_registration))
    _handles.append(module_api.register_module_module_registration_hook(_on_registration))


def _release_registration_hooks() -> None:
    global _live
    _live -= 1
    if _live == 0:
        while _handles:
            _handles.pop().remove()


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    watchers = _WATCHED.get(module)
    if not watchers:
        return None  # a module no step watches (any module being built, for instance)
    current = _MISSING
    for table in ("_parameters", "_buffers", "_modules"):
        entries = module.__dict__.get(table)
        if entries is not None and name in entries:
            current = entries[name]
            break
    if value is not current:
        for ref in watchers:
            watch = ref()
            if watch is not None:
                watch._note(module, name)
    return None
