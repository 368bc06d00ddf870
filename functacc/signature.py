"""What makes one compiled graph of the step different from another: its signature.

A call's signature has two parts:

- **the batch**: each input tensor's shape, dtype, device and layout, the batch's structure
  (tuple, dict, keys) and its Python constants;
- **the context**: train/eval mode of every module, which parameters are trainable, the
  model's dtypes and shapes, the optimizer's structure, the parallel strategy's phase, and
  the ambient state that changes which ops a trace records (``torch.autocast``, the default
  dtype).

A graph traced with symbolic dimensions serves a *family*: every batch whose signature
differs only in those sizes (:func:`family_key` erases sizes, keeps the rest).
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .guards import ModelGuard, model_guard

__all__ = [
    "HELD_DEPTH",
    "AmbientWatch",
    "BatchWatch",
    "HookWatch",
    "ModelWatch",
    "StructureWatch",
    "TensorSpec",
    "ambient_key",
    "batch_names",
    "describe_difference",
    "family_key",
    "filled_settings",
    "held_items",
    "size_changes",
]


class TensorSpec(NamedTuple):
    """What a static graph assumes about one input tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, t.device, t.stride())

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.shape} {dtype} on {self.device} (stride {self.stride})"


class LayoutSpec(NamedTuple):
    """What a graph with symbolic sizes assumes about one input tensor: everything but
    the sizes. Contiguous tensors (the rule for batches) have size-independent layout;
    other layouts are kept exactly (their graphs stay static)."""

    ndim: int
    dtype: torch.dtype
    device: torch.device
    layout: str | tuple[int, ...]


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

    def snapshot(self) -> Callable[[], None]:
        """What the modules' plain attributes and the containers and objects the key looks
        into hold now (each one's entries, shallowly; an object's private fields too), and a
        function that puts them back: after a forward has run once more than eager runs it
        (the step's check of a setting a forward filled in), so the model holds what one
        forward left."""
        contents: dict[int, Any] = {}
        self._read(contents)
        attributes = [
            (vars(m), attr, vars(m).get(attr, _MISSING)) for _, m, attr in self._attributes
        ]
        held = [(value, _entries(value)) for value in contents.values()]

        def restore() -> None:
            for fields, attr, value in attributes:
                if value is _MISSING:
                    fields.pop(attr, None)
                elif fields.get(attr, _MISSING) is not value:
                    fields[attr] = value
            for value, entries in held:
                now = _entries(value)
                if (
                    len(now) == len(entries)
                    and all(a is b for a, b in zip(_values(now), _values(entries), strict=True))
                    and (not isinstance(now, dict) or now.keys() == entries.keys())
                ):
                    continue  # untouched: leave its version alone (the check stays valid)
                if isinstance(value, list):
                    value[:] = entries
                else:
                    target = value if isinstance(value, dict) else vars(value)
                    target.clear()
                    target.update(entries)

        return restore

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
            (
                "module attributes",
                tuple(
                    (name, _value_key(vars(module).get(attr, _MISSING), contents))
                    for name, module, attr in self._attributes
                ),
            ),
        )


def _entries(value: Any) -> list | dict:
    """A shallow copy of what a list, dict or plain object (its ``__dict__``) holds."""
    if isinstance(value, list):
        return list(value)
    return dict(value if isinstance(value, dict) else vars(value))


