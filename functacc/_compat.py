"""What differs between the torch releases functacc supports, in one place.

Supported: torch 2.11 through 2.15 (``SUPPORTED``; pyproject.toml says the same). functacc
reaches into private torch APIs (functional collectives, Inductor's code generator, the
symbolic-shapes helpers); where one of those changed inside the range, the rest of functacc
calls the name here, never the torch one. Each entry is a feature check where possible
(a backport or a patch release then just works), a version gate where the difference is in
behaviour, and says which release changed what.

Importing functacc with a torch outside the range warns once, naming the range: the
package may still work, but nothing has run it there.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

__all__ = [
    "COMPILE_TAKES_RECOMPILE_LIMIT",
    "INDUCTOR_COMPILES_SIZE_GENERIC_INDEXING",
    "INDUCTOR_KEEPS_RANDOM_ORDER",
    "INDUCTOR_PRINTS_FLOAT_MINMAX",
    "INDUCTOR_ROUNDS_16BIT_LIKE_EAGER",
    "SUPPORTED",
    "TORCH",
    "all_gather_single",
    "compile_with_recompile_limit",
    "inductor_defers_input_checks",
    "make_fx_traces_generators",
    "optimization_hint",
    "reduce_scatter_single",
    "symbolic_max_min",
    "warn_where_inductor_differs",
]

SUPPORTED = ((2, 11), (2, 15))
"""The oldest and newest torch (major, minor) that the suite runs on (``make test-torch``)."""


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.15.0+cu130"``, ``"2.16.0a0+git…"``)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(
            f"functacc cannot read torch's version {version!r}: expected 'MAJOR.MINOR...'. "
            "Reinstall torch from PyPI or pytorch.org."
        )
    return int(match[1]), int(match[2])


TORCH = _release(torch.__version__)
"""The running torch's ``(major, minor)``."""


def check_version(version: tuple[int, int] = TORCH) -> None:
    """Warns when ``version`` lies outside :data:`SUPPORTED` (called once, at import)."""
    (low, high) = SUPPORTED
    if low <= version <= high:
        return
    warnings.warn(
        f"functacc supports torch {low[0]}.{low[1]} through {high[0]}.{high[1]}, but this is "
        f"torch {torch.__version__}. It may work, but nothing has tested it there: private "
        f"torch APIs it uses change between releases. Install a supported torch "
        f"(pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}') to be on tested "
        "ground.",
        RuntimeWarning,
        stacklevel=2,
    )


check_version()


# --- functional collectives -------------------------------------------------------------
# After 2.11 (2.11 lacks them, 2.13 has them) torch renamed ``all_gather_tensor`` and
# ``reduce_scatter_tensor`` to ``*_single`` and made the old names warn (FutureWarning,
# outside torch.compile); the ops they trace into (``_c10d_functional.all_gather_into_tensor``,
# ``reduce_scatter_tensor``) are the same. The old ``all_gather_tensor`` refuses a
# non-contiguous input: every caller passes a flat 1-D chunk.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = (
    getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
)


# --- torch.compile ------------------------------------------------------------------------
def _compile_takes_recompile_limit() -> bool:
    # Newer torch.compile takes ``recompile_limit`` (pytorch#177936, March 2026; 2.14 has it):
    # Dynamo then patches its config with it around each compilation of that call's frames.
    # Without it, compile_with_recompile_limit patches the config around each call itself.
    return "recompile_limit" in inspect.signature(torch.compile).parameters


COMPILE_TAKES_RECOMPILE_LIMIT = _compile_takes_recompile_limit()
"""Whether ``torch.compile`` takes ``recompile_limit`` (a feature check)."""


def compile_with_recompile_limit(
    fn: Callable[..., Any], recompile_limit: int, **kwargs: Any
) -> Callable[..., Any]:
    """``torch.compile(fn, **kwargs)`` whose frames Dynamo may compile up to
    ``recompile_limit`` times each, leaving the process-wide
    ``torch._dynamo.config.recompile_limit`` (the user's other compiled code) as it is.

    Example:
        >>> before = torch._dynamo.config.recompile_limit
        >>> f = compile_with_recompile_limit(lambda x: x + 1, before + 8, backend="eager")
        >>> f(torch.ones(2)), torch._dynamo.config.recompile_limit == before
        (tensor([2., 2.]), True)
    """
    if COMPILE_TAKES_RECOMPILE_LIMIT:
        return torch.compile(fn, recompile_limit=recompile_limit, **kwargs)
    compiled = torch.compile(fn, **kwargs)
    config = torch._dynamo.config

    @functools.wraps(fn)
    def call(*args: Any, **call_kwargs: Any) -> Any:
        # Dynamo reads the limit when a call meets a frame that no compiled entry's guards
        # accept (convert_frame's exceeds_recompile_limit), inside the call: set for the
        # call, it holds for every compilation of this function's frames and for nothing
        # else. Set and restored by hand: 4 us a call here (2-core CPU), config.patch 17 us.
        before = config.recompile_limit
        config.recompile_limit = recompile_limit
        try:
            return compiled(*args, **call_kwargs)
        finally:
            config.recompile_limit = before

    return call


