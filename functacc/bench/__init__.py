"""``python -m functacc bench``: functacc against eager PyTorch and torch.compile.

All competitors run in one process, start from the same weights and data, and are timed
interleaved, round by round; the report gives ratios, not just absolute numbers.
"""

from .cli import main

__all__ = ["main"]