def _values(entries: list | dict) -> Any:
    return entries.values() if isinstance(entries, dict) else entries


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
    if isinstance(value, dict):
        return "dict", [(f"[{k!r}]", v) for k, v in value.items()]
    fields = getattr(value, "__dict__", None)
    if isinstance(value, _OPAQUE) or not isinstance(fields, dict):
        return None
    return "object", [(k, v) for k, v in fields.items() if private or not k.startswith("_")]


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
    on every such assignment; functacc installs one, once per process, that only looks the
    module up among the watched ones. Per call the step reads one attribute
    (:attr:`replaced`); in-place changes (``copy_``, ``load_state_dict``, ``model.to()``)
    keep the tensors and are not replacements.
    """

    def __init__(self, model: nn.Module):
        self.replaced: str | None = None
        self._model = weakref.ref(model)
        self._tensors = self._registered(model)
        self._names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        _install_registration_hooks()
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
_hooks_installed = False


def _install_registration_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as module_api

    module_api.register_module_parameter_registration_hook(_on_registration)
    module_api.register_module_buffer_registration_hook(_on_registration)
    module_api.register_module_module_registration_hook(_on_registration)
    _hooks_installed = True


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


class BatchWatch:
    """The signature key of a plain ``step(inputs, targets)`` batch (a sequence of
    tensors): the *same* tuple object while the tensors' shapes, strides, dtypes and
    devices are those of the last call. One C++ check (Dynamo's ``TensorGuards``, sizes and
    strides checked) instead of building a :class:`TensorSpec` per tensor (about 1.6 us
    each); only a changed batch rebuilds the key and the check.

    ``TensorGuards`` fails a tensor passed twice, which is how a language model is often
    called (``step(tokens, tokens)``: the targets are the inputs): there the check runs on
    the distinct tensors and the repeats are compared by identity (GPT-2 bench: 4.2 us per
    call rebuilding the key before, under 1 us after).
    """

    def __init__(self) -> None:
        self._guards: Any = None
        self._count = -1
        self._distinct: list[int] | None = None  # positions to check, when some repeat
        self._repeats: list[tuple[int, int]] = []  # (first position, repeat position)
        self._key: tuple = ()

    def key(self, tensors: Sequence[Tensor]) -> tuple[TensorSpec, ...]:
        if len(tensors) == self._count and self._guards is not None:
            if self._distinct is None:
                if self._guards.check(*tensors):
                    return self._key
            elif all(tensors[i] is tensors[j] for i, j in self._repeats) and self._guards.check(
                *[tensors[i] for i in self._distinct]
            ):
                return self._key
        first: dict[int, int] = {}
        for i, t in enumerate(tensors):
            first.setdefault(id(t), i)
        self._repeats = [(first[id(t)], i) for i, t in enumerate(tensors) if first[id(t)] != i]
        self._distinct = sorted(first.values()) if self._repeats else None
        self._key = tuple(map(TensorSpec.of, tensors))
        self._guards = _tensor_guards([tensors[i] for i in sorted(first.values())])
        self._count = len(tensors)
        return self._key


def _tensor_guards(tensors: Sequence[Tensor]) -> Any:
    """A C++ check of the tensors' dtype, device, ``requires_grad``, dispatch keys, sizes and
    strides; ``None`` without Dynamo's guards."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # a torch without Dynamo's C++ guards: re-read in Python each call
        return None
    return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


def family_key(tensors: Sequence[Tensor]) -> tuple[LayoutSpec, ...]:
    """The batch tensors' signature with sizes erased."""
    return tuple(
        LayoutSpec(
            t.dim(), t.dtype, t.device, "contiguous" if t.is_contiguous() else tuple(t.stride())
        )
        for t in tensors
    )


def ambient_key(device_type: str) -> tuple:
    """The ambient state a trace bakes into the graph: autocast on the model's device and
    on CPU (enabled, dtype), and the default dtype (``torch.zeros(n)`` in a forward)."""
    autocast = tuple(
        (d, torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else (d, None)
        for d in dict.fromkeys(("cpu", device_type))
    )
    return (("autocast", autocast), ("default dtype", torch.get_default_dtype()))


class AmbientWatch:
    """:func:`ambient_key`, returning the same tuple object while it is unchanged. Without
    autocast, one check per device and the default dtype (no tuples built)."""

    def __init__(self, device_type: str):
        self.devices = tuple(dict.fromkeys(("cpu", device_type)))
        self._dtype: torch.dtype | None = None
        self._key = ambient_key(device_type)
        self._plain = False  # the last key had no autocast

    def key(self) -> tuple:
        dtype = torch.get_default_dtype()
        if (
            self._plain
            and dtype is self._dtype
            and not any(map(torch.is_autocast_enabled, self.devices))
        ):
            return self._key
        key = ambient_key(self.devices[-1])
        if key != self._key:
            self._key = key
        self._dtype = dtype
        self._plain = all(d is None for _, d in key[0][1])
        return self._key


def batch_names(args: tuple, kwargs: dict, *, with_targets: bool) -> list[str]:
    """A readable name for each tensor of a call's batch, in flattening order:
    ``inputs['input_ids']`` and ``targets`` for ``step(inputs, targets)``, ``args[0]`` and
    ``input_ids`` for ``step(*args, **kwargs)``."""
    names = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, Tensor):
            continue
        top, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 0:  # positional
            head = ("inputs", "targets")[top.idx] if with_targets else f"args[{top.idx}]"
        else:
            head = str(top.key)
        names.append(head + rest)
    return names