# --- symbolic shapes ----------------------------------------------------------------------
def _optimization_hint():
    from torch.fx.experimental import symbolic_shapes

    # After 2.11 (2.11 lacks it, 2.13 has it) torch added ``optimization_hint`` (a size's
    # traced value, no guard added) and removed ``size_hint``, which did the same.
    if hasattr(symbolic_shapes, "optimization_hint"):
        return symbolic_shapes.optimization_hint
    return symbolic_shapes.size_hint


def optimization_hint(size: torch.SymInt | int, *, fallback: int | None = None) -> int:
    """The value ``size`` had in the traced example (a plain int as it is), without adding
    a guard on it: for choices of speed, never of values."""
    return _optimization_hint()(size, fallback=fallback)


# --- Inductor's generated code ------------------------------------------------------------
@functools.cache
def inductor_defers_input_checks() -> bool:
    """Whether Inductor's generated code checks each input's sizes just before the first
    kernel that reads it, grouped per kernel (``assert_size_stride_grouped``), which
    :mod:`functacc.backends.inductor.input_checks` gathers into one call at the start."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    # After 2.11 (2.11 writes one ``assert_size_stride`` per input, all at the top of
    # ``call()``; 2.13 defers them): with the old placement every check already runs before
    # the first kernel, and there is nothing to move.
    return hasattr(PythonWrapperCodegen, "codegen_deferred_input_asserts")


INDUCTOR_COMPILES_SIZE_GENERIC_INDEXING = TORCH > (2, 11)
"""Whether Inductor's C++ backend compiles size-generic kernels that bounds-check an index
read from a tensor. A version gate: torch 2.11 emits the check on a variable declared in
another scope (``'tmp2' was not declared in this scope``) for HF GPT-2's whole training step
with a symbolic sequence length; 2.14 and 2.15 compile that graph."""

INDUCTOR_KEEPS_RANDOM_ORDER = TORCH > (2, 11)
"""Whether Inductor calls the random draws it leaves to eager's kernels
(``fallback_random``) in the graph's order. A version gate: torch 2.11's scheduler may
call two independent draws the other way round, so they take other numbers from the
generator than eager (a Transformer with attention and feed-forward dropout: loss 1.470365
vs eager's 1.479578 after one step). Turning 2.11's peak-memory reordering off fixed that
model and broke another (a data-parallel dropout MLP), so nothing is switched: on 2.11 a
step with several dropouts draws eager's distribution, not eager's numbers. 2.14 and 2.15
keep the order."""

INDUCTOR_PRINTS_FLOAT_MINMAX = TORCH > (2, 11)
"""Whether Inductor's C++ kernels compute ``max``/``min`` of Python floats the graph holds as
symbols (``torch.sym_max``) as floats. A version gate: torch 2.11 prints them as
``std::max(static_cast<int64_t>(a), static_cast<int64_t>(b))``, truncating both (Adafactor's
``max(eps2, p.norm().item() / ...)`` among them): its traced step moved the weights 1% away
from eager's (found on the H100 machine's torch 2.11; 2.14 and 2.15 print
floats). On 2.11 the optimizer's ``max``/``min`` of floats are traced as float64 tensor ops
instead (:func:`symbolic_max_min`)."""

INDUCTOR_ROUNDS_16BIT_LIKE_EAGER = TORCH > (2, 11)
"""Whether Inductor, with ``emulate_precision_casts`` (functacc sets it), rounds each bf16 or
fp16 op's result inside a fused kernel as eager rounds it. A version gate: torch 2.11 keeps a
scalar product in float32 into the add that follows (``a * 0.9 + b`` over 4,096 bf16 values:
1,111 differ from eager on 2.11.0, none on 2.14.1), so a bf16 model's step there matches
eager within a bf16 rounding, not bit for bit."""


_WARNED: set[str] = set()


def warn_where_inductor_differs(gm: torch.fx.GraphModule) -> list[str]:
    """Warn, once per process and kind, where this torch's Inductor will not give eager's
    numbers for the CPU graph ``gm`` that functacc otherwise matches: several random draws
    (:data:`INDUCTOR_KEEPS_RANDOM_ORDER`), bf16/fp16 arithmetic
    (:data:`INDUCTOR_ROUNDS_16BIT_LIKE_EAGER`). Returns the kinds that apply (warned or not).

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> warn_where_inductor_differs(make_fx(lambda x: x * 2)(torch.ones(2)))
        []
    """
    seeded = torch.Tag.nondeterministic_seeded
    draws = sum(seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)
    low = any(
        getattr(n.meta.get("val"), "dtype", None) in (torch.bfloat16, torch.float16)
        for n in gm.graph.nodes
    )
    kinds = []
    if draws > 1 and not INDUCTOR_KEEPS_RANDOM_ORDER:
        kinds.append("random order")
    if low and not INDUCTOR_ROUNDS_16BIT_LIKE_EAGER:
        kinds.append("16-bit rounding")
    messages = {
        "random order": (
            f"this step draws random numbers {draws} times (dropout); torch "
            f"{torch.__version__}'s Inductor may make those draws in another order than "
            "eager, so the masks follow eager's distribution but are not eager's numbers "
            "(torch 2.14 and later keep eager's order; backend='eager' draws eager's numbers "
            "on any torch)."
        ),
        "16-bit rounding": (
            f"torch {torch.__version__}'s Inductor rounds some bf16/fp16 results inside fused "
            "kernels later than eager does, so this step matches eager within a 16-bit "
            "rounding, not bit for bit (torch 2.14 and later round as eager)."
        ),
    }
    for kind in kinds:
        if kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(messages[kind], UserWarning, stacklevel=2)
    return kinds


# --- make_fx ------------------------------------------------------------------------------
@functools.cache
def make_fx_traces_generators() -> bool:
    """Whether ``make_fx`` can trace an op given a ``torch.Generator`` argument
    (``torch.randn(..., generator=g)``: a module drawing from its own generator)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # torch 2.11's proxy tracing refuses the argument (NotImplementedError: "argument of
    # type: <class 'torch._C.Generator'>"); 2.14 records it in the graph. Probed on a
    # private generator, which a draw may advance.
    generator = torch.Generator()
    try:
        make_fx(lambda x: x + torch.randn(x.shape, generator=generator))(torch.zeros(2))
    except NotImplementedError:
        return False
    return True


