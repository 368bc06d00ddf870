"""``functacc.compile_step``: the front door for a model, a loss and an optimizer."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from ..backends import Backend
from ..optim import GradientTransformation
from ..transforms.remat import RematPolicy
from .step import Step
from .step_fn import LossFn

__all__ = ["compile_step"]


def compile_step(
    model: nn.Module,
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer | GradientTransformation,
    *,
    backend: Backend = "inductor",
    inductor_options: dict[str, Any] | None = None,
    background_compile: bool = False,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    parallel: Any = None,
    precision: Any = None,
    remat: Collection[str] | None = None,
    remat_policy: RematPolicy = "full",
    cuda_graphs: bool | None = None,
    dynamic: bool | None = None,
    max_traces: int | None = 32,
    cuda_graph_cache_size: int = 8,
) -> Step:
    """Compile the whole training step of ``model`` into one graph.

    Args:
        model: the module to train, already on its device and dtype.
        loss_fn: ``loss_fn(outputs, targets) -> 0-dim tensor`` with
            ``outputs = model(inputs)`` (``inputs`` a tensor, a tuple for ``model(*inputs)``
            or a dict for ``model(**inputs)``); ``None`` if the model returns its own loss
            (a 0-dim tensor, ``.loss`` or ``["loss"]``), then ``step(*args, **kwargs)``.
        opt: any ``torch.optim.Optimizer`` over the model's parameters (torch's, a third
            party's, your own; all param groups and their options honoured; its state and
            ``param_groups`` stay live), or a :class:`functacc.optim.GradientTransformation`
            (run as :func:`functacc.optim.as_optimizer` of it). The step is the standard
            eager body (:mod:`functacc.frontends.step`) compiled by :func:`functacc.jit`:
            SGD, Adam and AdamW by their functional twins, other optimizers by tracing
            their own ``step()``.
        backend: ``"inductor"`` (fused kernels) or ``"eager"`` (the traced graph as is).
        inductor_options: ``torch._inductor.config`` settings for this step's compiles,
            as ``torch.compile(options=...)`` takes them, e.g. ``{"cpp_wrapper": True}``;
            they override functacc's defaults (on CPU, a ``post_grad_custom_post_pass``
            of yours replaces functacc's: :mod:`functacc.bias_add` and
            :mod:`functacc.input_checks`).
        background_compile: compile with Inductor in a worker process while the first
            steps run the traced graph op by op (about eager speed); the compiled code takes
            over at the first step after it is ready, and ``step.wait_for_compile()`` waits
            for it. The first step then costs a trace, not a compile (docs/benchmarks.md,
            "Time to the first step"). For static graphs on CPU in one process (ranks would
            swap at different steps); elsewhere the graph compiles before its first step.
        grad_accum_steps: split each batch into this many micro-batches inside the graph,
            sum their gradients (of ``loss / k``), update once.
        max_grad_norm: clip the global gradient norm, as ``clip_grad_norm_``.
        parallel: ``None`` (data parallel over all ranks when the world size is > 1),
            :class:`functacc.parallel.DataParallel` or :class:`functacc.parallel.ZeRO`.
        precision: ``None`` (the model's dtype), ``"bf16"``, ``"fp16"`` (with dynamic loss
            scaling) or :class:`functacc.Precision`: autocast compute, float32 master
            weights and optimizer state.
        remat: class names of modules whose activations are recomputed in backward instead
            of stored (e.g. ``{"TransformerEncoderLayer"}``).
        remat_policy: what those modules recompute: ``"full"`` (default) their whole forward,
            as ``torch.utils.checkpoint``; ``"save_matmuls"`` keeps their matmul and
            convolution results from forward and recomputes only the cheap ops in between
            (more memory than ``"full"``, less compute); ``"selective"`` keeps only those
            with a weight operand and recomputes the matmuls of two activations (attention's
            scores and weighted values, whose results grow with the sequence length squared)
            with the softmax and dropout around them, as Megatron-LM's selective
            recomputation.
        cuda_graphs: capture the compiled step as a CUDA graph and replay it; ``None`` means
            on for CUDA models, off elsewhere, and off for a distributed step whose process
            group does not use NCCL for CUDA tensors (a CUDA graph cannot capture gloo's
            collectives; ``True`` is then an error). With symbolic sizes, one capture per
            concrete size.
        dynamic: input sizes traced symbolically. ``None`` (automatic, as torch.compile):
            the first call is static; a later call whose batch differs only in some sizes
            retraces once with those dimensions symbolic, and that graph serves every later
            size (guards checked per call). ``True``: every batch dimension symbolic from
            the first call. ``False``: one static graph per distinct shape (fastest per step;
            use it with a bucketing loader, ``DeviceLoader(..., buckets=...)``).
        max_traces: the most traces the step may take; the one beyond raises
            :class:`functacc.RetraceError` (``None``: no limit). From the third trace on,
            each one logs a warning naming what changed.
        cuda_graph_cache_size: CUDA graphs kept per compiled graph (one per concrete size),
            least recently used evicted; they share one memory pool.

    On CPU (with glibc), building a step makes ``malloc`` keep the memory that steps free
    for the next step instead of returning it to the kernel, as the CUDA caching allocator
    does; the process keeps its high-water mark. ``FUNCTACC_KEEP_HOST_MEMORY=0`` turns this
    off; see :mod:`functacc.host_memory`.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                             torch.nn.Linear(16, 4))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> step = functacc.compile_step(model, torch.nn.CrossEntropyLoss(), opt,
        ...                              backend="eager")
        >>> loss = step(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    """
    if isinstance(opt, GradientTransformation) and isinstance(model, nn.Module):
        # As a torch optimizer, stepped in place, over the names the step uses (a model
        # wrapped in DDP or torch.compile: its inner module's); a model that is no module is
        # Step's clear error.
        from ..core.functional import unwrap
        from ..optim import as_optimizer

        opt = as_optimizer(unwrap(model).named_parameters(), opt)
    return Step(
        model,
        loss_fn,
        opt,
        backend=backend,
        inductor_options=inductor_options,
        background_compile=background_compile,
        grad_accum_steps=grad_accum_steps,
        max_grad_norm=max_grad_norm,
        parallel=parallel,
        precision=precision,
        remat=remat,
        remat_policy=remat_policy,
        cuda_graphs=cuda_graphs,
        dynamic=dynamic,
        max_traces=max_traces,
        cuda_graph_cache_size=cuda_graph_cache_size,
    )
