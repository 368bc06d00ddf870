"""Donated arguments of a pure jitted step (JAX's ``donate_argnums``).

An output that matches a donated input tensor (same shape, dtype and device) is written
into that input's memory at the end of the graph; the caller's handle on the input is then
turned into a tensor that refuses every use, so reading stale state is an error, not a
silent read of the new values.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..errors import argument_error
from .diagnostics import describe_tensor

__all__ = [
    "check_donatable",
    "donated_positions",
    "donated_targets",
    "donation_target",
    "poison",
]


def donated_positions(donate: frozenset[int], args: tuple, leaves: list) -> list[int]:
    """Positions, among the call's tensors, of those in donated arguments."""
    if not donate:
        return []
    positions: list[int] = []
    index = 0
    seen: dict[int, int] = {}
    for i, arg in enumerate(args):
        for leaf in pytree.tree_leaves(arg):
            if isinstance(leaf, Tensor):
                if i in donate:
                    positions.append(index)
                seen[id(leaf)] = seen.get(id(leaf), 0) + 1
                index += 1
    for leaf in leaves[len(pytree.tree_leaves(args)) :]:
        if isinstance(leaf, Tensor):
            seen[id(leaf)] = seen.get(id(leaf), 0) + 1
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    for i in positions:
        check_donatable(tensors[i])
        if seen[id(tensors[i])] > 1:
            raise argument_error(
                f"a tensor of a donated argument ({describe_tensor(tensors[i])}) is also "
                "passed elsewhere in the same call; a donated tensor's memory is reused "
                "for the outputs, so it may be passed once only. Pass a .clone()."
            )
    return positions


def check_donatable(t: Tensor) -> None:
    """Refuse, before anything runs, a donated tensor whose memory others still reach: the
    call writes the new state into it, and eager would leave their values alone.

    Example:
        >>> import torch
        >>> state = torch.zeros(4)
        >>> check_donatable(state)  # nothing else holds its memory
        >>> view = state[:2]
        >>> check_donatable(state)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: a donated tensor ... is shared: ...
    """
    what = f"a donated tensor ({describe_tensor(t)})"
    fix = (
        "Fix: donate only state that nothing else holds (state, out = step(state, batch), "
        "keeping no other handle on it), pass a .clone(), or leave the argument out of "
        "donate=. Nothing was changed."
    )
    if t._base is not None:
        raise argument_error(
            f"{what} is a view of another tensor: the call would write the new state into "
            f"that tensor's memory too, which eager leaves alone. {fix}"
        )
    if weakref.getweakrefs(t) or t._use_count() > 1:
        raise argument_error(
            f"{what} is shared: a view of it is alive, or autograd holds it (saved for a "
            "backward pass), or a weak reference points to it. The call writes the new "
            f"state into its memory, so those would see their values change. {fix}"
        )


def donated_targets(kinds: list[Any]) -> list[int]:
    return [k[1] for k in kinds if isinstance(k, tuple) and k[0] == "donated"]


def donation_target(value: Tensor, free: dict[int, Tensor]) -> int | None:
    """The first donated input the output ``value`` can take the memory of."""
    for i, placeholder in free.items():
        if value is placeholder:
            return i
    for i, placeholder in free.items():
        if (
            value.shape == placeholder.shape
            and value.dtype == placeholder.dtype
            and value.device == placeholder.device
        ):
            return i
    return None


class _Donated(Tensor):
    """What a donated tensor becomes after the call: any use is an error."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (Tensor.__repr__, Tensor.__format__) or getattr(func, "__name__", "") in (
            "__repr__",
        ):
            return "<tensor donated to functacc.jit>"
        raise RuntimeError(
            "this tensor was donated to a functacc.jit step (donate=...): its memory now "
            "holds that call's outputs, and it may not be read again. Use the value the call "
            "returned instead (state, out = step(state, batch)), or stop donating this "
            "argument."
        )


def poison(t: Tensor) -> None:
    """Turn ``t`` (the caller's handle on a donated tensor) into a :class:`_Donated`."""
    dead = torch.empty(0, dtype=t.dtype, device=t.device).as_subclass(_Donated)
    torch.utils.swap_tensors(t, dead)
