"""The ways to train one workload that the benchmark compares, each from the same weights."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import tempfile
import time
from typing import Any, Protocol

import torch
from torch import Tensor

from ..frontends.compile_step import compile_step
from .models import Workload

__all__ = ["COMPETITORS", "Competitor", "make"]

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class Competitor(Protocol):
    name: str

    def step(self) -> Tensor: ...


class Eager:
    """The plain PyTorch loop: zero_grad, forward, backward, optimizer step; with the
    workload's ``amp`` dtype, forward and loss under ``torch.autocast`` (float32 weights)."""

    name = "eager"

    def __init__(self, w: Workload):
        self.w = w
        self.batches = w.cycle()
        self.model = copy.deepcopy(w.model)
        self.opt = w.make_opt(self.model)
        self.forward = self.model
        self.opt_step = self.opt.step

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.w.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.w.inputs.device.type, dtype=self.w.amp)

    def step(self) -> Tensor:
        inputs, targets = next(self.batches)
        self.opt.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.w.loss_fn(self.forward(inputs), targets)
        loss.backward()
        self.opt_step()
        return loss.detach()


class TorchCompile(Eager):
    """``torch.compile(model)`` for forward/backward and a compiled optimizer step, as in
    PyTorch's "Compiling the optimizer with torch.compile" recipe."""

    name = "torch.compile"
    mode: str | None = None

    def __init__(self, w: Workload):
        super().__init__(w)
        self.forward = torch.compile(self.model, mode=self.mode)
        # The optimizer step in the default mode: under CUDA graph trees its new state
        # (momentum buffers made at the first step) would be graph outputs that the next
        # replay overwrites ("accessing tensor output of CUDAGraphs that has been
        # overwritten", seen with SGD momentum on an H100).
        self.opt_step = torch.compile(self.opt.step)

    def step(self) -> Tensor:
        if self.mode == "reduce-overhead":
            # CUDA graph trees: a new training iteration starts here (the recipe's call).
            torch.compiler.cudagraph_mark_step_begin()
        return super().step()


class TorchCompileReduceOverhead(TorchCompile):
    """``torch.compile(model, mode="reduce-overhead")``: forward and backward replayed as
    CUDA graphs; the optimizer step compiled as above."""

    name = "torch.compile:reduce-overhead"
    mode = "reduce-overhead"


class Functacc:
    """``functacc.compile_step``: forward, backward and optimizer as one Inductor graph."""

    name = "functacc"

    def __init__(
        self,
        w: Workload,
        *,
        label: str | None = None,
        memory_format: torch.memory_format | None = None,
        **options,
    ):
        if label:
            self.name = f"functacc {label}"
        self.w = w
        self.model = copy.deepcopy(w.model)
        batches = w.batches
        if memory_format is not None:
            # The model's weights and the batches in this layout, converted once here; the
            # step writes its updates in place, so they keep it.
            self.model.to(memory_format=memory_format)
            batches = [(x.contiguous(memory_format=memory_format), y) for x, y in batches]
        self.batches = itertools.cycle(batches)
        self.opt = w.make_opt(self.model)
        if w.amp is not None:
            options.setdefault("precision", w.amp)
        self.compiled = self.front(self.model, w.loss_fn, self.opt, **options)

    @staticmethod
    def front(model: torch.nn.Module, loss_fn: Any, opt: Any, **options: Any) -> Any:
        return compile_step(model, loss_fn, opt, **options)

    def step(self) -> Tensor:
        return self.compiled(*next(self.batches))

    def compile_times(self) -> list[tuple[float, float]]:
        """(trace s, compile s) of each graph built so far."""
        return [(r.trace_s, r.compile_s) for r in self.compiled.traces]

    def host_overhead_s(self, calls: int = 200, blocks: int = 15) -> float:
        """Seconds per call that the step spends outside its compiled graph: checking the
        signature, picking the program, bookkeeping. Measured by calling the step with the
        graph replaced by one that returns what a real run returned, so nothing else is
        timed; the step count is put back afterwards."""
        self.step()
        program = self.compiled._jitted._engine.last_program
        real, count = program.run, self.compiled._calls
        outputs: list = []  # one real run's outputs, then returned by every timed call
        program.run = lambda args: outputs or outputs.extend(real(args)) or outputs
        self.step()
        try:
            best = float("inf")
            # The best block is the one least disturbed by other work on the machine
            # (a shared VM's neighbours doubled the median on some runs).
            for _ in range(blocks):
                start = time.perf_counter()
                for _ in range(calls):
                    self.step()
                best = min(best, (time.perf_counter() - start) / calls)
        finally:
            program.run, self.compiled._calls = real, count
        return best


class FunctaccBackground(Functacc):
    """``compile_step(..., background_compile=True)``: the first steps run the traced graph
    while a worker process compiles; the runner waits for the compiled code (``ready``)
    before the timed rounds. With ``--cold`` it compiles into an empty cache of its own, so
    that no other competitor's compile (run before or after it) shares its work."""

    name = "functacc:background"
    cold = False  # set by the command line's --cold

    def __init__(self, w: Workload):
        self._cache_dir = os.environ.get(CACHE_ENV)
        if self.cold:
            os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="functacc-bench-background-")
        super().__init__(w, background_compile=True)

    def ready(self) -> None:
        """Wait until the compiled step is in use (then put the cache folder back)."""
        try:
            self.compiled.wait_for_compile()
        finally:
            if self._cache_dir is not None:
                os.environ[CACHE_ENV] = self._cache_dir


class FunctaccJit(Eager):
    """``functacc.jit`` of the same eager step body (zero_grad, forward, loss, backward,
    opt.step()): the general front door, to compare with ``compile_step``."""

    name = "functacc.jit"

    def __init__(self, w: Workload):
        from ..frontends.jit import jit

        super().__init__(w)
        model, opt, loss_fn = self.model, self.opt, w.loss_fn

        def train_step(inputs: Tensor, targets: Tensor) -> Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            opt.step()
            return loss.detach()

        options = {"precision": w.amp} if w.amp is not None else {}
        if options:
            raise ValueError("functacc.jit in the bench takes no --amp yet")
        self.compiled = jit(train_step, modules=[model], optimizers=[opt])

    def step(self) -> Tensor:
        return self.compiled(*next(self.batches))

    def compile_times(self) -> list[tuple[float, float]]:
        return [(r.trace_s, r.compile_s) for r in self.compiled.traces]


class Accelerate(Eager):
    """The eager loop on a model prepared by ``functacc.accelerate`` (torch.compile)."""

    name = "accelerate"

    def __init__(self, w: Workload):
        from ..frontends.accelerate import accelerate

        super().__init__(w)
        accelerate(self.model)


COMPETITORS = {
    c.name: c
    for c in (
        Eager,
        TorchCompile,
        TorchCompileReduceOverhead,
        Functacc,
        FunctaccBackground,
        FunctaccJit,
        Accelerate,
    )
}


def make(name: str, workload: Workload) -> Competitor:
    if name not in COMPETITORS:
        raise ValueError(f"unknown competitor {name!r}; choose from {', '.join(COMPETITORS)}")
    return COMPETITORS[name](workload)


def functacc_variant(workload: Workload, label: str, **options) -> Competitor:
    """functacc with options (``precision=``, ``remat=``), shown as ``functacc <label>``."""
    return Functacc(workload, label=label, **options)
