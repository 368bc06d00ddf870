"""Generator objects a jitted step reaches (``rng = np.random.default_rng(0)``), fed draws.

A step that draws from a generator object it reads from a variable, a dict or an object
(``rng.normal(0, 1, (n, d))``) would bake the trace's numbers into the graph. While a body is
traced such an object is a :class:`_StandIn` whose drawing methods are fed draws, as
:mod:`.python_draws` does for the module functions of ``np.random`` and ``random``; any other
use that draws from it is refused and its state put back.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .python_draws import _GENERATORS, HostDraws
from .python_location import Location, Root

__all__ = ["reached_generators"]


@contextlib.contextmanager
def reached_generators(roots: list[Root], modules: Any = (), draws: Any = None) -> Iterator[None]:
    """While a body is traced, a generator object it reaches (a closure variable or global
    ``rng = np.random.default_rng(0)``, a ``np.random.RandomState``, a ``random.Random``,
    also in a dict, list or plain object) is a :class:`_StandIn` there, whose draws with
    plain arguments ``draws`` (the :class:`HostDraws`) feeds as it does the module
    functions'. Any other use that draws from it (``rng.shuffle(a)``, a library holding it)
    is refused, its state put back: the draw would be a constant of the graph. One the
    step's ``modules`` hold is the tracer's to refuse (``HeldRandomWatch``). Entered before
    the body's recording starts: finding them reads no recorded list."""
    from .python_reach import held, plain_objects
    from .watches import (
        _generator_state,
        _held_generators,
        _is_host_generator,
        _same,
        _set_generator_state,
    )

    kinds = (random.Random, np.random.Generator, np.random.RandomState)
    variables = [(Location(root), root.get()) for root in roots]
    reached = held(variables, plain_objects(roots).values(), kinds)
    found = {id(g): (loc, g) for loc, g in reached}
    for _, module in modules:
        for g in _held_generators(module).values():
            found.pop(id(g), None)
    before = [(loc, g, _generator_state(g)) for loc, g in found.values() if _is_host_generator(g)]
    stand_ins = []
    if draws is not None:
        for loc, g in reached:
            if id(g) in found and _is_host_generator(g) and loc.get() is g:
                stand_ins.append((loc, g, _StandIn(g, draws, loc)))
                loc.set(stand_ins[-1][2])
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        for loc, g, stand_in in stand_ins:
            if loc.get() is stand_in:
                loc.set(g)
        drawn = [(loc, g) for loc, g, state in before if not _same(state, _generator_state(g))]
        for _, g, state in before:
            _set_generator_state(g, state)
        if drawn and not failed:
            from ..errors import host_random_error

            raise host_random_error([f"{loc.label} ({type(g).__name__})" for loc, g in drawn])


class _StandIn:
    """A generator object where the step reads it while a trace runs: its drawing methods
    are fed draws (``rng.normal(0, 1, (n, d))``), anything else is the generator's own."""

    def __init__(self, generator: Any, draws: HostDraws, location: Location):
        names = _GENERATORS["random" if isinstance(generator, random.Random) else "np.random"][1]
        if isinstance(generator, np.random.Generator):
            names = (*names, "integers", "standard_exponential", "standard_gamma")
        tracer = threading.get_ident()
        self._generator, self._methods = (
            generator,
            {
                name: draws._drawing(location.label, name, method, tracer, location.get)
                for name in names
                if callable(method := getattr(generator, name, None))
            },
        )

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("_methods", {})
        return methods[name] if name in methods else getattr(self._generator, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(rng, np.random.Generator), as in eager
        return type(self._generator)
