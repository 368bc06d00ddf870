"""The loop nests of one CPU kernel that share no tensor run without barriers between them.

Inductor's C++ backend writes consecutive loop nests into one function and, where it can,
one OpenMP parallel region: each nest is a ``#pragma omp for`` (split over the threads) or,
below the size worth splitting, a ``#pragma omp single`` (one thread), and each ends in
OpenMP's implicit barrier, so that a nest that reads what an earlier one wrote finds it
written. A training step's optimizer update is many such nests, one per parameter and
optimizer state, and none reads what another writes: the bench MLP's AdamW update is one
region of 38 nests, and after each bias's single-threaded nest the other thread waited.

:func:`independent_loops_nowait` makes Inductor add ``nowait`` to every nest of a kernel
whose nests are pairwise independent — no buffer that one of them writes is read or written
by another, by the dependencies Inductor's scheduler records for them, a mutation counting as
a write to what it mutates and an output that Inductor writes in place into a dead input as a
write to that input — and that has no reduction (whose partial results a later part of the
kernel combines); a buffer written through a view of another (the parts of a ``torch.cat``)
counts as that other. The region's own closing barrier stays, so the kernel still returns
only when every nest is done. Other kernels keep Inductor's code, and so does any kernel
whose analysis fails inside torch's internals (a renamed attribute in a new torch): the
first such failure is logged at debug level. Measured on the bench MLP
(2-core CPU): see the README.

Example:
    >>> with independent_loops_nowait():
    ...     pass  # compile_fx(...) here: independent nests of a CPU kernel without barriers
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["independent_loops_nowait", "pairwise_independent"]

log = logging.getLogger("functacc")

_WORKSHARE = re.compile(r"^(\s*#pragma omp (?:single|for)\b.*?)\s*$")


@contextlib.contextmanager
def independent_loops_nowait() -> Iterator[None]:
    """While active, a CPU kernel whose loop nests are pairwise independent runs them
    without OpenMP barriers between them.

    The analysis reads Inductor's internals (its kernel's code buffer, scheduler nodes and
    buffers), which change between torch releases. Where any of that fails, the kernel keeps
    Inductor's own code, barriers included, and the first such failure is logged at debug
    level (logger ``"functacc"``): a rename in torch costs the speed-up, never a compile."""
    try:
        from torch._inductor.codegen.cpp import KernelGroup
    except ImportError:
        yield
        return
    finalize, codegen = KernelGroup.finalize_kernel, KernelGroup.codegen_group

    def finalize_kernel(self: Any, new_kernel: Any, nodes: Sequence[Any]) -> None:
        # One call writes one fused node's loops: note its nodes and how many work-sharing
        # nests it wrote (more than one: its nests may depend on each other). Inductor's
        # own finalize runs outside the try blocks: its errors are its own to raise.
        units = self.__dict__.setdefault(_UNITS, [])
        before = None
        if units is not None:
            try:
                before = len(_lines(self.loops_code))
            except Exception as exc:
                _give_up(self, exc)
        finalize(self, new_kernel, nodes)
        if before is None:
            return
        try:
            nests = _worksharing_lines(_lines(self.loops_code)[before:])
        except Exception as exc:
            _give_up(self, exc)
            return
        units.append((list(nodes), nests))

    def codegen_group(self: Any, name: str | None = None) -> str:
        code = codegen(self, name)
        units = self.__dict__.get(_UNITS, [])
        if not code or units is None:
            return code
        try:
            independent = all(nests <= 1 for _, nests in units) and pairwise_independent(
                [n for n, _ in units], _inplace_aliases(self.args)
            )
        except Exception as exc:
            # Not only this module's _UnknownAlias (pairwise_independent answers False for
            # it): an AttributeError or TypeError from a torch that renamed what is read
            # here. Unsure whether the nests are independent, the kernel keeps its barriers.
            _log_fallback(exc)
            return code
        return without_barriers(code) if independent else code

    KernelGroup.finalize_kernel = finalize_kernel
    KernelGroup.codegen_group = codegen_group
    try:
        yield
    finally:
        KernelGroup.finalize_kernel, KernelGroup.codegen_group = finalize, codegen


# A kernel group's attribute: its fused nodes and work-sharing nests so far, one entry per
# finalize_kernel call, or None once reading them failed (the kernel then keeps its barriers).
_UNITS = "_functacc_units"
_logged = False  # whether a fallback to Inductor's barriers was logged in this process


def _give_up(kernel: Any, exc: Exception) -> None:
    kernel.__dict__[_UNITS] = None
    _log_fallback(exc)


def _log_fallback(exc: Exception) -> None:
    # Once per process: every kernel of every compile would fail the same way.
    global _logged
    if not _logged:
        _logged = True
        log.debug(
            "independent_loops: a CPU kernel keeps Inductor's OpenMP barriers between its "
            "loop nests: reading Inductor's internals failed with %s: %s (torch %s; "
            "functacc's analysis may need updating for it). Later such kernels fall back "
            "silently.",
            type(exc).__name__,
            exc,
            torch.__version__,
        )


def _inplace_aliases(args: Any) -> dict[str, str]:
    """Buffers that share memory in this kernel: Inductor writes a node's output into an
    input that no later node reads ("in place"), and the earlier nests of the kernel that
    read that input are no later nodes. Each name maps to the kernel argument they share."""
    shared = {}
    for name, buffer in getattr(args, "inplace_buffers", {}).items():
        inner = getattr(buffer, "inner_name", None)
        if inner is not None:
            shared[name] = inner
    return shared


def _lines(buffer: Any) -> list[Any]:
    # The buffer's lines so far (Inductor's IndentedBuffer keeps them in a list; its
    # getvalue() would join them all again after every fused node, quadratic in the kernel).
    return buffer._lines


def _worksharing_lines(lines: Sequence[Any]) -> int:
    return sum(1 for line in lines if isinstance(line, str) and _WORKSHARE.match(line))


def without_barriers(code: str) -> str:
    """``nowait`` on every ``omp single`` and ``omp for`` line of ``code``.

    Example:
        >>> without_barriers("#pragma omp single\\n{ x(); }")
        '#pragma omp single nowait\\n{ x(); }'
    """
    lines = []
    for line in code.split("\n"):
        match = _WORKSHARE.match(line)
        if match and "nowait" not in line:
            line = match.group(1) + " nowait"
        lines.append(line)
    return "\n".join(lines)


def pairwise_independent(
    units: Sequence[Sequence[Any]], shared: dict[str, str] | None = None
) -> bool:
    """Whether groups of Inductor scheduler nodes (each one loop nest) can run in any order
    and at once: no reduction among them, and no buffer written by one group is read or
    written by another (a mutation counts as a write to the buffer it mutates; buffers that
    ``shared`` maps to one name are one buffer)."""
    shared = shared or {}

    def buffer(name: str) -> str:
        owner = _owner(_real(name))
        return shared.get(owner, shared.get(name, owner))

    if len(units) < 2:
        return False
    try:
        return _independent(units, buffer)
    except _UnknownAlias:
        return False


class _UnknownAlias(Exception):
    """A buffer whose memory is another's in a way this module does not follow."""


