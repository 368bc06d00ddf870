"""Activation rematerialisation: the same step, bit for bit, with less memory."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import assert_close
from torch import nn

import functacc
from functacc.bench.memory import peak_memory
from functacc.transforms.remat import POLICIES, RECOMPUTE
from functacc.transforms.remat_passes import _MATMULS, order_recomputation


class Block(nn.Module):
    """A residual MLP block with 4x-wide activations and dropout."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(x))))


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(128) for _ in range(8)], nn.Linear(128, 10))


class TokenModel(nn.Module):
    """Pre-norm nn.TransformerEncoderLayers (attention, GELU, dropout), mean-pooled."""

    def __init__(self, dim: int = 64, layers: int = 3, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(100, dim)
        layer = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def run(remat, steps: int = 3, backend: str = "eager", policy: str = "full", model=None, sgd=False):
    torch.manual_seed(0)
    model = deep_mlp() if model is None else model()
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend=backend, remat=remat, remat_policy=policy
    )
    g = torch.Generator().manual_seed(0)
    if isinstance(model, TokenModel):
        x = torch.randint(0, 100, (16, 32), generator=g)
    else:
        x = torch.randn(512, 128, generator=g)
    y = torch.randint(0, 10, (x.shape[0],), generator=g)
    losses = []
    for i in range(steps):
        torch.manual_seed(i)
        losses.append(step(x, y))
    torch.manual_seed(steps)
    peak = peak_memory(lambda: step(x, y))
    return model, losses, peak, step


def test_remat_same_result_and_less_memory() -> None:
    model, losses, peak, _ = run(None)
    results = {policy: run({"Block"}, policy=policy) for policy in POLICIES}
    for policy, (remat_model, remat_losses, _, _) in results.items():
        # Recomputation replays dropout's draws and saving a matmul keeps the very value
        # it would recompute, so the step is identical, bit for bit.
        assert_close(remat_losses, losses, rtol=0, atol=0, what=f"{policy} losses")
        assert_close(
            remat_model.state_dict(), model.state_dict(), rtol=0, atol=0, what=f"{policy} params"
        )
    full, saved = results["full"][2], results["save_matmuls"][2]
    assert full <= 0.7 * peak, f"{full / 2**20:.1f} MiB vs {peak / 2**20:.1f} MiB"
    # save_matmuls keeps each block's two matmul results: between the two.
    assert full < saved <= 0.8 * peak, [x / 2**20 for x in (full, saved, peak)]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_remat_of_attention_layers_is_exact(dropout) -> None:
    # Without dropout, attention runs as one fused op that returns several tensors and is
    # tagged as random (it takes a dropout probability): the replay records all of them.
    make = functools.partial(TokenModel, dropout=dropout, dim=32, layers=2)
    model, losses, _, _ = run(None, model=make)
    for policy in POLICIES:
        remat_model, remat_losses, _, _ = run(
            {"TransformerEncoderLayer"}, model=make, policy=policy
        )
        assert_close(remat_losses, losses, rtol=0, atol=0, what=f"{policy} losses")
        assert_close(
            remat_model.state_dict(), model.state_dict(), rtol=0, atol=0, what=f"{policy} params"
        )


@pytest.mark.parametrize("policy", POLICIES)
def test_remat_with_frozen_and_unused_parameters_is_exact(policy) -> None:
    # Eager's edges inside recomputed blocks: a frozen layer (no gradient, not updated) and
    # a block whose output never reaches the loss (its parameters get no gradient at all).
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(32), Block(32))
            self.unused = Block(32)
            self.head = nn.Linear(32, 5)

        def forward(self, x):
            self.unused(x)  # computed, but nothing of it reaches the loss
            return self.head(self.blocks(x))

    def train(remat):
        torch.manual_seed(0)
        model = Partly()
        model.blocks[0].up.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            opt,
            backend="eager",
            remat=remat,
            remat_policy=policy if remat else "full",
        )
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
        for i in range(3):
            torch.manual_seed(i)
            step(x, y)
        return model, opt

    model, opt = train(None)
    remat_model, remat_opt = train({"Block"})
    assert_close(remat_model.state_dict(), model.state_dict(), rtol=0, atol=0, what="params")
    assert_close(remat_opt.state_dict(), opt.state_dict(), rtol=0, atol=0, what="optimizer")
    frozen, unused = remat_model.blocks[0].up.weight, remat_model.unused.up.weight
    assert frozen not in remat_opt.state and unused not in remat_opt.state  # as torch.optim


def test_remat_policy_without_remat_warns() -> None:
    model = deep_mlp()
    with pytest.warns(UserWarning, match=r"remat_policy='save_matmuls' has no effect"):
        functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            remat_policy="save_matmuls",
        )


def test_save_matmuls_recomputes_no_matmul() -> None:
    def recomputed_matmuls(policy: str) -> int:
        step = run({"Block"}, steps=1, policy=policy)[3]
        (gm,) = step.graphs  # one step, one graph
        graph = gm.graph
        return sum(1 for n in graph.nodes if RECOMPUTE in n.meta and n.target in _MATMULS)

    assert recomputed_matmuls("full") == 16  # up and down, in each of the 8 blocks
    assert recomputed_matmuls("save_matmuls") == 0


