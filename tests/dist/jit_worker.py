"""``functacc.jit`` under torchrun, for tests/test_jit.py: ``jit_worker.py OUT``.

Every rank trains the distillation, EMA+SAM, clipping and edge-case (tied weight, frozen
layer, a parameter without gradient) step bodies on its half of each global batch with data
parallel, then with ZeRO-1, ZeRO-2 and ZeRO-3, and the WGAN-GP body (two optimizers,
double backward) with each; rank 0 saves the trained tensors and the optimizer's
state_dict(). The test trains the same bodies eagerly in one process on the full batches and
compares. Per-sample models only (no training-mode BatchNorm, no dropout): a half batch then
gives half of the full batch's gradient sum, so data parallel must reproduce the full-batch
step up to summation order.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functacc

STEPS = 4
B = 8  # per rank


def distill_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))
    teacher.eval().requires_grad_(False)
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    return student, teacher, torch.optim.AdamW(student.parameters(), lr=1e-2)


def distill_step(student: nn.Module, teacher: nn.Module, opt) -> object:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            soft = F.softmax(teacher(x) / 2.0, dim=-1)
        logits = student(x)
        kd = F.kl_div(F.log_softmax(logits / 2.0, dim=-1), soft, reduction="batchmean")
        loss = kd + F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def ema_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    ema = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5)).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    return model, ema, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def ema_step(model: nn.Module, ema: nn.Module, opt) -> object:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # SAM's ascent direction from the (averaged) gradient
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
            shifts = [p.grad * (0.05 / (norm + 1e-12)) for p in model.parameters()]
            for p, e in zip(model.parameters(), shifts, strict=True):
                p.add_(e)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(model.parameters(), shifts, strict=True):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                pe.mul_(0.9).add_(p, alpha=0.1)
        return loss.detach()

    return body


def clip_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    head = nn.Linear(32, 5)
    return encoder, head, torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=1e-2)


def clip_step(encoder: nn.Module, head: nn.Module, opt) -> object:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(head(encoder(x)), y)
        loss.backward()
        # In place on the averaged gradients (ZeRO-2: gathered whole for it), then stepped;
        # with foreach=True (its default on CUDA), whose write make_fx does not count.
        params = [*encoder.parameters(), *head.parameters()]
        torch.nn.utils.clip_grad_norm_(params, 0.05, foreach=True)
        opt.step()
        return loss.detach()

    return body


class Edges(nn.Module):
    """A tied weight (the head uses the embedding's transpose), a frozen layer and a
    parameter that gets no gradient: AdamW skips it, as torch.optim skips a .grad of None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 24, bias=False)
        self.frozen = nn.Linear(24, 24).requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(7))
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(x)))
        return F.linear(h, self.embed.weight.t(), self.bias)[:, :5]


def edges_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model, other = Edges(), nn.Linear(5, 5).requires_grad_(False)
    return model, other, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def edges_step(model: nn.Module, other: nn.Module, opt) -> object:
    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(other(model(x)), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def temperature_objects(seed: int = 0) -> tuple:
    """A learned temperature kept as a bare tensor, trained by the optimizer (SAC's
    ``log_alpha``), another value on each rank: the step starts from rank 0's."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    other = nn.Linear(5, 5).requires_grad_(False)
    log_t = torch.full((1,), 0.1 * seed, requires_grad=True)
    groups = [{"params": model.parameters()}, {"params": [log_t], "lr": 0.05}]
    return model, other, torch.optim.Adam(groups, lr=1e-2)


def temperature_step(model: nn.Module, other: nn.Module, opt) -> object:
    (log_t,) = opt.param_groups[1]["params"]

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(other(model(x)) / log_t.exp(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def bare_tensors(opt) -> list:
    """The optimizers' tensors that are no module's parameter, as they are now."""
    return [p.detach().clone() for o in _all(opt) for g in o.param_groups for p in g["params"]
            if type(p) is torch.Tensor]  # fmt: skip


def amp_step(encoder: nn.Module, head: nn.Module, opt) -> object:
    # The AMP recipe with its own GradScaler, the scale so near float32's top that 4 x the
    # loss overflows at 2^126: steps 2 and 4 are skipped (the scale halves, then doubles
    # again). Every rank must skip the same steps (the inf check reads the averaged
    # gradients) and keep the same scale.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125, growth_interval=1)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        # float32 (no autocast): bf16 sums over half batches round differently from one
        # sum over the whole batch, far beyond this comparison's 1e-5.
        loss = F.cross_entropy(head(encoder(x)), y)
        scaler.scale(4 * loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([*encoder.parameters(), *head.parameters()], 0.05)
        scaler.step(opt)
        scaler.update()
        return torch.stack([loss.detach().float(), scaler._scale])

    return body


def wgan_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    critic = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    # The critic's SGD: Adam's first steps are lr * sign(gradient), so a critic gradient
    # near zero (a LeakyReLU unit) would turn the ranks' summation order into a whole step.
    opts = (
        torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.9)),
        torch.optim.SGD(critic.parameters(), lr=1e-2, momentum=0.9),
    )
    return generator, critic, opts


def wgan_step(generator: nn.Module, critic: nn.Module, opts) -> object:
    """WGAN-GP: two optimizers, a critic step with a gradient penalty (double backward),
    then a generator step. The noise and the interpolation weights come from the batch, so
    that each sample's draws are the same on its rank as in the full batch."""
    opt_g, opt_d = opts

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z, eps = x[:, :8], torch.sigmoid(x[:, 8:9])
        opt_d.zero_grad()
        fake = generator(z).detach()
        mixed = (eps * x + (1 - eps) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        penalty = (grad.norm(dim=1) - 1).pow(2).mean()
        loss_d = critic(fake).mean() - critic(x).mean() + 10 * penalty
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = -critic(generator(z)).mean()
        loss_g.backward()
        opt_g.step()
        return torch.stack([loss_d.detach(), loss_g.detach()])

    return body


SCENARIOS = {
    "wgan_gp": (wgan_objects, wgan_step),
    "amp": (clip_objects, amp_step),
    "distill": (distill_objects, distill_step),
    "ema_sam": (ema_objects, ema_step),
    "clip": (clip_objects, clip_step),
    "edges": (edges_objects, edges_step),
    "temperature": (temperature_objects, temperature_step),
}


def batches(world: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B * world, 16, generator=g), torch.randint(0, 5, (B * world,), generator=g))
        for _ in range(STEPS)
    ]