def size_changes(
    names: Sequence[str], old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]
) -> list[str]:
    """``["inputs['input_ids'] dim 1: 57 -> 91", ...]`` for every size that differs."""
    out = []
    for name, a, b in zip(names, old, new, strict=True):
        out.extend(
            f"{name} dim {d}: {x} -> {y}"
            for d, (x, y) in enumerate(zip(a, b, strict=True))
            if x != y
        )
    return out


def describe_difference(old: Hashable, new: Hashable, path: str = "") -> str:
    """Where two signature keys first differ, e.g. ``inputs[0]: (8, 3) ... -> (5, 3) ...``.

    Keys are nested plain tuples; ``(label, value)`` pairs name their part.
    """
    if type(old) is tuple and type(new) is tuple:
        if len(old) == 2 and len(new) == 2 and isinstance(old[0], str) and old[0] == new[0]:
            label = old[0] if old[0] not in _MARKERS else ""
            return describe_difference(old[1], new[1], " ".join(filter(None, (path, label))))
        if len(old) == len(new):
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b:
                    inner = f"{path}[{i}]" if path and _is_sequence_of_specs(old) else path
                    return describe_difference(a, b, inner)
        elif _is_labelled(old) and _is_labelled(new):  # entries added or removed
            before, after = dict(old), dict(new)
            added = [label for label in after if label not in before]
            removed = [label for label in before if label not in after]
            where = f"{path}: " if path else ""
            return where + "; ".join(
                [*(f"{label} added" for label in added), *(f"{label} removed" for label in removed)]
            )
    where = f"{path}: " if path else ""
    return f"{where}{old!r} -> {new!r}"


def filled_settings(old: Hashable, new: Hashable, path: str = "") -> list[str] | None:
    """Where two signature keys differ only by settings that were ``None`` or absent in
    ``old`` and hold a value in ``new`` (a forward's one-time lazy setting, such as a
    Hugging Face config's ``problem_type``): their names, e.g.
    ``["module attributes model.config problem_type"]``. ``None`` if anything else differs
    (a value replaced by another, an entry removed).

    Example:
        >>> filled_settings((("mode", None), ("p", 0.1)), (("mode", "x"), ("p", 0.1)))
        ['mode']
        >>> filled_settings((("p", 0.1),), (("p", 0.2),)) is None
        True
    """
    if old == new:
        return []
    if old is None:
        return [path or "value"]
    if type(old) is not tuple or type(new) is not tuple:
        return None
    if len(old) == 2 and len(new) == 2 and isinstance(old[0], str) and old[0] == new[0]:
        label = old[0] if old[0] not in _MARKERS else ""
        return filled_settings(old[1], new[1], " ".join(filter(None, (path, label))))
    if len(old) != len(new) and _is_labelled(old) and _is_labelled(new):
        before = dict(old)
        if len(before) != len(old) or not before.keys() <= dict(new).keys():
            return None  # repeated labels, or an entry removed
        found = []
        for label, value in new:
            where = " ".join(filter(None, (path, label)))
            inner = [where] if label not in before else filled_settings(before[label], value, where)
            if inner is None:
                return None
            found += inner
        return found
    if len(old) != len(new):
        return None
    found = []
    for a, b in zip(old, new, strict=True):
        inner = filled_settings(a, b, path)
        if inner is None:
            return None
        found += inner
    return found


# Labels that say which kind of call a key is for, not what changed.
_MARKERS = ("inplace", "pure")


def _is_sequence_of_specs(key: tuple) -> bool:
    return all(isinstance(x, (TensorSpec, LayoutSpec)) for x in key)


def hashable_constant(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return (type(x), x)


def _is_labelled(key: tuple) -> bool:
    """A tuple of ``(label, value)`` pairs, as keys hold a container's entries."""
    return all(type(x) is tuple and len(x) == 2 and isinstance(x[0], str) for x in key)
