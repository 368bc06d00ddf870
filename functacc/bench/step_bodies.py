"""Benchmark workloads that are whole step bodies (``--model wgan-gp``, ``distill``,
``lstm-lm``): eager, ``torch.compile`` of the step function, and ``functacc.jit``, from the
same start.

``torch.compile(train_step)`` compiles what Dynamo can of the body, the optimizers' steps
included (its recommended way to compile an optimizer), and falls back to eager around
what it cannot (graph breaks). ``functacc.jit`` traces the whole body into one graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["STEP_WORKLOADS", "StepWorkload", "build_step_workload", "make_step_competitor"]


@dataclass
class StepWorkload:
    """A step body over modules and optimizers; ``build()`` makes them afresh (same seed)."""

    name: str
    description: str
    build: Callable[[], tuple[list[nn.Module], list[torch.optim.Optimizer]]]
    make_step: Callable[..., Callable[..., Any]]
    batches: list[tuple[Tensor, ...]]
    # State the loop carries from step to step (an RNN's hidden state): its start, made
    # from the modules; the step then takes it last and returns (loss, new state).
    carry: Callable[[list[nn.Module]], Any] | None = None
    samples: int | None = None  # samples per step, where not the first input's first size


def _mlp(sizes: list[int], act: Callable[[], nn.Module], norm: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes[:-1]):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if norm else []), act()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1]))


def _wgan_gp(batch: int, device: str) -> StepWorkload:
    noise, data, width = 64, 32, 256

    def build() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        gen = _mlp([noise, width, width, width, data], nn.ReLU).to(device)
        critic = _mlp([data, width, width, width, 1], lambda: nn.LeakyReLU(0.2)).to(device)
        adam = dict(lr=1e-4, betas=(0.5, 0.9))
        return [gen, critic], [
            torch.optim.Adam(gen.parameters(), **adam),
            torch.optim.Adam(critic.parameters(), **adam),
        ]

    def make_step(gen: nn.Module, critic: nn.Module, opt_g: Any, opt_c: Any) -> Callable:
        def train_step(real: Tensor, z: Tensor) -> Tensor:
            opt_c.zero_grad()
            fake = gen(z).detach()
            alpha = torch.rand(real.shape[0], 1, device=real.device)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            loss_c = critic(fake).mean() - critic(real).mean() + 10.0 * gp
            loss_c.backward()
            opt_c.step()
            opt_g.zero_grad()
            for p in critic.parameters():
                p.requires_grad_(False)
            (-critic(gen(z)).mean()).backward()
            for p in critic.parameters():
                p.requires_grad_(True)
            opt_g.step()
            return loss_c.detach()

        return train_step

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, data, generator=g).to(device), torch.randn(batch, noise, generator=g))
        for _ in range(4)
    ]
    batches = [(r, z.to(device)) for r, z in batches]
    return StepWorkload(
        "wgan-gp",
        f"WGAN-GP, generator and critic 3x{width} MLPs, batch {batch}, {device}: critic step "
        "with gradient penalty (double backward) + generator step, Adam x2",
        build,
        make_step,
        batches,
    )


def _distill(batch: int, device: str) -> StepWorkload:
    features, classes = 256, 100

    def build() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        teacher = _mlp([features, 1024, 1024, 1024, classes], nn.ReLU, norm=True)
        teacher = teacher.to(device).eval().requires_grad_(False)
        student = _mlp([features, 256, 256, classes], nn.ReLU, norm=True).to(device)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.01)
        return [student, teacher], [opt]

    def make_step(student: nn.Module, teacher: nn.Module, opt: Any) -> Callable:
        def train_step(x: Tensor, y: Tensor) -> Tensor:
            opt.zero_grad()
            with torch.no_grad():
                soft = F.softmax(teacher(x) / 4.0, dim=-1)
            logits = student(x)
            kd = F.kl_div(F.log_softmax(logits / 4.0, dim=-1), soft, reduction="batchmean")
            loss = 0.9 * 16.0 * kd + 0.1 * F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            return loss.detach()

        return train_step

    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(batch, features, generator=g).to(device),
            torch.randint(0, classes, (batch,), generator=g).to(device),
        )
        for _ in range(4)
    ]
    return StepWorkload(
        "distill",
        f"distillation, teacher 3x1024 MLP+BN (eval, no_grad), student 2x256 MLP+BN, batch "
        f"{batch}, {device}, AdamW",
        build,
        make_step,
        batches,
    )


class _WordLM(nn.Module):
    """pytorch/examples word_language_model's RNNModel (LSTM, tied decoder weights)."""

    def __init__(self, vocab: int, dim: int, layers: int, dropout: float):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, dropout=dropout)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.encoder.weight
        self.vocab, self.layers, self.dim = vocab, layers, dim

    def forward(self, tokens: Tensor, hidden: tuple[Tensor, Tensor]) -> tuple[Tensor, Any]:
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.vocab)
        return F.log_softmax(decoded, dim=1), hidden


