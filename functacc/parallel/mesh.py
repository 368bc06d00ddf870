"""The process group: started from torchrun's environment, and the sharding topology."""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import warnings
import weakref

import torch
import torch.distributed as dist

__all__ = [
    "GroupRef",
    "Topology",
    "check_launched",
    "default_device",
    "device_for",
    "init_distributed",
    "rank",
    "world_size",
]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def init_distributed(
    backend: str | None = None, *, timeout: datetime.timedelta | float | None = None
) -> bool:
    """Start the default process group from torchrun's environment; idempotent.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
    ``torchrun``). ``backend=None`` picks gloo for CPU tensors and, when this node has a GPU
    for every local process, NCCL for CUDA tensors (``"cpu:gloo,cuda:nccl"``, each process
    on the GPU ``LOCAL_RANK``); with more processes on the node (``LOCAL_WORLD_SIZE``) than
    GPUs it picks gloo alone and warns (a CPU run on a GPU machine, or a launch that asked
    for too many processes). ``timeout`` (seconds or a timedelta, default 300 s, or
    ``FUNCTACC_TIMEOUT`` seconds from the environment) bounds how long a collective waits
    for a rank that has died, so the others fail with an error instead of hanging forever.
    Without torchrun's variables this is a single process: nothing to start, returns
    ``False``.

    Example:
        >>> import functacc
        >>> functacc.init_distributed()  # python script.py: world size 1
        False
    """
    if dist.is_available() and dist.is_initialized():
        return True
    world = _env_int("WORLD_SIZE")
    if world is None or _env_int("RANK") is None:
        return False
    if timeout is None:
        env_timeout = os.environ.get("FUNCTACC_TIMEOUT")
        timeout = float(env_timeout) if env_timeout else DEFAULT_TIMEOUT
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    local_rank = _env_int("LOCAL_RANK") or 0
    if backend is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_world = _env_int("LOCAL_WORLD_SIZE") or local_rank + 1
        backend = default_backend(gpus, local_world)
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
    _release_at_exit()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return True
    # Restarted by torchrun (--max-restarts): the launcher's store still holds the previous
    # attempt's addresses, which a new process group would try to connect to. A prefix per
    # attempt keeps each attempt's keys apart.
    store, rank_, world_ = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"functacc/attempt{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world_, timeout=timeout)
    return True


@functools.cache
def _release_at_exit() -> None:
    """Free the process groups while Python is still whole, once, at exit.

    A gloo worker thread frees each finished collective's tensors itself, which needs the
    interpreter lock when a tensor has a Python object. A process group that outlives
    ``destroy_process_group()`` (held in reference cycles, e.g. by a wrapped module's
    hooks) is freed only while the interpreter shuts down, when a thread that asks for the
    lock is ended instead: "terminate called without an active exception", SIGABRT.
    Measured here (2-core CPU, torch 2.14.1, DDP then FSDP2 on gloo, tests/dist/worker.py
    accelerate): 2 aborts in 28 runs under load, the core dump showing a gloo thread ended
    in ``take_gil`` while freeing a barrier's work; 0 in 100 once the cycles are collected
    before shutdown. atexit runs while Python is whole: destroying a gloo-only default group
    (local, no collective) and collecting the cycles joins those threads there. A NCCL
    group is left to the user's ``destroy_process_group()``: at exit after a failure its
    teardown could wait on ranks that are gone.
    """

    def release() -> None:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        gc.collect()

    atexit.register(release)