@functools.cache
def make_fx_slices_by_item() -> bool:
    """Whether ``make_fx`` traces a slice at a tensor's value (MoCo's queue:
    ``ptr = int(self.queue_ptr)``, then ``queue[:, ptr : ptr + n] = keys``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def write(queue: torch.Tensor, ptr: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        at = ptr.item()
        queue[:, at : at + keys.shape[1]] = keys
        return queue

    # torch 2.11 asks for a guard on the slice's length (GuardOnDataDependentSymNode);
    # 2.14 computes it in the graph.
    try:
        make_fx(write, tracing_mode="symbolic")(
            torch.zeros(2, 6), torch.tensor([2]), torch.ones(2, 2)
        )
    except Exception:
        return False
    return True


def symbolic_max_min() -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    """``max`` and ``min`` of Python numbers a traced optimizer step holds as symbols:
    ``torch.sym_max`` / ``torch.sym_min``, except floats on a torch whose Inductor truncates
    them (:data:`INDUCTOR_PRINTS_FLOAT_MINMAX`): there the same choice is made by
    ``torch.maximum`` / ``torch.minimum`` on float64 0-dim tensors and read back with
    ``.item()``, exact since both values are doubles already.

    Example:
        >>> [f(2, 3) for f in symbolic_max_min()]
        [3, 2]
    """
    if INDUCTOR_PRINTS_FLOAT_MINMAX:
        return torch.sym_max, torch.sym_min

    def through_tensors(sym: Callable, op: Callable) -> Callable[[Any, Any], Any]:
        def call(a: Any, b: Any) -> Any:
            if not any(isinstance(v, (float, torch.SymFloat)) for v in (a, b)):
                return sym(a, b)
            return op(*(torch.scalar_tensor(v, dtype=torch.float64) for v in (a, b))).item()

        return call

    return through_tensors(torch.sym_max, torch.maximum), through_tensors(
        torch.sym_min, torch.minimum
    )
