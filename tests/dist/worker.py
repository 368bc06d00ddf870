"""Scenarios run under torchrun by tests/test_parallel.py: ``worker.py SCENARIO OUT``.

Every rank runs the scenario; rank 0 saves what the test asserts on with ``torch.save``.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import functacc  # noqa: E402
from functacc.parallel import DataParallel, PowerSGD, ZeRO  # noqa: E402

STEPS = 10
B = 8  # per-rank batch


def batches(kind: str, world: int, n: int = STEPS, seed: int = 0):
    """Global batches of B * world samples; rank r trains on the r-th slice."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if kind == "image":
            x = torch.randn(B * world, 3, 16, 16, generator=g)
        elif kind == "tokens":
            x = torch.randint(0, 50, (B * world, 12), generator=g)
        elif kind == "tied":
            x = torch.randint(0, 20, (B * world, 6), generator=g)
            out.append((x, torch.randint(0, 20, (B * world,), generator=g)))
            continue
        else:
            x = torch.randn(B * world, 16, generator=g)
        out.append((x, torch.randint(0, 5, (B * world,), generator=g)))
    return out


MODELS = {
    "mlp": (models.mlp, "vector"),
    "cnn_bn": (lambda: _no_dropout(models.cnn_bn()), "image"),
    # No biases: the key projection's bias has a gradient that is zero in exact arithmetic,
    # which Adam turns into full-size steps of either sign on rounding noise.
    "transformer": (lambda: models.TinyTransformer(dropout=0.0, bias=False), "tokens"),
    "tied": (lambda: models.Tied(vocab=20, dim=8), "tied"),
}
OPTS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05),
}
WRAP = {"cnn_bn": {"Conv2d"}, "transformer": {"TransformerEncoderLayer"}, "mlp": {"Linear"}}


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def train(model_name: str, opt_name: str, parallel, *, seed_by_rank: bool = False, **kw):
    """Train on this rank's slices; return the full model state and the step's stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    make, kind = MODELS[model_name]
    # Ranks may initialise differently: the step broadcasts rank 0's weights.
    torch.manual_seed(rank if seed_by_rank else 0)
    model = make()
    if opt_name == "transform_adamw":  # functacc.optim's AdamW: torch's, purely
        opt = functacc.optim.adamw(1e-3, weight_decay=0.05)
    elif opt_name == "transform_clip_adamw":  # clip_grad_norm_(0.1), then AdamW
        adamw = functacc.optim.adamw(1e-3, weight_decay=0.05)
        opt = functacc.optim.chain(functacc.optim.clip_by_global_norm(0.1), adamw)
    else:
        opt = OPTS[opt_name](model)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel, **kw
    )
    losses = []
    for x, y in batches(kind, world):
        losses.append(step(x.chunk(world)[rank], y.chunk(world)[rank]))
    step.sync_model()
    held, held_opt = _held(step)
    return {
        "state": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(step.optimizer.state_dict()),  # ZeRO: gathered whole
        "losses": torch.stack(losses),
        "stats": step.stats(),
        "held": {"params": held, "optimizer": held_opt},
    }


def _held(step) -> tuple[int, int]:
    """The bytes of parameters and optimizer state the step holds, read off its own tensors
    (not stats()): the jitted body's inputs (step.state refuses under ZeRO)."""
    capture = step._jitted._engine.capture
    rest = capture.rest
    params = [p for n, p in capture.params.items() if rest is None or n not in rest.names]
    params += list(rest.chunks.values()) if rest is not None else []
    opt_state = [linked.leaves()[1] for linked in capture.optimizers]
    return tuple(  # type: ignore[return-value]
        sum(t.numel() * t.element_size() for t in _leaves(tree)) for tree in (params, opt_state)
    )