LAYOUTS = {
    "dp": functacc.parallel.DataParallel,
    "zero1": lambda: functacc.parallel.ZeRO(1),
    "zero2": lambda: functacc.parallel.ZeRO(2),
    "zero3": lambda: functacc.parallel.ZeRO(3),
}


def save_and_finish(saved: dict, out: str) -> None:
    """Rank 0 saves what the ranks computed; then every rank leaves the process group."""
    if dist.get_rank() == 0:
        torch.save(saved, out)
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> None:
    functacc.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {}
    for layout, parallel in LAYOUTS.items():
        for name, (objects, make_step) in SCENARIOS.items():
            # Another seed on each rank: the step must start every rank from rank 0's weights.
            first, second, opt = objects(seed=rank)
            step = functacc.jit(
                make_step(first, second, opt),
                modules=[first, second],
                optimizers=opt if isinstance(opt, tuple) else [opt],
                backend="eager",
                parallel=parallel(),
            )
            losses = []
            for x, y in batches(world):
                part = slice(rank * B, (rank + 1) * B)
                losses.append(step(x[part], y[part]))
            # The steady state's graph (a second signature may trace again, to the same
            # code: see "traces" below).
            nodes = [str(n.target) for n in step.graphs[-1].graph.nodes]
            placeholders = [tuple(p.shape) for p in first.parameters()]
            step.sync_modules()  # ZeRO-3: the modules hold placeholders between calls
            saved[layout, name] = {
                "placeholders": placeholders,
                "first": {k: v.clone() for k, v in first.state_dict().items()},
                "second": {k: v.clone() for k, v in second.state_dict().items()},
                "traces": step.num_traces,
                "all_reduces": sum("all_reduce" in t for t in nodes),
                "all_gathers": sum("all_gather" in t for t in nodes),
                "reduce_scatters": sum("reduce_scatter" in t for t in nodes),
                "grads_after_call": [p.grad is not None for p in first.parameters()],
                "torch_state_between_calls": sum(len(o.state) for o in _all(opt)),
                # ZeRO: gathered whole, on every rank
                "optimizer": [o.state_dict() for o in _all(opt)],
                "bare": bare_tensors(opt),
            }
    for stage in (1, 2, 3):
        saved["resume", stage] = resume_under_inductor(rank, world, stage)
    saved["accumulating"] = zero2_refuses_accumulating_over_calls(rank, world)
    saved["zero3_order"] = zero3_order(rank, world)
    saved["powersgd"] = powersgd_against_compile_step(rank, world)
    save_and_finish(saved, out)


def _all(opt) -> tuple:
    return opt if isinstance(opt, tuple) else (opt,)


