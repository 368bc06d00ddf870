"""``functacc.jit(..., parallel=ZeRO(3))`` on one process, against the same body run eagerly.

On one process ZeRO-3 runs the same program as on several ranks without the collectives:
the optimizers' parameters live as chunks between calls (the modules hold empty
placeholders), are gathered whole inside the step, and the update writes the chunks. So on
the eager backend every step must equal eager PyTorch bit for bit: parameters, optimizer
state, the EMA copy and a GradScaler's skipped step included. Two ranks against one process
on the full batch: tests/dist/jit_worker.py (tests/test_jit.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, run_torchrun_worker
from test_jit_amp import batches as amp_batches
from test_jit_amp import build as amp_build
from torch import nn

import functacc

EXACT = {"rtol": 0, "atol": 0}


def ema_objects() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, ema, opt


def ema_body(model: nn.Module, ema: nn.Module, opt: torch.optim.Optimizer):
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # reads .grad whole
        opt.step()
        with torch.no_grad():  # reads the parameters after the update
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.1)
        return torch.stack([loss.detach(), norm])

    return body


def data(n: int = 5) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def zero3_step(body, modules, optimizers, **options):
    return functacc.jit(
        body,
        modules=modules,
        optimizers=optimizers,
        backend="eager",
        parallel=functacc.parallel.ZeRO(3),
        **options,
    )


def test_zero3_equals_eager_bit_for_bit_and_keeps_placeholders_between_calls() -> None:
    model, ema, opt = ema_objects()
    ref_model, ref_ema, ref_opt = ema_objects()
    step = zero3_step(ema_body(model, ema, opt), [model, ema], [opt])
    eager = ema_body(ref_model, ref_ema, ref_opt)
    for x, y in data():
        assert_close(step(x, y), eager(x, y), **EXACT, what="loss and norm")
        # Between calls the optimized model holds placeholders, no .grad (as under ZeRO-2),
        # and the EMA copy, which no optimizer updates, stays whole.
        assert all(p.shape == (0,) and p.grad is None for p in model.parameters())
        assert [p.shape for p in ema.parameters()] == [p.shape for p in ref_ema.parameters()]
    assert opt.state == {}  # sharded into the step: state_dict() shows it whole
    assert_close(opt.state_dict(), ref_opt.state_dict(), **EXACT, what="optimizer")
    step.sync_modules()
    assert_close(model.state_dict(), ref_model.state_dict(), **EXACT, what="model")
    assert_close(ema.state_dict(), ref_ema.state_dict(), **EXACT, what="ema")
    assert step.num_traces == 1


def test_after_sync_modules_the_next_call_trains_what_the_modules_hold() -> None:
    model, ema, opt = ema_objects()
    ref_model, ref_ema, ref_opt = ema_objects()
    step = zero3_step(ema_body(model, ema, opt), [model, ema], [opt])
    eager = ema_body(ref_model, ref_ema, ref_opt)
    (x, y), *rest = data()
    step(x, y), eager(x, y)
    step.sync_modules()
    # Code outside the step changes the whole parameters (a checkpoint loaded, a layer
    # reset): the next call shards them again and trains them, as eager would.
    changed = {k: v * 0.5 for k, v in ref_model.state_dict().items()}
    model.load_state_dict(changed)
    ref_model.load_state_dict(changed)
    for x, y in rest:
        assert_close(step(x, y), eager(x, y), **EXACT, what="loss after the load")
    assert all(p.shape == (0,) for p in model.parameters())
    step.sync_modules()
    step.sync_modules()  # twice: nothing more to gather
    assert_close(model.state_dict(), ref_model.state_dict(), **EXACT, what="model")
    assert step.num_traces == 1


def test_zero3_with_a_grad_scaler_skips_the_overflowing_step_as_eager() -> None:
    # The skipped step writes the parameters back with where(): the chunks are then cut
    # from the whole parameters, not taken from the update.
    model, opt, scaler, body = amp_build("AdamW", torch.bfloat16, clip=True)
    ref_model, ref_opt, ref_scaler, ref_body = amp_build("AdamW", torch.bfloat16, clip=True)
    step = zero3_step(body, [model], [opt])
    for x, y in amp_batches():
        assert_close(step(x, y), ref_body(x, y), **EXACT, what="loss")
        assert scaler.get_scale() == ref_scaler.get_scale()
    step.sync_modules()
    assert_close(model.state_dict(), ref_model.state_dict(), **EXACT, what="model")
    assert_close(opt.state_dict(), ref_opt.state_dict(), **EXACT, what="optimizer")


def test_a_failing_call_keeps_the_chunks_and_the_optimizer_state() -> None:
    model, ema, opt = ema_objects()
    step = zero3_step(ema_body(model, ema, opt), [model, ema], [opt])
    (x, y), *_ = data()
    step(x, y)
    step.sync_modules()
    before = copy.deepcopy((model.state_dict(), ema.state_dict(), opt.state_dict()))
    with pytest.raises(RuntimeError):
        step(x[:, :5], y)  # the wrong width: the trace fails in the first Linear
    step.sync_modules()
    after = (model.state_dict(), ema.state_dict(), opt.state_dict())
    assert_close(after, before, **EXACT, what="state after the failed call")


def test_zero3_refuses_an_optimizer_traced_through_its_own_step() -> None:
    model, ema, _ = ema_objects()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    with pytest.raises(
        ValueError, match=r"ZeRO\(3\) with opt \(RMSprop\).*Use ZeRO\(1\) or ZeRO\(2\)"
    ):
        zero3_step(ema_body(model, ema, opt), [model, ema], [opt])
    assert all(p.shape != (0,) for p in model.parameters())  # nothing was emptied


@pytest.mark.distributed
def test_hybrid_zero3_on_four_ranks_equals_one_process_on_the_full_batch(tmp_path) -> None:
    # ZeRO(3, shard_size=2): chunks over pairs of ranks, the chunk gradients all-reduced
    # across the two pairs (tests/dist/jit_hybrid_worker.py).
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    import jit_worker

    got = run_torchrun_worker("jit_hybrid_worker", tmp_path / "hybrid.pt", nproc=4)
    for name in ("wgan_gp", "distill"):
        objects, make_step = jit_worker.SCENARIOS[name]
        first, second, opt = objects(seed=0)
        opts = opt if isinstance(opt, tuple) else (opt,)
        body = make_step(first, second, opt)
        for x, y in jit_worker.batches(4):
            body(x, y)
        run = got[name]
        # Sums over ranks in another order than over one batch: 4 steps.
        for label, module in (("first", first), ("second", second)):
            assert_close(run[label], module.state_dict(), rtol=1e-5, atol=2e-5, what=label)
        for state_dict, o in zip(run["optimizer"], opts, strict=True):
            assert_close(
                state_dict["state"], o.state_dict()["state"], rtol=1e-5, atol=2e-5, what=name
            )
        assert run["all_reduces"] >= 1, name  # the replicas' all-reduce is in the graph


@pytest.mark.distributed
def test_a_weight_tied_across_zero3_units_equals_data_parallel(tmp_path) -> None:
    # The embedding in a unit of its own shares its weight with the output projection
    # (compile_step's pure step refuses this split; jit gathers the weight once per use and
    # sums its gradients). 2 ranks, AdamW, 4 steps: the same arithmetic as data parallel.
    got = run_torchrun_worker("jit_tied_worker", tmp_path / "tied.pt")
    for name in ("zero3", "zero3_split"):
        assert got[name]["tied"], name
        assert_close(got[name]["model"], got["dp"]["model"], rtol=0, atol=0, what=name)
        optimizer, reference = got[name]["optimizer"], got["dp"]["optimizer"]
        assert_close(optimizer["state"], reference["state"], rtol=0, atol=0, what=name)


# -- the edges: Python state, recurrent layers, varying shapes -----------------------------
PYTHON_CASES = ["closure_scale", "scheduler_in_body", "seed_in_body", "counter", "item_returned"]


@pytest.mark.parametrize("name", PYTHON_CASES)
def test_python_state_under_zero3_matches_eager_bit_for_bit(name: str) -> None:
    # tests/test_jit_python.py's bodies (dropout, SGD with momentum) under ZeRO(3): the
    # returned values, the Python state and the RNG after every call, then the modules and
    # the optimizer's gathered state, bit for bit as eager.
    from test_jit_python import CASES

    jitted, eager = CASES[name](), CASES[name]()
    step = zero3_step(jitted.body, jitted.modules, jitted.optimizers)
    for i, batch in enumerate(jitted.batches):
        jitted.between(i)
        torch.manual_seed(100 + i)
        got = step(*batch)
        rng = torch.get_rng_state()
        eager.between(i)
        torch.manual_seed(100 + i)
        expected = eager.body(*batch)
        assert torch.equal(rng, torch.get_rng_state()), f"call {i}: the RNG advanced differently"
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        got, expected = (torch.utils._pytree.tree_map(detach, v) for v in (got, expected))
        assert_close(got, expected, **EXACT, what=f"call {i}: returned")
        assert jitted.state() == eager.state(), f"call {i}: Python state"
    step.sync_modules()
    for module, ref in zip(jitted.modules, eager.modules, strict=True):
        assert_close(module.state_dict(), ref.state_dict(), **EXACT, what="modules")
    for opt, ref in zip(jitted.optimizers, eager.optimizers, strict=True):
        assert_close(opt.state_dict(), ref.state_dict(), **EXACT, what="optimizer")
    assert step.num_traces == jitted.traces, [t.reason for t in step.traces]


class Tagger(nn.Module):
    """An LSTM over a sequence and a linear head, tied to nothing: a recurrent unit."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def test_an_lstm_over_varying_lengths_under_zero3_matches_eager() -> None:
    # Sequences of 5, 7, 5, 9 steps: the step traces again for the new lengths (or takes
    # them symbolically) and stays equal to eager's LSTM, bit for bit on the eager backend.
    def build():
        torch.manual_seed(0)
        model = Tagger()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def make(model, opt):
        def body(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            return loss.detach()

        return body

    (model, opt), (ref_model, ref_opt) = build(), build()
    step = zero3_step(make(model, opt), [model], [opt])
    eager = make(ref_model, ref_opt)
    g = torch.Generator().manual_seed(3)
    for length in (5, 7, 5, 9):
        x, y = torch.randn(4, length, 6, generator=g), torch.randint(0, 3, (4, length), generator=g)
        assert_close(step(x, y), eager(x, y), **EXACT, what=f"length {length}")
    assert all(p.shape == (0,) for p in model.parameters())
    step.sync_modules()
    assert_close(model.state_dict(), ref_model.state_dict(), **EXACT, what="model")
    assert_close(opt.state_dict(), ref_opt.state_dict(), **EXACT, what="optimizer")


def averaged_objects() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=ema_fn, use_buffers=True)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        ema.update_parameters(model)  # reads the parameters (gathered) after the update
        return loss.detach()

    return model, opt, ema, body


def test_zero3_with_an_averaged_model_updated_in_the_step_equals_eager() -> None:
    # torch's AveragedModel as an EMA (its copy-or-average selected in the graph,
    # core/averaged_model.py): the averaged copy stays whole, the model's parameters are
    # gathered where update_parameters reads them.
    model, opt, ema, body = averaged_objects()
    ref_model, _, ref_ema, eager = averaged_objects()
    step = zero3_step(body, [model, ema], [opt])
    for x, y in data(4):
        assert_close(step(x, y), eager(x, y), **EXACT, what="loss")
    step.sync_modules()
    assert_close(ema.state_dict(), ref_ema.state_dict(), **EXACT, what="averaged model")
    assert_close(model.state_dict(), ref_model.state_dict(), **EXACT, what="model")
    assert int(ema.n_averaged) == 4 and step.num_traces == 1
