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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from _race import arguments, race
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
    args = arguments(__doc__, steps=200)
    apply_fn, opt, state = build()
    train_step = make_step(apply_fn, opt)
    step = functacc.jit(train_step, donate=(0,), backend=args.backend)
    states = {"functacc.jit": state, "eager": build()[2]}  # the same start for both

    def advance(name: str, fn: Callable) -> Callable:
        def one(batch: tuple) -> dict:
            states[name], metrics = fn(states[name], batch)
            return metrics

        return one

    race(
        {"functacc.jit": advance("functacc.jit", step), "eager": advance("eager", train_step)},
        batches(args.steps),
        lambda m: f"loss {m['loss'].item():.4f}, accuracy {m['accuracy']:.3f}",
        step,
    )


if __name__ == "__main__":
    main()
