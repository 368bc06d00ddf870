"""Different transformations for disjoint groups of parameters (torch's param groups)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ._transform import GradientTransformation, Params, Updates, step_params

__all__ = ["partition"]


def partition(
    transforms: Sequence[GradientTransformation], groups: Sequence[Collection[str]]
) -> GradientTransformation:
    """Apply ``transforms[i]`` to the parameters named in ``groups[i]``.

    Parameters in no group are not updated. The state is the tuple of the group states.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.partition(
        ...     [functacc.optim.adamw(1e-3), functacc.optim.adamw(1e-3, weight_decay=0.0)],
        ...     [["0.weight"], ["0.bias"]],
        ... )
    """
    if len(transforms) != len(groups):
        raise ValueError(f"got {len(transforms)} transforms for {len(groups)} groups")
    groups = [tuple(g) for g in groups]
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        for name in group:
            if name in seen:
                raise ValueError(f"parameter {name!r} is in group {seen[name]} and group {i}")
            seen[name] = i

    def init(params: Params) -> tuple:
        return tuple(
            t.init({n: params[n] for n in g if n in params})
            for t, g in zip(transforms, groups, strict=True)
        )

    def run(grads: Updates, state: tuple, params: Params, *, new_params: bool) -> tuple:
        out: dict = {}
        new_state = []
        for t, group, sub_state in zip(transforms, groups, state, strict=True):
            sub_grads = {n: grads[n] for n in group if n in grads}
            sub_params = {n: params[n] for n in group if n in params}  # ZeRO: this rank's
            if new_params:
                sub_out, sub_state = step_params(t, sub_grads, sub_state, sub_params)
                sub_out = {n: sub_out[n] for n in sub_grads}
            else:
                sub_out, sub_state = t.update(sub_grads, sub_state, sub_params)
            out.update(sub_out)
            new_state.append(sub_state)
        return out, tuple(new_state)

    def update(grads: Updates, state: tuple, params: Params) -> tuple[Updates, tuple]:
        return run(grads, state, params, new_params=False)

    def update_params(grads: Updates, state: tuple, params: Params) -> tuple[dict, tuple]:
        return run(grads, state, params, new_params=True)

    return GradientTransformation(init, update, update_params)
