"""The exceptions functacc raises.

- :class:`TraceError` (a ``RuntimeError``): the training step could not be traced into a
  graph — data-dependent Python control flow, a model that rejects the inputs' shapes, dtypes
  or devices, a forward that draws from Python's ``random`` or NumPy's ``np.random`` (the
  draw would be taken once and replayed), a draw from a ``torch.Generator`` of the model's
  own under Inductor, or any other error raised by the model or the loss while tracing — or the
  traced graph failed while running for these inputs. The message names the module and the
  source line where it can, what was expected and what came.
- :class:`RetraceError` (a :class:`TraceError`): a new input signature would exceed the
  step's trace budget (``max_traces``).
- ``RuntimeError``: a call inside ``torch.no_grad()``, or a parameter, buffer or submodule of
  the model replaced or added after the step was built (the message names it).
- ``ValueError`` / ``TypeError``: an argument is invalid (an optimizer whose parameters are
  not the model's, an unsupported optimizer, a loss that is not a 0-dim floating tensor, a
  batch that does not split into ``grad_accum_steps`` micro-batches, ...).

A call that raises changes nothing: the model, the optimizer and any state are exactly as
before it.
"""

from __future__ import annotations

__all__ = ["RetraceError", "TraceError", "argument_error", "user_stacklevel"]


class TraceError(RuntimeError):
    """The training step could not be traced; the message says where and how to fix it.

    Example:
        >>> import torch, functacc
        >>> class Branchy(torch.nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) if x.sum() > 0 else x
        >>> model = Branchy(2, 2)
        >>> step = functacc.compile_step(
        ...     model, lambda out, y: out.sum(), torch.optim.SGD(model.parameters(), lr=0.1),
        ...     backend="eager")
        >>> step(torch.ones(1, 2), None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        functacc.errors.TraceError: ...data-dependent...
    """


class RetraceError(TraceError):
    """One more trace of the step would exceed ``compile_step(..., max_traces=...)``.

    The message lists the recent signatures that caused traces and the fix (symbolic
    sizes with ``dynamic=True``, or loader ``buckets=``); the call changed nothing.
    """


def argument_error(message: str, cls: type[Exception] = ValueError) -> Exception:
    """An error about the user's arguments found while tracing: it is raised as is, not
    wrapped into a :class:`TraceError`."""
    exc = cls(message)
    exc._functacc_user_error = True  # type: ignore[attr-defined]
    return exc


def attribute_change_error(names: list[str]) -> Exception:
    """The forward assigned to the model's Python attributes while it was traced."""
    return argument_error(
        f"the forward changed the model's Python attributes {names}: a compiled step runs "
        "the forward's Python code once, when it traces, not at every step as eager PyTorch "
        "does, so these would silently stop changing (a tensor stored there would not even "
        "hold a value). Keep per-step state in a registered buffer updated in place "
        "(self.register_buffer('calls', torch.zeros((), dtype=torch.long)) and "
        "self.calls.add_(1)), or outside the model."
    )


def computed_key_error(key: str, where: str) -> TraceError:
    """A dict key the step formatted from a number it computes (a trace's stand-in:
    ``"\\x00functacc...\\x00"`` in ``key``), used at ``where`` (``the dict at self.logs``)."""
    import re

    shown = re.sub("\x00functacc[^\x00]*\x00", "{...}", key)
    return TraceError(
        f"the step uses the string {shown!r} as a key of {where}, and formatted it from a "
        "number it computes (the {...}): functacc.jit runs the step's Python once, when it "
        "traces, with no values yet (a number fed to the graph, such as a counter, has none "
        "either), so it cannot know which entry eager reads or writes there, nor how many "
        "entries there are. Fix: compute such keys and their entries after the call, from "
        "what the step returns (or in a function of yours wrapped with functacc.host, "
        "which runs after each call with the call's values)."
    )


