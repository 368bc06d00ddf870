"""``'%.4f' % loss.item()`` in a traced body: the number, filled in after each call.

An f-string formats a traced number through ``__format__``, which :mod:`.python_output`
turns into a token. The ``%`` operator does not: ``str.__mod__`` asks the number for a real
``float`` (``__float__``) or ``int`` (``__int__``), which a traced value does not have yet
(pytorch/examples' DCGAN prints its losses so, ``'Loss_D: %.4f' % errD.item()``). While the
body is traced, such a conversion asked by the user's ``"..." % args`` returns a stand-in
number whose text, in each conversion the format string has, is unique (a distinct power of
ten past 1e100, which no step prints); when the string is used (printed, logged, stored) that
text becomes the token of the traced value, formatted after each call with the same ``%``
conversion, so the text is eager's.

The format string is read from the source of the ``%`` expression (a literal, or a variable
that holds it); where it cannot be, the conversion fails as before, with the trace's error.

Example:
    >>> conversions("[%d/%d] Loss_D: %.4f %s %%")
    ['%d', '%d', '%.4f']
"""

from __future__ import annotations

import ast
import dis
import linecache
import re
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

__all__ = ["conversions", "is_percent", "patch_percent", "untangle"]

# One conversion of printf-style formatting: %[(key)][flags][width][.precision][length]type.
_CONVERSION = re.compile(r"%%|%(?:\([^)]*\))?([-+ #0]*\d*(?:\.\d*)?)[hlL]?([a-zA-Z])")
_FLOAT_TYPES, _INT_TYPES = "eEfFgG", "diouxX"
_MOST = 200  # stand-ins per trace: 1e100 .. 1e299 stay finite floats
_REMAINDER = {dis.opmap[name] for name in ("BINARY_OP", "BINARY_MODULO") if name in dis.opmap}
_NB_REMAINDER = (6, 19)  # BINARY_OP's argument for % and %=


def conversions(fmt: str) -> list[str]:
    """The numeric conversions of a ``%`` format string, in order (``%s`` and ``%%`` left
    out: a traced number's ``str`` is a token already)."""
    found = []
    for m in _CONVERSION.finditer(fmt):
        if m.group(0) != "%%" and m.group(2) in _FLOAT_TYPES + _INT_TYPES:
            found.append(f"%{m.group(1)}{m.group(2)}")
    return found


def untangle(text: str, rendered: dict[str, str]) -> str:
    """``text`` with each stand-in's rendering replaced by its token (longest first, so that
    ``%.0f``'s digits inside ``%.4f``'s are not taken for it)."""
    for shown in sorted((s for s in rendered if s in text), key=len, reverse=True):
        text = text.replace(shown, rendered[shown])
    return text


def patch_percent(recorder: Any, patch: Callable[[Any, str, Any], None]) -> None:
    """While the body is traced: a traced number converted by the user's ``"..." % args``
    returns a stand-in whose renderings ``recorder.rendered`` maps to the value's token."""
    import torch

    from .python_numpy import TracedArray

    made = [0]  # stand-ins so far

    # Not Tensor's: torch's __torch_function__ handlers tell its methods by identity
    # ("%.4f" % loss is a TraceError advising loss.item(): diagnostics).
    for cls, name, kinds, kind in (
        (torch.SymFloat, "__float__", _FLOAT_TYPES, float),
        (torch.SymInt, "__float__", _FLOAT_TYPES, float),
        (torch.SymFloat, "__int__", _INT_TYPES, int),
        (torch.SymInt, "__int__", _INT_TYPES, int),
        (torch.SymInt, "__index__", _INT_TYPES, int),
        (TracedArray, "__float__", _FLOAT_TYPES, float),  # "%d%%" % (100 * d_acc): NumPy's
        (TracedArray, "__int__", _INT_TYPES, int),
    ):
        if name in vars(cls):
            patch(cls, name, _converting(vars(cls)[name], recorder, kinds, kind, made))


def _converting(real: Callable, recorder: Any, kinds: str, kind: type, made: list[int]) -> Any:
    def convert(value: Any) -> Any:
        frame = sys._getframe(1)
        specs = _percent_format(frame)
        if specs is _UNREAD:
            try:  # a fed number has a value for the trace (a guard); loss.item() has none
                return real(value)
            except Exception as exc:
                raise _unread_error(frame) from exc
        specs = [s for s in specs or () if s[-1] in kinds]
        if not specs or made[0] >= _MOST:
            return real(value)
        stand_in = kind(10 ** (100 + made[0]))
        made[0] += 1
        from .python_output import token  # (which imports this module)

        made_token = token(recorder, value)  # the value's, with each conversion's spec below
        for spec in specs:  # the one the format applies to it is among them
            recorder.rendered[spec % stand_in] = f"{made_token[:-1]}{spec}\x00"
        return stand_in

    return convert


_LEFT: dict[tuple[CodeType, int], ast.expr | None] = {}  # read once per place in the code
_UNREAD: list[str] = []  # a '%' whose format string the source does not show


def _unread_error(frame: FrameType) -> Exception:
    from ..errors import TraceError

    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return TraceError(
        f"the step formats a traced number with '%' at {where} ({line}), and functacc reads a "
        "'%' format from the source of that line: a string literal or a variable holding "
        "it, which this one is not. The number exists only after each call; functacc fills "
        "it in when the string is printed, logged or stored. Fix: write the format there, "
        "'loss %.4f' % loss.item(), or use an f-string, f'loss {loss.item():.4f}'."
    )


def is_percent(code: CodeType, at: int) -> bool:
    """Whether the instruction at byte ``at`` of ``code`` is ``%`` (or ``%=``)."""
    if code.co_code[at] not in _REMAINDER:
        return False
    return dis.opname[code.co_code[at]] != "BINARY_OP" or code.co_code[at + 1] in _NB_REMAINDER


def _percent_format(frame: FrameType) -> list[str] | None:
    """The conversions of the format string when ``frame`` (the user's code) is computing
    ``fmt % args`` (``_UNREAD`` where its source does not show it); else ``None``."""
    from .python_output import is_user_code

    code, at = frame.f_code, frame.f_lasti
    if not is_percent(code, at) or not is_user_code(code.co_filename):
        return None
    if (code, at) not in _LEFT:
        _LEFT[code, at] = _left_operand(code, at)
    left = _LEFT[code, at]
    if isinstance(left, ast.Constant) and isinstance(left.value, str):
        return conversions(left.value)
    if isinstance(left, ast.Name):  # a format string kept in a variable (or a number's %)
        for scope in (frame.f_locals, frame.f_globals):
            if left.id in scope:
                return conversions(scope[left.id]) if isinstance(scope[left.id], str) else None
    return _UNREAD


def _left_operand(code: CodeType, at: int) -> ast.expr | None:
    """The left operand of the ``%`` at byte ``at`` of ``code``, parsed from its source."""
    positions = getattr(code, "co_positions", None)
    if positions is None:  # Python 3.10: no columns to find the expression by
        return None
    line, end_line, column, end_column = list(positions())[at // 2]
    if None in (line, end_line, column, end_column):
        return None
    lines = [linecache.getline(code.co_filename, n) for n in range(line, end_line + 1)]
    lines[-1] = lines[-1][:end_column]
    lines[0] = lines[0][column:]
    try:
        # In parentheses: a format continued on the next line parses as it does in the call.
        node = ast.parse(f"({''.join(lines)})", mode="eval").body
    except SyntaxError:
        return None
    return node.left if isinstance(node, ast.BinOp) else None
