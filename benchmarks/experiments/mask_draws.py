"""Dropout mask draws: eager's CPU ``bernoulli_`` against functacc's kernel
(``functacc/backends/inductor/bernoulli.py``), the same bytes, interleaved in one process::

    python benchmarks/experiments/mask_draws.py              # 1M elements, p = 0.9
    python benchmarks/experiments/mask_draws.py 4096

Prints nanoseconds per element (best of 7 rounds) and checks that both drew the same mask
and left the generator in the same state.
"""

from __future__ import annotations

import sys
import time

import torch

from functacc.backends.inductor import bernoulli


def main(elements: int = 1 << 20, p: float = 0.9, rounds: int = 7) -> None:
    if not bernoulli.available():
        sys.exit("functacc's mask kernel could not be built here (no C++ compiler?)")
    torch.manual_seed(0)
    eager = torch.empty(elements, dtype=torch.uint8).bernoulli_(p)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    assert torch.equal(bernoulli.draw_bytes([elements], p), eager)
    assert torch.equal(torch.get_rng_state(), after_eager)
    out = torch.empty(elements, dtype=torch.uint8)
    draws = {
        "eager bernoulli_": lambda: out.bernoulli_(p),
        "functacc": lambda: bernoulli.draw_bytes([elements], p),
    }
    best = dict.fromkeys(draws, float("inf"))
    calls = max(1, (1 << 22) // elements)
    for _ in range(rounds):
        for name, draw in draws.items():  # interleaved, round by round
            start = time.perf_counter()
            for _ in range(calls):
                draw()
            best[name] = min(best[name], (time.perf_counter() - start) / calls / elements)
    for name, seconds in best.items():
        print(f"{name}: {seconds * 1e9:.2f} ns per element ({elements} elements, p={p})")
    print(f"speed-up: {best['eager bernoulli_'] / best['functacc']:.1f}x; same mask and state")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:2]))
