"""A uint8 dropout mask read through remat's fence, under Inductor (transforms/remat.py).

Times one kernel over 1M elements, ``mask.float() / 0.9 * x``, with the mask read plainly,
through ``where(ready, mask, mask)`` (the fence integer values had until fe533b4) and
through ``mask | zero`` (the fence they have now); ``ready`` is ``a[0] == a[0]``::

    python benchmarks/experiments/fence_read.py
"""

from __future__ import annotations

import time

import torch

N = 1 << 20


def plain(mask, x, a):
    return mask.float() / 0.9 * x


def where_fence(mask, x, a):
    ready = a[0] == a[0]
    return torch.where(ready, mask, mask).float() / 0.9 * x


def or_fence(mask, x, a):
    ready = a[0] == a[0]
    return (mask | (ready ^ ready).to(torch.uint8)).float() / 0.9 * x


def main() -> None:
    torch.manual_seed(0)
    mask, x, a = (torch.rand(N) > 0.1).to(torch.uint8), torch.randn(N), torch.randn(8)
    for fn in (plain, where_fence, or_fence):
        compiled = torch.compile(fn, fullgraph=True)
        assert torch.equal(compiled(mask, x, a), plain(mask, x, a))
        for _ in range(3):
            compiled(mask, x, a)
        start = time.perf_counter()
        for _ in range(50):
            compiled(mask, x, a)
        print(f"{fn.__name__:12s} {(time.perf_counter() - start) / 50 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
