"""The benchmark workloads: a model, synthetic data, a loss and an optimizer."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torchvision
from torch import Tensor, nn

__all__ = ["WORKLOADS", "NextTokenLoss", "Workload", "build", "gpt2"]


@dataclass
class Workload:
    """Everything a competitor needs to train; ``make_opt`` builds a fresh optimizer."""

    name: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor
    loss_fn: nn.Module
    make_opt: Callable[[nn.Module], torch.optim.Optimizer]
    description: str
    amp: torch.dtype | None = None
    """Mixed precision for every competitor: autocast compute, float32 weights."""
    batches: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """The batches a competitor's steps cycle through, ``(inputs, targets)`` first (see
    :data:`POOL`); left empty, that one batch."""

    def __post_init__(self) -> None:
        self.batches = self.batches or [(self.inputs, self.targets)]

    def cycle(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches in order, round and round: every competitor trains on the same
        sequence."""
        return itertools.cycle(self.batches)


class MLP(nn.Sequential):
    """8 x (Linear(256, 256) + ReLU) and a classifier: small matmuls, optimizer-heavy."""

    def __init__(self, width: int = 256, depth: int = 8, classes: int = 10):
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers, nn.Linear(width, classes))


class TokenClassifier(nn.Module):
    """A 4-layer pre-norm TransformerEncoder over token embeddings, mean-pooled."""

    def __init__(self, vocab: int = 1000, dim: int = 256, layers: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(
            dim,
            nhead=4,
            dim_feedforward=4 * dim,
            dropout=0.1,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class NextTokenLoss(nn.Module):
    """Cross-entropy of a causal language model's logits (``outputs.logits``) against the
    next token of ``targets`` (the input ids)."""

    def forward(self, outputs, targets: Tensor) -> Tensor:
        logits = outputs.logits[:, :-1]
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten())


def gpt2(layers: int = 4, dim: int = 256, vocab: int = 1000, positions: int = 128) -> nn.Module:
    """A Hugging Face GPT-2 language model from a small config, random weights."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:  # a dev/bench dependency, not a runtime one
        raise SystemExit(
            "--model gpt2 needs Hugging Face transformers: pip install transformers"
        ) from exc
    config = GPT2Config(
        n_layer=layers,
        n_embd=dim,
        n_head=max(1, dim // 64),
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# Every competitor steps through up to POOL different random batches (at most POOL_BYTES of
# them). Trained on one fixed batch, the MLP memorised it within 100 steps (loss 1e-6):
# softmax's gradients then underflow to denormal floats, which make the backward matmuls
# up to 130x slower on x86, and the bench timed that instead of training (eager 2.56 ->
# 3.01 ms per step: benchmarks/experiments/denormals.py). With 64 batches of random labels the loss
# stays near ln(10) for the bench's few hundred steps. (Past about 600 steps, Adam's moments of
# parameters whose gradient is exactly zero, such as dead ReLU units, decay into denormals too; the
# bench runs fewer steps.)
POOL = 64
POOL_BYTES = 64 * 2**20

DEFAULTS = {
    "mlp": {"batch_size": 32},
    "resnet18": {"batch_size": 32, "image_size": 32},
    "resnet50": {"batch_size": 16, "image_size": 32},
    "transformer": {"batch_size": 16, "seq_len": 64},
    "gpt2": {"batch_size": 8, "seq_len": 64},
    # GPT-2 small (124M parameters: 12 layers x 768, the 50257-token vocabulary).
    "gpt2-small": {"batch_size": 8, "seq_len": 512},
}
WORKLOADS = tuple(DEFAULTS)


def build(
    name: str,
    *,
    batch_size: int | None = None,
    image_size: int | None = None,
    seq_len: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    amp: torch.dtype | None = None,
) -> Workload:
    """Build workload ``name`` with its defaults, overridden by the given sizes; ``amp``
    runs every competitor in that mixed precision."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(WORKLOADS)}")
    sizes = {**DEFAULTS[name]}
    for key, value in (
        ("batch_size", batch_size),
        ("image_size", image_size),
        ("seq_len", seq_len),
    ):
        if value is not None:
            sizes[key] = value
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    b = sizes["batch_size"]
    ce = nn.CrossEntropyLoss()
    if name == "mlp":
        model, opt = MLP(), _adamw
        inputs = torch.randn(b, 256, generator=g)
        desc = f"MLP 8x Linear(256,256)+ReLU, batch {b}, AdamW"
    elif name in ("resnet18", "resnet50"):
        model = getattr(torchvision.models, name)(num_classes=10)
        opt = _sgd
        s = sizes["image_size"]
        inputs = torch.randn(b, 3, s, s, generator=g)
        desc = f"torchvision {name}, {s}x{s} images, batch {b}, SGD momentum"
    elif name in ("gpt2", "gpt2-small"):
        n = sizes["seq_len"]
        if name == "gpt2":
            model, vocab = gpt2(), 1000
            desc = f"HF GPT-2 4 layers x 256, seq {n}, batch {b}, AdamW"
        else:
            model, vocab = gpt2(layers=12, dim=768, vocab=50257, positions=max(1024, n)), 50257
            desc = f"HF GPT-2 small (12 layers x 768), seq {n}, batch {b}, AdamW"
        inputs = torch.randint(0, vocab, (b, n), generator=g)
        desc += f", {_AMP_NAMES[amp]}" if amp is not None else ""
        batches = [inputs.to(device)]
        for _ in range(_pool_size(inputs) - 1):
            batches.append(torch.randint(0, vocab, (b, n), generator=g).to(device))
        pairs = [(t, t) for t in batches]  # next-token loss: the tokens are the targets
        return Workload(
            name, model.to(device), *pairs[0], NextTokenLoss(), _adamw, desc, amp, pairs
        )
    else:
        model, opt = TokenClassifier(), _adamw
        inputs = torch.randint(0, 1000, (b, sizes["seq_len"]), generator=g)
        desc = f"4-layer Transformer d=256, seq {sizes['seq_len']}, batch {b}, AdamW"
    targets = torch.randint(0, 10, (b,), generator=g)
    desc += f", {_AMP_NAMES[amp]}" if amp is not None else ""
    batches = [(inputs.to(device), targets.to(device))]
    for _ in range(_pool_size(inputs, targets) - 1):
        if inputs.is_floating_point():
            x = torch.randn(inputs.shape, generator=g)
        else:
            x = torch.randint(0, 1000, inputs.shape, generator=g)
        batches.append((x.to(device), torch.randint(0, 10, (b,), generator=g).to(device)))
    return Workload(name, model.to(device), *batches[0], ce, opt, desc, amp, batches)


def _pool_size(*tensors: Tensor) -> int:
    size = sum(t.numel() * t.element_size() for t in tensors)
    return max(1, min(POOL, POOL_BYTES // max(size, 1)))


_AMP_NAMES = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast"}