def _leaves(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def single_process(model_name: str, opt_name: str, world: int, **kw):
    """The reference: one process, eager PyTorch, the full batch of all ranks."""
    make, kind = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = OPTS[opt_name](model)
    for x, y in batches(kind, world):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if kw.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
        opt.step()
    return copy.deepcopy(model.state_dict())


def scenario_parity(out: dict) -> None:
    world = dist.get_world_size()
    for model_name in ("mlp", "transformer"):
        out[f"single/{model_name}"] = single_process(model_name, "adamw", world)
        out[f"dp/{model_name}/adamw"] = train(model_name, "adamw", None, seed_by_rank=True)
    out["dp/mlp/transform_adamw"] = train("mlp", "transform_adamw", None, seed_by_rank=True)
    out["single_clip_adamw/mlp"] = single_process("mlp", "adamw", world, max_grad_norm=0.1)
    # ZeRO-1/2: each rank steps whole parameters; ZeRO-3: its segments of the flat units.
    # Either way the global norm is summed over the ranks.
    for stage in (1, 2, 3):
        parallel = ZeRO(stage, wrap_layer_cls=None)
        out[f"zero{stage}/mlp/transform_clip"] = train("mlp", "transform_clip_adamw", parallel)
    out["single_clip/mlp"] = single_process("mlp", "sgd_momentum", world, max_grad_norm=0.1)
    for stage in (None, 1, 2, 3):
        parallel = None if stage is None else ZeRO(stage, wrap_layer_cls=None)
        out[f"clip/{stage}"] = train("mlp", "sgd_momentum", parallel, max_grad_norm=0.1)
    for model_name in ("cnn_bn", "transformer"):
        for opt_name in OPTS:
            out[f"dp/{model_name}/{opt_name}"] = train(model_name, opt_name, DataParallel())
            for stage in (1, 2, 3):
                zero = ZeRO(stage, wrap_layer_cls=WRAP[model_name])
                out[f"zero{stage}/{model_name}/{opt_name}"] = train(model_name, opt_name, zero)
    out["dp_small_buckets"] = train("mlp", "adamw", DataParallel(bucket_mb=0.004))
    out["dp/tied/adamw"] = train("tied", "adamw", None)
    out["zero3/tied/adamw"] = train("tied", "adamw", ZeRO(3))
    # The tied weight across two wrap units (the embedding's and the root's).
    out["zero3/tied-split/adamw"] = train("tied", "adamw", ZeRO(3, wrap_layer_cls={"Embedding"}))
    out["dp_bf16"] = train("mlp", "adamw", DataParallel(compression="bf16"))


def scenario_hybrid(out: dict) -> None:
    for model_name in ("cnn_bn", "transformer"):
        for opt_name in OPTS:
            out[f"dp/{model_name}/{opt_name}"] = train(model_name, opt_name, None)
            for stage in (1, 2, 3):
                zero = ZeRO(stage, shard_size=2, wrap_layer_cls=WRAP[model_name])
                out[f"hybrid{stage}/{model_name}/{opt_name}"] = train(model_name, opt_name, zero)


def scenario_powersgd(out: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    # A learnable problem: a random 2-layer teacher, 256-wide student.
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    xs = torch.randn(200, 2 * B * world, 32, generator=g)
    with torch.no_grad():
        ys = [teacher(x).argmax(1) for x in xs]
    for name, compression in (("plain", None), ("powersgd", PowerSGD(rank=4, warmup_steps=5))):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, backend="eager",
            parallel=DataParallel(compression=compression),
        )
        losses, sent = [], 0.0
        for x, y in zip(xs, ys, strict=True):
            losses.append(float(step(x.chunk(world)[rank], y.chunk(world)[rank])))
            sent += sum(step.stats()["payload_bytes"].values())
        with torch.no_grad():  # the final model's loss over all the training data
            final = float(nn.functional.cross_entropy(model(xs.flatten(0, 1)), torch.cat(ys)))
        out[name] = {
            "losses": losses, "final": final, "payload_bytes": sent, "traces": step.num_traces
        }


def scenario_uneven(out: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.utils.data.TensorDataset(torch.randn(21, 16), torch.randint(0, 5, (21,)))
    loader = functacc.DeviceLoader(
        torch.utils.data.DataLoader(data, batch_size=4, shuffle=True), prefetch=2
    )
    torch.manual_seed(0)
    model = models.mlp()
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
        backend="eager",
    )
    seen, counts = [], []
    for _epoch in range(3):
        n = 0
        for x, y in loader:
            step(x, y)
            n += 1
            seen.append(y)
        counts.append(n)
    all_counts = [None] * world
    dist.all_gather_object(all_counts, counts)
    # Which samples did this rank see in epoch 0 (by label tensor identity: index order)?
    loader.set_epoch(0)
    indices = list(iter(loader.loader.sampler))
    all_indices = [None] * world
    dist.all_gather_object(all_indices, indices)
    out["counts"] = all_counts
    out["indices"] = all_indices
    out["len"] = len(loader)

    class Stream(torch.utils.data.IterableDataset):
        """25 samples of unknown length: 7 batches of 4, split batch by batch over ranks."""

        def __iter__(self):
            for i in range(25):
                yield torch.randn(16), i % 5

    stream = functacc.DeviceLoader(torch.utils.data.DataLoader(Stream(), batch_size=4))
    stream_counts = []
    for _ in range(2):
        n = 0
        for x, y in stream:
            step(x, y)
            n += 1
        stream_counts.append(n)
    gathered = [None] * world
    dist.all_gather_object(gathered, stream_counts)
    out["stream_counts"] = gathered


def scenario_errors(out: dict) -> None:
    rank = dist.get_rank()
    errors = {}
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, build in {
        "shard_size": lambda: functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, parallel=ZeRO(2, shard_size=3)
        ),
        "wrap_cls": lambda: functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, parallel=ZeRO(3, wrap_layer_cls={"Bottleneck"})
        ),
        "mismatch": lambda: _mismatched(rank),
        # compile_step on jit's pipeline: the same names (the model's own).
        "mismatch_body": lambda: _mismatched(rank, torch.optim.RMSprop),
    }.items():
        try:
            build()
            errors[name] = None
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    out["errors"] = gathered