def default_backend(gpus: int, local_processes: int) -> str:
    """The backend when ``local_processes`` processes share a node with ``gpus`` GPUs (the
    same answer on every rank of the node, so they agree).

    Example:
        >>> default_backend(gpus=8, local_processes=8), default_backend(gpus=0, local_processes=2)
        ('cpu:gloo,cuda:nccl', 'gloo')
    """
    if gpus == 0:
        return "gloo"
    if local_processes > gpus:
        warnings.warn(
            f"this node has {gpus} GPU(s) for {local_processes} processes: not every process "
            "can have its own GPU, so the process group uses gloo (CPU tensors) only. For GPU "
            f"training launch one process per GPU (torchrun --nproc-per-node={gpus}); for a "
            "CPU run pass backend='gloo' to silence this.",
            stacklevel=3,
        )
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def default_device() -> torch.device:
    """The device this process trains on when none is named (``DeviceLoader``,
    ``accelerate``): see :func:`device_for`.

    Example:
        >>> default_device()  # device(type='cpu') without CUDA, else the current GPU
        device(type='...)
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    current = torch.cuda.current_device() if gpus else 0
    return device_for(gpus, _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"), current)


def device_for(
    gpus: int, local_rank: int | None, local_processes: int | None, current: int = 0
) -> torch.device:
    """One process (no ``LOCAL_RANK``): the current CUDA device, or the CPU without one.
    Under torchrun: GPU ``LOCAL_RANK`` when the node has a GPU for every local process, else
    the CPU, as :func:`default_backend` picks gloo then (two processes sharing a GPU would
    run gloo's host collectives on CUDA tensors, which a CUDA graph cannot capture).

    Example:
        >>> device_for(8, 3, 8), device_for(1, 1, 2), device_for(1, None, None)
        (device(type='cuda', index=3), device(type='cpu'), device(type='cuda', index=0))
    """
    if gpus == 0:
        return torch.device("cpu")
    if local_rank is None:
        return torch.device("cuda", current)
    if (local_processes or local_rank + 1) > gpus:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def check_launched() -> None:
    """Raise if torchrun started this process as one of several ranks but the process group
    is not initialised (each rank would train alone)."""
    launched = _env_int("WORLD_SIZE") or 1
    if launched > 1 and world_size() == 1:
        raise RuntimeError(
            f"this process was launched as one of {launched} ranks (WORLD_SIZE={launched}) "
            "but the process group is not initialised, so each rank would train alone. Call "
            "functacc.init_distributed() before building the step (compile_step or "
            "functacc.jit)."
        )


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class GroupRef:
    """A weak reference to a process group, which ``torch.distributed`` owns.

    A strong one held by a step or a loader would keep the group alive past
    ``dist.destroy_process_group()`` until that object is collected, at the latest while the
    interpreter shuts down, where Gloo's threads can abort the process ("terminate called
    without an active exception", exit code -6, after the script finished).
    """

    __slots__ = ("_ref",)

    def __init__(self, group: dist.ProcessGroup):
        self._ref = weakref.ref(group)

    def __call__(self) -> dist.ProcessGroup:
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group this step or loader was built with has been destroyed "
                "(dist.destroy_process_group()). Build the step or loader again after "
                "functacc.init_distributed()."
            )
        return group


class Topology:
    """How the ranks are arranged: ``replicas`` groups of ``shard_size`` ranks.

    Parameters and optimizer state are sharded within a group and replicated across groups.
    Plain data parallelism is ``shard_size == 1``; ZeRO over all ranks is ``replicas == 1``;
    hybrid sharding is both > 1 (shard within a node, replicate across nodes: torchrun gives
    one node's processes consecutive ranks, so a shard group is consecutive ranks). The
    groups are held weakly (:class:`GroupRef`).
    """

    __slots__ = ("_data", "_replicate", "_shard", "shard_size", "world")

    def __init__(
        self,
        world: int,
        shard_size: int,
        shard_group: dist.ProcessGroup | None,  # None when shard_size == 1
        replicate_group: dist.ProcessGroup | None,  # None when there is one replica
        data_group: dist.ProcessGroup | None = None,
    ):
        self.world = world
        self.shard_size = shard_size
        self._shard = GroupRef(shard_group) if shard_group is not None else None
        self._replicate = GroupRef(replicate_group) if replicate_group is not None else None
        # All ``world`` ranks of this data-parallel axis: every rank, unless tensor
        # parallelism makes the axis one rank of each tensor-parallel group.
        if data_group is None and world > 1:
            data_group = dist.group.WORLD
        self._data = GroupRef(data_group) if data_group is not None else None

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        return self._data() if self._data is not None else None

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        return self._shard() if self._shard is not None else None

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self._replicate() if self._replicate is not None else None

    def __repr__(self) -> str:
        return f"Topology(world={self.world}, shard_size={self.shard_size})"

    @property
    def replicas(self) -> int:
        return self.world // self.shard_size

    @property
    def shard_rank(self) -> int:
        group = self.shard_group
        return dist.get_rank(group) if group is not None else 0

    @classmethod
    def build(cls, shard_size: int | None, *, device_type: str = "cpu") -> Topology:
        """Create the process groups (a collective call: every rank must make it)."""
        world = world_size()
        size = world if shard_size is None else shard_size
        if not isinstance(size, int) or size < 1 or world % size:
            raise ValueError(
                f"shard_size must divide the world size; got shard_size={shard_size} with "
                f"world size {world}. Use a divisor of {world} (e.g. the number of GPUs of one "
                "node), or None to shard over all ranks."
            )
        if world == 1:
            return cls(1, 1, None, None)
        if size == world:
            return cls(world, size, dist.group.WORLD, None)
        if size == 1:
            return cls(world, 1, None, dist.group.WORLD)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type, (world // size, size), mesh_dim_names=("replicate", "shard")
        )
        return cls(world, size, mesh.get_group("shard"), mesh.get_group("replicate"))
