"""What a step body prints, logs, shows in a progress bar or saves, replayed after each call.

Eager runs ``print(f"loss {loss.item():.4f}")`` on every step; a traced body's Python runs
once, and the number is a symbol then (it printed ``loss zuf0``, once). While the body is
traced, ``print``, ``logging``'s loggers, TensorBoard's ``SummaryWriter.add_*`` (torch's and
tensorboardX's: ``writer.add_scalar("loss", loss, step)`` logged one point), ``wandb.log``
and ``run.log``, Accelerate's, Fabric's and a ``LightningModule``'s ``log``,
``tqdm``'s ``update`` / ``set_postfix`` / ``set_description``,
``torch.save`` (a checkpoint every N steps: at the trace it wrote fake tensors),
torchvision's ``save_image`` (a GAN's samples every N steps) and the
writes to files it opens (:mod:`.python_files`) called from the user's code are noted as
``("call", function, args, kwargs)`` effects (:mod:`.python_effects`) and run after each
call with that call's values.
A number the graph computes that the body formats into a string (an f-string, ``format``,
``str``) becomes a token in the string, replaced by the formatted value when the string is
used after the call (:func:`fill`), so f-strings print eager's text; a tensor printed or
formatted becomes its token too, its ``repr`` given the ``grad_fn`` it had in the trace.

Example:
    >>> fill("loss \\x00functacc0:.2f\\x00", [0.12345])
    'loss 0.12'
"""

from __future__ import annotations

import builtins
import inspect
import json
import logging
import os
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path, PurePath
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor

from .python_effects import ABSENT, Effect, restorer
from .python_files import NotedFile, OpenFile, noting_open
from .python_numpy import TracedArray, symbol_ufunc, traced_numpy
from .python_percent import patch_percent, untangle

__all__ = ["fill", "has_tokens", "is_user_code", "output_template", "patch_output", "token"]

_TOKEN = re.compile("\x00functacc([0-9]+|lr[0-9]+\\.[0-9]+\\.[0-9]+):([^\x00]*)\x00")
_INTERNAL = (
    os.path.dirname(os.path.dirname(__file__)),  # functacc
    os.path.dirname(torch.__file__),
    os.path.dirname(os.__file__),  # the standard library, logging included
)
_PERCENT_SPEC = re.compile(r"%[-+ #0]*\d*(?:\.\d*)?[a-zA-Z]")
# Classes of output libraries whose methods the body's calls are noted, where imported:
# (module, class, methods; None for every add_* method).
_NOTED_METHODS = (
    (
        "tqdm.std",
        "tqdm",
        ("update", "set_postfix", "set_postfix_str", "set_description", "refresh"),
    ),
    ("torch.utils.tensorboard.writer", "SummaryWriter", None),  # writer.add_scalar(...)
    ("tensorboardX.writer", "SummaryWriter", None),
    ("wandb.sdk.wandb_run", "Run", ("log",)),  # run.log({...}); wandb.log below
    ("accelerate.accelerator", "Accelerator", ("log", "print")),  # its trackers, main rank
    ("lightning_fabric.fabric", "Fabric", ("log", "log_dict", "print")),  # its loggers
    ("lightning_fabric.loggers.csv_logs", "CSVLogger", ("log_metrics",)),
    ("lightning_fabric.loggers.tensorboard", "TensorBoardLogger", ("log_metrics",)),
    # self.log(...) in a LightningModule's training_step: into the trainer's results
    ("pytorch_lightning.core.module", "LightningModule", ("log", "log_dict", "print")),
    ("lightning.pytorch.core.module", "LightningModule", ("log", "log_dict", "print")),
)

# Functions of output libraries noted where called, under the module's name or any name
# the user's code imported them as (PyTorch-GAN's `from torchvision.utils import save_image`).
_NOTED_FUNCTIONS = (("torchvision.utils", "save_image"),)


def has_tokens(text: str) -> bool:
    return "\x00functacc" in text


