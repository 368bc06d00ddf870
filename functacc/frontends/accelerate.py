"""``functacc.accelerate``: TorchAcc's front door for people who keep their eager loop.

``model, loader = functacc.accelerate(model, loader, config)`` puts the model on its device,
starts the process group under torchrun, and hands back the user's own module, prepared
with PyTorch's engines: ``DistributedDataParallel`` for data parallelism, FSDP2
``fully_shard`` (with ``MixedPrecisionPolicy``) for sharding, ``torch.utils.checkpoint`` for
activation checkpointing, ``torch.autocast`` for mixed precision and ``torch.compile`` for
speed. The loop keeps calling ``loss.backward()`` and ``optimizer.step()``.

This differs from :func:`functacc.compile_step`, which also compiles the backward pass, the
optimizer and the collectives into the one graph; ``accelerate`` compiles the model only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._compat import compile_with_recompile_limit
from ..core.functional import check_module_classes
from ..data import DeviceLoader
from ..parallel.mesh import default_device, init_distributed, world_size
from ..parallel.strategy import sync_from_rank0
from .config import Config

__all__ = ["accelerate"]


def _low_precision(config: Config) -> torch.dtype | None:
    if config.compute.bf16:
        return torch.bfloat16
    if config.compute.fp16:
        return torch.float16
    return None


def _checkpoint_modules(model: nn.Module, classes: set[str]) -> None:
    """Recompute the activations of these modules in backward (forward patched in place,
    so parameter names and ``state_dict()`` keys stay the user's)."""
    classes = check_module_classes(model, classes, "memory.gc_cls")
    for module in model.modules():
        if type(module).__name__ in classes:
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def _autocast_forward(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Run ``forward`` under autocast and hand back float32 outputs, so the user's loss,
    computed outside the model, stays in float32 as with ``torch.autocast``."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=dtype):
            out = forward(*args, **kwargs)
        return pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype else t, out
        )

    model.forward = autocast_forward


class _Shell(nn.Module):
    """Lets DDP drive the user's module while the user keeps holding that module: DDP wraps
    this shell, whose forward is the module's original forward."""

    def __init__(self, module: nn.Module, forward: Any):
        super().__init__()
        self.module = module
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


def _data_parallel(model: nn.Module, device: torch.device, compile_model: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel

    shell = _Shell(model, model.forward)
    ddp = DistributedDataParallel(
        shell, device_ids=[device.index] if device.type == "cuda" else None
    )
    runner = torch.compile(ddp, options=_compile_options(device)) if compile_model else ddp

    def forward(*args: Any, **kwargs: Any) -> Any:  # model(x) -> DDP -> original forward
        return runner(*args, **kwargs)

    # object.__setattr__: nn.Module would register a module-valued attribute as a submodule
    # (and put "forward.module..." keys into state_dict()).
    object.__setattr__(model, "forward", forward)
    object.__setattr__(model, "_functacc_ddp", ddp)


def _fully_shard(
    model: nn.Module, config: Config, device: torch.device, dtype: torch.dtype | None
) -> list[nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, fsdp = world_size(), config.dist.fsdp.size
    dp = config.dp_size(world)
    if dp > 1:  # hybrid: replicate across groups of fsdp.size ranks
        mesh = init_device_mesh(device.type, (dp, fsdp), mesh_dim_names=("dp", "fsdp"))
    else:
        mesh = init_device_mesh(device.type, (fsdp,), mesh_dim_names=("fsdp",))
    policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype
        else (MixedPrecisionPolicy())
    )
    wrap = check_module_classes(model, config.dist.fsdp.wrap_layer_cls, "dist.fsdp.wrap_layer_cls")
    units = [module for module in model.modules() if type(module).__name__ in wrap]
    for module in units:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return units


def _compile_sharded(model: nn.Module, units: list[nn.Module], device: torch.device) -> None:
    """``torch.compile`` a model whose wrap units are FSDP2 ``fully_shard`` units.

    Dynamo does not trace FSDP2's hooks: it breaks the graph at every unit, so each unit's
    ``forward`` becomes a frame of its own. Units of one class share that code, and when
    they differ in width (ResNet-50's Bottlenecks: 64 to 2048 channels) the second width
    makes Dynamo's automatic dynamic shapes recompile the frame with symbolic channel
    sizes, whose backward Inductor (torch 2.14, CPU) fails to generate ("InductorError:
    TypeError: Cannot convert expression to float"). Static shapes give every distinct
    unit its own specialised graph instead, the code that whole-model compilation would
    produce; the recompile limit must then hold one entry per distinct unit, twice over
    for a last, smaller batch. That limit is this model's own: the process-wide
    ``torch._dynamo.config.recompile_limit`` stays the user's.
    """
    shapes = {
        (type(unit), tuple(tuple(p.shape) for p in unit.parameters(recurse=True))) for unit in units
    }
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(shapes))
    # What nn.Module.compile does (it sets this attribute and nothing else), with the limit.
    model._compiled_call_impl = compile_with_recompile_limit(
        model._call_impl, limit, dynamic=False, options=_compile_options(device)
    )


def _compile_options(device: torch.device) -> dict[str, Any]:
    # See functacc.backends.inductor.compile: Inductor's channels-last conversion of the
    # weights costs more than it saves on CPU.
    return {"layout_optimization": False} if device.type == "cpu" else {}


def accelerate(
    model: nn.Module,
    dataloader: Iterable | None = None,
    config: Config | None = None,
    *,
    device: torch.device | str | None = None,
) -> nn.Module | tuple[nn.Module, DeviceLoader]:
    """Prepare ``model`` (and ``dataloader``) for fast, possibly distributed, eager training.

    Returns ``model`` — the same module object, on its device, with ``model.device`` — or
    ``(model, loader)`` when a dataloader is given; the loader yields batches already on the
    device. Under ``torchrun`` the process group is started here (gloo on CPU, NCCL on CUDA),
    so ``torch.distributed.get_rank()`` works afterwards; the default is data parallelism
    over all ranks. ``device`` is where the model trains; ``None`` (the default) is this
    process's own GPU (``cuda:LOCAL_RANK`` under torchrun) where the node has one for every
    process, else the CPU (:func:`functacc.parallel.mesh.device_for`).

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(4, 2)
        >>> config = functacc.Config()
        >>> config.compute.compile = False
        >>> model = functacc.accelerate(model, config=config)
        >>> model.device  # device(type='cpu') without CUDA, else the current GPU
        device(type='...)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a functacc.Config; got {type(config).__name__}")
    init_distributed()
    world = world_size()
    config.validate(world_size=world)
    device = torch.device(device) if device is not None else default_device()
    model.to(device)
    dtype = _low_precision(config)
    if world > 1:
        # Ranks that initialised differently start from rank 0's model (DDP would do this,
        # fully_shard does not).
        sync_from_rank0({**dict(model.named_parameters()), **dict(model.named_buffers())})
    if config.memory.gc:
        _checkpoint_modules(model, set(config.memory.gc_cls or ()))
    if world > 1 and config.dist.fsdp.size > 1:
        units = _fully_shard(model, config, device, dtype)
        if config.compute.compile:
            _compile_sharded(model, units, device)
    else:
        if dtype is not None:
            _autocast_forward(model, dtype, device)
        if world > 1:
            _data_parallel(model, device, config.compute.compile)
        elif config.compute.compile:
            model.compile(options=_compile_options(device))
    if not isinstance(getattr(type(model), "device", None), property):
        model.device = device  # Hugging Face models already have a .device property
    if dataloader is None:
        return model
    loader = DeviceLoader(
        dataloader,
        device=device,
        prefetch=config.dataloader.prefetch,
        **config.dataloader.bucket_options(),
    )
    return model, loader
