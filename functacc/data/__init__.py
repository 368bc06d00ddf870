"""Data: the loader that feeds a compiled step, and what it needs to do so.

``loader.py`` holds :class:`DeviceLoader` (batches moved to the device ahead of the step,
sharded across ranks, resumable from a checkpoint), ``buckets.py`` pads batches to a few
shapes (``functacc.buckets``), and ``sampling.py`` decides each epoch's order of samples.
"""

from . import buckets
from .loader import DeviceLoader

__all__ = ["DeviceLoader", "buckets"]
