"""functacc.accelerate and Config: the eager loop on PyTorch's engines."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from helpers import assert_close, needs_inductor_random_order
from test_parallel import REDUCTION, run_torchrun, workdir  # noqa: F401
from torch import nn

import functacc

ROOT = Path(__file__).resolve().parent.parent


def no_compile() -> functacc.Config:
    config = functacc.Config()
    config.compute.compile = False
    return config


def loop(model, batches, opt_cls=torch.optim.SGD):
    opt = opt_cls(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def data(n=5):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(n)
    ]


def test_accelerated_eager_loop_equals_plain_loop() -> None:
    torch.manual_seed(0)
    model = models.cnn_bn()
    model[9].p = 0.0
    ref = copy.deepcopy(model)
    same = functacc.accelerate(model, config=no_compile(), device="cpu")
    assert same is model and model.device == torch.device("cpu")
    assert list(model.state_dict()) == list(ref.state_dict())  # the user's own names
    assert_close(loop(model, data()), loop(ref, data()), rtol=0, atol=0, what="losses")
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")


@pytest.mark.inductor
def test_accelerate_with_torch_compile() -> None:
    torch.manual_seed(0)
    model = models.mlp()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(5)
    ]
    functacc.accelerate(model, device="cpu")
    # Inductor's fused kernels reorder float32 arithmetic.
    assert_close(loop(model, batches), loop(ref, batches), rtol=1e-5, atol=1e-6, what="losses")


def test_dataloader_yields_batches_on_the_device() -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    model, loader = functacc.accelerate(
        nn.Linear(3, 2), torch.utils.data.DataLoader(dataset, batch_size=4), no_compile()
    )
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4, 2]
    assert all(x.device == model.device for x, _ in batches)


def test_bf16_config_computes_in_bf16_returns_float32() -> None:
    config = no_compile()
    config.compute.bf16 = True
    model = functacc.accelerate(models.mlp(), config=config, device="cpu")
    out = model(torch.randn(4, 16))
    assert out.dtype == torch.float32 and model[0].weight.dtype == torch.float32


def test_gradient_checkpointing_config() -> None:
    torch.manual_seed(0)
    model = models.TinyTransformer(dropout=0.0)
    ref = copy.deepcopy(model)
    config = no_compile()
    config.memory.gc = True
    config.memory.gc_cls = {"TransformerEncoderLayer"}
    functacc.accelerate(model, config=config, device="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(3)
    ]
    assert_close(loop(model, batches), loop(ref, batches), rtol=0, atol=0, what="losses")
    assert list(model.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize(
    ("setup", "field"),
    [
        (
            lambda c: (setattr(c.compute, "fp16", True), setattr(c.compute, "bf16", True)),
            "compute.fp16 and compute.bf16",
        ),
        (lambda c: setattr(c.dist.fsdp, "size", 3), "dist.fsdp.size=3"),
        (lambda c: setattr(c.dist.dp, "size", 2), r"dist.dp.size \(2\) x dist.fsdp.size"),
        (lambda c: setattr(c.memory, "gc", True), "memory.gc_cls"),
        (lambda c: setattr(c.dataloader, "prefetch", -1), "dataloader.prefetch"),
    ],
)
def test_invalid_config_names_the_field(setup, field) -> None:
    config = functacc.Config()
    setup(config)
    with pytest.raises(ValueError, match=field):
        functacc.accelerate(models.mlp(), config=config)


def test_unknown_config_attribute_raises() -> None:
    config = functacc.Config()
    with pytest.raises(AttributeError, match=r"Did you mean dist.fsdp.wrap_layer_cls\?"):
        config.dist.fsdp.wrap_layer_class = {"Block"}
    with pytest.raises(AttributeError, match="no field 'gpu'"):
        config.gpu = 1


class BreakingBlock(nn.Module):
    """A wrap unit whose forward Dynamo compiles as a frame of its own, as it does each
    FSDP2 unit's (it breaks the graph at FSDP2's hooks)."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()
        return x.relu()


