"""The errors of a jitted step body that read what it cannot take as an input.

A body traced alone sees only its inputs: the call's arguments, the modules' tensors, the
optimizers' state, and the tensors and numbers of its Python state fed to the graph
(:mod:`.python_tensors`). What else it reads would be a constant of the graph, where eager
reads it afresh; these errors say which it was and what to do instead.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import TraceError
from .python_location import Location
from .python_reach import MODULE_TABLES, entries, held, plain_objects

__all__ = ["counting_backwards", "dropped_gradient_error", "outside_tensor_error"]


def _held_by(roots: Sequence[Any]) -> str:
    """Where the body's Python state holds a tensor with autograd history, in words."""
    for location, value in plain_objects(list(roots)).values():
        values = [v for kind, _, v in entries(value) if kind == "item"]
        if any(isinstance(v, Tensor) and v.grad_fn is not None for v in values):
            return f" (held in {location.label})"
    for root in roots:
        value = root.get()
        if isinstance(value, Tensor) and value.grad_fn is not None:
            return f" ({root.label})"
    return ""


def dropped_gradient_error(what: str, read: list[str]) -> TraceError:
    """``what`` (the step) reads gradients ZeRO-2 did not keep past the last call."""
    return TraceError(
        f"{what} reads the gradient that its previous call left on "
        f"{', '.join(map(repr, read))}: it adds to it in backward() (accumulating over "
        "calls), reads it, or zeroes it in place (zero_grad(set_to_none=False)). Under "
        "ZeRO(2) a call's gradients do not outlive it (each rank keeps only its shard, "
        "inside the call), so .grad is None after the call where eager leaves them. "
        "Fix: clear them at the start of the step (opt.zero_grad()), accumulate "
        "micro-batches inside one call, or use parallel=functacc.parallel.ZeRO(1)."
    )


def outside_tensor_error(exc: Exception, roots: Any, capture: Any) -> TraceError | None:
    """The error for a body that read a tensor from outside its inputs (``exc``: what
    the trace raised; ``capture``: the step's modules and their labels), or ``None`` where
    ``exc`` is another error."""
    labels = capture.labels
    if "convert all Tensors to FakeTensors" in str(exc) and _real_with_history(str(exc)):
        return TraceError(
            "the step read a tensor computed before the call, with autograd history "
            f"(a grad_fn){_held_by(roots)}: functacc.jit traces the step "
            "alone, so its backward() cannot reach the work done outside it, where "
            "eager's backward() runs through it. Passing the tensor as an argument "
            "would not help (arguments come in detached).\n"
            f"  the op: {str(exc).split('Found in', 1)[-1].strip()[:300]}\n"
            "Fix: compute it inside the step: keep what the forward needs (observations, "
            "actions, inputs) and call the model in the step body, e.g. an actor-critic "
            "update that stacks the episode's states and recomputes the log-"
            "probabilities there; or leave this update eager."
        )
    loading = _loading(exc) if "convert all Tensors to FakeTensors" in str(exc) else None
    if loading is not None:
        return TraceError(
            f"the step loads a state dict into a module ({loading}) from tensors it keeps "
            "between calls: functacc.jit would copy them in as constants of the graph, "
            "where eager copies what they hold at each call. Fix: load it before the call, "
            "outside the step (an episodic reset, as Tent's reset(): jit the adaptation "
            "function, forward_and_adapt, and reset before calling it); the step then "
            "reads the loaded values as it reads its modules' tensors."
        )
    if "convert all Tensors to FakeTensors" in str(exc):
        held = _tensors_held(roots)
        return TraceError(
            "the step read a tensor that is none of its inputs: not an argument of the "
            f"call, not a parameter, buffer or tensor attribute of the modules "
            f"({', '.join(labels) or 'none given'}), not optimizer state. "
            "functacc.jit would have to bake it into the graph as a constant, where eager "
            "reads it afresh on every call.\n"
            f"  the op: {str(exc).split('Found in', 1)[-1].strip()[:300]}\n"
            + _inside_objects(capture.modules, labels)
            + _modules_not_given(roots, capture.modules)
            + (
                f"The step's Python state holds tensors that require grad at "
                f"{', '.join(held[:4])}: functacc.jit feeds the tensors it reads from "
                "variables, attributes, dicts and lists to the graph on every call, but not "
                "these, since eager's backward() reaches them and a graph input's would not. "
                "Give the optimizer that updates such a tensor in optimizers=(...) (its "
                "tensors are then the step's own), or make it an nn.Parameter of a module "
                "given in modules=(...).\n"
                if held
                else ""
            )
            + "Fix: pass the tensor as an argument of the call, or give the module that "
            "holds it in modules=(...) (a teacher model, an EMA copy), or give its "
            "optimizer in optimizers=(...). A parameter list taken before the call "
            "(params = list(model.parameters())) holds the real tensors: read them "
            "through the module inside the step instead."
        )
    return None


def _loading(exc: BaseException) -> str | None:
    """``Type.load_state_dict(...)`` and the line of the code that called it, where ``exc``
    was raised in a module's ``load_state_dict``."""
    tb, caller = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "load_state_dict" and isinstance(
            frame.f_locals.get("self"), nn.Module
        ):
            name = f"{type(frame.f_locals['self']).__name__}.load_state_dict(...)"
            return name + (f", called at {caller}" if caller else "")
        line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
        caller = f"{os.path.basename(frame.f_code.co_filename)}:{tb.tb_lineno}: `{line}`"
        tb = tb.tb_next
    return None