def fill(text: str, outputs: Sequence[Any], lrs: dict | None = None) -> str:
    """``text`` with each token replaced by its number, formatted as the body asked (a
    ``format`` spec, or a ``%`` conversion: :mod:`.python_percent`); ``lrs``: the replayed
    schedulers' learning rates, for a rate read after a scheduler's step."""

    def number(m: re.Match) -> str:
        which, spec = m.group(1), m.group(2)
        if which.startswith("lr"):  # lr<id(scheduler)>.<steps>.<group>
            scheduler, count, index = map(int, which[2:].split("."))
            value = (lrs or {})[scheduler][count][index]
        else:
            value = outputs[int(which)]
        if spec.startswith("!n"):  # a .numpy() array's value or NumPy scalar (python_numpy)
            value, spec = value.numpy()[()], spec[2:]
        if spec.startswith("!r"):  # a tensor's repr: eager's, grad_fn included
            return _repr_with(value, spec[2:])
        if spec.startswith("!p"):  # a module's parameter, as nn.Parameter's repr shows it
            return "Parameter containing:\n" + _repr_with(value, spec[2:])
        if spec == "!j":  # a number json.dumps wrote
            return json.dumps(value)
        return spec % value if _PERCENT_SPEC.fullmatch(spec) else format(value, spec)

    return _TOKEN.sub(number, text)


def output_template(
    value: Any, template: Callable[[Any], tuple], rendered: dict[str, str]
) -> tuple | None:
    """The template (:mod:`.python_effects`) of a value output calls take that the body
    made from traced values: a string or a path with numbers formatted in (by a format
    spec, or by ``%``: ``rendered``), the ``OrderedDict`` of ``state_dict()`` (``template``
    makes its items'); else ``None``."""
    if isinstance(value, str) and has_tokens(text := untangle(value, rendered)):
        return ("fmt", text)  # f"{loss.item():.4f}", "%.4f" % loss.item()
    if isinstance(value, PurePath) and has_tokens(text := untangle(str(value), rendered)):
        return ("path", type(value), text)  # folder / f"{step}.pt"
    if type(value) is OrderedDict:  # model.state_dict(), for torch.save
        items = {k: template(v) for k, v in value.items()}
        if all(t[0] == "const" for t in items.values()):
            return ("const", value)
        return ("odict", items, getattr(value, "_metadata", None))
    return None


def _from_user(depth: int) -> bool:
    """Whether the code ``depth`` frames up (past ``logging``'s own) is the user's."""
    frame = sys._getframe(depth + 1)
    logging_dir = os.path.dirname(logging.__file__)
    while frame is not None and frame.f_code.co_filename.startswith(logging_dir):
        frame = frame.f_back
    return frame is not None and is_user_code(frame.f_code.co_filename)


def is_user_code(filename: str) -> bool:
    """Code of the user's (a notebook's cells included), not of torch, functacc, the
    standard library or an installed package (whose output eager may make once:
    transformers' ``warning_once``)."""
    path = os.path.abspath(filename)
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return not (path.startswith(_INTERNAL) or installed)


