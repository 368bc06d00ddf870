"""Where in the code a trace failed: what the traceback of a failed trace says.

:func:`~functacc.core.diagnostics.translate` turns a failed trace into advice; which advice
depends on where it failed: the user's innermost line and module, a ``torch.optim`` helper
or an installed package's method called from the step, a NumPy array indexed with a traced
value, a ``%`` format of a tensor. These readers answer that from the exception's frames
(their code, their locals), never from the message's text.

Example:
    >>> try:
    ...     raise ValueError("x")
    ... except ValueError as e:
    ...     in_function(e, "<module>")
    True
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import sys
import traceback
from types import TracebackType
from typing import Any

import torch
from torch import nn

__all__ = [
    "COPIED",
    "anomaly_checks",
    "call_site",
    "call_to_hoist",
    "draw_site",
    "formats_with_percent",
    "hashed_size",
    "in_function",
    "in_package",
    "is_data_dependent",
    "library_call",
    "library_code",
    "numpy_index",
    "optim_utility",
    "optimizer_step",
    "random_transform",
    "step_path",
    "user_frame",
    "user_module",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FUNCTACC_DIR = os.path.dirname(os.path.dirname(__file__))  # the package, not core/
_STDLIB_DIR = os.path.dirname(os.__file__)
_LIBRARY_DIRS = (_TORCH_DIR, _FUNCTACC_DIR, _STDLIB_DIR)
_OWN_DIRS = tuple(d + os.sep for d in _LIBRARY_DIRS)  # not torchvision's (its name starts so)


COPIED = (
    "the step copies its traced tensors (copy.deepcopy of a module or tensor: Reptile's inner "
    "model, a lazy EMA copy), which functacc.jit does not follow (under Inductor such a copy "
    "trained wrongly). Fix: make the copy before the first call, give it in modules=(...), "
    "and copy the weights in the step: inner.load_state_dict(model.state_dict())."
)


def _installed(path: str) -> bool:
    return any(f"{os.sep}{d}-packages{os.sep}" in path for d in ("site", "dist"))


def _user_entries(exc: BaseException) -> list[TracebackType]:
    """The traceback entries of ``exc`` in the user's code, outermost first: not torch,
    functacc, the standard library, an installed package or generated code (FX's, eval)."""
    tb, user = exc.__traceback__, []
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        path = os.path.abspath(name)
        if not (name.startswith("<") or _installed(path) or path.startswith(_LIBRARY_DIRS)):
            user.append(tb)
        tb = tb.tb_next
    return user


def is_data_dependent(exc: BaseException) -> bool:
    """Whether the trace failed on a tensor's value read in Python (or a shape made from
    one), here or in an exception it came from."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    data_dependent = (
        DataDependentOutputException,
        DynamicOutputShapeException,
        GuardOnDataDependentSymNode,
    )
    while exc is not None:
        if isinstance(exc, data_dependent):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def hashed_size(exc: BaseException, dims: Any) -> str | None:
    """Where a trace with symbolic sizes (``dims``) failed hashing one (a dict keyed by
    the sequence length, lucidrains' ``self.cache[f"freqs:{seq_len}"]``): a symbolic size
    has no hash, an int has; the trace is then made with static sizes, as eager's."""
    while dims is not None and exc is not None:
        if isinstance(exc, TypeError) and "unhashable type" in str(exc) and "Sym" in str(exc):
            frame = user_frame(exc.__traceback__)
            site = f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else "the step"
            return f"a size hashed at {site}, a dict key or set member, traced static"
        exc = exc.__cause__ or exc.__context__
    return None


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame that is neither torch, functacc nor the standard library."""
    return _innermost_user(traceback.extract_tb(tb))


def call_site() -> str:
    """``file:line`` of the innermost frame of the user's code running now (a message's)."""
    frame = _innermost_user(traceback.extract_stack())
    if frame is None:
        return "an unknown line"
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def draw_site() -> tuple[str, str | None]:
    """Where the user's code running now is (``file:line in function: `code```, its
    innermost frame) and, when that is another line, the statement that called the drawing
    function, in backquotes (```transitions = memory.sample(BATCH_SIZE)``` for a draw in
    ``ReplayMemory.sample``), with the step's statements that led to it where the step did
    not call it itself: the innermost run of user frames, the step's body being called by
    functacc's."""
    from .python_output import is_user_code

    frames = [f for f in traceback.extract_stack() if not f.filename.startswith("<")]
    users = [is_user_code(f.filename) for f in frames]
    inner = max((i for i, user in enumerate(users) if user), default=None)
    if inner is None:
        return "an unknown line", None
    outer = inner
    while outer > 0 and users[outer - 1]:
        outer -= 1
    frame = frames[inner]
    site = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    site += f": `{frame.line.strip()}`" if frame.line else ""
    return site, call_to_hoist([(f.line or "").strip() for f in frames[outer:inner]])


