"""Small models for the parity tests; each is sized to train in milliseconds on a CPU."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


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


# -- recurrent models (tests/test_recurrent.py) ----------------------------------------------
class WordLM(nn.Module):
    """pytorch/examples word_language_model's RNNModel: embedding, a 2-layer LSTM with
    dropout, a decoder tied to the embedding, log-softmax over the vocabulary."""

    VOCAB = 50

    def __init__(self, dim: int = 16, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(self.VOCAB, dim)
        self.rnn = nn.LSTM(dim, dim, layers, dropout=dropout)
        self.decoder = nn.Linear(dim, self.VOCAB)
        self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.layers, self.dim = layers, dim

    def forward(self, tokens: torch.Tensor, hidden: tuple) -> tuple[torch.Tensor, tuple]:
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.VOCAB)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.layers, batch, self.dim),
            weight.new_zeros(self.layers, batch, self.dim),
        )


class CarriedLM(nn.Module):
    """WordLM with its hidden state carried between calls in buffers, detached (truncated
    backpropagation through time for a step that returns only the loss)."""

    def __init__(self, batch: int):
        super().__init__()
        self.lm = WordLM()
        h, c = self.lm.init_hidden(batch)
        self.register_buffer("h", h)
        self.register_buffer("c", c)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Copies in: backward reads the initial state, which the copy_ below overwrites.
        output, (h, c) = self.lm(tokens, (self.h.clone(), self.c.clone()))
        self.h.copy_(h.detach())
        self.c.copy_(c.detach())
        return output


class PackedClassifier(nn.Module):
    """Token sequences of different lengths, packed (unsorted), through a 2-layer
    bidirectional recurrent layer with dropout; the mean of the padded-back outputs is
    classified."""

    def __init__(self, rnn: type = nn.GRU):
        super().__init__()
        self.embed = nn.Embedding(30, 8, padding_idx=0)
        self.rnn = rnn(8, 12, num_layers=2, batch_first=True, dropout=0.1, bidirectional=True)
        self.head = nn.Linear(24, 3)

    def forward(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        packed = pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = self.rnn(packed)
        padded, counts = pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / counts[:, None].to(padded.dtype))


class BiLSTMTagger(nn.Module):
    """A sequence tagger: embedding, a 2-layer bidirectional LSTM (batch first, dropout
    between layers), a score per tag for every token."""

    def __init__(self, vocab: int = 40, tags: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, 12)
        self.lstm = nn.LSTM(12, 16, 2, batch_first=True, dropout=0.25, bidirectional=True)
        self.tags = nn.Linear(32, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tags(self.lstm(self.embed(tokens))[0])


class CellTagger(nn.Module):
    """The same tagger from cells unrolled over time: an LSTMCell, a GRUCell on its output
    and an RNNCell on that, each with its state carried from step to step."""

    def __init__(self, vocab: int = 40, tags: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, 12)
        self.lstm = nn.LSTMCell(12, 16)
        self.gru = nn.GRUCell(16, 16)
        self.rnn = nn.RNNCell(16, 16, nonlinearity="relu")
        self.tags = nn.Linear(16, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, state, g, r, out = self.embed(tokens), None, None, None, []
        for t in range(x.shape[1]):
            state = self.lstm(x[:, t], state)
            g = self.gru(state[0], g)
            r = self.rnn(g, r)
            out.append(r)
        return self.tags(torch.stack(out, 1))


def rnnt_heads() -> nn.ModuleDict:
    """Hugging Face's Parakeet RNN-T prediction network (embedding, 2-layer LSTM, projection)
    and joint network, from a tiny config (random weights, no download)."""
    from transformers import ParakeetRNNTConfig
    from transformers.models.parakeet.modeling_parakeet import (
        ParakeetRNNTDecoder,
        ParakeetRNNTJointNetwork,
    )

    config = ParakeetRNNTConfig(
        vocab_size=20, decoder_hidden_size=16, num_decoder_layers=2, blank_token_id=0
    )
    return nn.ModuleDict(
        {"decoder": ParakeetRNNTDecoder(config), "joint": ParakeetRNNTJointNetwork(config)}
    )