def powersgd_against_compile_step(rank: int, world: int) -> dict:
    """The standard step under data parallel with PowerSGD (rank 4, 2 warm-up steps), as a
    jit body and through compile_step, and as a jit body uncompressed: the trained models
    and the losses."""
    from functacc.parallel import DataParallel, PowerSGD

    def build() -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    data = [(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]) for x, y in batches(world, seed=2) * 2]
    out = {}
    for name, compression in (("jit", PowerSGD(rank=4, warmup_steps=2)), ("jit_plain", None)):
        model, opt = build()

        def body(x: torch.Tensor, y: torch.Tensor, model=model, opt=opt) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = functacc.jit(
            body, modules=[model], optimizers=[opt], backend="eager",
            parallel=DataParallel(compression=compression),
        )  # fmt: skip
        losses = torch.stack([step(x, y) for x, y in data])
        out[name] = {"model": model.state_dict(), "losses": losses, "traces": step.num_traces}
    model, opt = build()
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend="eager",
        parallel=DataParallel(compression=PowerSGD(rank=4, warmup_steps=2)),
    )  # fmt: skip
    losses = torch.stack([step(x, y).detach() for x, y in data])
    out["compile_step"] = {"model": model.state_dict(), "losses": losses}
    return out


def zero3_order(rank: int, world: int) -> str:
    """The distillation step under ZeRO-3 with each Linear a unit: its collectives and
    matrix products in graph order, as letters (G: all-gather, M: matmul, R:
    reduce-scatter)."""
    student, teacher, opt = distill_objects(seed=0)
    step = functacc.jit(
        distill_step(student, teacher, opt),
        modules=[student, teacher],
        optimizers=[opt],
        backend="eager",
        parallel=functacc.parallel.ZeRO(3, wrap_layer_cls={"Linear"}),
    )
    x, y = batches(world)[0]
    step(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B])
    letters = {"all_gather": "G", "mm": "M", "reduce_scatter": "R"}
    targets = [str(node.target) for node in step.graphs[-1].graph.nodes]
    return "".join(next((v for k, v in letters.items() if k in t), "") for t in targets)


def zero2_refuses_accumulating_over_calls(rank: int, world: int) -> dict:
    """A body that adds to the .grad its previous call left (no zero_grad) under ZeRO(2):
    the first call trains, the second is a clear error that changes nothing."""
    model = ema_objects(seed=0)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = functacc.jit(
        body, modules=[model], optimizers=[opt], backend="eager", parallel=functacc.parallel.ZeRO(2)
    )
    (x, y), *_ = batches(world)
    part = slice(rank * B, (rank + 1) * B)
    step(x[part], y[part])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = copy.deepcopy(opt.state_dict())
    try:
        step(x[part], y[part])
        error = None
    except functacc.TraceError as exc:
        error = str(exc)
    unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    opt_after = opt.state_dict()
    unchanged = unchanged and all(
        torch.equal(opt_after["state"][i]["momentum_buffer"], s["momentum_buffer"])
        for i, s in opt_before["state"].items()
    )
    return {"error": error, "unchanged": unchanged, "grads": [p.grad for p in model.parameters()]}


def resume_under_inductor(rank: int, world: int, stage: int) -> dict:
    """ZeRO under Inductor: the distillation step for 4 steps, with the optimizer's
    gathered state_dict() taken after 2; then a new step on fresh objects loads it and the
    model's and trains the last 2."""
    data = [(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]) for x, y in batches(world)]

    def build(seed: int) -> tuple:
        student, teacher, opt = distill_objects(seed=seed)
        step = functacc.jit(
            distill_step(student, teacher, opt),
            modules=[student, teacher],
            optimizers=[opt],
            parallel=functacc.parallel.ZeRO(stage),
        )
        return student, teacher, opt, step

    student, teacher, opt, step = build(seed=rank)
    losses = [step(x, y) for x, y in data[:2]]
    step.sync_modules()  # ZeRO-3: whole parameters for state_dict(); the next call shards
    checkpoint = (
        {k: v.clone() for k, v in student.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
    )
    losses += [step(x, y) for x, y in data[2:]]
    step.sync_modules()
    student2, teacher2, opt2, step2 = build(seed=rank + 10)
    step2.sync_modules()  # ZeRO-3: load into whole parameters
    teacher2.load_state_dict(teacher.state_dict())
    student2.load_state_dict(checkpoint[0])
    opt2.load_state_dict(checkpoint[1])
    resumed = [step2(x, y) for x, y in data[2:]]
    step2.sync_modules()
    return {
        "losses": torch.stack(losses),
        "student": {k: v.clone() for k, v in student.state_dict().items()},
        "resumed_losses": torch.stack(resumed),
        "resumed_student": {k: v.clone() for k, v in student2.state_dict().items()},
        "resumed_optimizer": opt2.state_dict(),
        "optimizer": opt.state_dict(),
    }


if __name__ == "__main__":
    main(sys.argv[1])