def host_random_error(
    generators: list[str], where: str | None = None, statement: str | None = None
) -> TraceError:
    """The step drew from Python's or NumPy's global generator while traced; ``where``:
    the first draw (``random.sample, at dqn.py:15 in sample: `...```), ``statement``: the
    call that led there, in backquotes, when that is another line (``draw_site``)."""
    labels = {"random": "Python's random module", "numpy.random": "NumPy's np.random"}
    names = " and ".join(labels.get(g, g) for g in generators)
    at = f" ({where})" if where else ""
    pass_in = (
        "draw them before the call and pass them in, the same numbers as eager's (mixup's "
        "step(x, y, lam=np.random.beta(a, a)): a number argument is fed to the graph, without "
        "a trace per value)"
    )
    fix = (
        f"Fix: run {statement} before the call and pass what it makes to the step: eager's "
        "numbers (a sample of a replay memory, an order shuffled in place)."
        if statement
        else "Fix: draw them with torch (torch.rand, torch.bernoulli, torch.randint): they are "
        "part of the graph, new at every step, and eager's numbers. A decision that skips a "
        "layer can be a mask: x + block(x) * torch.bernoulli(torch.full((), keep)) / keep. Or "
        f"{pass_in}."
    )
    return TraceError(
        f"the step (a forward, a loss or a jitted body) drew random numbers from {names}{at} "
        "while it was traced: a compiled step runs its Python code once, when it traces, so "
        "every step would reuse the numbers drawn then (an order shuffled once for the whole "
        "run), where eager PyTorch draws new ones at every step. A draw with plain arguments "
        "(numbers and sizes: np.random.normal(0, 1, (n, d)), rng.random() of a generator the "
        "step reads) is drawn again before every call and fed; this one (a population or "
        f"array argument, a shuffle in place, a library's own draw) cannot be. {fix}"
    )


def drawn_computed_error(label: str, what: str, statement: str | None = None) -> TraceError:
    """The step computed in NumPy with an array it drew (``label``) before handing it to
    torch (core/python_draws.py); ``statement``: the call that drew it, when the step
    reached it through calls (``failure_sites.call_to_hoist``)."""
    fix = (
        f"Fix: run {statement} before the call and pass what it makes to the step (eager's "
        "numbers; where that code is a library's, such as a replay buffer's sample(), write "
        "the update as a function of yours that takes the batch); or hand the array to "
        "torch first and compute with torch (torch.from_numpy(z) * 2)."
        if statement
        else "Fix: hand the array to torch first and compute with torch "
        "(torch.from_numpy(z) * 2), or draw with torch (torch.randn, torch.randint)."
    )
    return TraceError(
        f"the step computes with the array {label} drew ({what}) before handing it to torch. "
        "functacc draws such an array again before every call, as eager does, and feeds it "
        "to the graph; that works for the array as drawn (torch.Tensor(z), "
        "torch.from_numpy(z), torch.tensor(z), or a view of it), whose values the trace does "
        f"not have. {fix}"
    )


def drawn_branch_error(
    module: str, where: str, statement: str | None = None, count: int = 1
) -> TraceError:
    """The step branched in Python on ``count`` numbers it drew from ``module``
    (``np.random`` or ``random``), the first at ``where``; ``statement``: the step's line
    that called the library code that drew it."""
    sources = {"np.random": "NumPy's np.random", "random": "Python's random module"}
    source = sources.get(module, f"the generator {module}")
    fix = (
        f"run `{statement}` before the call and pass what it makes to the step"
        if statement
        else "decide in the graph with torch (torch.where(torch.rand(()) < p, a, b); a layer "
        "skipped at random is a mask: x + block(x) * torch.bernoulli(torch.full((), keep)) / "
        "keep), or draw the number before the call and pass it in (a number argument is fed)"
    )
    return TraceError(
        f"the step branches in Python on {count} numbers it drew from {source} while it was "
        f"traced (the first: {where}). functacc draws such numbers ahead of each call and "
        "runs the program traced for the branches they take, one trace per path; past 3 "
        f"numbers the paths multiply (2**{count} here; a decision at every step of a "
        f"sequence has one per step). Fix: {fix}."
    )


def replaced_error(path: str, door: str) -> RuntimeError:
    """A parameter, buffer or submodule (``path``, e.g. ``model.fc``) was replaced or
    added after ``door`` (``compile_step``, ``functacc.jit``) built the step."""
    return RuntimeError(
        f"{path} was replaced or added after {door} built this step. The step trains the "
        "tensors and modules it was built with, so it would keep updating the old ones while "
        "the model uses the new (eager PyTorch would use the new). Change values in place "
        "instead (e.g. module.running_mean.copy_(new), model.load_state_dict(...)), or build "
        f"the step again with {door}(...) after changing the model (model.double() and "
        "model.to(device) replace its buffers)."
    )


def foreign_parameter_error(label: str, group: int, index: int, shape: tuple) -> ValueError:
    """``label``'s optimizer holds a parameter of none of the step's modules."""
    return ValueError(
        f"{label}.param_groups[{group}]['params'][{index}] (shape {shape}) is not a parameter "
        "of the step's modules (the model given to compile_step, or the modules= given to "
        "functacc.jit). Build the optimizer on their parameters, or give functacc.jit the "
        "module that owns it in modules=(...)."
    )


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside functacc (the user's ``step(...)``),
    counted from the function that calls ``warnings.warn``."""
    import os
    import sys

    package = os.path.dirname(__file__)
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
