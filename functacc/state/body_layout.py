"""The checkpoint of ``compile_step`` on ``jit``'s pipeline (an optimizer traced whole).

Such a step keeps no pure state of its own: the model holds the parameters and buffers,
the ``torch.optim`` optimizer its state, a ``GradScaler`` the loss scale. So the checkpoint
is theirs, in torch's own forms: the model's tensors under the same names as
:class:`~functacc.state.layout.Layout` gives them (``params.*``, ``buffers.*``: a model file
reads the same either way), the tensors of ``opt.state_dict()`` as they are, and its
non-tensor parts (``param_groups``, numbers in the state), the scaler's ``state_dict()`` and
the step count in ``body.json``. Under ZeRO these are whole too (gathered while saving), so a
checkpoint loads into any layout and world size. Loading allocates the optimizer's tensors from the
checkpoint's metadata and hands the whole to ``opt.load_state_dict()``, which creates the
state a fresh optimizer does not have yet.

Example:
    >>> import os, tempfile, torch, functacc
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
    >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_1")
    >>> functacc.save(step, path)
    >>> functacc.load(step, path)
    >>> step.count
    1
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..data import DeviceLoader
from ..parallel import ZeRO
from .layout import Layout
from .safe_io import CheckpointError

__all__ = ["BodyLayout"]

_FILE = "body.json"


class BodyLayout(Layout):
    """Checkpoint names for a :class:`~functacc.frontends.step.Step`."""

    def __init__(self, step: Any, loader: DeviceLoader | None):
        self.step = step
        model, opt = step.model, step.optimizer
        # TensorParallel: a split parameter, and its optimizer state, stored whole (gathered
        # over its group), so that a run of another layout loads it.
        self.split = getattr(model, "_functacc_tensor_parallel", None)
        if self.split is not None and any(isinstance(p, ZeRO) for p in _listed(step.parallel)):
            raise CheckpointError(
                "checkpoints of a step with TensorParallel and ZeRO together are not supported "
                "yet; save with [TensorParallel(...), DataParallel()], or gather the weights with "
                "model._functacc_tensor_parallel.full_state_dict(model)"
            )
        self.params = dict(model.named_parameters())
        owned = {id(p) for p in self.params.values()}
        for i, group in enumerate(opt.param_groups):  # what else it trains: a loss module's
            for j, p in enumerate(group["params"]):  # parameter, a bare tensor (temperature)
                if id(p) not in owned:
                    self.params[f"optimizer.param_groups[{i}]['params'][{j}]"] = p
        self.entries: dict[str, Any] = {}
        self.per_rank: set[str] = set()
        self.fixups = []
        self.split_fixups = []
        # Under ZeRO the checkpoint holds the whole tensors, as under data parallelism, so
        # that it loads into any layout: the model gathers its parameters (ZeRO-3; the next
        # call shards what it then holds, a loaded checkpoint included) and the optimizer's
        # state_dict() gathers its state, load_state_dict() shards it (collective calls:
        # every rank saves and loads).
        step.sync_model()
        self.shapes = self._param_shapes()  # whole shapes, by name (ZeRO-3: gathered)
        for name, p in self.params.items():
            if self.split is not None and name in self.split.dims:
                self._whole(f"params.{name}", name, p.detach())
            else:
                self._plain(f"params.{name}", p.detach())
        for name, shape in self.shapes.items():
            self.entries[f"shapes.params.{name}"] = torch.tensor(list(shape))
        names = {id(p): n for n, p in self.params.items()}
        # opt.state_dict()'s parameter indices, by name (its param_groups' order).
        self.index_names = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        for name, buf in model.named_buffers():
            self._plain(f"buffers.{name}", buf.detach())
        saved = opt.state_dict()
        numbers: dict[str, dict[str, Any]] = {}
        for index, state in saved["state"].items():
            for key, value in state.items():
                name = self.index_names[index]
                if isinstance(value, Tensor) and self._split_like(name, value):
                    # Whole, in its shape (a collective of the group).
                    self.entries[f"optim.state.{index}.{key}"] = self.split.gather(name, value)
                elif isinstance(value, Tensor):
                    self.entries[f"optim.state.{index}.{key}"] = value
                else:
                    numbers.setdefault(str(index), {})[key] = value
        groups = []
        for i, group in enumerate(saved["param_groups"]):
            plain = {}
            for key, value in group.items():
                if isinstance(value, Tensor):  # a tensor lr: kept a tensor
                    self.entries[f"optim.param_groups.{i}.{key}"] = value
                else:
                    plain[key] = value
            groups.append(plain)
        scaler = step.scaler
        self.documents = {
            _FILE: {
                "count": step.count,
                "skipped": step.skipped_steps,
                "param_groups": groups,
                "numbers": numbers,
                "scaler": scaler.state_dict() if scaler is not None else None,
            }
        }
        self._host_state(loader)

    def load_targets(self, metadata: Any, path: str) -> dict[str, Any]:
        """The optimizer's tensors are those the checkpoint holds (a fresh optimizer has
        none yet), allocated as stored; the rest as :meth:`Layout.load_targets`."""
        device = next((p.device for p in self.step.model.parameters()), torch.device("cpu"))
        self.entries = {k: v for k, v in self.entries.items() if not k.startswith("optim.")}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("optim."):
                dtype = meta.properties.dtype
                self.entries[key] = torch.empty(tuple(meta.size), dtype=dtype, device=device)
        return super().load_targets(metadata, path)

    def _param_shapes(self) -> dict[str, torch.Size]:
        """The parameters' whole shapes (under TensorParallel, of the whole layer)."""
        shapes = {}
        for name, p in self.params.items():
            shape = list(p.shape)
            if self.split is not None and name in self.split.dims:
                shape[self.split.dims[name]] *= self.split.size
            shapes[name] = torch.Size(shape)
        return shapes

    def _split_like(self, name: str, value: Tensor) -> bool:
        """Whether ``value`` (optimizer state of parameter ``name``) is split as it is."""
        if self.split is None or name not in self.split.dims or value.dim() == 0:
            return False
        return value.shape == self.params[name].shape

    def _local(self, index: int, value: Tensor) -> Tensor:
        """This rank's slice of optimizer state stored whole (TensorParallel)."""
        name = self.index_names[index]
        if self.split is None or name not in self.split.dims or value.dim() == 0:
            return value
        if value.shape != self.shapes[name]:
            return value  # not shaped like the parameter: kept whole on every rank
        return self.split.slice(name, value).clone()

    def finish_load(self, targets: Mapping[str, Any], path: str) -> None:
        """Hand the loaded state to the optimizer and the scaler, and the count to the
        step."""
        try:
            with open(os.path.join(path, _FILE)) as f:
                saved = json.load(f)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {path!r} has no {_FILE}: it was not written by compile_step with "
                f"an optimizer traced whole ({type(self.step.optimizer).__name__})"
            ) from exc
        opt, step = self.step.optimizer, self.step
        live = opt.state_dict()["param_groups"]
        if len(live) != len(saved["param_groups"]):
            raise CheckpointError(
                f"checkpoint {path!r} has {len(saved['param_groups'])} param groups; the "
                f"optimizer has {len(live)}"
            )
        groups = []
        for i, (group, now) in enumerate(zip(saved["param_groups"], live, strict=True)):
            # JSON keeps no tuples (betas): the live group's types decide.
            group = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in group.items()}
            prefix = f"optim.param_groups.{i}."
            group.update({k[len(prefix) :]: v for k, v in targets.items() if k.startswith(prefix)})
            groups.append(group)
        state: dict[int, dict[str, Any]] = {}
        for key, value in targets.items():
            if key.startswith("optim.state."):
                index, name = key[len("optim.state.") :].split(".", 1)
                state.setdefault(int(index), {})[name] = self._local(int(index), value)
        for index, values in saved["numbers"].items():
            state.setdefault(int(index), {}).update(values)
        held = [{k: v for k, v in g.items() if isinstance(v, Tensor)} for g in opt.param_groups]
        opt.load_state_dict({"state": state, "param_groups": groups})
        for group, tensors in zip(opt.param_groups, held, strict=True):
            for key, tensor in tensors.items():  # lr=torch.tensor(...): filled in place,
                with torch.no_grad():  # as torch's schedulers keep it
                    tensor.copy_(group[key])
                group[key] = tensor
        if step.scaler is not None and saved["scaler"] is not None:
            step.scaler.load_state_dict(saved["scaler"])
        step._calls = saved["count"]
        step._skipped = torch.tensor(saved["skipped"]) if saved["skipped"] else None


def _listed(parallel: Any) -> list:
    return list(parallel) if isinstance(parallel, (list, tuple)) else [parallel]
