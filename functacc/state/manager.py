"""CheckpointManager: save every N steps, keep the last K, restore the newest complete one."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

from ..data import DeviceLoader
from ..parallel.mesh import rank
from .checkpoint import load, save

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointManager:
    """Periodic, atomic checkpoints of a training step in ``directory``.

    Checkpoints are named ``step_<count>``; each is written under a ``.partial`` name and
    renamed when complete, so a crash while writing leaves the previous checkpoints intact
    and nothing :meth:`restore_latest` would pick.

    Example:
        >>> import tempfile, torch, functacc
        >>> model = torch.nn.Linear(4, 2)
        >>> step = functacc.compile_step(model, torch.nn.MSELoss(),
        ...     torch.optim.SGD(model.parameters(), lr=0.1), backend="eager")
        >>> manager = functacc.CheckpointManager(tempfile.mkdtemp(), every_steps=2, keep=3)
        >>> manager.restore_latest(step)  # a fresh start: nothing to restore
        False
        >>> for _ in range(4):
        ...     loss = step(torch.randn(8, 4), torch.randn(8, 2))
        ...     _ = manager.maybe_save(step)  # at steps 2 and 4
        >>> manager.restore_latest(step), step.count
        (True, 4)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int,
        keep: int = 3,
        loader: DeviceLoader | None = None,
        states: Mapping[str, Any] | None = None,
    ):
        if every_steps < 1 or keep < 1:
            raise ValueError(f"every_steps and keep must be >= 1; got {every_steps}, {keep}")
        self.directory = os.fspath(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.loader = loader
        self.states = states
        os.makedirs(self.directory, exist_ok=True)

    def checkpoints(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        found = []
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            full = os.path.join(self.directory, name)
            if match and os.path.isfile(os.path.join(full, ".metadata")):
                found.append((int(match.group(1)), full))
        return [path for _, path in sorted(found)]

    def maybe_save(self, step: Any, *, force: bool = False) -> str | None:
        """Save if the step count is a multiple of ``every_steps`` (or ``force``); return
        the checkpoint's path, or ``None``."""
        count = step.count
        if not force and (count == 0 or count % self.every_steps):
            return None
        path = os.path.join(self.directory, f"step_{count:08d}")
        save(step, path, loader=self.loader, states=self.states)
        if rank() == 0:
            for old in self.checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def restore_latest(self, step: Any) -> bool:
        """Load the newest complete checkpoint into ``step``; ``False`` if there is none."""
        found = self.checkpoints()
        if not found:
            return False
        load(step, found[-1], loader=self.loader, states=self.states)
        return True
