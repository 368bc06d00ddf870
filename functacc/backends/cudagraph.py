"""CUDA-graph capture and replay of a compiled step (all CUDA-only code lives here).

A CUDA graph replays a recorded sequence of kernels with the same memory addresses, so the
host launches one graph instead of hundreds of kernels. The stateful step suits it: its state
tensors (parameters, buffers, optimizer state) keep their addresses from step to step, and
the graph writes the new values into them. Only the batch changes address, so it is copied
into static input buffers first; the outputs (the loss) are copied out, because the next
replay overwrites them. The first call runs uncaptured (warm-up: lazy initialisation,
autotuning); the second captures and replays; later calls replay. Random ops (dropout) use
PyTorch's default CUDA generator, whose state ``torch.cuda.graph`` registers with the graph,
so every replay draws fresh numbers.

A graph compiled with symbolic sizes serves many batch shapes, but a CUDA graph is fixed to
one: the runner keeps one capture per concrete batch shape, at most ``cache_size`` of them
(least recently used evicted), all in one shared memory pool (replays never overlap, and
each copies its outputs out, so captures can reuse each other's intermediate memory).

The graph is injected (``graph_factory``; ``Step`` uses :data:`DEFAULT_GRAPH_FACTORY`) so
that everything but the CUDA calls — static buffers, copy-in, copy-out, re-capture when the
state moves — is tested on CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "CapturedGraph",
    "CudaGraphRunner",
    "GraphFactory",
    "TorchCudaGraph",
    "check_cuda_graphs",
    "cuda_backend",
]


class CapturedGraph(Protocol):
    """What the runner needs from a graph: record ``fn`` once (in memory ``pool``), replay
    it, its outputs."""

    outputs: Sequence[Tensor]

    def capture(self, fn: Callable[[], Sequence[Tensor]], pool: Any) -> None: ...

    def replay(self) -> None: ...


GraphFactory = Callable[[], CapturedGraph]


class TorchCudaGraph:
    """``torch.cuda.CUDAGraph`` behind the runner's interface."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.outputs: Sequence[Tensor] = ()

    def capture(self, fn: Callable[[], Sequence[Tensor]], pool: Any) -> None:
        # torch.cuda.graph captures on a side stream and registers the default generator's
        # state with the graph, so every replay draws fresh dropout masks.
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = tuple(fn())

    def replay(self) -> None:
        self.graph.replay()


DEFAULT_GRAPH_FACTORY: GraphFactory = TorchCudaGraph


def _default_pool() -> Any:
    return torch.cuda.graph_pool_handle()


def check_cuda_graphs(
    enabled: bool | None, device: torch.device, collectives: str | None = None
) -> bool:
    """``None``: on for CUDA, off elsewhere; ``True`` off CUDA is an error.

    ``collectives`` is the process group's backend when the step communicates (``None`` for
    one process). A CUDA graph can capture NCCL's collectives but not gloo's, which run on
    the host: with CUDA tensors and a group whose CUDA backend is not NCCL (``"gloo"``, as
    :func:`functacc.init_distributed` picks with more processes than GPUs), ``None`` means
    off and ``True`` is an error, where the capture would fail with CUDA's
    ``cudaErrorStreamCaptureInvalidated``.

    Example:
        >>> check_cuda_graphs(None, torch.device("cuda", 0), collectives="gloo")
        False
    """
    if enabled and device.type != "cuda":
        raise ValueError(
            f"cuda_graphs=True needs the model on a CUDA device; it is on {device}. CUDA "
            "graphs replay GPU kernels; on CPU use cuda_graphs=None (the default) or False."
        )
    capturable = collectives is None or cuda_backend(collectives) == "nccl"
    if enabled and not capturable:
        raise ValueError(
            f"cuda_graphs=True cannot capture this step's collectives: the process group's "
            f"backend for CUDA tensors is {cuda_backend(collectives)!r} ({collectives!r}), and "
            "a CUDA graph captures only NCCL's. Launch one process per GPU so that "
            "functacc.init_distributed() picks NCCL, or pass cuda_graphs=None or False."
        )
    if enabled is None:
        return device.type == "cuda" and capturable
    return bool(enabled)


