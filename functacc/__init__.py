"""functacc: whole-step compilation for PyTorch training.

The model becomes a pure function of its parameters; forward, loss, backward and the
optimizer update are traced once into one graph, compiled, and replayed.

Example:
    >>> import torch, functacc
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
    >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
"""

from . import optim, parallel
from .core.functional import functionalize
from .core.host_calls import host
from .data import DeviceLoader, buckets
from .errors import RetraceError, TraceError
from .frontends.accelerate import accelerate
from .frontends.compile_step import compile_step
from .frontends.config import Config
from .frontends.jit import Jitted, jit
from .frontends.step import Step
from .frontends.step_fn import TrainState
from .parallel import init_distributed
from .state import CheckpointError, CheckpointManager, load, load_model, save, save_model
from .transforms.precision import Precision

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "Config",
    "DeviceLoader",
    "Jitted",
    "Precision",
    "RetraceError",
    "Step",
    "TraceError",
    "TrainState",
    "__version__",
    "accelerate",
    "buckets",
    "compile_step",
    "functionalize",
    "host",
    "init_distributed",
    "jit",
    "load",
    "load_model",
    "optim",
    "parallel",
    "save",
    "save_model",
]
