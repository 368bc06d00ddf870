"""The model alone, as one safetensors file: the weights to share, evaluate or fine-tune."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..parallel.mesh import rank
from .layout import barrier, short
from .safe_io import CheckpointError

__all__ = ["load_model", "save_model"]


def _model_and_step(target: Any) -> tuple[torch.nn.Module, Any]:
    from ..frontends.step import Step

    if isinstance(target, Step):
        return target.model, target
    if isinstance(target, torch.nn.Module):
        return target, None
    raise TypeError(f"expected a torch.nn.Module or a functacc.Step; got {type(target).__name__}")


def _gathered_for(step: Any) -> Any:
    """Under ZeRO-3, with the model holding only placeholders: gather the whole parameters
    into it (a collective call) and return what shards them again afterwards; else None."""
    if step is None:
        return None
    rest = step._jitted._engine.capture.rest
    if rest is None or rest.holds_whole:
        return None
    step.sync_model()
    return rest


def save_model(model_or_step: Any, path: str | os.PathLike) -> None:
    """Write the full model weights (parameters and persistent buffers) as one
    ``safetensors`` file, for inference and export. Under ZeRO-3 the shards are gathered
    first (every rank must call it); rank 0 writes.

    Example:
        >>> import torch, functacc, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> functacc.save_model(torch.nn.Linear(2, 2), path)
    """
    from safetensors.torch import save_file

    model, step = _model_and_step(model_or_step)
    rest = _gathered_for(step)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tensors = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}
    if rest is not None:  # ZeRO-3: the model goes back to its placeholders
        rest.release()
    if rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = os.fspath(path) + ".partial"
        # safetensors refuses tensors that share memory (tied weights): store each once.
        seen: dict[int, str] = {}
        unique = {}
        for k, v in tensors.items():
            if v.data_ptr() in seen and v.numel():
                continue
            seen[v.data_ptr()] = k
            unique[k] = v
        save_file(unique, tmp, metadata={"format": "pt", "producer": "functacc"})
        os.replace(tmp, path)
    barrier()


def load_model(model_or_step: Any, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Load weights written by :func:`save_model` (or any ``safetensors`` state dict) into
    a model, or into a step's live state (re-sharded under ZeRO-3). Safetensors holds raw
    tensors only: loading runs no code."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model, step = _model_and_step(model_or_step)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no model file at {path!r}")
    try:
        loaded = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path!r} is not a readable safetensors file: {exc}") from exc
    rest = _gathered_for(step)
    try:
        _load_checked(model, loaded, path, strict)
    finally:  # ZeRO-3: sharded from what the model now holds (as before, if it failed)
        if rest is not None:
            rest.release()


def _load_checked(
    model: torch.nn.Module, loaded: Mapping[str, Tensor], path: str, strict: bool
) -> None:
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in loaded and not _tied(model, k, loaded))
    unexpected = sorted(k for k in loaded if k not in expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path!r} is of a different model: missing {short(missing)}; unexpected "
            f"{short(unexpected)}"
        )
    for name, value in loaded.items():
        if name in expected and tuple(expected[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path!r}: {name!r} has shape {tuple(value.shape)} in the file but "
                f"{tuple(expected[name].shape)} in the model"
            )
    model.load_state_dict(loaded, strict=False)


def _tied(model: torch.nn.Module, key: str, loaded: Mapping[str, Tensor]) -> bool:
    """Whether ``key`` shares its tensor with a key present in ``loaded`` (tied weights)."""
    state = model.state_dict(keep_vars=True)
    target = state[key]
    return any(state[k] is target for k in loaded if k in state)
