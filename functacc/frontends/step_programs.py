"""The programs of ``compile_step``: the pure step traced, compiled and kept per signature.

For a call, :class:`StepPrograms` finds the program compiled for its signature (the batch's
key and the context's: :mod:`.step_signature`) or builds one on the shared engine
(:class:`functacc.core.engine.Engine`): the pure step in flat form (:func:`.step_fn.flat_form`),
traced, transformed (selective recomputation), compiled, and on CUDA wrapped for CUDA-graph
capture and replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ..backends import CudaGraphRunner
from ..core.engine import Engine, Program
from ..core.functional import unalias_reassigned
from ..core.signature import TensorSpec, batch_names, family_key
from ..core.tracer import Traced
from ..parallel.comm import CommStats, comm_stats
from ..transforms.remat import RematPolicy
from ..transforms.remat_passes import save_matmuls
from .step_fn import StepFunction, TrainState, flat_form
from .step_signature import StepSignature, describe_batch
from .step_state import LiveState

__all__ = ["StepProgram", "StepPrograms"]

_tensor_key = TensorSpec.of


@dataclass
class StepProgram(Program):
    """The compiled step for one input signature, and what its outputs mean."""

    changed: list[bool] = field(default_factory=list)  # which state leaves the step rewrites
    names_with_grads: frozenset[str] = frozenset()
    stats: CommStats | None = None


class StepPrograms:
    """Finds or builds the program for each call of one step."""

    def __init__(
        self,
        engine: Engine,
        signature: StepSignature,
        fn: StepFunction,
        state: LiveState,
        attributes: list[tuple[str, nn.Module, str]],
        context: Callable[[int], tuple],
        *,
        with_targets: bool,
        remat_policy: RematPolicy,
        cuda_graphs: bool,
        cuda_graph_cache_size: int,
    ):
        self.engine = engine
        self.signature = signature
        self.fn = fn
        self.state = state
        self.attributes = attributes  # the model's plain tensor attributes: (name, module, attr)
        self.context = context  # the context's key for a step count (the strategy's phase)
        self.with_targets = with_targets
        self.remat_policy = remat_policy
        self.cuda_graphs = cuda_graphs
        self.cuda_graph_cache_size = cuda_graph_cache_size
        self._last_key: tuple | None = None
        self._last_program: StepProgram | None = None

    def program(
        self,
        context: tuple,
        state: TrainState,
        args: tuple,
        kwargs: dict,
        *,
        inplace: bool,
        count: int,
    ) -> tuple[StepProgram, list[Tensor]]:
        """The program for this call and its inputs after the state: the model's plain
        tensor attributes (read now, as eager reads them in every forward), then the
        batch's tensors."""
        tensors, batch_key = self.signature.batch(args, kwargs)
        attributes = self.attribute_values()
        if attributes:
            context = (*context, ("tensor attributes", tuple(map(_tensor_key, attributes))))
        key = (batch_key, context)
        if key == self._last_key:  # the common case: compared, not hashed
            return self._last_program, [*attributes, *tensors]
        program = self.engine.cache.get(key)
        if program is None:
            # Not compiled for exactly these shapes: a graph with symbolic sizes may take them.
            family = ((("inputs", family_key(tensors)), *batch_key[1:]), context)
            program = self.engine.cache.find(family, tensors)
            if program is None:
                program, key = self._build(
                    key,
                    family,
                    state,
                    args,
                    kwargs,
                    attributes,
                    tensors,
                    inplace=inplace,
                    count=count,
                )
                attributes = self.attribute_values()  # the trace may have unaliased one
                if inplace and self.cuda_graphs:
                    # Attributes keep their addresses like the state (a new one re-captures).
                    program.run = CudaGraphRunner(
                        program.run,
                        len(self.state.leaves) + len(attributes),
                        cache_size=self.cuda_graph_cache_size,
                    )
        if program.guard is None:
            self._last_key, self._last_program = key, program
        return program, [*attributes, *tensors]

    def attribute_values(self) -> list[Tensor]:
        values = []
        for name, module, attr in self.attributes:
            value = getattr(module, attr, None)
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"the model's tensor attribute {name!r} is now {type(value).__name__}; the "
                    "step reads it as a tensor input on every call. Keep it a tensor (or "
                    "register it as a buffer) and rebuild the step if the model changed."
                )
            values.append(value)
        return values

    def _build(
        self,
        key: tuple,
        family: tuple,
        state: TrainState,
        args: tuple,
        kwargs: dict,
        attributes: list[Tensor],
        tensors: list[Tensor],
        *,
        inplace: bool,
        count: int,
    ) -> tuple[StepProgram, tuple]:
        """Trace and compile the step for this call; returns the program and the key it is
        kept under (see :meth:`StepSignature.left_behind`)."""
        watched = self.signature.model_watch.key()  # the model's part of ``key``
        names = batch_names(args, kwargs, ("inputs", "targets") if self.with_targets else ())
        plan = self.engine.plan(key, family, names, tensors, describe_batch(args, kwargs))
        self.engine.check_budget(plan)
        meta: dict[str, Any] = {}
        flat_step, example, n_fixed = flat_form(
            self.fn,
            state,
            args,
            kwargs,
            self.attributes,
            attributes,
            tensors,
            signature=self.state.strategy.signature(count),
            inplace=inplace,
            meta=meta,
        )

        def run_trace() -> Traced:
            return self.engine.trace(flat_step, example, plan, n_fixed=n_fixed)

        traced = run_trace()
        plan.key, plan.family = self.signature.left_behind(
            key, family, watched, traced, run_trace, meta, lambda: self.context(count)
        )
        model_tensors = (*self.state.params.values(), *self.state.buffers.values())
        unalias_reassigned(self.attributes, meta["reassigned"], model_tensors)
        graph = traced.graph
        if self.remat_policy != "full":
            selective = self.remat_policy == "selective"
            save_matmuls(graph, batch_inputs=len(tensors) if selective else None)
        program = StepProgram(
            run=self.engine.compile(traced, example),
            graph=graph,
            changed=meta["changed"],
            names_with_grads=meta["names_with_grads"],
            stats=comm_stats(graph) if _communicates(self.state.strategy) else None,
        )
        self.engine.keep(plan, program, traced, n_fixed=n_fixed)
        return program, plan.key


def _communicates(strategy: Any) -> bool:
    """Whether the step's graph may hold collectives (data parallel or tensor parallel)."""
    split = strategy.tensor_parallel
    return strategy.topology.world > 1 or (split is not None and split.group is not None)