def _independent(units: Sequence[Sequence[Any]], buffer: Callable[[str], str]) -> bool:
    written: set[str] = set()
    read: set[str] = set()
    for unit in units:
        reads: set[str] = set()
        writes: set[str] = set()
        for node in unit:
            if node.is_reduction():
                return False
            reads |= {buffer(dep.name) for dep in node.read_writes.reads}
            writes |= {buffer(dep.name) for dep in node.read_writes.writes}
            writes |= {buffer(name) for name in node.get_buffer_names()}
            for out in node.get_outputs():
                writes |= {buffer(name) for name in out.get_mutations()}
        if (reads | writes) & written or writes & read:
            return False
        written |= writes
        read |= reads
    return True


def _owner(name: str) -> str:
    """The buffer whose memory ``name`` is: a part of a ``torch.cat`` result is written
    through a view of the result (``NonOwningLayout``), a mutation through its target."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    seen = set()
    while name not in seen:
        seen.add(name)
        node = V.graph.try_get_buffer(name)
        try:
            layout = node.get_output_spec() if isinstance(node, ir.Buffer) else None
        except Exception as exc:
            raise _UnknownAlias(name) from exc
        if isinstance(layout, ir.NonOwningLayout):
            name = layout.view.get_name()
        elif isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
            name = layout.target.get_name()
        elif layout is None or type(layout) in (ir.FixedLayout, ir.FlexibleLayout):
            return name
        else:
            raise _UnknownAlias(name)
    raise _UnknownAlias(name)


def _real(name: str) -> str:
    """One name for a buffer and its mutated versions (Inductor's ``mutation_real_name``,
    followed to its end)."""
    from torch._inductor.virtualized import V

    real = getattr(getattr(V.graph, "scheduler", None), "mutation_real_name", {})
    seen = set()
    while name in real and name not in seen:
        seen.add(name)
        name = real[name]
    return name