@pytest.mark.parametrize("per_call_patch", [False, True], ids=["torch.compile", "patched call"])
def test_sharded_compile_raises_the_recompile_limit_for_its_model_only(
    monkeypatch, per_call_patch
) -> None:
    # accelerate's FSDP2 path on one process: the ranks, rank 0's broadcast and the sharding
    # stood in for (what is tested is Dynamo's recompile limit, not FSDP2), and the eager
    # backend for Inductor (Dynamo counts frames the same way; Inductor would take minutes).
    # Five units of one class and five widths, batches of 8 and a last one of 3: 10 graphs of
    # BreakingBlock.forward, more than Dynamo's default limit of 8.
    acc = functacc.frontends.accelerate
    monkeypatch.setattr(acc, "world_size", lambda: 2)
    monkeypatch.setattr(acc, "sync_from_rank0", lambda tensors: None)

    def units(model: nn.Module, *args) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, BreakingBlock)]

    monkeypatch.setattr(acc, "_fully_shard", units)
    real = acc.compile_with_recompile_limit
    monkeypatch.setattr(
        acc,
        "compile_with_recompile_limit",
        lambda fn, limit, options, **kw: real(fn, limit, backend="eager", **kw),
    )
    if per_call_patch:
        # Older torch's way (torch.compile takes no recompile_limit there): Dynamo's config
        # patched around each call of the compiled model.
        monkeypatch.setattr(functacc._compat, "COMPILE_TAKES_RECOMPILE_LIMIT", False)
    elif not functacc._compat.COMPILE_TAKES_RECOMPILE_LIMIT:
        pytest.skip(f"torch {torch.__version__}'s torch.compile takes no recompile_limit")
    widths = [4, 5, 6, 7, 8, 9]
    torch.manual_seed(0)
    model = nn.Sequential(*(BreakingBlock(a, b) for a, b in itertools.pairwise(widths)))
    model.append(nn.Linear(9, 5))
    ref = copy.deepcopy(model)
    config = functacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"BreakingBlock"}
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(n, 4, generator=g), torch.randint(0, 5, (n,), generator=g))
        for n in (8, 3, 8, 3)
    ]
    user_limit = torch._dynamo.config.recompile_limit
    stats = torch._dynamo.utils.counters["stats"]
    graphs = stats["unique_graphs"]
    torch._dynamo.reset()  # no entries of BreakingBlock.forward from another test
    try:
        # A hard error where Dynamo would give up compiling a frame (and run it eagerly).
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            functacc.accelerate(model, config=config, device="cpu")
            assert torch._dynamo.config.recompile_limit == user_limit
            losses = loop(model, batches)
            assert torch._dynamo.config.recompile_limit == user_limit
        assert stats["unique_graphs"] - graphs >= 10  # compiled, not run eagerly
    finally:
        torch._dynamo.reset()
    assert_close(losses, loop(ref, batches), rtol=0, atol=0, what="losses")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="torch.cuda.amp is a no-op only where CUDA is missing"
)
def test_cuda_amp_in_the_loop_is_a_noop_on_cpu() -> None:
    model = functacc.accelerate(models.mlp(), config=no_compile())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning):
        scaler = torch.cuda.amp.GradScaler()
    with pytest.warns(UserWarning), torch.cuda.amp.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 16)), torch.zeros(4).long())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert loss.dtype == torch.float32


@pytest.mark.distributed
def test_accelerate_under_torchrun_matches_ddp_and_fsdp_matches_dp(workdir) -> None:  # noqa: F811
    result = run_torchrun(workdir, "accelerate", 2)
    for name in ("dp", "fsdp"):
        assert result[f"{name}_same_object"]
        assert result[f"{name}_rank"] == (0, 2)
        assert not any(
            k.startswith(("module.", "_fsdp", "forward")) for k in result[f"{name}_keys"]
        )
    assert_close(result["dp_losses"], result["ddp_losses"], rtol=0, atol=0, what="DP losses")
    assert_close(result["dp_state"], result["ddp_state"], rtol=0, atol=0, what="DP model")
    # FSDP reduce-scatters where DDP all-reduces: another summation order.
    assert_close(result["fsdp_losses"], result["dp_losses"], **REDUCTION, what="FSDP losses")
    assert_close(result["fsdp_state"], result["dp_state"], **REDUCTION, what="FSDP model")


