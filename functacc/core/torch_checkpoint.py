"""``torch.utils.checkpoint`` inside a traced step.

Eager PyTorch's checkpointing saves the random generators' states in forward and puts
them back in backward before recomputing, so a recomputed dropout draws the forward's
masks. A trace runs that Python once: putting a generator back is harmless while tracing
(the draws are ops of the graph), but a draw made by the recomputation would be a new draw
in every run, other masks than the forward's, and silently other gradients. So a draw in
checkpoint's recomputation is an error (functacc's own ``remat=`` replays the forward's
draws instead), and its ``torch.set_rng_state`` calls are allowed where the jitted step
refuses the body's own (``core/python_effects.py``).

Example:
    >>> in_torch_checkpoint()
    False
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["in_torch_checkpoint", "no_checkpoint_draws"]


class _NoCheckpointDraws(TorchDispatchMode):
    """Refuses a random draw made by ``torch.utils.checkpoint``'s recomputation while the
    step takes its gradients. Eager restores the forward's RNG state before recomputing, so
    the recomputed dropout masks equal the forward's; a traced graph cannot restore it (the
    restore happens in Python at trace time), so its recomputation would draw new masks and
    silently give other gradients. functacc's own ``remat`` replays the forward's draws."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        # In backward only: checkpoint's forward also runs inside torch/utils/checkpoint.py,
        # and its draws there are the forward's own.
        if (
            torch.Tag.nondeterministic_seeded in func.tags
            and torch._C._current_graph_task_id() != -1
            and in_torch_checkpoint()
        ):
            from ..errors import argument_error

            raise argument_error(
                f"torch.utils.checkpoint recomputes a region that draws random numbers "
                f"({func._overloadpacket.__name__}, e.g. dropout) during backward. Eager "
                "PyTorch replays the forward's random state there; a compiled step cannot, "
                "and would use other dropout masks. Let functacc recompute instead: remove "
                "the checkpoint call (or turn off the model's gradient checkpointing) and "
                "pass remat={'BlockClassName'} to compile_step or functacc.jit, which keeps "
                "the masks."
            )
        return func(*args, **(kwargs or {}))


def in_torch_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint``'s code."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


@contextlib.contextmanager
def no_checkpoint_draws() -> Iterator[None]:
    """While a step's backward is traced: see :class:`_NoCheckpointDraws`."""
    with _NoCheckpointDraws():
        yield
