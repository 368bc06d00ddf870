"""Compile the optimizer-update graph in a second process while this one compiles the rest.

A step's two graphs (:mod:`functacc.backends.split`) are independent, and Inductor's work
on each is mostly single-threaded Python. A worker process compiles the update graph into
Inductor's on-disk cache while this process compiles forward and backward; this process then
compiles the update itself and finds it in the cache, as a second run of the same program would.
The worker only ever fills the cache (keyed by Inductor on the graph, its inputs' layouts
and the settings), so a worker that fails, is slow, or computes another key costs time,
never correctness: this process then compiles the update as it would without one.

Measured on ResNet-18 (2-core CPU, empty cache): the update graph took 8.5 s of a 29 s
first step; with the worker it takes 0.2 s (a cache hit) and the first step 26 s (the two
compiles share two cores).

The worker is used on CPU only (on CUDA it would create a second CUDA context), for update
graphs of at least ``MIN_NODES`` nodes, once per graph per process, with Inductor's graph
cache on, and not when several ranks already share this machine's cores (torchrun's
``LOCAL_WORLD_SIZE``). ``FUNCTACC_COMPILE_WORKER=0`` turns it off.
"""

from __future__ import annotations

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
from .inductor.compile import compile_inductor

__all__ = ["UpdateWorker", "start_worker"]

log = logging.getLogger("functacc")

# Below this many nodes an update graph compiles in a few seconds, less than a new Python
# process takes to import torch (about 5 s here): a worker would only add load.
MIN_NODES = 400
ENV = "FUNCTACC_COMPILE_WORKER"
_started: set[str] = set()  # graphs (code + input layouts) sent to a worker in this process


class UpdateWorker:
    """A worker compiling one graph into Inductor's cache."""

    def __init__(self, process: subprocess.Popen, folder: Path):
        self._process = process
        self._folder = folder

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
            log.debug("update compile worker exited with %s:\n%s", code, err)
        log.debug("waited %.1f s for the update compile worker", time.perf_counter() - t0)
        shutil.rmtree(self._folder, ignore_errors=True)
        return code == 0

    def stop(self) -> None:
        """Stop the worker now (this process is failing or being interrupted)."""
        self.finish(wait=False)


def start_worker(
    gm: GraphModule, example_inputs: Sequence[Tensor], options: dict[str, Any]
) -> UpdateWorker | None:
    """Start compiling ``gm`` in a worker process, or return ``None`` where a worker
    cannot help (see the module docstring)."""
    from torch._inductor import config as inductor_config

    if not env_flag(ENV, True) or len(gm.graph.nodes) < MIN_NODES:
        return None
    if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
        return None  # nothing to fill
    if any(t.device.type != "cpu" for t in example_inputs):
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if (os.cpu_count() or 1) < 2 * local_ranks:
        return None
    layouts = [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in example_inputs]
    identity = gm.code + repr(layouts)
    if identity in _started:
        return None  # compiled in this process before: a cache hit here
    _started.add(identity)
    job = {
        "graph": gm,
        # Unpickling re-traces the code and records the tracer where the original has
        # none; AOTAutograd's cache key reads it.
        "tracer_cls": (gm._tracer_cls, gm.graph._tracer_cls),
        "inputs": layouts,
        "options": options,
        "config": inductor_config.save_config_portable(),
        "default_dtype": torch.get_default_dtype(),
    }
    folder = Path(tempfile.mkdtemp(prefix="functacc-worker-"))
    try:
        (folder / "job.pkl").write_bytes(pickle.dumps(job))
    except Exception as e:  # e.g. a graph holding an unpicklable constant
        log.debug("update graph not sent to a worker: %s", e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    # The package's own directory first: the worker imports the same functacc as this
    # process, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    code = "import sys; sys.path.insert(0, sys.argv[1]); "
    code += "import functacc.backends.compile_worker as w; "
    code += "w._main(sys.argv[2])"
    # The update fuses into few kernels: the worker compiles them itself rather than
    # starting a pool of compiler processes (the key ignores this setting).
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
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
        log.debug("no update compile worker: %s", e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return UpdateWorker(process, folder)


def _main(folder: str) -> None:
    from torch._inductor import config as inductor_config

    job = pickle.loads((Path(folder) / "job.pkl").read_bytes())
    gm = job["graph"]
    gm._tracer_cls, gm.graph._tracer_cls = job["tracer_cls"]
    inductor_config.load_config(job["config"])
    torch.set_default_dtype(job["default_dtype"])
    inputs = [_like(*layout) for layout in job["inputs"]]
    (Path(folder) / "compiling").touch()
    compile_inductor(gm, inputs, None, job["options"])


def _like(shape: tuple, stride: tuple, dtype: torch.dtype, offset: int) -> Tensor:
    """A tensor with this layout (all that Inductor's cache key reads); values unset."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    return torch.empty(offset + span, dtype=dtype).as_strided(shape, stride, offset)
