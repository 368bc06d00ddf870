"""Dropout's masks drawn with eager PyTorch's numbers, about eight times faster, on CPU.

PyTorch 2.14's CPU ``bernoulli_(p)`` (its MKL path is compiled out of release builds) draws
one element at a time: two 32-bit outputs of the default generator's Mersenne Twister
(MT19937) per element, joined into a 53-bit fraction ``u`` in [0, 1), and the element is
``u < p``. That is about 4.6 ns per element on the 2-core build machine; the bench
Transformer draws 7.4 million mask elements per step (about 35 ms of a 117 ms step).

:func:`draw_bytes` computes the same numbers: the same generator, the same state after the
draw, the same mask bit for bit (tested against eager for many sizes, probabilities and
generator positions). It runs the twister a whole 624-word block at a time, which the
compiler vectorizes, and compares integers (``u < p`` is ``m < ceil(p * 2**53)`` for the
53-bit integer ``m`` of ``u = m / 2**53``): about 0.6 ns per element
(``python benchmarks/experiments/mask_draws.py``, 1M elements: 4.61 vs 0.56 ns). The kernel is C++
compiled once per machine with the compiler and vector flags Inductor uses, and cached in
Inductor's cache directory.

The masks pass (``masks.py``) draws a compiled step's dropout masks with it through the
operator ``functacc::bernoulli_bytes``; where the kernel cannot be built, it keeps eager's
``bernoulli_``. One difference from eager: eager holds the generator's lock while it draws;
this reads the state, draws and writes the state back, so another thread drawing from the
same default generator at the same moment would see the state of before the draw.

Example:
    >>> import torch
    >>> from functacc.backends.inductor.bernoulli import available, draw_bytes
    >>> if available():
    ...     _ = torch.manual_seed(0)
    ...     mine = draw_bytes([1000], 0.9)
    ...     _ = torch.manual_seed(0)
    ...     assert torch.equal(mine, torch.empty(1000, dtype=torch.uint8).bernoulli_(0.9))
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import subprocess
import tempfile

import torch
from torch import Tensor

__all__ = ["OP", "available", "draw_bytes"]

log = logging.getLogger("functacc")

_SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {
constexpr int N = 624;  // MT19937's state words
constexpr int M = 397;

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

inline uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}

// ATen's mt19937::next_state, as three loops the compiler vectorizes.
void next_state(uint32_t* s) {
  int i = 0;
  for (; i < N - M; i++) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
  for (; i < N - 1; i++) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
  s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

struct Engine {
  uint32_t s[N];
  int64_t left;  // as ATen's: the next draw twists when it is 1
  int64_t next;  // index of the next word to temper
};

// The engine's next `count` outputs, as `count` calls of ATen's operator() give them.
void words(Engine& e, uint32_t* dst, int64_t count) {
  while (count > 0) {
    if (e.left == 1) {
      next_state(e.s);
      e.left = N + 1;
      e.next = 0;
    }
    const int64_t k = std::min<int64_t>(count, e.left - 1);
    const uint32_t* src = e.s + e.next;
    for (int64_t j = 0; j < k; j++) dst[j] = temper(src[j]);
    e.left -= k;
    e.next += k;
    dst += k;
    count -= k;
  }
}
}  // namespace

// state: the bytes of torch.Generator.get_state() (CPUGeneratorImplStateLegacy: int32
// left at 8, uint64 next at 16, 624 uint64 words at 24), read and written back.
extern "C" void functacc_bernoulli_bytes(uint8_t* state, uint8_t* out, int64_t n,
                                         int64_t threshold) {
  Engine e;
  int32_t left;
  uint64_t next;
  uint64_t wide[N];
  std::memcpy(&left, state + 8, 4);
  std::memcpy(&next, state + 16, 8);
  std::memcpy(wide, state + 24, 8 * N);
  for (int i = 0; i < N; i++) e.s[i] = static_cast<uint32_t>(wide[i]);
  e.left = left;
  e.next = static_cast<int64_t>(next);
  constexpr int64_t CHUNK = 2048;
  uint32_t buf[2 * CHUNK];
  for (int64_t i = 0; i < n; i += CHUNK) {
    const int64_t c = std::min<int64_t>(CHUNK, n - i);
    words(e, buf, 2 * c);
    for (int64_t k = 0; k < c; k++) {
      // random64(): the first draw is the high word; uniform_real keeps the low 53 bits.
      const uint64_t v = (static_cast<uint64_t>(buf[2 * k]) << 32) | buf[2 * k + 1];
      out[i + k] = static_cast<int64_t>(v & ((uint64_t(1) << 53) - 1)) < threshold;
    }
  }
  left = static_cast<int32_t>(e.left);
  next = static_cast<uint64_t>(e.next);
  for (int i = 0; i < N; i++) wide[i] = e.s[i];
  std::memcpy(state + 8, &left, 4);
  std::memcpy(state + 16, &next, 8);
  std::memcpy(state + 24, wide, 8 * N);
}
"""