def _inside_objects(modules: Sequence[nn.Module], labels: Sequence[str]) -> str:
    """The tensors the modules keep inside other objects (kornia's samplers: the bounds of
    a ``torch.distributions.Uniform``), which are not fed, in words, with the way out."""
    found, hidden = [], []
    for label, module in zip(labels, modules, strict=True):
        for name, sub in module.named_modules():
            for attr, obj in vars(sub).items():
                if attr in MODULE_TABLES or isinstance(obj, (nn.Module, Tensor)):
                    continue
                # A plain list of layers (pytorch/examples' forward-forward Net) is no
                # submodule: the modules in it are neither given nor part of `module`.
                items = obj.values() if isinstance(obj, dict) else obj
                if isinstance(obj, (list, tuple, dict)) and any(
                    isinstance(item, nn.Module) for item in items
                ):
                    hidden.append(".".join(filter(None, [label, name, attr])))
                for key, value in getattr(obj, "__dict__", {}).items():
                    if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                        path = ".".join(filter(None, [label, name, attr, key]))
                        found.append(f"{path} (in a {type(obj).__name__})")
    if hidden:
        return (
            "The modules keep modules in a plain list or dict, which "
            f"are not their submodules: {', '.join(hidden[:3])}. Their parameters are no "
            "input of the step. Fix: hold them in an nn.ModuleList (or nn.ModuleDict), or "
            "give each of them in modules=(...) too.\n"
        )
    if not found:
        return ""
    return (
        f"The modules keep tensors inside other objects, which functacc does not feed to "
        f"the graph: {', '.join(found[:3])}{f' and {len(found) - 3} more' if found[3:] else ''}"
        ". Fix: run "
        "that module outside the step (augment the batch before the call), or keep those "
        "tensors as buffers of the module (register_buffer).\n"
    )


def _modules_not_given(roots: Sequence[Any], modules: Sequence[nn.Module]) -> str:
    """The modules holding tensors that the body's Python state reaches (a variable, an
    attribute of a plain object) and that are not among ``modules``, in words: a loss
    with class weights, ``nn.CrossEntropyLoss(weight=w)``, is one."""
    given = {id(sub) for m in modules for sub in m.modules()}
    values = [(root.label, root.get()) for root in roots]
    values += [
        (loc.label, v)
        for loc, v in held(
            [(Location(r), r.get()) for r in roots], plain_objects(list(roots)).values(), nn.Module
        )
    ]
    found = {
        id(v): f"{label} ({type(v).__name__})"
        for label, v in values
        if isinstance(v, nn.Module)
        and id(v) not in given
        and any(True for _ in v.parameters()) | any(True for _ in v.buffers())
    }
    if not found:
        return ""
    return (
        f"The step's code holds modules with tensors that are not in modules=: "
        f"{', '.join(list(found.values())[:3])}; given in modules=(...) too, their tensors "
        "are read on every call.\n"
    )


def _tensors_held(roots: Sequence[Any]) -> list[str]:
    """Where the body's variables, and the plain objects, dicts and lists it reaches, hold
    tensors that require grad (not fed to the graph: python_tensors), in words."""
    variables = [(Location(root), root.get()) for root in roots]
    tensors = held(variables, plain_objects(list(roots)).values(), Tensor)
    return [location.label for location, value in tensors if value.requires_grad]


def _real_with_history(text: str) -> bool:
    """Whether an op printed in ``text`` took a real tensor (``tensor(...)``, not the
    trace's ``FakeTensor(...)``) that has a ``grad_fn``."""
    start = text.find("tensor(")
    while start >= 0:
        depth, end = 0, start + len("tensor")
        for end in range(start + len("tensor"), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        if "grad_fn=" in text[start : end + 1]:
            return True
        start = text.find("tensor(", end)
    return False


@contextlib.contextmanager
def counting_backwards(what: str, fn: Any) -> Iterator[list[Any]]:
    """While the body ``fn`` is traced: note its ``backward()`` and
    ``torch.autograd.grad`` calls; the caller puts what the body returned in the list
    yielded, and a body that returned a tensor that requires grad, having run neither, is
    warned about (at ``fn``'s line). jit returns tensors detached: a ``loss.backward()``
    after the call (jitting the forward alone, as one does with ``torch.compile``) fails
    with torch's "does not require grad"; the warning says why first."""
    seen: list[str] = []
    returned: list[Any] = []
    real_backward, real_grad = torch.autograd.backward, torch.autograd.grad

    def backward(*args: Any, **kwargs: Any) -> Any:
        seen.append("backward")
        return real_backward(*args, **kwargs)

    def grad(*args: Any, **kwargs: Any) -> Any:
        seen.append("grad")
        return real_grad(*args, **kwargs)

    torch.autograd.backward, torch.autograd.grad = backward, grad
    try:
        yield returned
    finally:
        torch.autograd.backward, torch.autograd.grad = real_backward, real_grad
    if seen or not any(isinstance(t, Tensor) and t.requires_grad for t in returned):
        return
    code = getattr(fn, "__code__", None)
    warnings.warn_explicit(
        f"{what} returned a tensor that requires grad and ran no backward() or "
        "torch.autograd.grad: functacc.jit compiles a whole training step and returns "
        'tensors detached, so a backward() on them after the call fails ("does not require '
        'grad"). Fix: put loss.backward() and opt.step() in the jitted function (its '
        "optimizers in optimizers=); to compute values only, call it under torch.no_grad().",
        UserWarning,
        code.co_filename if code else "functacc",
        code.co_firstlineno if code else 0,
    )
