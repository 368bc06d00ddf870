"""State on disk: checkpoints of a training run and of a model.

``checkpoint.py`` saves and loads a step's whole state (parameters, optimizer state, the
loader's position, RNG state; sharded with ``torch.distributed.checkpoint`` where the state
is) and a model's weights alone (safetensors); ``manager.py`` keeps the last few checkpoints
of a run; ``safe_io.py`` reads them without unpickling arbitrary objects.
"""

from .checkpoint import load, save
from .manager import CheckpointManager
from .model_file import load_model, save_model
from .safe_io import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "load", "load_model", "save", "save_model"]
