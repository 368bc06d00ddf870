"""`make demo`: a small GPT-style language model trained three ways, side by side.

The same model, from the same weights, on the same batches, with AdamW:

- **eager** PyTorch: ``zero_grad(); loss.backward(); opt.step()``;
- **torch.compile**: the model compiled, and the optimizer step compiled (PyTorch's recipe);
- **functacc**: ``functacc.compile_step``, forward, backward and AdamW as one graph.

Each one's first step (which compiles) is timed on its own; then they take turns, a block
of steps each, for several rounds, and the summary gives each one's median throughput and
the ratios. A language model with AdamW is where a whole-step graph wins by design on a
CPU: dozens of small elementwise kernels per layer (attention, layer norms, GELU, the
optimizer's per-parameter update) that eager runs one by one and functacc fuses.

    python examples/demo.py                   # GPT-style LM, 2 layers x 64, seq 64, batch 16
    python examples/demo.py --model resnet18  # the ResNet-18 demo (examples/resnet_quickstart.py)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import functacc


class Block(nn.Module):
    """A GPT-2 block as nanoGPT writes it without flash attention: the attention's mask,
    softmax and dropout are ops of their own, as are the layer norms, GELU and residuals."""

    def __init__(self, width: int, heads: int, seq: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        attn = self.drop(scores.softmax(dim=-1)) @ v
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 256, layers: int = 2, seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's init (tied with the head)
        self.position = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.Sequential(*(Block(width, 4, seq) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=["gpt", "resnet18"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per round and loop")
    args = p.parse_args()
    if args.model == "resnet18":
        import resnet_quickstart

        sys.argv = [sys.argv[0]]
        resnet_quickstart.main()
        return
    torch.manual_seed(0)
    model = TinyGPT(width=args.width, layers=args.layers)
    g = torch.Generator().manual_seed(0)
    batches = [
        (lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 512, (args.batch_size, 65), generator=g))
        for _ in range(8)
    ]
    loops = {"eager": eager_loop(model), "torch.compile": compiled_loop(model)}
    loops["functacc"] = functacc_loop(model)
    print(
        f"TinyGPT ({args.layers} layers x {args.width}, seq 64, vocab 512), AdamW, "
        f"batch {args.batch_size}, {torch.get_num_threads()} threads"
    )
    first = {}
    for name, step in loops.items():
        start = time.perf_counter()
        step(*batches[0])  # compiles, for the two compilers
        first[name] = time.perf_counter() - start
        print(f"[{name}] first step {first[name]:.1f} s")
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(args.rounds):
        for name, step in loops.items():  # interleaved: the same conditions for all three
            start = time.perf_counter()
            for i in range(args.steps):
                loss = step(*batches[(r * args.steps + i) % len(batches)])
            rates[name].append(args.steps * args.batch_size / (time.perf_counter() - start))
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f}" for n in loops))
    median = {name: statistics.median(v) for name, v in rates.items()}
    print("\n| | sequences/s | vs eager | vs torch.compile | first step (s) |")
    print("|---|---:|---:|---:|---:|")
    for name in loops:
        print(
            f"| {name} | {median[name]:.1f} | {median[name] / median['eager']:.2f}x | "
            f"{median[name] / median['torch.compile']:.2f}x | {first[name]:.1f} |"
        )
    print(f"(last loss {loss.item():.3f}; medians over {args.rounds} interleaved rounds)")


def eager_loop(model: nn.Module) -> Callable:
    model = copy.deepcopy(model)
    opt = adamw(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def compiled_loop(model: nn.Module) -> Callable:
    model = copy.deepcopy(model)
    opt = adamw(model)
    forward, opt_step = torch.compile(model), torch.compile(opt.step)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(forward(x), y)
        loss.backward()
        opt_step()
        return loss.detach()

    return step


def functacc_loop(model: nn.Module) -> Callable:
    model = copy.deepcopy(model)
    return functacc.compile_step(model, lm_loss, adamw(model))


if __name__ == "__main__":
    main()