def _mismatched(rank: int, opt_cls=torch.optim.SGD):
    hidden = 32 if rank == 0 else 24
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 5))
    return functacc.compile_step(model, nn.CrossEntropyLoss(), opt_cls(model.parameters(), lr=0.1))


def scenario_killed(out: dict) -> None:
    """Rank 1 dies (SIGKILL) after two steps; rank 0 must fail, not hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = models.mlp()
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
        backend="eager",
    )
    start = time.monotonic()
    for i, (x, y) in enumerate(batches("vector", world, n=50)):
        if i == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            step(x.chunk(world)[rank], y.chunk(world)[rank])
        except Exception as exc:
            print(f"RANK0_FAILED after {time.monotonic() - start:.1f}s: {exc}", flush=True)
            # Out at once: a process group whose peer died cannot be destroyed cleanly, and
            # at interpreter shutdown Gloo's threads sometimes abort (exit code -6, seen
            # here under load) before exit code 3 arrives.
            os._exit(3)
    print("RANK0_FINISHED", flush=True)


def scenario_multinode(out: dict) -> None:
    out["dp/mlp/adamw"] = train("mlp", "adamw", None)


def scenario_teardown(out: dict) -> None:
    """dist.destroy_process_group() while steps and a loader that use the groups are alive:
    the groups must die there (functacc holds them weakly), not at interpreter shutdown,
    where Gloo's threads aborted train_zero3.py after it finished (exit code -6)."""
    import weakref

    rank, world = dist.get_rank(), dist.get_world_size()

    class Stream(torch.utils.data.IterableDataset):
        """Split batch by batch over the ranks, which agree on each batch in a group of
        the loader's own."""

        def __iter__(self):
            for i in range(16):
                yield torch.randn(16), i % 5

    loader = functacc.DeviceLoader(torch.utils.data.DataLoader(Stream(), batch_size=4))
    steps = []
    # The pure step (SGD), and jit's pipeline: compile_step with RMSprop, and a body.
    for parallel, opt_cls in (
        (DataParallel(), torch.optim.SGD),
        (ZeRO(3, wrap_layer_cls={"Linear"}), torch.optim.SGD),
        (DataParallel(), torch.optim.RMSprop),
    ):
        torch.manual_seed(0)
        model = models.mlp()
        opt = opt_cls(model.parameters(), lr=0.1)
        steps.append(
            functacc.compile_step(
                model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel
            )
        )
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    steps.append(functacc.jit(train_step, modules=model, optimizers=opt, backend="eager"))
    out["steps"] = len(steps)
    for x, y in loader:
        for step in steps:
            step(x, y)
    groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
    out["groups"] = len(groups)
    dist.barrier()
    dist.destroy_process_group()
    out["alive_after_destroy"] = sum(ref() is not None for ref in groups)
    errors = []
    for step in steps:
        try:
            step(x, y)
        except RuntimeError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["rank"] = rank
    out["world"] = world


