"""Small models for the parity tests; each is sized to train in milliseconds on a CPU."""

from __future__ import annotations

import torch
import torchvision
from torch import nn


def mlp(in_features: int = 16, classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, classes)
    )


def cnn_bn(classes: int = 5) -> nn.Module:
    # Convolutions before BatchNorm have no bias, as in real CNNs: a bias there gets a
    # gradient that is zero up to rounding, which Adam then amplifies into noise.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(16, classes),
    )


class DropoutKinds(nn.Module):
    """Every CPU dropout flavour eager runs through ``bernoulli_`` on a fresh buffer: channel
    dropout on a channels-last feature map, in-place dropout, alpha and feature-alpha
    dropout, and a dropout on a transposed (non-contiguous) tensor."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.25)
        self.feature_alpha = nn.FeatureAlphaDropout(0.2)
        self.proj = nn.Linear(8, 16)
        self.inplace = nn.Dropout(0.3, inplace=True)
        self.alpha = nn.AlphaDropout(0.2)
        self.transposed = nn.Dropout(0.1)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).contiguous(memory_format=torch.channels_last)
        h = self.feature_alpha(self.drop2d(torch.relu(h)))
        h = h.flatten(2).transpose(1, 2)  # (batch, positions, channels), non-contiguous
        h = self.alpha(torch.selu(self.inplace(self.proj(h))))
        h = self.transposed(h.transpose(1, 2)).mean(dim=2)  # strided again
        return self.head(h)


class SeluTransposed(nn.Module):
    """Tokens through Linear and SELU, then averaged over the transposed sequence axis.
    SELU's backward of a transposed gradient is contiguous in PyTorch's meta kernel and
    transposed when it runs: the trace's ``view`` of it cannot run as traced."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.proj = nn.Linear(4, 24)
        self.head = nn.Linear(24, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.selu(self.proj(x.unflatten(1, (4, 4)).transpose(1, 2)))
        return self.head(h.transpose(1, 2).mean(dim=2))


def resnet18(classes: int = 10) -> nn.Module:
    return torchvision.models.resnet18(num_classes=classes)


class TinyTransformer(nn.Module):
    """Token classifier: embedding, a 2-layer TransformerEncoder (LayerNorm, GELU, dropout)."""

    def __init__(
        self, vocab: int = 50, dim: int = 32, classes: int = 5, dropout: float = 0.1, bias=True
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim,
            nhead=4,
            dim_feedforward=64,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            bias=bias,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.encoder(h).mean(dim=1))


class LossInside(nn.Module):
    """Hugging Face style: forward(input_ids=..., labels=...) returns {'loss', 'logits'}."""

    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.norm(self.embed(input_ids).mean(dim=1)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class TupleOut(nn.Module):
    """Returns (logits, features); the loss uses both."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.tanh(self.body(x))
        return self.head(feats), feats


class Tied(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, vocab: int = 20, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(self.embed(tokens).mean(dim=1))))


class WithBuffers(nn.Module):
    """A buffer the forward reads but never writes, and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("offset", torch.zeros(5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale) + self.offset


def gpt2(dropout: float = 0.1, layers: int = 2, dim: int = 32, vocab: int = 64) -> nn.Module:
    """A small Hugging Face GPT-2 (random weights, no download); `wte` tied to `lm_head`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=dim,
        n_head=4,
        vocab_size=vocab,
        n_positions=128,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert(dropout: float = 0.1, layers: int = 2, dim: int = 32, vocab: int = 64) -> nn.Module:
    """A small Hugging Face BERT for masked language modelling (random weights)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=dim,
        num_attention_heads=4,
        intermediate_size=2 * dim,
        vocab_size=vocab,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
    )
    return BertForMaskedLM(config)


def padded_text_batch(
    lengths: list[int], vocab: int = 64, *, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A batch as DataCollatorWithPadding makes it: right-padded to its longest sequence,
    with an attention mask, and labels that ignore the padding (-100)."""
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
