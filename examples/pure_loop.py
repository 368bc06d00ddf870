"""A pure, JAX-style training loop: ``state, metrics = train_step(state, batch)``.

The model is a pure function of its parameters (``functacc.functionalize``), gradients
come from ``torch.func.grad_and_value``, the update from ``functacc.optim`` (optax-style
``init``/``update``). ``functacc.jit(train_step, donate=(0,))`` compiles the whole step and
lets the new state reuse the old state's memory, as JAX's ``donate_argnums``: the state
passed in may not be read after the call.

    python examples/pure_loop.py                  # Inductor, 200 steps
    python examples/pure_loop.py --backend eager  # the traced graph run op by op
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import functacc


def build(seed: int = 0) -> tuple:
    """The pure model, the optimizer and the initial state (a dict of tensors)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
    model.append(nn.Linear(256, 10))
    apply_fn, params, buffers = functacc.functionalize(model)
    opt = functacc.optim.adamw(lr=3e-3, weight_decay=1e-2)
    params = {n: p.clone() for n, p in params.items()}  # the state owns its tensors
    state = {"params": params, "buffers": dict(buffers), "opt": opt.init(params)}
    return apply_fn, opt, state


def make_step(apply_fn, opt):
    """A pure step: a new state and the metrics; nothing is mutated."""

    def train_step(state: dict, batch: tuple) -> tuple[dict, dict]:
        x, y = batch

        def loss_fn(params: dict) -> tuple[torch.Tensor, dict]:
            logits, buffers = apply_fn(params, state["buffers"], x)
            return F.cross_entropy(logits, y), buffers

        grads, (loss, buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = functacc.optim.apply_updates(state["params"], updates)
        accuracy = (apply_fn(params, buffers, x)[0].argmax(-1) == y).float().mean()
        return {"params": params, "buffers": buffers, "opt": opt_state}, {
            "loss": loss,
            "accuracy": accuracy,
        }

    return train_step


def batches(steps: int, batch: int = 64, seed: int = 1) -> list:
    """A learnable synthetic task: labels from a fixed random linear map."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=g)
    x = torch.randn(steps, batch, 32, generator=g)
    return list(zip(x, (x @ teacher).argmax(-1), strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()
    apply_fn, opt, state = build()
    train_step = make_step(apply_fn, opt)
    step = functacc.jit(train_step, donate=(0,), backend=args.backend)
    data = batches(args.steps)
    eager_state = build()[2]  # the same start, for the eager run
    times = {}
    for name, fn in (("functacc.jit", step), ("eager", train_step)):
        s = state if name == "functacc.jit" else eager_state
        s, metrics = fn(s, data[0])  # functacc traces and compiles here
        start = time.perf_counter()
        for batch in data[1:]:
            s, metrics = fn(s, batch)
        times[name] = time.perf_counter() - start
        print(f"[{name}] loss {metrics['loss'].item():.4f}, accuracy {metrics['accuracy']:.3f}")
    print(
        f"{args.steps - 1} steps: eager {times['eager']:.2f} s, functacc.jit "
        f"{times['functacc.jit']:.2f} s ({times['eager'] / times['functacc.jit']:.2f}x), "
        f"{step.num_traces} trace"
    )


if __name__ == "__main__":
    main()