def call_to_hoist(lines: list[str]) -> str | None:
    """The call into a drawing function, in backquotes, with the step's statements that led
    to it (``lines``: outermost first, the step's own, down to that call; improved-diffusion:
    `self.forward_backward(...)`, then `t, weights = self.schedule_sampler.sample(...)` in
    it): the one to run before the call and pass in, the innermost that assigns what it
    makes (a replay buffer's `sample()` that returns its parent's, `return
    super().sample(...)`, is not one to run). ``None`` without lines or sources."""
    if not lines or not all(lines):
        return None
    k = max((i for i, line in enumerate(lines) if _assigns(line)), default=len(lines) - 1)
    through = " -> ".join(f"`{line}`" for line in lines[:k])
    return f"`{lines[k]}`" + (f" (which the step reaches through {through})" * bool(through))


def _assigns(line: str) -> bool:
    try:
        tree = ast.parse(line)
    except SyntaxError:  # a line of a statement that spans several
        return False
    return bool(tree.body) and isinstance(tree.body[0], (ast.Assign, ast.AnnAssign))


def step_path(frame: Any, body: Any) -> str | None:
    """:func:`call_to_hoist` for the stack from ``frame`` (the code that drew) out to the
    step's function ``body`` (its code object), also where both are a library's (a jitted
    Stable-Baselines3 ``train()``, whose replay buffer's ``sample()`` draws); ``None`` where
    the step drew itself or ``body`` is not on the stack."""
    lines: list[str] = []
    frame = frame.f_back
    while frame is not None:
        lines.append(linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip())
        if frame.f_code is body:
            return call_to_hoist(lines[::-1])
        frame = frame.f_back
    return None


def _innermost_user(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    for frame in reversed(frames):
        if frame.filename.startswith("<"):  # generated code (FX, dataclasses, eval)
            continue
        path = os.path.abspath(frame.filename)
        if not path.startswith(_LIBRARY_DIRS):
            return frame
    return None


def user_module(tb: TracebackType | None, model: nn.Module) -> str | None:
    """The qualified name of the innermost module of ``model`` whose code was running."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nn.Module) and id(candidate) in names:
            name = names[id(candidate)]
            found = (
                f"'{name}' ({type(candidate).__name__})"
                if name
                else (f"the model's root ({type(candidate).__name__})")
            )
        tb = tb.tb_next
    return found


def formats_with_percent(tb: TracebackType | None) -> bool:
    """Whether the user's innermost frame in ``tb`` was computing ``fmt % args``."""
    from .python_percent import is_percent

    found = False
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS):
            found = is_percent(tb.tb_frame.f_code, tb.tb_lasti)
        tb = tb.tb_next
    return found


def optim_utility(exc: BaseException) -> tuple[str, str] | None:
    """``torch.optim``'s helper (not an optimizer) that ``exc`` was raised in, named as
    called (``AveragedModel.update_parameters``, ``ReduceLROnPlateau.step``), and ``torch``."""
    tb = exc.__traceback__
    optim_dir = os.path.join(_TORCH_DIR, "optim") + os.sep
    while tb is not None:
        code = tb.tb_frame.f_code
        owner = tb.tb_frame.f_locals.get("self")
        if os.path.abspath(code.co_filename).startswith(optim_dir) and owner is not None:
            if isinstance(owner, torch.optim.Optimizer):
                return None  # its step() is traced (functacc.core.own_step)
            return f"{type(owner).__name__}.{code.co_name}", "torch"
        tb = tb.tb_next
    return None


