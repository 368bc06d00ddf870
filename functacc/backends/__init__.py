"""Backends: what turns a traced step graph into something that runs, and runs it.

``compile.py`` picks the backend for a graph (``"eager"`` runs it as traced, ``"inductor"``
compiles it) and ``split.py`` cuts a step at the optimizer update so that Inductor compiles
the update once for every batch shape, with ``compile_worker.py`` compiling it in a second
process meanwhile (with ``background_compile=True``, ``background.py`` runs the first
steps as traced while a worker compiles the whole step); ``inductor/`` holds the
Inductor-only code (its settings, the CPU passes on the graph and on the generated code,
the direct call of the result). At run time,
``cudagraph.py`` captures and replays a CUDA step, ``host_memory.py`` keeps the host memory
a CPU step frees.
"""

from .compile import (
    Backend,
    Compiled,
    check_backend,
    check_background,
    check_generators,
    check_inductor_options,
    compile_graph,
)
from .cudagraph import CudaGraphRunner, check_cuda_graphs
from .host_memory import keep_freed_memory
from .split import mark_optimizer_inputs

__all__ = [
    "Backend",
    "Compiled",
    "CudaGraphRunner",
    "check_backend",
    "check_background",
    "check_cuda_graphs",
    "check_generators",
    "check_inductor_options",
    "compile_graph",
    "keep_freed_memory",
    "mark_optimizer_inputs",
]