def patch_output(recorder: Any) -> Callable[[], None]:
    """While the body is traced: output calls from its code are noted by ``recorder``
    instead of run, and traced numbers format as tokens. Returns the undo."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, vars(owner).get(name, ABSENT)))
        setattr(owner, name, value)

    def note(function: Any, args: Sequence[Any], kwargs: dict, what: str) -> None:
        where = f"the arguments of {what}"
        recorder.effects.append(Effect.call(function, args, kwargs, recorder.template, where=where))

    def note_print(function: Any, args: Sequence[Any], kwargs: dict, what: str) -> None:
        # print(loss) shows eager's grad_fn: each tensor becomes its repr's token
        texts = [
            _tensor_token(recorder, a, "!r") if isinstance(a, torch.Tensor) else a for a in args
        ]
        if isinstance(kwargs.get("file"), (NotedFile, OpenFile)):  # print(..., file=f)
            sep, end = kwargs.get("sep") or " ", kwargs.get("end", "\n")
            words = [
                token(recorder, a) if isinstance(a, (torch.SymInt, torch.SymFloat)) else str(a)
                for a in texts
            ]
            kwargs["file"].write(sep.join(words) + ("\n" if end is None else end))
            return
        note(function, texts, kwargs, what)

    patch(builtins, "print", _noting(builtins.print, note_print, "print()"))
    for name in ("stdout", "stderr"):  # sys.stdout.write(...), tqdm.write(...)
        patch(sys, name, _NotingStream(getattr(sys, name), name, note))
    patch(builtins, "open", noting_open(builtins.open, note, _from_user))
    for name in ("write_text", "write_bytes"):  # (folder / "metrics.txt").write_text(...)
        patch(Path, name, _noting(getattr(Path, name), note, f"Path.{name}()"))
    patch(logging.Logger, "_log", _noting(logging.Logger._log, note, "a logging call"))
    patch(torch, "save", _noting(torch.save, note, "torch.save()"))
    patch(json, "dumps", _json_dumps(json.dumps, recorder))  # f.write(json.dumps(stats))
    patch(json, "dump", _json_dump)  # json.dump(stats, f): the same, through f.write
    patch(torch.Tensor, "numpy", traced_numpy(torch.Tensor.numpy))  # preds.extend(t.numpy())
    for cls in (torch.SymFloat, torch.SymInt, torch.SymBool):  # np.sqrt(loss.item())
        patch(cls, "__array_ufunc__", symbol_ufunc)
    for module_name, class_name, methods in _NOTED_METHODS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        for name in methods or [n for n in vars(cls) if n.startswith("add_")]:
            real = vars(cls)[name]
            patch(cls, name, _noting(real, note, f"{class_name}.{name}()"))
    tqdm = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    if tqdm is not None:  # tqdm.write(f"..."): a classmethod, noted whole (its text, end)
        patch(tqdm, "write", staticmethod(_noting(tqdm.write, note, "tqdm.write()")))
    wandb = sys.modules.get("wandb")
    if inspect.ismethod(getattr(wandb, "log", None)):  # wandb.init() bound it to its run
        patch(wandb, "log", _noting(wandb.log, note, "wandb.log()"))
    for cls in (torch.SymFloat, torch.SymInt, TracedArray):  # TracedArray: NumPy's text
        real_format, real_str = cls.__format__, cls.__str__
        patch(cls, "__format__", _formatting(real_format, recorder))
        patch(cls, "__str__", _formatting(lambda v, spec, f=real_str: f(v), recorder))
    for cls in (torch.Tensor, FunctionalTensor):  # str(loss), f"{loss:.4f}", f"{loss}"
        real_repr = vars(cls)["__repr__"]
        patch(cls, "__repr__", _formatting(lambda t, spec, f=real_repr: f(t), recorder, "repr"))
    patch(torch.Tensor, "__format__", _formatting(torch.Tensor.__format__, recorder, "format"))
    patch_percent(recorder, patch)
    imported: list[tuple[dict, str, Any]] = []  # (the user's module globals, name, function)
    for module_name, name in _NOTED_FUNCTIONS:
        real = getattr(sys.modules.get(module_name), name, None)
        if real is not None:
            noted = _noting(real, note, f"{name}()")
            patch(sys.modules[module_name], name, noted)
            for scope in getattr(recorder, "scopes", ()):
                keys = [key for key, value in scope.items() if value is real]
                imported += [(scope, key, real) for key in keys]
                scope.update(dict.fromkeys(keys, noted))
    undo = restorer(patches)
    return lambda: (undo(), [scope.__setitem__(key, real) for scope, key, real in imported])


def _noting(real: Callable, note: Callable, what: str) -> Callable:
    """``real`` (a function, or a method set on its class), noted instead of run when the
    user's code calls it, or a library's code with values the step computes (Accelerate's
    ``accelerator.print(f"loss {loss.item():.4f}")`` calls ``print``; a tracker calls
    ``SummaryWriter.add_scalar`` with the loss)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not _from_user(1) and not _traced_values(args, kwargs):
            return real(*args, **kwargs)
        return note(real, args, kwargs, what)

    return call


def _json_dump(obj: Any, fp: Any, *args: Any, **kwargs: Any) -> None:
    """``json.dump`` while a step is traced: ``fp.write(json.dumps(...))`` (the same text),
    so that the numbers the step computes are written as ``json.dumps`` writes them."""
    fp.write(json.dumps(obj, *args, **kwargs))


def _json_dumps(real: Callable, recorder: Any) -> Callable:
    """``json.dumps`` of what holds numbers the step computes (``{"loss": loss.item()}``):
    the text with a token for each, filled in with its JSON after each call."""

    def dumps(obj: Any, *args: Any, **kwargs: Any) -> str:
        marks: dict[str, Any] = {}

        def mark(value: Any) -> Any:
            if isinstance(value, (torch.SymInt, torch.SymFloat)):
                key = f"\x01functacc{len(marks)}\x01"
                marks[key] = value
                return key
            if isinstance(value, dict):
                return {k: mark(v) for k, v in value.items()}
            return [mark(v) for v in value] if isinstance(value, (list, tuple)) else value

        marked = mark(obj)
        if not marks:
            return real(obj, *args, **kwargs)
        text = real(marked, *args, **kwargs)
        ascii_only = kwargs.get("ensure_ascii", True)
        for key, value in marks.items():
            text = text.replace(real(key, ensure_ascii=ascii_only), token(recorder, value, "!j"))
        return text

    return dumps