_STATE_BYTES = 5056
"""Size of the CPU generator's state (``torch.get_rng_state()``) this layout is for."""


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    """The compiled kernel, built on first use; ``None`` (logged) where it cannot be."""
    if torch.default_generator.get_state().numel() != _STATE_BYTES:
        log.info("functacc: unknown CPU generator state layout; dropout masks drawn by eager")
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        # Built here rather than by Inductor's CppPythonBindingsCodeCache: its build of
        # this source ran at 6.9 ns per element (the twister not vectorized), this one at 0.6.
        compiler = get_cpp_compiler()
        flags = ["-O3", "-shared", "-fPIC", *pick_vec_isa().build_arch_flags().split()]
        key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags]).encode()).hexdigest()[:24]
        folder = os.path.join(cache_dir(), "functacc")
        path = os.path.join(folder, f"bernoulli_{key}.so")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                source = os.path.join(scratch, "bernoulli.cpp")
                with open(source, "w") as f:
                    f.write(_SOURCE)
                built = os.path.join(scratch, "bernoulli.so")
                subprocess.run(
                    [compiler, *flags, source, "-o", built], check=True, capture_output=True
                )
                os.replace(built, path)  # atomic: another process may be building it too
        function = ctypes.CDLL(path).functacc_bernoulli_bytes
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        log.info("functacc: the dropout-mask kernel could not be built (%s); eager draws", exc)
        return None
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return function


def available() -> bool:
    """Whether :func:`draw_bytes` can run here (its kernel builds; built on first call)."""
    return _kernel() is not None


def draw_bytes(size: list[int], p: float) -> Tensor:
    """``torch.empty(size, dtype=torch.uint8).bernoulli_(p)``: the same mask, drawn from the
    default CPU generator, which it leaves where eager leaves it."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli_ expects 0 <= p <= 1; got p={p}")
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("functacc's dropout-mask kernel is not available on this machine")
    out = torch.empty(size, dtype=torch.uint8)
    generator = torch.default_generator
    state = generator.get_state()
    # u < p for u = m / 2**53 with an integer m is m < ceil(p * 2**53) (exact in float64).
    kernel(state.data_ptr(), out.data_ptr(), out.numel(), math.ceil(p * 2.0**53))
    generator.set_state(state)
    return out


# The operator the compiled step calls. It reads and advances the default generator, so it
# is tagged as random: FX and Inductor then neither drop nor merge it (as for aten.bernoulli).
_LIBRARY = torch.library.Library("functacc", "FRAGMENT")
_LIBRARY.define(
    "bernoulli_bytes(SymInt[] size, float p) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_LIBRARY.impl("bernoulli_bytes", draw_bytes, "CompositeExplicitAutograd")


@torch.library.register_fake("functacc::bernoulli_bytes")
def _fake(size: list[int], p: float) -> Tensor:
    return torch.empty(size, dtype=torch.uint8)


OP = torch.ops.functacc.bernoulli_bytes.default
