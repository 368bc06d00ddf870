"""The CUDA path on a real GPU: Inductor's Triton kernels, CUDA-graph capture and replay,
mixed precision on tensor cores, the loader's pinned-memory copies, accelerate.

Two references. Against the eager PyTorch loop on the same GPU, with TF32 off (TF32 rounds
float32 matmul inputs to 10 bits, and cuBLAS/cuDNN pick algorithms per call site, so it
would make the comparison about algorithms, not about the step) and cuDNN deterministic
(``helpers.exact_cuda``): Inductor reorders float32
arithmetic, hence rtol 1e-4 / atol 1e-5 after several AdamW steps, as on CPU. Against the
same compiled step with ``cuda_graphs=False``: a replay runs the very kernels of the
uncaptured call on the same inputs, so it must be equal bit for bit (rtol = atol = 0).

Every test needs a CUDA device; without one each is skipped with that reason.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import models
import pytest
import torch
from helpers import (
    assert_close,
    assert_same_training,
    eager_train,
    exact_cuda,
    functacc_train,
)
from torch import nn

import functacc

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device: these run the real CUDA path"
    ),
    pytest.mark.inductor,
]


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    with exact_cuda():
        yield


def cnn() -> nn.Module:
    model = models.cnn_bn()
    model[9].p = 0.0  # Inductor draws dropout with its own kernels: see the dropout test
    return model


def cnn_batches(n: int = 5, batch: int = 8) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, 3, 16, 16, generator=g).cuda(),
            torch.randint(0, 5, (batch,), generator=g).cuda(),
        )
        for _ in range(n)
    ]


def token_batches(n: int = 5) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 50, (8, 12), generator=g).cuda(), torch.randint(0, 5, (8,)).cuda())
        for _ in range(n)
    ]


def twin_steps(make_model, *, make_opt=None, **options):
    """The same model and optimizer twice: one step with CUDA graphs, one without."""
    make_opt = make_opt or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    torch.manual_seed(0)
    model = make_model().cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graphs=True, **options)
    ref_step = functacc.compile_step(
        ref, nn.CrossEntropyLoss(), ref_opt, cuda_graphs=False, **options
    )
    return (model, opt, step), (ref, ref_opt, ref_step)


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["cuda_graphs", "no_graphs"])
@pytest.mark.parametrize("name", ["cnn_bn", "transformer"])
def test_inductor_step_on_gpu_matches_the_eager_loop(name, cuda_graphs) -> None:
    make, batches = {
        "cnn_bn": (cnn, cnn_batches()),
        # No biases: the attention's key bias gets a gradient that is zero up to rounding,
        # which AdamW amplifies into lr-sized noise in either implementation.
        "transformer": (lambda: models.TinyTransformer(dropout=0.0, bias=False), token_batches()),
    }[name]
    torch.manual_seed(0)
    model = make().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graphs=cuda_graphs)
    losses = functacc_train(step, batches)
    ref_losses = eager_train(ref, ref_opt, nn.CrossEntropyLoss(), batches)
    # torch.optim keeps a non-capturable optimizer's step count on the host; the step keeps
    # it on the GPU (as torch does with capturable=True), so a replay can advance it.
    assert all(s["step"].device == x.device for s in opt.state.values() for x in batches[0][:1])
    assert_same_training(
        model, opt, ref, ref_opt, losses, ref_losses, rtol=1e-4, atol=1e-5, host_steps=True
    )
    runs = step._jitted._engine.cache.programs()[0].run
    if cuda_graphs:  # call 1 warms up, call 2 captures, calls 3-5 replay
        assert runs.describe() == {"calls": 5, "captures": 1, "kept": 1, "evictions": 0}
    else:
        assert not hasattr(runs, "describe")


def test_replay_draws_fresh_dropout_masks_like_the_uncaptured_step() -> None:
    (model, opt, step), (ref, _, ref_step) = twin_steps(models.cnn_bn)  # dropout 0.2
    for i, (x, y) in enumerate(cnn_batches(6)):
        torch.manual_seed(i)  # a replay reads the generator's state as a direct call does
        loss = step(x, y)
        torch.manual_seed(i)
        assert torch.equal(loss, ref_step(x, y))
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    # Without reseeding, replays of one batch on frozen weights draw different masks.
    for group in opt.param_groups:
        group["lr"] = 0.0
    x, y = cnn_batches(1)[0]
    model.eval(), model[9].train()  # batch norm fixed, dropout on
    losses = {float(step(x, y)) for _ in range(4)}
    assert len(losses) == 4, losses


def test_symbolic_sizes_capture_once_per_batch_size() -> None:
    (model, _, step), (ref, _, ref_step) = twin_steps(models.mlp, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for n in (8, 6, 6, 5, 5, 7, 7, 6, 6):
        x, y = torch.randn(n, 16, generator=g).cuda(), torch.randint(0, 5, (n,), generator=g)
        assert torch.equal(step(x, y.cuda()), ref_step(x, y.cuda()))
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    assert step.num_traces == 1
    # Each size: one uncaptured call, then a capture (8 is called once: never captured).
    assert step._jitted._engine.cache.programs()[0].run.describe() == {
        "calls": 9,
        "captures": 3,
        "kept": 4,
        "evictions": 0,
    }


def test_loaded_state_is_replayed_from_its_new_tensors() -> None:
    (model, opt, step), (ref, ref_opt, ref_step) = twin_steps(cnn)
    start_model = copy.deepcopy(model.state_dict())
    batches = cnn_batches(4)
    for x, y in batches[:3]:
        step(x, y), ref_step(x, y)
    saved_opt = opt.state_dict()
    # load_state_dict copies into the model's tensors; the optimizer's gets new tensors
    # (each its own: torch keeps the loaded tensors when device and dtype already match).
    model.load_state_dict(start_model), ref.load_state_dict(start_model)
    opt.load_state_dict(copy.deepcopy(saved_opt)), ref_opt.load_state_dict(copy.deepcopy(saved_opt))
    for x, y in batches:
        assert torch.equal(step(x, y), ref_step(x, y))
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=0, what="optimizer")
    assert step._jitted._engine.cache.programs()[0].run.describe()["captures"] == 2


def test_bf16_on_tensor_cores_is_as_accurate_as_eager_autocast() -> None:
    # Same casts as eager autocast, but Inductor fuses the elementwise work around the bf16
    # matmuls in float32 registers where eager rounds every intermediate to bf16: the two
    # differ by bf16 rounding (8 bits), which SGD steps carry forward (losses 3.4% apart
    # after 4 steps on an H100). So both are measured against float64 training of the same
    # model: functacc's error must be at most 1.5x eager autocast's, and the first loss, one
    # bf16 forward with nothing accumulated yet, agrees with eager's to 1e-2.
    torch.manual_seed(0)
    model = models.TinyTransformer(dropout=0.0).cuda()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, exact)]
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opts[0], precision="bf16")
    batches = token_batches(4)
    losses = functacc_train(step, batches)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_losses = eager_train(ref, opts[1], nn.CrossEntropyLoss(), batches)
    exact_losses = eager_train(exact, opts[2], nn.CrossEntropyLoss(), batches)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(losses[0], ref_losses[0].float(), rtol=1e-2, atol=0)

    def error(m: nn.Module) -> float:
        return max(
            float((p.double() - q).abs().max())
            for p, q in zip(m.parameters(), exact.parameters(), strict=True)
        )

    def loss_error(ls: list) -> float:
        return max(abs(float(a) - float(b)) for a, b in zip(ls, exact_losses, strict=True))

    assert error(model) <= 1.5 * error(ref), (error(model), error(ref))
    assert loss_error(losses) <= 1.5 * loss_error(ref_losses), (
        loss_error(losses),
        loss_error(ref_losses),
    )


def test_fp16_overflow_is_skipped_inside_the_replayed_graph() -> None:
    precision = functacc.Precision("fp16", init_scale=2.0**10)
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731
    (model, opt, step), (ref, _, ref_step) = twin_steps(
        models.mlp, make_opt=adam, precision=precision
    )
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g).cuda(), torch.randint(0, 5, (8,), generator=g).cuda()
    for _ in range(3):
        assert torch.equal(step(x, y), ref_step(x, y))
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    step(x * 1e30, y), ref_step(x * 1e30, y)  # overflows in float16: a replay skips it
    assert step.skipped_steps == ref_step.skipped_steps == 1
    assert step.loss_scale == 2.0**9
    assert_close(model.state_dict(), before[0], rtol=0, atol=0, what="params")
    assert_close(opt.state_dict(), before[1], rtol=0, atol=0, what="optimizer")
    assert torch.equal(step(x, y), ref_step(x, y))
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    assert step._jitted._engine.cache.programs()[0].run.describe()["captures"] == 1


def test_device_loader_prefetches_pinned_batches_to_the_gpu() -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 16), torch.randint(0, 5, (40,)))
    source = torch.utils.data.DataLoader(dataset, batch_size=8)
    loader = functacc.DeviceLoader(source, device="cuda", prefetch=2)
    batches = list(loader)
    expected = list(source)
    assert len(batches) == len(expected) == 5
    for (x, y), (ex, ey) in zip(batches, expected, strict=True):
        assert x.is_cuda and y.is_cuda
        assert torch.equal(x.cpu(), ex) and torch.equal(y.cpu(), ey)
    # Training from it equals training from the host batches moved by hand.
    (model, _, step), (ref, _, ref_step) = twin_steps(models.mlp)
    for (x, y), (ex, ey) in zip(loader, expected, strict=True):
        assert torch.equal(step(x, y), ref_step(ex.cuda(), ey.cuda()))
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")


def test_a_host_batch_for_a_gpu_model_is_a_clear_error_and_changes_nothing() -> None:
    from helpers import Snapshot

    (model, opt, step), _ = twin_steps(models.mlp)
    x, y = torch.randn(8, 16).cuda(), torch.randint(0, 5, (8,)).cuda()
    step(x, y), step(x, y)
    snap = Snapshot(model, opt, step)
    with pytest.raises(Exception, match=r"(?i)cpu") as info:
        step(x.cpu(), y.cpu())
    assert "cuda" in str(info.value).lower()
    snap.assert_unchanged()
    step(x, y)  # and the step still works


def test_accelerate_on_gpu_matches_the_plain_loop() -> None:
    torch.manual_seed(0)
    model = cnn().cuda()
    ref = copy.deepcopy(model)
    functacc.accelerate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in cnn_batches(4):
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert_close(model.state_dict(), ref.state_dict(), rtol=1e-4, atol=1e-5, what="model")
