"""A model as a pure function of its parameters and buffers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..errors import argument_error, attribute_change_error
from .diagnostics import describe_tensor

__all__ = [
    "ApplyFn",
    "call_module",
    "check_dense_gradients",
    "check_module_classes",
    "functionalize",
    "refuse_script_modules",
    "swap_attributes",
    "unalias_reassigned",
    "unwrap",
    "write_back_attributes",
]

ApplyFn = Callable[..., tuple[Any, dict[str, Tensor]]]


def call_module(
    model: nn.Module,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    args: tuple,
    kwargs: Mapping[str, Any],
) -> tuple[Any, dict[str, Tensor]]:
    """Run ``model`` with the given tensors in place of its own; return outputs and buffers.

    The given buffers are never written: the module runs on copies, which come back as the
    new buffers. (Whether a module wrote a buffer cannot be read off reliably:
    ``native_batch_norm`` updates its running statistics without declaring the write in its
    schema or bumping the version counter, so every buffer is treated as written.)
    """
    bufs = {n: b.clone() for n, b in buffers.items()}
    out = functional_call(model, (dict(params), bufs), tuple(args), dict(kwargs), strict=True)
    return out, bufs


def functionalize(model: nn.Module) -> tuple[ApplyFn, dict[str, Tensor], dict[str, Tensor]]:
    """Split ``model`` into a pure function and its tensors.

    Returns ``(apply_fn, params, buffers)`` with
    ``apply_fn(params, buffers, *args, **kwargs) -> (outputs, new_buffers)``. ``apply_fn``
    never mutates its arguments: buffers the forward pass updates (BatchNorm running
    statistics) are returned as new tensors in ``new_buffers``. ``params`` and ``buffers``
    are detached views of the model's own tensors (no copy); tied parameters appear once.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> apply_fn, params, buffers = functacc.functionalize(model)
        >>> out, new_buffers = apply_fn(params, buffers, torch.randn(8, 3))
        >>> bool(buffers["1.num_batches_tracked"] == 0), int(new_buffers["1.num_batches_tracked"])
        (True, 1)
    """
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def apply_fn(
        params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], *args: Any, **kwargs: Any
    ) -> tuple[Any, dict[str, Tensor]]:
        return call_module(model, params, buffers, args, kwargs)

    return apply_fn, params, buffers


def check_module_classes(model: nn.Module, classes: Collection[str], option: str) -> set[str]:
    """``classes`` as a set, after checking the model has a module of each class; the error
    lists the classes it does have (``option`` names the setting, e.g. ``"remat"``)."""
    chosen = {classes} if isinstance(classes, str) else set(classes)
    found = {type(m).__name__ for m in model.modules()}
    missing = chosen - found
    if missing:
        raise ValueError(
            f"{option} names {sorted(missing)}, which the model does not contain. The model's "
            f"module classes are: {', '.join(sorted(found))}"
        )
    return chosen


def check_dense_gradients(model: nn.Module) -> None:
    """Refuse embeddings built with ``sparse=True`` whose weight trains: the step computes
    dense gradients in its graph (a sparse gradient cannot be traced), and training them
    densely would silently differ from eager's sparse update where the optimizer treats
    sparse gradients differently (torch.optim.Adam refuses them)."""
    for name, module in model.named_modules():
        embedding = isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        if embedding and module.sparse and module.weight.requires_grad:
            raise ValueError(
                f"{name or 'the model'} ({type(module).__name__}) has sparse=True: its "
                "gradient would be a sparse tensor, which a compiled step cannot trace (the "
                "step computes dense gradients). Build it with sparse=False (plain SGD then "
                "makes the same update: the rows not looked up get zero), or freeze it "
                "(weight.requires_grad_(False))."
            )


Attribute = tuple[str, nn.Module, str]


@contextlib.contextmanager
def swap_attributes(
    attributes: Sequence[Attribute], values: Sequence[Tensor]
) -> Iterator[dict[int, Tensor]]:
    """Let the modules' tensor attributes be ``values`` for the duration (tracing).

    Yields a dict that, after the block, maps the index of each attribute the block
    assigned a new tensor to (``self.last = out.mean()``, or ``torch.nn.utils.weight_norm``'s
    hook setting ``weight``) to that tensor; eager would leave it there, so the step writes
    it back. Assigning something else than a tensor is an error.
    """
    saved = [vars(module)[attr] for _, module, attr in attributes]
    for (_, module, attr), value in zip(attributes, values, strict=True):
        vars(module)[attr] = value
    reassigned: dict[int, Tensor] = {}
    failed = True
    try:
        yield reassigned
        failed = False
    finally:
        others = []
        for i, ((name, module, attr), value) in enumerate(zip(attributes, values, strict=True)):
            now = vars(module).get(attr)
            if now is value:
                continue
            if isinstance(now, Tensor):
                reassigned[i] = now
            else:
                others.append(name)
        for (_, module, attr), value in zip(attributes, saved, strict=True):
            vars(module)[attr] = value
        if others and not failed:
            raise attribute_change_error(others)


def write_back_attributes(
    attributes: Sequence[Attribute], inputs: Sequence[Tensor], reassigned: Mapping[int, Tensor]
) -> None:
    """After a traced body: the values it assigned to tensor attributes (what
    :func:`swap_attributes` yielded) written into the attributes' inputs, which keep their
    shape and dtype from call to call."""
    with torch.no_grad():
        for i, value in reassigned.items():
            old = inputs[i]
            if value.shape != old.shape or value.dtype != old.dtype:
                raise argument_error(
                    f"the step assigned {describe_tensor(value)} to the tensor attribute "
                    f"{attributes[i][0]!r}, which holds {describe_tensor(old)}; the jitted "
                    "step writes it back after every call, which needs the same shape and "
                    "dtype. Register it as a buffer of that shape."
                )
            old.copy_(value.detach())


def unalias_reassigned(
    attributes: Sequence[Attribute], indices: Iterable[int], model_tensors: Iterable[Tensor]
) -> bool:
    """Give each tensor attribute at ``indices`` (those a step assigns, and so writes back
    into after every call) its own copy where it shares memory with one of
    ``model_tensors``: ``weight_norm`` and ``spectral_norm`` start ``module.weight`` as
    ``weight_orig.data``, and the write must not reach the parameter (eager replaces the
    attribute at the first forward anyway). Returns whether any attribute was replaced."""
    storages = {t.untyped_storage().data_ptr() for t in model_tensors} - {0}
    replaced = False
    for i in indices:
        _, module, attr = attributes[i]
        value = vars(module)[attr]
        if value.untyped_storage().data_ptr() in storages:
            vars(module)[attr] = value.clone()
            replaced = True
    return replaced


def unwrap(model: nn.Module) -> nn.Module:
    """The module to trace: ``torch.compile(model)`` gives its original module (the step
    compiles the whole step itself; the two compute the same function, on the same
    parameters); a data-parallel wrapper is an error, since functacc does that itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return unwrap(model._orig_mod)
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(
            f"model is wrapped in {type(model).__name__}; functacc parallelises the step "
            "itself (data parallel over torchrun's processes by default, or "
            "parallel=functacc.parallel.ZeRO(...)). Pass the module inside: "
            "compile_step(model.module, ...)."
        )
    refuse_script_modules(model, "model")
    return model


def refuse_script_modules(model: nn.Module, what: str) -> None:
    """A TorchScript module (``torch.jit.script`` / ``trace``) among ``model``'s is a
    ``TypeError``: its parameters and submodules live in C++, where the traced tensors that
    stand for them cannot be put (an unclear ``TypeError`` from a guard before)."""
    scripted = [
        n or "(the module itself)"
        for n, m in model.named_modules()
        if isinstance(m, torch.jit.ScriptModule)
    ]
    if scripted:
        raise TypeError(
            f"{what} holds a TorchScript module ({', '.join(scripted[:3])}): torch.jit.script "
            "or trace keeps its parameters in C++, where functacc cannot put the tensors its "
            "trace runs on. Fix: give the nn.Module before scripting (functacc compiles the "
            "whole step, so scripting a part gains nothing inside it)."
        )
