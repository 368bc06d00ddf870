"""Keep the host memory a CPU training step frees, for the next step to reuse.

A training step allocates its activations and gradients and frees them again, every step.
glibc's ``malloc`` returns large freed blocks to the kernel (``munmap``, or trimming the
top of the heap), so the next step faults the same memory back in, one 4 KiB page at a
time: on ResNet-18 (32x32, batch 32) on a 2-core CPU that was about 14,000 page faults and
20 ms of kernel time in a 50 ms step, for eager PyTorch and compiled steps alike.

:func:`keep_freed_memory` tells ``malloc`` to keep freed memory for reuse instead: blocks
up to 32 MiB (glibc's documented maximum threshold) come from the heap, and the heap is
never trimmed. It is what PyTorch's CUDA caching allocator does on GPUs, and what
``torch.backends.xeon.run_cpu`` gets by preloading jemalloc with decay off. The cost: the
process keeps its high-water mark (its resident memory does not shrink after a peak; later
allocations reuse it) until :func:`release_freed_memory` hands the free part back, e.g.
after training, before other work. The setting is process-wide, so everything in the
process, eager code included, stops faulting too.

:func:`functacc.compile_step` calls it for a CPU model unless the environment variable
``FUNCTACC_KEEP_HOST_MEMORY`` is ``0`` (or ``false``, ``no``, ``off``). Other C libraries
(macOS, Windows, musl) are left alone.

Example:
    >>> from functacc.backends import host_memory
    >>> isinstance(host_memory.keep_freed_memory(), bool)
    True
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["ENV_VAR", "keep_freed_memory", "release_freed_memory"]

log = logging.getLogger(__name__)

ENV_VAR = "FUNCTACC_KEEP_HOST_MEMORY"
"""Set to ``0`` before building a step to leave ``malloc``'s settings alone."""

# mallopt() parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks above this still get their own mapping, returned on free: the largest threshold
# glibc documents (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), so a one-off huge allocation
# (a checkpoint being loaded) is not kept for the rest of the process.
_MMAP_THRESHOLD = 32 * 1024 * 1024
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest is "never" in practice

_applied: bool | None = None  # None: not tried yet


def keep_freed_memory() -> bool:
    """Make ``malloc`` keep freed memory (blocks up to 32 MiB) for reuse rather than return
    it to the kernel. Returns whether the setting is in effect: ``False`` where the C library
    is not glibc (nothing is changed there). Calling it again does nothing more.
    """
    global _applied
    if _applied is None:
        _applied = _set_mallopt()
    return _applied


def release_freed_memory() -> bool:
    """Return the heap's free memory to the kernel now (glibc's ``malloc_trim``): what
    :func:`keep_freed_memory` keeps for the next step, once no step follows. Returns
    whether any memory was released (``False`` where the C library is not glibc).

    Example:
        >>> from functacc.backends import host_memory
        >>> isinstance(host_memory.release_freed_memory(), bool)
        True
    """
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def _set_mallopt() -> bool:
    libc = _glibc()
    if libc is None:
        log.debug("host memory: C library is not glibc; malloc settings left as they are")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Each returns 1 on success. The heap threshold first: without it, never trimming
    # would keep only small blocks, which are not the ones that fault.
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok = ok and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    log.debug("host memory: malloc keeps freed memory: %s", ok)
    return ok