def check_cache_size(size: Any) -> int:
    """``cuda_graph_cache_size``: an int >= 1 (the CUDA graphs kept per compiled graph)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"cuda_graph_cache_size must be an int >= 1; got {size!r}")
    return size


def cuda_backend(backend: str | None) -> str | None:
    """The backend that serves CUDA tensors in a ``torch.distributed`` backend string:
    ``"cpu:gloo,cuda:nccl"`` -> ``"nccl"``, ``"gloo"`` -> ``"gloo"``.

    Example:
        >>> cuda_backend("cpu:gloo,cuda:nccl"), cuda_backend("gloo")
        ('nccl', 'gloo')
    """
    if backend is None or ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(","))
    return pairs.get("cuda")


@dataclass
class _Capture:
    """One batch shape's capture: its static batch buffers and the state it baked in."""

    calls: int = 0
    graph: CapturedGraph | None = None
    static_batch: list[Tensor] = field(default_factory=list)
    state_ptrs: tuple[int, ...] = ()


class CudaGraphRunner:
    """Wraps a compiled step ``run(inputs) -> outputs`` with capture and replay.

    ``num_state`` leading inputs are the live state, whose addresses a capture bakes in (a
    state tensor that moves is captured again); the rest is the batch, copied into static
    buffers before each replay. Each batch shape gets ``warmup_calls`` uncaptured calls,
    then a capture. ``written`` are batch positions that the step writes into (a donated
    argument of :func:`functacc.jit`): after a replay their static buffers are copied back
    into the caller's tensors.
    """

    def __init__(
        self,
        run: Callable[[list[Tensor]], Sequence[Tensor]],
        num_state: int,
        *,
        cache_size: int = 8,
        graph_factory: GraphFactory | None = None,
        pool_factory: Callable[[], Any] | None = None,
        warmup_calls: int = 1,
        written: Collection[int] = (),
    ):
        self.run = run
        self.num_state = num_state
        self.written = sorted(i for i in written if i >= num_state)
        self.cache_size = cache_size
        self.graph_factory = graph_factory or DEFAULT_GRAPH_FACTORY
        self.pool_factory = pool_factory or _default_pool
        self.pool: Any = None
        self.warmup_calls = warmup_calls
        self.calls = 0
        self.captures = 0
        self.evictions = 0
        self.entries: OrderedDict[tuple, _Capture] = OrderedDict()

    def __call__(self, inputs: list[Tensor]) -> list[Tensor]:
        state, batch = inputs[: self.num_state], inputs[self.num_state :]
        self.calls += 1
        shapes = tuple(t.shape for t in batch)
        entry = self.entries.get(shapes)
        if entry is None:
            entry = self.entries[shapes] = _Capture()
            if len(self.entries) > self.cache_size:
                self.entries.popitem(last=False)  # the least recently used size
                self.evictions += 1
        else:
            self.entries.move_to_end(shapes)
        entry.calls += 1
        if entry.calls <= self.warmup_calls:
            return list(self.run([*state, *batch]))
        ptrs = tuple(t.data_ptr() for t in state)
        if entry.graph is None or ptrs != entry.state_ptrs:
            # First replay of this size, or the state was replaced (e.g.
            # optimizer.load_state_dict): the graph baked in the old addresses, so capture.
            self._capture(entry, state, batch, ptrs)
        else:
            for static, new in zip(entry.static_batch, batch, strict=True):
                static.copy_(new, non_blocking=True)
        entry.graph.replay()
        for i in self.written:
            inputs[i].copy_(entry.static_batch[i - self.num_state])
        # The next replay overwrites the graph's outputs: hand out copies.
        return [t.clone() for t in entry.graph.outputs]

    def _capture(
        self, entry: _Capture, state: list[Tensor], batch: list[Tensor], ptrs: tuple[int, ...]
    ) -> None:
        if self.pool is None:
            self.pool = self.pool_factory()
        entry.static_batch = [t.clone() for t in batch]
        static_inputs = [*state, *entry.static_batch]
        graph = self.graph_factory()
        graph.capture(lambda: self.run(list(static_inputs)), self.pool)
        entry.graph = graph
        entry.state_ptrs = ptrs
        self.captures += 1

    def describe(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "captures": self.captures,
            "kept": len(self.entries),
            "evictions": self.evictions,
        }