EXAMPLES = ROOT / "examples" / "torchacc"
TINY = [
    "--samples",
    "16",
    "--batch-size",
    "4",
    "--image-size",
    "32",
    "--log-steps",
    "2",
    "--epochs",
    "1",
    # torchvision's ResNet with one BasicBlock per stage rather than the documentation's
    # ResNet-50: the same modules and API, a fraction of the compile (resnet_acc.py, cold
    # cache: ResNet-50 100 s, ResNet-18 51 s, this 38 s).
    "--arch",
    "resnet10",
]


def run_example(args: list[str], torchrun: bool = False) -> str:
    # As a user runs them: torch.compile on (accelerate's default), nothing switched off.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TORCH_COMPILE_DISABLE", None)
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, *args, *TINY], capture_output=True, text=True, timeout=600, env=env, cwd=EXAMPLES
    )
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.parametrize(
    ("script", "torchrun"),
    [
        ("resnet_native.py", False),
        ("resnet_acc.py", False),
        ("resnet_acc_amp.py", False),
        pytest.param("resnet_acc_dp.py", True, marks=pytest.mark.distributed),
        pytest.param("resnet_acc_fsdp.py", True, marks=pytest.mark.distributed),
    ],
)
def test_torchacc_examples(script: str, torchrun: bool) -> None:
    source = (EXAMPLES / script).read_text()
    if script != "resnet_native.py":
        assert "import functacc as torchacc" in source
    out = run_example([script], torchrun)
    lines = [ln for ln in out.splitlines() if ln.startswith("Epoch:")]
    # 16 samples / 4 per batch (per rank under torchrun: 2 steps), a line every 2 steps,
    # printed once (rank 0 only).
    expected = 1 if torchrun else 2
    assert len(lines) == expected, out
    assert lines[0].startswith("Epoch: 0, Step: 2, Loss: ") and lines[0].endswith(" samples/s")


def tiny_vit() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=16,
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        dropout=0.1,
        num_classes=5,
    )


def vit_one_step(model: nn.Module, train) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    torch.manual_seed(123)  # the dropout masks
    train(model, x, y)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager_sgd_step(model, x, y) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def accelerate_sgd_step(model, x, y) -> None:
    functacc.accelerate(model, device="cpu")  # torch.compile, Inductor
    eager_sgd_step(model, x, y)


def compile_step_sgd_step(model, x, y) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="inductor")(x, y)


@pytest.mark.inductor
@pytest.mark.parametrize(
    ("train", "fallback_random", "same_masks"),
    [
        # torch.compile keeps eager's dropout kernel when told to fall back to eager's RNG.
        (accelerate_sgd_step, True, True),
        # Without fallback_random Inductor draws its own masks: the check below notices.
        (accelerate_sgd_step, False, False),
        # compile_step: the attention block's dropout applies to nn.MultiheadAttention's
        # transposed (non-contiguous) output; eager fills empty_like(input) in memory order,
        # and Inductor's functional bernoulli draws in logical order. functacc draws into a
        # contiguous byte buffer in memory order (backends/inductor/masks.py), so the masks
        # are eager's (before it: 1.9e-2 apart in the head weights).
        (compile_step_sgd_step, True, True),
    ],
)
def test_vit_dropout_under_inductor_against_eager(train, fallback_random, same_masks) -> None:
    # torchvision ViT, dropout 0.1 (four dropouts, one on a non-contiguous tensor), one SGD
    # step from the same weights and seed. Its head starts at zero, so the head's update is
    # the mean of the (dropped-out) features: a different mask moves it by ~1e-2.
    if same_masks and train is compile_step_sgd_step:
        needs_inductor_random_order()  # four dropouts in one graph
    expected = vit_one_step(tiny_vit(), eager_sgd_step)
    torch._dynamo.reset()  # a cached frame would keep the other fallback_random setting
    with torch._inductor.config.patch(fallback_random=fallback_random):
        actual = vit_one_step(tiny_vit(), train)
    torch._dynamo.reset()
    if same_masks:
        # Inductor's fused kernels reorder float32 arithmetic (measured: 1.5e-8).
        assert_close(actual, expected, rtol=1e-5, atol=1e-6, what="parameters after one step")
    else:
        diff = (actual["heads.head.weight"] - expected["heads.head.weight"]).abs().max()
        assert diff > 1e-3, f"masks were expected to differ; head differs by {diff:.2e}"
