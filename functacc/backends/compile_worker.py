"""Compile graphs in a second process, into Inductor's on-disk cache.

Two uses. **The update worker** (:func:`start_worker`): a step's two graphs
(:mod:`functacc.backends.split`) are independent, and Inductor's work on each is mostly
single-threaded Python. A worker process compiles the update graph into the cache while this
process compiles forward and backward; this process then compiles the update itself and
finds it in the cache, as a second run of the same program would. **Background compiles**
(:mod:`functacc.backends.background`, ``background_compile=True``): a worker compiles every
graph of the step while this process runs its first steps op by op.

A worker only ever fills the cache (keyed by Inductor on the graph, its inputs' layouts and
the settings), so a worker that fails, is slow, or computes another key costs time, never
correctness: this process then compiles the graph as it would without one.

Measured on ResNet-18 (2-core CPU, empty cache): the update graph took 8.5 s of a 29 s
first step; with the worker it takes 0.2 s (a cache hit) and the first step 26 s (the two
compiles share two cores).

The update worker is used on CPU only (on CUDA it would create a second CUDA context), for
update graphs of at least ``MIN_NODES`` nodes, once per graph per process, with Inductor's
graph cache on, and not when several ranks already share this machine's cores (torchrun's
``LOCAL_WORLD_SIZE``). ``FUNCTACC_COMPILE_WORKER=0`` turns it off.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

from .._env import env_flag
from .graph_transport import pack, unpack
from .inductor.compile import compile_inductor

__all__ = ["CompileWorker", "can_help", "spawn", "start_worker"]

log = logging.getLogger("functacc")

# Below this many nodes an update graph compiles in a few seconds, less than a new Python
# process takes to import torch (about 5 s here): a worker would only add load.
MIN_NODES = 400
ENV = "FUNCTACC_COMPILE_WORKER"
_started: set[str] = set()  # graphs (code + input layouts) sent to a worker in this process
_live: set[CompileWorker] = set()  # workers not yet finished (stopped at exit)


class CompileWorker:
    """A worker process compiling graphs into Inductor's cache."""

    def __init__(self, process: subprocess.Popen, folder: Path):
        self._process = process
        self._folder = folder

    @property
    def done(self) -> bool:
        """Whether the worker has exited (compiled, failed or stopped)."""
        return self._process.poll() is not None

    @property
    def compiling(self) -> bool:
        """Whether the worker has loaded its job and started compiling."""
        return (self._folder / "compiling").exists()

    def finish(self, *, wait: bool | None = None, timeout: float = 900.0) -> bool:
        """End the worker; return whether it compiled its graph.

        ``wait=None`` waits only if the worker is already compiling: it started before this
        process could, so it finishes first. A worker still starting up is stopped (this
        process compiles about as fast as it would). ``timeout``: seconds to wait at most.
        """
        if wait is None:
            wait = self.compiling
        if self._process.poll() is None and not wait:
            self._process.kill()
        t0 = time.perf_counter()
        try:
            code = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        if code not in (0, -9):
            err = (self._folder / "stderr.txt").read_text(errors="replace")[-2000:]
            log.debug("compile worker exited with %s:\n%s", code, err)
        log.debug("waited %.1f s for the compile worker", time.perf_counter() - t0)
        _live.discard(self)
        shutil.rmtree(self._folder, ignore_errors=True)
        return code == 0

    def stop(self) -> None:
        """Stop the worker now (this process is failing or being interrupted)."""
        self.finish(wait=False)


def start_worker(
    gm: GraphModule, example_inputs: Sequence[Tensor], options: dict[str, Any]
) -> CompileWorker | None:
    """Start compiling ``gm`` in a worker process, or return ``None`` where a worker
    cannot help (see the module docstring)."""
    if not env_flag(ENV, True) or len(gm.graph.nodes) < MIN_NODES:
        return None
    if not can_help(example_inputs):
        return None
    identity = _identity(gm, example_inputs)
    if identity in _started:
        return None  # compiled in this process before: a cache hit here
    # The update fuses into few kernels: the worker compiles them itself rather than
    # starting a pool of compiler processes (the key ignores this setting).
    return spawn([(gm, example_inputs)], options, threads=1)


def can_help(example_inputs: Sequence[Tensor]) -> bool:
    """Whether a worker could fill the cache for these inputs with spare cores."""
    from torch._inductor import config as inductor_config

    if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
        return False  # nothing to fill
    if any(t.device.type != "cpu" for t in example_inputs):
        return False
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return (os.cpu_count() or 1) >= 2 * local_ranks


def _layouts(example_inputs: Sequence[Tensor]) -> list[tuple]:
    return [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in example_inputs]


def _identity(gm: GraphModule, example_inputs: Sequence[Tensor]) -> str:
    return gm.code + repr(_layouts(example_inputs))


def spawn(
    graphs: Sequence[tuple[GraphModule, Sequence[Tensor]]],
    options: dict[str, Any],
    *,
    threads: int | None = None,
) -> CompileWorker | None:
    """Start one worker process that compiles ``graphs`` (each with its example inputs),
    one after the other, into Inductor's cache; ``None`` where it cannot start (a graph
    that does not pickle, no process to start). ``threads``: Inductor's compile threads
    in the worker (``None``: Inductor's default)."""
    from torch._inductor import config as inductor_config

    # This process will find these graphs in the cache: no update worker for them later.
    _started.update(_identity(gm, inputs) for gm, inputs in graphs)
    job = {
        # The graphs' nodes, not their code (graph_transport.py says why).
        "graphs": [(pack(gm), _layouts(inputs)) for gm, inputs in graphs],
        "options": options,
        "config": inductor_config.save_config_portable(),
        "default_dtype": torch.get_default_dtype(),
    }
    folder = Path(tempfile.mkdtemp(prefix="functacc-worker-"))
    try:
        (folder / "job.pkl").write_bytes(pickle.dumps(job))
    except Exception as e:  # e.g. a graph holding an unpicklable constant
        log.debug("graph not sent to a compile worker: %s", e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    # The package's own directory first: the worker imports the same functacc as this
    # process, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    code = "import sys; sys.path.insert(0, sys.argv[1]); "
    code += "import functacc.backends.compile_worker as w; "
    code += "w._main(sys.argv[2])"
    env = dict(os.environ)
    if threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    try:
        with open(folder / "stderr.txt", "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-c", code, root, str(folder)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
            )
    except OSError as e:  # no interpreter to start, no processes left: compile here
        log.debug("no compile worker: %s", e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    worker = CompileWorker(process, folder)
    _live.add(worker)
    return worker


@atexit.register
def _stop_live_workers() -> None:
    """A worker still compiling when this process exits would go on alone: stop it."""
    for worker in list(_live):
        worker.stop()


def _main(folder: str) -> None:
    from torch._inductor import config as inductor_config

    job = pickle.loads((Path(folder) / "job.pkl").read_bytes())
    inductor_config.load_config(job["config"])
    torch.set_default_dtype(job["default_dtype"])
    (Path(folder) / "compiling").touch()
    for packed, layouts in job["graphs"]:
        gm = unpack(packed)
        compile_inductor(gm, [_like(*layout) for layout in layouts], None, job["options"])


def _like(shape: tuple, stride: tuple, dtype: torch.dtype, offset: int) -> Tensor:
    """A tensor with this layout (all that Inductor's cache key reads); values unset."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    return torch.empty(offset + span, dtype=dtype).as_strided(shape, stride, offset)
