"""``compile_step`` as a canned step body on ``jit``'s pipeline: any optimizer.

``compile_step(model, loss_fn, opt)`` with an optimizer that has no pure twin in
:mod:`functacc.optim` (RMSprop, Adagrad, Adafactor, Muon, timm's Lamb, a class of your
own, ...) writes the standard step — ``opt.zero_grad()``, the forward and the loss per
micro-batch, ``(loss / k).backward()``, ``clip_grad_norm_``, ``opt.step()`` — as an eager
body and compiles it with :func:`functacc.jit`, which traces the optimizer's own ``step()``
(:mod:`functacc.core.own_step`). After each call the model, its ``.grad`` and the optimizer
hold what that eager step leaves there.

Example:
    >>> import torch, functacc
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
    >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    >>> type(step).__name__, step.num_traces
    ('BodyStep', 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..backends import Backend
from ..core.cache import TraceRecord
from ..core.functional import unwrap
from .jit import jit
from .step_fn import LossFn, model_loss, split_micro_batches

__all__ = ["BodyStep", "needs_body_step"]


def needs_body_step(opt: Any) -> bool:
    """Whether ``compile_step`` runs ``opt`` through its own traced ``step()`` (no twin)."""
    from ..optim._torch import SUPPORTED

    return isinstance(opt, torch.optim.Optimizer) and type(opt) not in SUPPORTED


class BodyStep:
    """The standard training step of ``model``, ``loss_fn`` and ``opt`` on ``jit``'s
    pipeline; build it with :func:`functacc.compile_step`."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn | None,
        opt: torch.optim.Optimizer,
        *,
        backend: Backend,
        inductor_options: dict[str, Any] | None,
        grad_accum_steps: int,
        background_compile: bool = False,
        max_grad_norm: float | None,
        parallel: Any,
        cuda_graphs: bool | None,
        dynamic: bool | None,
        max_traces: int | None,
        remat: Any = None,
        remat_policy: Any = "full",
        **unsupported: Any,
    ):
        given = {k: v for k, v in unsupported.items() if v not in (None, "full", 8)}
        if given:
            raise ValueError(
                f"compile_step with {type(opt).__name__} (traced through its own step(), "
                f"with functacc.jit) does not take {sorted(given)} yet; those work with "
                "torch.optim.SGD, Adam or AdamW. Leave them out, or write the step body "
                "yourself for functacc.jit."
            )
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1; got {grad_accum_steps!r}")
        self.model = unwrap(model)
        self.loss_fn = loss_fn
        self.optimizer = opt
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self._calls = 0
        self._jitted = jit(
            self._body,
            modules=[self.model],
            optimizers=[opt],
            backend=backend,
            inductor_options=inductor_options,
            background_compile=background_compile,
            dynamic=dynamic,
            max_traces=max_traces,
            parallel=parallel,
            cuda_graphs=cuda_graphs,
            remat=remat,
            remat_policy=remat_policy,
        )

    def _body(self, *args: Any, **kwargs: Any) -> Tensor:
        """The eager step that ``compile_step`` compiles, as eager PyTorch would write it."""
        model, opt, k = self.model, self.optimizer, self.grad_accum_steps
        opt.zero_grad(set_to_none=True)
        losses = []
        for micro_args, micro_kwargs in split_micro_batches(args, kwargs, k):
            if self.loss_fn is None:
                loss = model_loss(_call(model, micro_args, micro_kwargs))
            else:
                inputs, targets = micro_args
                loss = self.loss_fn(_call(model, (inputs,), {}), targets)
            (loss / k if k > 1 else loss).backward()
            losses.append(loss.detach())
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        opt.step()
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step; returns the loss, a detached 0-dim tensor."""
        if self.loss_fn is not None and (len(args) != 2 or kwargs):
            raise TypeError(
                "a step with a loss_fn is called as step(inputs, targets); got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments"
            )
        loss = self._jitted(*args, **kwargs)
        self._calls += 1
        return loss

    @property
    def backend(self) -> Backend:
        return self._jitted._engine.engine.backend

    @property
    def num_traces(self) -> int:
        """Graphs traced and compiled so far."""
        return self._jitted.num_traces

    def wait_for_compile(self) -> float:
        """With ``background_compile=True``: wait for the compiles still running in the
        background, and run the compiled code from the next call on (a fixed step for the
        swap, where a run must repeat bit for bit); returns the seconds waited."""
        return self._jitted.wait_for_compile()

    @property
    def traces(self) -> list[TraceRecord]:
        """Every compiled trace: why it happened, which sizes it made symbolic, its cost."""
        return self._jitted.traces

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        return self._jitted.graphs

    @property
    def count(self) -> int:
        """Steps taken."""
        return self._calls

    def warmup(self, batches: Iterable[Any], *, progress: bool = True) -> list[TraceRecord]:
        raise NotImplementedError(
            f"warmup() of a compile_step with {type(self.optimizer).__name__} is not there "
            "yet (it would train on the batches): call the step on them, or use SGD, Adam "
            "or AdamW."
        )

    def sync_model(self) -> nn.Module:
        """The model (it holds the trained parameters after every call)."""
        return self.model


def _call(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    if len(args) == 1 and not kwargs:
        inputs = args[0]
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)
    return model(*args, **kwargs)