def test_selective_recomputes_only_attention_matmuls() -> None:
    # The two matmuls of activations per layer (q @ k^T, scores @ v; bmm with dropout on)
    # are recomputed, every matmul with a weight is kept; memory between the two policies.
    make = functools.partial(TokenModel, dropout=0.1, dim=32, layers=2)
    recomputed, peaks = {}, {}
    for policy in POLICIES:
        _, _, peaks[policy], step = run(
            {"TransformerEncoderLayer"}, steps=1, policy=policy, model=make
        )
        (gm,) = step.graphs  # one step, one graph
        graph = gm.graph
        recomputed[policy] = sorted(
            str(n.target) for n in graph.nodes if RECOMPUTE in n.meta and n.target in _MATMULS
        )
    assert recomputed["selective"] == ["aten.bmm.default"] * 4
    assert recomputed["save_matmuls"] == []
    assert peaks["full"] < peaks["selective"] < peaks["save_matmuls"], peaks


def test_recomputation_fences_keep_the_bits_and_vector_code() -> None:
    # Under Inductor a recomputation reads forward values through a fence that ties it to
    # backward. `where(ready, v, v)` on a uint8 dropout mask compiled into a loop that built
    # a byte mask one element at a time (7x slower than reading the mask; the selective
    # policy ran at 0.80x instead of 0.95x the stored-activation step); integer values are
    # fenced with `v | 0` instead. The fenced graph must compute the same bits.
    make = functools.partial(TokenModel, dropout=0.1, dim=32, layers=2)
    step = run({"TransformerEncoderLayer"}, steps=1, policy="selective", model=make)[3]
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 100, (16, 32), generator=g), torch.randint(0, 10, (16,), generator=g)]
    # The program of this batch and the tensors it reads (the step's state, then the batch).
    body = step._jitted._engine
    program, state, _, tensors = body.program(tuple(batch), {})
    flat = [*state, *body.python.inputs(program.python), *tensors]
    graph = program.graph  # the eager backend's graph: not fenced
    fenced = copy.deepcopy(graph)
    assert order_recomputation(fenced) > 0
    wheres = [
        n.args[1].meta["val"].dtype
        for n in fenced.graph.nodes
        if n.target is torch.ops.aten.where.self and n.args[1] is n.args[2]
    ]
    ors = [
        n.args[0].meta["val"].dtype
        for n in fenced.graph.nodes
        if n.target is torch.ops.aten.bitwise_or.Tensor
    ]
    assert wheres and all(d.is_floating_point for d in wheres), wheres
    assert ors and set(ors) == {torch.uint8}, ors  # the recorded dropout masks

    results = []
    for gm in (graph, fenced):
        inputs = [flat[i].detach().clone() for i in program.used]
        torch.manual_seed(5)
        with torch.no_grad():
            results.append((gm(*inputs), inputs))  # the step updates its state in place
    assert_close(results[1], results[0], rtol=0, atol=0, what="fenced graph")


def test_unknown_remat_policy() -> None:
    model = deep_mlp()
    with pytest.raises(
        ValueError, match=r"remat_policy must be one of .*'selective'.*'everything'"
    ):
        functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            remat={"Block"},
            remat_policy="everything",
        )


def test_recomputation_reads_the_step_parameters_not_the_module() -> None:
    # Backward runs after functional_call has swapped the module's own parameters back in;
    # a recomputation that read them computed gradients at the module's weights, not at
    # the state given to the step (and Inductor baked those weights in at the first step).
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), nn.Linear(16, 4))
    model[0].drop.p = 0.0
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    losses_and_grads = []
    for remat in (None, {"Block"}):
        step = functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=1.0),
            backend="eager",
            remat=remat,
        )
        state = step.init_state()
        state.params.update({n: p * 2 for n, p in state.params.items()})  # not the module's
        new, loss = step.apply(state, x, y)
        losses_and_grads.append((loss, {n: state.params[n] - new.params[n] for n in new.params}))
    assert_close(losses_and_grads[1], losses_and_grads[0], rtol=0, atol=0, what="remat")


@pytest.mark.inductor
@pytest.mark.parametrize(
    ("policy", "limit"), [("full", 0.8), ("save_matmuls", 0.9), ("selective", 0.9)]
)
def test_remat_under_inductor_matches_and_lowers_memory(policy, limit) -> None:
    # Inductor sees the recomputation as forward ops reading forward buffers; unfenced, it
    # fused the recomputed attention with the forward's and kept it alive into backward
    # (measured on this model, full: 0.89x the stored-activation peak; fenced 0.62x;
    # save_matmuls keeps the matmul results: 0.83x). The
    # reference is the stored-activation step on the eager backend (one Inductor compile).
    # No dropout: the two graphs are scheduled differently, and Inductor may then draw the
    # masks of two dropout layers in the other order (fresh masks either way, other bits).
    layer = {"TransformerEncoderLayer"}
    no_dropout = functools.partial(TokenModel, dropout=0.0, dim=32, layers=2)
    # SGD: attention's key bias has a zero gradient up to rounding, which Adam divides by
    # its own tiny second moment: that noise then moves it by up to the learning rate, and
    # any reordering of the arithmetic shows (seen: 1e-6 apart in a fresh clone).
    model, losses, peak, _ = run(None, model=no_dropout, sgd=True)
    remat_model, remat_losses, remat_peak, _ = run(
        layer, backend="inductor", model=no_dropout, sgd=True, policy=policy
    )
    # The same arithmetic in other kernels: float32 rounding, over 3 SGD steps.
    assert_close(remat_losses, losses, rtol=1e-5, atol=1e-6, what="losses")
    assert_close(remat_model.state_dict(), model.state_dict(), rtol=1e-4, atol=1e-6, what="params")
    assert remat_peak <= limit * peak, f"{remat_peak / 2**20:.1f} MiB vs {peak / 2**20:.1f} MiB"


def test_remat_unknown_class() -> None:
    model = deep_mlp()
    with pytest.raises(ValueError, match=r"remat names \['Bottleneck'\].*Block, Dropout"):
        functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            remat={"Bottleneck"},
        )