def _traced_values(args: Sequence[Any], kwargs: dict) -> bool:
    """Whether a call's arguments hold what the step computes: text it formatted, or a
    number (``{"loss": loss.item()}``), one level into a dict or a list."""
    values = [*args, *kwargs.values()]
    values += [v for a in values if isinstance(a, (dict, list, tuple)) for v in _items(a)]
    return any(
        isinstance(v, (torch.SymInt, torch.SymFloat)) or (isinstance(v, str) and has_tokens(v))
        for v in values
    )


def _items(container: Any) -> Any:
    return container.values() if isinstance(container, dict) else container


class _NotingStream:
    """``sys.stdout`` or ``sys.stderr`` while the body is traced: a write from the user's
    code, or of text the step formatted (``tqdm.write(f"loss {loss.item():.4f}")``), is
    noted and made after each call; anything else reaches the stream."""

    def __init__(self, stream: Any, name: str, note: Callable):
        self._stream, self._name, self._note = stream, name, note

    def write(self, text: Any) -> Any:
        installed = vars(sys).get(self._name) is self
        if installed and isinstance(text, str) and (has_tokens(text) or _from_user(1)):
            self._note(_WRITERS[self._name], (text,), {}, f"sys.{self._name}.write()")
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _write_stdout(text: str) -> int:
    return sys.stdout.write(text)  # the stream of the call's time, as eager writes to


def _write_stderr(text: str) -> int:
    return sys.stderr.write(text)


_WRITERS = {"stdout": _write_stdout, "stderr": _write_stderr}


def _formatting(real: Callable, recorder: Any, tensor: str = "") -> Callable:
    """``real`` (``__format__``, ``__str__`` or, for ``tensor="repr"``, a tensor's
    ``__repr__``), giving a token when the user's code calls it."""

    def format_(value: Any, spec: str = "", **_: Any) -> str:  # a Parameter's repr: as None
        if not _from_user(1):
            return real(value, spec)
        if tensor:  # f"{loss}" is the number, f"{x}" of a vector its repr, as in eager
            as_repr = tensor == "repr" or (value.dim() != 0 and not spec)
            return _tensor_token(recorder, value, "!r" if as_repr else spec)
        return token(recorder, value, spec)

    return format_


def token(recorder: Any, value: Any, spec: str = "") -> str:
    """The token standing for a traced ``value`` in a string, formatted with ``spec`` (a
    ``format`` spec, a ``%`` conversion, or ``!r`` and a tensor's grad suffix) by
    :func:`fill` after the call."""
    if isinstance(value, TracedArray):  # formatted as NumPy formats it (fill: "!n")
        value, spec = value.value(), f"!n{spec}"
    index = recorder.template(value, "a value formatted into a string")[1]
    return f"\x00functacc{index}:{spec}\x00"


def _tensor_token(recorder: Any, tensor: torch.Tensor, spec: str) -> str:
    """The token of a traced tensor in a string: ``format(t, spec)``, or for ``spec="!r"``
    its ``repr`` with the ``grad_fn`` it has here (the graph's outputs come back detached)."""
    if spec != "!r":
        return token(recorder, tensor, spec)
    grad = tensor.grad_fn
    name = None if grad is None else type(grad).__name__
    if name == "CppFunction":
        name = grad.name().rsplit("::", 1)[-1]
    suffix = f"grad_fn=<{name}>" if name else "requires_grad=True" if tensor.requires_grad else ""
    kind = "!p" if getattr(tensor, "_functacc_parameter", False) else "!r"  # capture.py
    return token(recorder, tensor, f"{kind}{suffix}")


def _repr_with(tensor: torch.Tensor, suffix: str) -> str:
    """``repr(tensor)`` with ``suffix`` (``grad_fn=<...>``) added as torch adds it."""
    text = repr(tensor)
    if not suffix:
        return text
    body = text[:-1]
    last_line = len(body) - body.rfind("\n") + 1  # as torch._tensor_str._add_suffixes counts
    if last_line + len(suffix) + 2 > torch._tensor_str.PRINT_OPTS.linewidth:
        return f"{body},\n{' ' * len('tensor(')}{suffix})"
    return f"{body}, {suffix})"