def _lstm_lm(batch: int, device: str) -> StepWorkload:
    vocab, dim, layers, bptt, lr, clip = 10000, 200, 2, 35, 20.0, 0.25

    def build() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        return [_WordLM(vocab, dim, layers, dropout=0.2).to(device)], []

    def make_step(model: nn.Module) -> Callable:
        def train_step(data: Tensor, targets: Tensor, hidden: tuple[Tensor, Tensor]) -> tuple:
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = F.nll_loss(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            return loss.detach(), hidden

        return train_step

    def carry(modules: list[nn.Module]) -> tuple[Tensor, Tensor]:
        zeros = torch.zeros(layers, batch, dim, device=device)
        return zeros, zeros.clone()

    g = torch.Generator().manual_seed(1)
    source = torch.randint(0, vocab, (4 * bptt + 1, batch), generator=g).to(device)
    batches = [
        (source[i : i + bptt], source[i + 1 : i + 1 + bptt].reshape(-1))
        for i in range(0, 4 * bptt, bptt)
    ]
    return StepWorkload(
        "lstm-lm",
        f"word-level LSTM language model (pytorch/examples word_language_model: 2x{dim} LSTM, "
        f"dropout 0.2, tied {vocab}-word decoder, bptt {bptt}, batch {batch}), {device}: "
        "clip_grad_norm_ and a manual SGD update in the step, hidden state carried",
        build,
        make_step,
        batches,
        carry,
        samples=batch,
    )


STEP_WORKLOADS = {
    "wgan-gp": (_wgan_gp, 256),
    "distill": (_distill, 128),
    "lstm-lm": (_lstm_lm, 20),
}


def build_step_workload(name: str, *, batch_size: int | None, device: str) -> StepWorkload:
    factory, default_batch = STEP_WORKLOADS[name]
    return factory(batch_size or default_batch, device)


class StepCompetitor:
    """One way to run a step body: ``wrap(body, modules, optimizers)`` is what is timed."""

    def __init__(self, name: str, w: StepWorkload, wrap: Callable[..., Callable]):
        self.name = name
        modules, optimizers = w.build()
        self.jitted = wrap(w.make_step(*modules, *optimizers), modules, optimizers)
        self.batches = itertools.cycle(w.batches)
        self.carried = w.carry(modules) if w.carry is not None else None

    def step(self) -> Tensor:
        if self.carried is None:
            return self.jitted(*next(self.batches))
        loss, carried = self.jitted(*next(self.batches), self.carried)
        # repackage_hidden: the next step starts from the values, not through this graph
        self.carried = tuple(t.detach() for t in carried)
        return loss

    def compile_times(self) -> list[tuple[float, float]]:
        traces = getattr(self.jitted, "traces", None)
        return [(r.trace_s, r.compile_s) for r in traces] if traces is not None else []


def make_step_competitor(name: str, w: StepWorkload) -> StepCompetitor:
    from ..frontends.jit import jit

    wraps: dict[str, Callable[..., Callable]] = {
        "eager": lambda body, m, o: body,
        "torch.compile": lambda body, m, o: torch.compile(body),
        "functacc": lambda body, m, o: jit(body, modules=m, optimizers=o),
    }
    if name not in wraps:
        raise ValueError(f"--model {w.name} compares {', '.join(wraps)}; got competitor {name!r}")
    return StepCompetitor("functacc.jit" if name == "functacc" else name, w, wraps[name])