SCENARIOS = {
    "parity": scenario_parity,
    "hybrid": scenario_hybrid,
    "powersgd": scenario_powersgd,
    "uneven": scenario_uneven,
    "errors": scenario_errors,
    "killed": scenario_killed,
    "multinode": scenario_multinode,
    "teardown": scenario_teardown,
}


def main(scenarios: dict | None = None) -> None:
    """Run ``argv[1]`` of ``scenarios`` (default: this file's) on every rank; rank 0 saves
    what it put in ``out`` to ``argv[2]``."""
    scenario, path = sys.argv[1], sys.argv[2]
    functacc.init_distributed()
    out: dict = {}
    try:
        (scenarios or SCENARIOS)[scenario](out)
    except Exception:
        traceback.print_exc()
        raise
    if int(os.environ["RANK"]) == 0:
        torch.save(out, path)
    if dist.is_initialized():  # a scenario may have destroyed it
        dist.barrier()
        dist.destroy_process_group()



def _eager_loop(model, world, rank, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches("image", world, n=steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def scenario_accelerate(out: dict) -> None:
    """accelerate + the eager loop, against plain DDP, and FSDP against DP."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    make = MODELS["cnn_bn"][0]
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make())
    out["ddp_losses"] = _eager_loop(ddp, world, rank)
    out["ddp_state"] = copy.deepcopy(ddp.module.state_dict())
    for name, fsdp in (("dp", 1), ("fsdp", world)):
        torch.manual_seed(rank)  # different inits: accelerate broadcasts rank 0's (seed 0)
        model = make()
        config = functacc.Config()
        config.compute.compile = False
        config.dist.fsdp.size = fsdp
        config.dist.fsdp.wrap_layer_cls = {"Conv2d"}
        same = functacc.accelerate(model, config=config)
        out[f"{name}_same_object"] = same is model
        out[f"{name}_rank"] = (torch.distributed.get_rank(), torch.distributed.get_world_size())
        out[f"{name}_losses"] = _eager_loop(model, world, rank)
        state = model.state_dict()
        out[f"{name}_keys"] = list(state)
        out[f"{name}_state"] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()
        }


SCENARIOS["accelerate"] = scenario_accelerate


def _reshard_step(parallel):
    """An MLP + AdamW step (no BatchNorm: its batch statistics depend on the per-rank batch,
    so only parameters and optimizer state carry over between layouts); ``OPT=RMSprop``: an
    optimizer traced through its own step() (compile_step on jit's pipeline); ``OPT=transform``:
    a functacc.optim transformation (clip_by_global_norm, then AdamW)."""
    torch.manual_seed(0)
    model = models.mlp()
    if os.environ.get("OPT") == "transform":
        opt = transform_clip_adamw()
    else:
        opt = getattr(torch.optim, os.environ.get("OPT", "AdamW"))(model.parameters(), lr=1e-2)
    return model, functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel
    )


def transform_clip_adamw() -> functacc.optim.GradientTransformation:
    adamw = functacc.optim.adamw(1e-2, weight_decay=0.05)
    return functacc.optim.chain(functacc.optim.clip_by_global_norm(0.1), adamw)


def reshard_train(step, start: int, stop: int) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches("vector", world=1, n=stop)[start:]:
        # The same global batch of 8 whatever the world size; each rank its slice.
        losses.append(step(x.chunk(world)[rank], y.chunk(world)[rank]))
    return losses


def scenario_reshard_save(out: dict) -> None:
    """ZeRO-3 (``SAVE=zero2``: ZeRO-2) on 2 ranks: 5 steps, save, 5 more (the reference
    trajectory)."""
    save = {"zero3": ZeRO(3, wrap_layer_cls={"Linear"}), "zero2": ZeRO(2)}
    model, step = _reshard_step(save[os.environ.get("SAVE", "zero3")])
    reshard_train(step, 0, 5)
    functacc.save(step, os.environ["CKPT"])
    reshard_train(step, 5, 10)
    step.sync_model()
    out["state"] = copy.deepcopy(model.state_dict())


def scenario_reshard_load(out: dict) -> None:
    layouts = {"dp": DataParallel(), "zero1": ZeRO(1), "zero3": ZeRO(3)}
    parallel = layouts[os.environ["LAYOUT"]]
    model, step = _reshard_step(parallel)
    functacc.load(step, os.environ["CKPT"])
    out["count"] = step.count
    reshard_train(step, 5, 10)
    step.sync_model()
    out["state"] = copy.deepcopy(model.state_dict())


def scenario_crash(out: dict) -> None:
    """Data parallel with a CheckpointManager; under torchrun --max-restarts=1, rank 1 dies
    at step 7 of the first attempt and the restarted job resumes from step 6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = models.cnn_bn()  # dropout and BatchNorm
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 5, (48,), generator=g)
    )
    loader = functacc.DeviceLoader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager")
    manager = functacc.CheckpointManager(os.environ["CKPT"], every_steps=2, keep=2, loader=loader)
    restored = manager.restore_latest(step)
    out["restored_at"] = step.count if restored else None
    while step.count < 10:
        for x, y in loader:
            if os.environ.get("CRASH") and attempt == 0 and rank == 1 and step.count == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            step(x, y)
            manager.maybe_save(step)
            if step.count == 10:
                break
    out["state"] = copy.deepcopy(model.state_dict())
    out["attempt"] = attempt
    out["checkpoints"] = [os.path.basename(p) for p in manager.checkpoints()]


SCENARIOS.update(
    reshard_save=scenario_reshard_save,
    reshard_load=scenario_reshard_load,
    crash=scenario_crash,
)


def scenario_samplers(out: dict) -> None:
    """The user's samplers sharded over the ranks (tests/test_data.py)."""
    import loader_cases

    rank = dist.get_rank()
    world = dist.get_world_size()

    def gather(value):
        every = [None] * world
        dist.all_gather_object(every, value)
        return every

    out["epochs"], out["len"], out["resumed"] = {}, {}, {}
    for case, make in loader_cases.CASES.items():
        loader = functacc.DeviceLoader(make())
        epochs = [[loader_cases.content(b) for b in loader] for _ in range(2)]
        out["epochs"][case] = gather(epochs)
        out["len"][case] = gather(len(loader))
        # Resume: epoch 0, one batch of epoch 1, then a fresh loader takes over.
        first = functacc.DeviceLoader(make())
        list(first)
        it = iter(first)
        next(it)
        state = first.state_dict()
        rest = [loader_cases.content(b) for b in it] + [
            loader_cases.content(b) for b in first
        ]
        second = functacc.DeviceLoader(make())
        second.load_state_dict(state)
        again = [loader_cases.content(b) for b in second] + [
            loader_cases.content(b) for b in second
        ]
        out["resumed"][case] = all(gather(again == rest))
    errors = {}
    data = loader_cases.numbers()
    for name, sampler in {
        "python_random": loader_cases.PythonRandomSampler(20, seed=rank),
        "no_len": loader_cases.Endless(),
    }.items():
        loader = functacc.DeviceLoader(
            torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
        )
        try:
            list(loader)
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            errors[name] = str(exc)
    out["errors"] = gather(errors)


SCENARIOS["samplers"] = scenario_samplers


# -- issue "Trust": each behaves like eager PyTorch / one-process data parallelism -----------


class ScaledBN(nn.Module):
    """Linear -> BatchNorm1d -> times a float buffer the forward only reads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 5)
        self.register_buffer("scale", torch.randn(8))

    def forward(self, x):
        return self.head(self.bn(self.fc(x)) * self.scale)


def _buffer_replicas(world: int, steps: int):
    """The reference: ``world`` eager replicas in this process, gradients averaged
    (summed, then divided) and BatchNorm running statistics summed, then divided by the
    world size after every step."""
    torch.manual_seed(0)
    replicas = [ScaledBN() for _ in range(world)]
    for r in replicas[1:]:
        r.load_state_dict(replicas[0].state_dict())
    opts = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in replicas]
    for x, y in batches("vector", world, n=steps):
        for r, (m, opt) in enumerate(zip(replicas, opts, strict=True)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x.chunk(world)[r]), y.chunk(world)[r]).backward()
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in replicas), strict=True):
                mean = sum(p.grad for p in ps) / world
                for p in ps:
                    p.grad = mean.clone()
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for name in ("running_mean", "running_var"):
                mean = sum(getattr(m.bn, name) for m in replicas) / world
                for m in replicas:
                    getattr(m.bn, name).copy_(mean)
    return copy.deepcopy(replicas[0].state_dict())


def scenario_buffers3(out: dict) -> None:
    """Buffers under data parallelism and ZeRO on 3 ranks (not a power of two)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 4
    out["reference"] = _buffer_replicas(world, steps)
    for name, parallel in (("dp", DataParallel()), ("zero2", ZeRO(2))):
        torch.manual_seed(0)
        model = ScaledBN()
        initial = model.scale.clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = functacc.compile_step(
            model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel
        )
        for x, y in batches("vector", world, n=steps):
            step(x.chunk(world)[rank], y.chunk(world)[rank])
        step.sync_model()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = [None] * world
        dist.all_gather_object(gathered, state)
        out[name] = {"initial_scale": initial, "ranks": gathered}


SCENARIOS["buffers3"] = scenario_buffers3


def _placeholders(model: nn.Module) -> bool:
    """Whether every parameter is ZeRO-3's empty placeholder (no storage behind it)."""
    return all(
        p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in model.parameters()
    )


def scenario_zero3_sync(out: dict) -> None:
    """ZeRO-3: sync_model() and save_model() between steps neither retrace nor leave the
    full weights in the model once training goes on."""
    import tempfile

    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches("vector", world, n=6)
    torch.manual_seed(0)
    model = models.mlp()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend="eager",
        parallel=ZeRO(3, wrap_layer_cls={"Linear"}),
    )
    for x, y in data[:3]:
        step(x.chunk(world)[rank], y.chunk(world)[rank])
    out["placeholders_before"] = _placeholders(model)
    step.sync_model()
    out["synced_full"] = all(p.shape == shapes[n] for n, p in model.named_parameters())
    out["traces_before"] = step.num_traces
    x, y = data[3]
    step(x.chunk(world)[rank], y.chunk(world)[rank])
    out["traces_after_sync"] = step.num_traces
    out["placeholders_after_sync"] = _placeholders(model)
    paths = [os.path.join(tempfile.mkdtemp(), "model.safetensors")]
    dist.broadcast_object_list(paths, src=0)  # rank 0 writes: every rank reads its file
    path = paths[0]
    functacc.save_model(step, path)
    out["placeholders_after_save"] = _placeholders(model)
    for x, y in data[4:]:
        step(x.chunk(world)[rank], y.chunk(world)[rank])
    out["traces_after_save"] = step.num_traces
    step.sync_model()
    out["state"] = copy.deepcopy(model.state_dict())
    torch.manual_seed(0)
    reference = models.mlp()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
    dp = functacc.compile_step(reference, nn.CrossEntropyLoss(), opt, backend="eager")
    for x, y in data:
        dp(x.chunk(world)[rank], y.chunk(world)[rank])
    out["dp_state"] = copy.deepcopy(reference.state_dict())
    # load_model into the step holding placeholders: gathered, loaded, sharded again.
    from safetensors.torch import load_file

    step(x.chunk(world)[rank], y.chunk(world)[rank])
    functacc.load_model(step, path)
    out["placeholders_after_load"] = _placeholders(model)
    step.sync_model()
    out["loaded"] = copy.deepcopy(model.state_dict())
    out["saved"] = load_file(path)