def optimizer_step(exc: BaseException) -> str | None:
    """The class of the optimizer whose ``step()`` ``exc`` was raised in (Hugging Face's
    ``Adafactor``: ``max(eps, state["RMS"])``, a tensor the step computed)."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "step" and isinstance(owner, torch.optim.Optimizer):
            found = type(owner).__name__
        tb = tb.tb_next
    return found


def library_call(exc: BaseException) -> tuple[str, str] | None:
    """The method of an installed package's object that the user's code called directly
    and ``exc`` was raised in (ema_pytorch's ``EMA.update``: its step count read with
    ``.item()``), named as called, and its package; not a forward pass."""
    tb, caller_is_user = exc.__traceback__, False
    while tb is not None:
        code, owner = tb.tb_frame.f_code, tb.tb_frame.f_locals.get("self")
        path = os.path.abspath(code.co_filename)
        installed = _installed(path) and not path.startswith(_TORCH_DIR)
        if caller_is_user and installed and owner is not None and code.co_name != "forward":
            return f"{type(owner).__name__}.{code.co_name}", type(owner).__module__.split(".")[0]
        caller_is_user = not installed and not path.startswith(_LIBRARY_DIRS)
        tb = tb.tb_next
    return None


def numpy_index(exc: BaseException) -> tuple[str, str, str] | None:
    """The NumPy array the user's code indexed with a traced value (nanoGPT's ``get_batch``:
    ``data[i:i+block_size] for i in torch.randint(...)``), where, and the step's statement
    that led there; None if no user line subscripts an array."""
    ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
    user = _user_entries(exc) if ndarray is not None else []
    for depth, tb in reversed(list(enumerate(user))):
        frame = tb.tb_frame
        summary = traceback.extract_tb(tb, limit=1)[0]
        try:
            tree = ast.parse((summary.line or "").strip())
        except SyntaxError:  # a line of a statement over several lines
            continue
        for node in ast.walk(tree):
            name = getattr(node, "value", None) if isinstance(node, ast.Subscript) else None
            if not isinstance(name, ast.Name):
                continue
            value = frame.f_locals.get(name.id, frame.f_globals.get(name.id))
            if isinstance(value, ndarray):
                # a comprehension's frame is named <listcomp>: name the function around it
                outer = user[: depth + 1]
                named = [t for t in outer if not t.tb_frame.f_code.co_name.startswith("<")]
                function = named[-1].tb_frame.f_code.co_name if named else "the step"
                at = f"at {summary.filename}:{summary.lineno} in {function}\n    {summary.line}"
                call = (traceback.extract_tb(user[0], limit=1)[0].line or "").strip()
                return name.id, at, call
    return None


def in_package(exc: BaseException, package: str, outermost: bool = False) -> str | None:
    """The innermost (or outermost) function of ``package`` that ``exc`` was raised in."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").split(".")[0] == package:
            found = tb.tb_frame.f_code.co_name
            if outermost:
                return found
        tb = tb.tb_next
    return found


def random_transform(exc: BaseException) -> str | None:
    """The torchvision transform (``RandomHorizontalFlip``) whose code ``exc`` was raised in:
    a random one decides on the host, from a number torch drew."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_globals.get("__name__", "").startswith("torchvision.transforms"):
            found = type(owner).__name__ if owner is not None else found
        tb = tb.tb_next
    return found


def library_code(exc: BaseException) -> tuple[str, str, str] | None:
    """Where an installed package's model code (not torch's) was running, innermost, when
    ``exc`` was raised past the user's code: its package, its function and ``file:line:
    text``. None where none of its frames runs a module (an optimizer's step)."""
    run, tb = [], exc.__traceback__  # the installed packages' frames since the user's last
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not (tb.tb_frame.f_code.co_filename.startswith("<") or path.startswith(_OWN_DIRS)):
            run = [*run, tb] if _installed(path) else []
        tb = tb.tb_next
    if not any(isinstance(t.tb_frame.f_locals.get("self"), nn.Module) for t in run):
        return None
    code, lineno = run[-1].tb_frame.f_code, run[-1].tb_lineno
    path = os.path.abspath(code.co_filename)
    package = path.split(f"-packages{os.sep}", 1)[1].split(os.sep)[0].split(".")[0]
    line = linecache.getline(path, lineno).strip()
    return package, code.co_name, f"{os.path.basename(path)}:{lineno}: {line}"


def in_function(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` was raised inside a function called ``name``."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == name:
            return True
        tb = tb.tb_next
    return False


def anomaly_checks(exc: BaseException) -> bool:
    """Whether autograd's anomaly detection was checking for NaN where ``exc`` was raised:
    on for the process (``set_detect_anomaly(True)``), or in a ``with detect_anomaly():``
    of the user's function that failed (the context has exited by now)."""
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        return True
    user = _user_entries(exc)
    code = user[-1].tb_frame.f_code if user else None  # the innermost user function's
    try:
        lines = inspect.getsourcelines(code)[0] if code is not None else []
    except (OSError, TypeError):
        return False
    return any("detect_anomaly(" in line and "check_nan=False" not in line for line in lines)
