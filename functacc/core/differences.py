"""Why a step is traced again: where two signatures differ, in words.

Signature keys are nested plain tuples whose ``(label, value)`` pairs name their parts;
the retrace record and warning name the first part that differs
(``inputs[0]: (8, 3) ... -> (5, 3) ...``), the sizes that changed, or the settings a
forward filled in at its first call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .lookup_tables import table_repr
from .signature import LayoutSpec, TensorSpec

__all__ = ["describe_difference", "filled_settings", "leaf_difference", "size_changes"]


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
    arrays = table_repr(old), table_repr(new)  # NumPy arrays: not their bytes
    if all(arrays):
        return f"{path}: {arrays[0]} -> {arrays[1]}" if path else f"{arrays[0]} -> {arrays[1]}"
    if type(old) is tuple and type(new) is tuple:
        if len(old) == 2 and len(new) == 2 and isinstance(old[0], str) and old[0] == new[0]:
            label = old[0] if old[0] not in _MARKERS else ""
            return describe_difference(old[1], new[1], " ".join(filter(None, (path, label))))
        if len(old) == len(new):
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b:
                    inner = f"{path}[{i}]" if path and _is_sequence_of_specs(old) else path
                    return describe_difference(a, b, inner)
        elif _all_str(old) and _all_str(new):  # names added or removed (a step's state)
            where = f"{path}: " if path else ""
            added = [n for n in new if n not in set(old)]
            removed = [n for n in old if n not in set(new)]
            return where + "; ".join(
                filter(None, (_listed(added, "added"), _listed(removed, "removed")))
            )
        elif _is_labelled(old) and _is_labelled(new):  # entries added or removed
            before, after = dict(old), dict(new)
            added = [label for label in after if label not in before]
            removed = [label for label in before if label not in after]
            where = f"{path}: " if path else ""
            return where + "; ".join(
                [*(f"{label} added" for label in added), *(f"{label} removed" for label in removed)]
            )
        elif _is_sequence_of_specs(old) and _is_sequence_of_specs(new):  # a None for a tensor
            i = next(
                (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
                min(map(len, (old, new))),
            )
            first = (old[i] if i < len(old) else "none", new[i] if i < len(new) else "none")
            return (
                f"{path}{': ' if path else ''}{len(old)} tensors -> {len(new)} (the argument's "
                f"structure changed; the first that differs, [{i}]: {first[0]!r} -> {first[1]!r})"
            )
    where = f"{path}: " if path else ""
    return f"{where}{old!r} -> {new!r}"


def leaf_difference(old: Hashable, new: Hashable, leaf_name: Callable[[int], str]) -> str | None:
    """Where a call's arguments hold a tensor where the other held another value (DQN's
    replay batch: a transition's ``next_state`` is ``None`` at an episode's end), named by
    ``leaf_name(i)`` (``transitions[3].next_state``); None if that is not what changed.

    The keys' ``("batch", treespec, constants, donated)`` entries tell: ``constants`` holds
    ``None`` for a tensor and the value otherwise.
    """
    a, b = _batch_entry(old), _batch_entry(new)
    if a is None or b is None or a[1] != b[1] or len(a[2]) != len(b[2]):
        return None
    for i, (x, y) in enumerate(zip(a[2], b[2], strict=True)):
        if x != y and (x is None or y is None):
            return (
                f"{leaf_name(i)}: {_leaf(x)} -> {_leaf(y)} (the argument's structure changed: "
                f"a tensor in one call, {_leaf(y if x is None else x)} in another)"
            )
    return None


def _batch_entry(key: Hashable) -> tuple | None:
    parts = key[1] if type(key) is tuple and len(key) == 2 and type(key[1]) is tuple else ()
    return next((p for p in parts if type(p) is tuple and len(p) == 4 and p[0] == "batch"), None)


def _leaf(constant: Any) -> str:
    if constant is None:
        return "a tensor"
    if type(constant) is tuple and len(constant) == 2 and isinstance(constant[0], type):
        return repr(constant[1])
    return str(constant)


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


def _is_labelled(key: tuple) -> bool:
    """A tuple of ``(label, value)`` pairs, as keys hold a container's entries."""
    return all(type(x) is tuple and len(x) == 2 and isinstance(x[0], str) for x in key)


def _all_str(key: tuple) -> bool:
    return bool(key) and all(isinstance(x, str) for x in key)


def _listed(names: list[str], what: str) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{shown} {what}"