SCENARIOS["zero3_sync"] = scenario_zero3_sync


class WithUnused(nn.Module):
    """``unused`` never runs; ``late`` gets frozen half-way through training."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.unused = nn.Linear(16, 16)
        self.late = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h + torch.relu(self.late(h)))


UNUSED_STEPS, FREEZE_AT = 6, 3


def _unused_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _unused_eager(world: int) -> dict:
    """Eager PyTorch, one process, the full batch: the reference."""
    torch.manual_seed(0)
    model = WithUnused()
    initial = copy.deepcopy(model.state_dict())
    opt = _unused_opt(model)
    for i, (x, y) in enumerate(batches("vector", world, n=UNUSED_STEPS)):
        if i == FREEZE_AT:
            model.late.requires_grad_(False)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {
        "initial": initial,
        "state": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
    }


def _unused_run(parallel, backend: str = "eager") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = WithUnused()
    opt = _unused_opt(model)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend=backend, parallel=parallel
    )
    out = {"opt_before": copy.deepcopy(opt.state_dict())}
    for i, (x, y) in enumerate(batches("vector", world, n=UNUSED_STEPS)):
        if i == FREEZE_AT:
            model.late.requires_grad_(False)
        step(x.chunk(world)[rank], y.chunk(world)[rank])
    step.sync_model()
    out["state"] = copy.deepcopy(model.state_dict())
    out["opt"] = copy.deepcopy(opt.state_dict())  # a collective call under ZeRO
    out["opt_state_after"] = len(opt.state)  # ZeRO keeps no full copy in opt.state
    out["traces"] = step.num_traces
    return out


def scenario_unused(out: dict) -> None:
    """Parameters without gradients (never used; frozen after the step was built) under
    data parallelism and ZeRO 1-3, against eager PyTorch on the full batch; and the
    optimizer's state_dict()."""
    out["eager"] = _unused_eager(dist.get_world_size())
    out["dp"] = _unused_run(DataParallel())
    for stage in (1, 2, 3):
        try:
            out[f"zero{stage}"] = _unused_run(ZeRO(stage))
            out[f"zero{stage}"]["reloaded"] = _reload(ZeRO(stage), out["dp"]["opt"])
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out[f"zero{stage}"] = f"{type(exc).__name__}: {exc}"


def _reload(parallel, opt_state: dict) -> dict:
    """opt.load_state_dict() into a ZeRO step, read back through opt.state_dict()."""
    torch.manual_seed(0)
    model = WithUnused()
    opt = _unused_opt(model)
    functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", parallel=parallel)
    opt.load_state_dict(copy.deepcopy(opt_state))
    return copy.deepcopy(opt.state_dict())


SCENARIOS["unused"] = scenario_unused


def scenario_unused_inductor(out: dict) -> None:
    """ZeRO-3 under Inductor (empty segments included: the root unit spans the ranks)."""
    out["eager"] = _unused_eager(dist.get_world_size())
    out["zero3"] = _unused_run(ZeRO(3), backend="inductor")


SCENARIOS["unused_inductor"] = scenario_unused_inductor


if __name__ == "__main__":
    main()
