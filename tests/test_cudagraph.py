"""CUDA graphs: the capture/replay logic on CPU with a stand-in graph; the real capture on
CUDA (skipped here, with the reason, when no GPU is present)."""

from __future__ import annotations

import copy
import typing

import models
import pytest
import torch
from helpers import assert_close, exact_cuda
from torch import nn

import functacc
from functacc.backends import cudagraph


class RecordedGraph:
    """Stands in for a CUDA graph on CPU: capture records the closure, replay runs it and
    writes the results into fixed output tensors, as a real replay writes its static
    outputs."""

    captures = 0

    def __init__(self) -> None:
        self.fn = None
        self.outputs: list[torch.Tensor] = []

    def capture(self, fn, pool) -> None:
        RecordedGraph.captures += 1
        self.fn = fn

    def replay(self) -> None:
        results = self.fn()
        if not self.outputs:
            self.outputs = [torch.empty_like(r) for r in results]
        for static, r in zip(self.outputs, results, strict=True):
            static.copy_(r)


def test_cuda_graphs_true_on_cpu_is_an_error() -> None:
    model = models.mlp()
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            cuda_graphs=True,
        )


def test_collectives_are_captured_only_with_nccl() -> None:
    from functacc.backends.cudagraph import check_cuda_graphs, cuda_backend

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cuda_backend("cpu:gloo,cuda:nccl") == "nccl" and cuda_backend("nccl") == "nccl"
    assert cuda_backend("cpu:gloo,cuda:gloo") == "gloo" and cuda_backend("cpu:gloo") is None
    assert check_cuda_graphs(None, gpu) and check_cuda_graphs(None, gpu, "cpu:gloo,cuda:nccl")
    # gloo's collectives run on the host: a capture of them fails inside CUDA
    # (cudaErrorStreamCaptureInvalidated, seen on an H100 with two ranks on one GPU).
    assert not check_cuda_graphs(None, gpu, "cpu:gloo,cuda:gloo")
    assert not check_cuda_graphs(None, cpu, None) and not check_cuda_graphs(False, gpu)
    with pytest.raises(ValueError, match=r"backend for CUDA tensors is 'gloo'.*one process per"):
        check_cuda_graphs(True, gpu, "cpu:gloo,cuda:gloo")


def test_runner_copies_in_and_out() -> None:
    state = torch.zeros(3)
    calls = []

    def run(inputs):
        s, x = inputs
        calls.append(x.data_ptr())
        s.add_(x)
        return [s.sum().reshape(1)]

    runner = cudagraph.CudaGraphRunner(run, 1, graph_factory=RecordedGraph, pool_factory=object)
    first = runner([state, torch.ones(3)])  # warm-up: runs directly
    second = runner([state, torch.full((3,), 2.0)])  # capture, then replay
    batch = torch.full((3,), 3.0)
    third = runner([state, batch])
    assert [float(o) for o in (first[0], second[0], third[0])] == [3.0, 9.0, 18.0]
    assert runner.captures == 1
    # Replays read the static buffer, never the caller's tensor.
    (entry,) = runner.entries.values()
    assert calls[-1] == entry.static_batch[0].data_ptr() != batch.data_ptr()
    third[0].add_(100.0)  # the caller owns a copy
    assert float(entry.graph.outputs[0]) == 18.0


def test_runner_recaptures_when_the_state_moves() -> None:
    def run(inputs):
        return [inputs[0] + inputs[1]]

    runner = cudagraph.CudaGraphRunner(run, 1, graph_factory=RecordedGraph, pool_factory=object)
    a = torch.zeros(2)
    for _ in range(3):
        runner([a, torch.ones(2)])
    b = torch.zeros(2)  # e.g. optimizer.load_state_dict replaced the tensors
    out = runner([b, torch.ones(2)])
    assert runner.captures == 2 and torch.equal(out[0], torch.ones(2))


def test_step_with_graph_replay_matches_plain_step(monkeypatch) -> None:
    monkeypatch.setattr(cudagraph, "DEFAULT_GRAPH_FACTORY", RecordedGraph)
    monkeypatch.setattr(cudagraph, "check_cuda_graphs", lambda *args: True)
    torch.manual_seed(0)
    model = models.cnn_bn()
    ref = copy.deepcopy(model)
    step = functacc.compile_step(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        backend="eager",
    )
    step._jitted._engine._captures = lambda devices: True  # on CPU: the recorded graph
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_step = functacc.compile_step(
        ref, nn.CrossEntropyLoss(), ref_opt, backend="eager", cuda_graphs=False
    )
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        torch.manual_seed(i)
        loss = step(x, y)
        torch.manual_seed(i)
        ref_loss = ref_step(x, y)
        assert torch.equal(loss, ref_loss)
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    program = step._jitted._engine.cache.programs()[0]
    assert program.run.describe() == {"calls": 5, "captures": 1, "kept": 1, "evictions": 0}


class PooledGraph(RecordedGraph):
    pools: typing.ClassVar[list] = []

    def capture(self, fn, pool) -> None:
        PooledGraph.pools.append(pool)
        super().capture(fn, pool)


def test_one_capture_per_size_least_recently_used_evicted_one_pool() -> None:
    # A graph with symbolic sizes serves many batch shapes; a CUDA graph only one.
    def run(inputs):
        return [inputs[0] + inputs[1].sum()]

    PooledGraph.pools = []
    runner = cudagraph.CudaGraphRunner(
        run, 1, cache_size=2, graph_factory=PooledGraph, pool_factory=object, warmup_calls=0
    )
    state = torch.zeros(1)
    for n in (2, 3, 2, 4, 3):  # 4 evicts 3 (2 was used more recently); 3 comes back
        out = runner([state, torch.ones(n)])
        assert float(out[0]) == n  # each replay read its own size's static buffer
    assert list(runner.entries) == [(torch.Size([4]),), (torch.Size([3]),)]
    assert runner.describe() == {"calls": 5, "captures": 4, "kept": 2, "evictions": 2}
    assert len(PooledGraph.pools) == 4 and len({id(p) for p in PooledGraph.pools}) == 1


@pytest.mark.parametrize("optimizer", ["torch.optim", "as_optimizer"])
def test_step_with_symbolic_sizes_captures_per_size(monkeypatch, optimizer) -> None:
    # torch.optim.SGD: its functional twin; SGD as functacc.optim.as_optimizer: its own
    # step() traced.
    monkeypatch.setattr(cudagraph, "DEFAULT_GRAPH_FACTORY", RecordedGraph)
    monkeypatch.setattr(cudagraph, "_default_pool", object)

    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "torch.optim":
            return torch.optim.SGD(model.parameters(), lr=0.1)
        return functacc.optim.as_optimizer(model.named_parameters(), functacc.optim.sgd(0.1))

    torch.manual_seed(0)
    model = models.mlp()
    ref = copy.deepcopy(model)
    make = functacc.compile_step
    step = make(model, nn.CrossEntropyLoss(), sgd(model), backend="eager", cuda_graph_cache_size=2)
    step._jitted._engine._captures = lambda devices: True  # on CPU: the recorded graph
    ref_step = make(ref, nn.CrossEntropyLoss(), sgd(ref), backend="eager", cuda_graphs=False)
    for n in (8, 6, 6, 5, 5, 7, 7, 6, 6):
        x, y = torch.randn(n, 16), torch.randint(0, 5, (n,))
        assert torch.equal(step(x, y), ref_step(x, y))
    assert step.num_traces == 2  # static 8, then one symbolic graph for every other size
    assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0, what="model")
    symbolic = step._jitted._engine.cache.programs()[-1].run.describe()
    # Sizes 6, 5, 7, 6: warm-up then capture per size, two kept, 6 re-captured after eviction.
    assert symbolic == {"calls": 8, "captures": 4, "kept": 2, "evictions": 2}


# -- functacc.jit ---------------------------------------------------------------------------
def accumulating(seed: int = 0) -> tuple:
    """A body that adds to the .grad its previous call left (no zero_grad): the graph reads
    and writes the gradients, which the capture bakes in like the rest of the state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    g = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))] * 3
    return (model, opt), body, [model], [opt], data


def jit_cases() -> dict:
    from test_jit import CASES

    return {**CASES, "accumulating": accumulating}


def captured(step: functacc.Jitted, monkeypatch) -> functacc.Jitted:
    """``step`` captures every program, with :class:`RecordedGraph` standing in for CUDA."""
    monkeypatch.setattr(cudagraph, "DEFAULT_GRAPH_FACTORY", RecordedGraph)
    monkeypatch.setattr(cudagraph, "_default_pool", object)
    step._engine._captures = lambda devices: True
    return step


@pytest.mark.parametrize("case", sorted(jit_cases()))
def test_jit_with_graph_replay_matches_plain_jit(case: str, monkeypatch) -> None:
    from test_jit import assert_same, tensors_of

    _, body, modules, optimizers, data = jit_cases()[case]()
    _, ref_body, ref_modules, ref_optimizers, _ = jit_cases()[case]()
    ref = functacc.jit(ref_body, modules=ref_modules, optimizers=ref_optimizers, backend="eager")
    step = functacc.jit(body, modules=modules, optimizers=optimizers, backend="eager")
    step = captured(step, monkeypatch)
    for i, batch in enumerate(data * 2):  # warm-up, capture, then replays
        torch.manual_seed(i)
        out = step(*batch)
        torch.manual_seed(i)
        expected = ref(*batch)
        for x, y in zip(
            torch.utils._pytree.tree_leaves(out),
            torch.utils._pytree.tree_leaves(expected),
            strict=True,
        ):
            assert torch.equal(x, y)
        assert_same(tensors_of(modules, optimizers), tensors_of(ref_modules, ref_optimizers))
    runners = [p.run for p in step._engine.cache.programs()]
    assert all(isinstance(r, cudagraph.CudaGraphRunner) for r in runners)
    assert not any(
        isinstance(p.run, cudagraph.CudaGraphRunner) for p in ref._engine.cache.programs()
    )
    # The steady state's program: captured once, then replayed.
    assert runners[-1].captures == 1 and runners[-1].calls >= 4, runners[-1].describe()


@pytest.mark.inductor
def test_jit_with_graph_replay_under_inductor_matches_plain_jit(monkeypatch) -> None:
    # Inductor's wrapper empties the argument list it is given: a replay must pass its own.
    from test_jit import assert_same, tensors_of

    _, body, modules, optimizers, data = accumulating()
    _, ref_body, ref_modules, ref_optimizers, _ = accumulating()
    ref = functacc.jit(ref_body, modules=ref_modules, optimizers=ref_optimizers)
    step = captured(functacc.jit(body, modules=modules, optimizers=optimizers), monkeypatch)
    for batch in data * 2:
        # The same graph, compiled to the same kernels (Inductor's cache): equal bits.
        assert torch.equal(step(*batch), ref(*batch))
        assert_same(tensors_of(modules, optimizers), tensors_of(ref_modules, ref_optimizers))
    runner = step._engine.cache.programs()[-1].run
    assert isinstance(runner, cudagraph.CudaGraphRunner) and runner.captures == 1


@pytest.mark.parametrize("name", ["hidden_on_trainer", "tensor_meter", "closure_tensors"])
def test_jit_with_graph_replay_feeds_the_tensors_of_the_python_state(name, monkeypatch) -> None:
    # A tensor read from Python state is an input of the capture: copied into its static
    # buffer at every replay (a new hidden state, a replaced mask), and an in-place update
    # (the meter's sum) copied back out into the tensor itself.
    from test_jit import assert_same, tensors_of
    from test_jit_python import CASES

    case, eager = CASES[name](), CASES[name]()
    step = functacc.jit(
        case.body, modules=case.modules, optimizers=case.optimizers, backend="eager"
    )
    step = captured(step, monkeypatch)
    for i, batch in enumerate(case.batches * 2):  # warm-up, capture, then replays
        case.between(i)
        eager.between(i)
        torch.manual_seed(i)
        out = step(*batch)
        torch.manual_seed(i)
        assert torch.equal(out, eager.body(*batch)), i
        leaves = torch.utils._pytree.tree_leaves
        for x, y in zip(leaves(case.state()), leaves(eager.state()), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (i, x, y)
        assert_same(
            tensors_of(case.modules, case.optimizers), tensors_of(eager.modules, eager.optimizers)
        )
    runners = [p.run for p in step._engine.cache.programs()]
    assert all(isinstance(r, cudagraph.CudaGraphRunner) for r in runners), runners
    # The steady state's program: captured, then replayed.
    assert any(r.captures == 1 and r.calls >= 4 for r in runners), [r.describe() for r in runners]


def test_jit_pure_form_with_graph_replay_writes_the_donated_state(monkeypatch) -> None:
    from test_jit import example

    ex = example("pure_loop")
    apply_fn, opt, state = ex.build()
    train_step = ex.make_step(apply_fn, opt)
    reference = ex.build()[2]
    step = captured(functacc.jit(train_step, donate=(0,), backend="eager"), monkeypatch)
    for batch in ex.batches(5):
        address = state["params"]["0.weight"].data_ptr()
        state, metrics = step(state, batch)
        reference, expected = train_step(reference, batch)
        # The replay wrote into its static copy of the state, copied back into the donated
        # memory, which the new state is.
        assert state["params"]["0.weight"].data_ptr() == address
        for x, y in zip(
            torch.utils._pytree.tree_leaves((state, metrics)),
            torch.utils._pytree.tree_leaves((reference, expected)),
            strict=True,
        ):
            assert torch.equal(x, y)
    (program,) = step._engine.cache.programs()
    assert program.run.describe() == {"calls": 5, "captures": 1, "kept": 1, "evictions": 0}


def test_jit_cuda_graphs_true_on_cpu_is_an_error() -> None:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        functacc.jit(lambda x: model(x).sum(), modules=[model], optimizers=[opt], cuda_graphs=True)
    step = functacc.jit(lambda w: (w * 2,), cuda_graphs=True, backend="eager")  # pure form
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        step(torch.ones(2))


def on_gpu(case: str, cuda_graphs: bool) -> tuple:
    """``case``'s body jitted with its modules, optimizers and batches on the GPU (the
    optimizers' state is still empty, so moving the modules keeps it theirs)."""
    _, body, modules, optimizers, data = jit_cases()[case]()
    for module in modules:
        module.cuda()
    data = [tuple(t.cuda() for t in batch) for batch in data]
    step = functacc.jit(body, modules=modules, optimizers=optimizers, cuda_graphs=cuda_graphs)
    return step, modules, optimizers, data


@pytest.fixture
def exact() -> typing.Iterator[None]:
    with exact_cuda():
        yield


def noise_gradients(modules: list[nn.Module], optimizers: list) -> set[str]:
    """``tensors_of`` key prefixes of biases that feed a BatchNorm, of their optimizer state
    and of that norm's running mean: the bias's gradient is zero up to rounding (the norm
    subtracts the mean), which Adam turns into lr-sized noise in either implementation, and
    the running mean adds the bias, so none of these is compared."""
    noisy: dict[str, nn.Parameter] = {}
    keys = set()
    for i, module in enumerate(modules):
        for name, seq in module.named_modules():
            if isinstance(seq, nn.Sequential):
                for j, (a, b) in enumerate(zip(seq, list(seq)[1:], strict=False)):
                    if isinstance(b, nn.modules.batchnorm._BatchNorm) and a.bias is not None:
                        noisy[f"{i}.{name + '.' if name else ''}{j}.bias"] = a.bias
                        keys.add(f"{i}.{name + '.' if name else ''}{j + 1}.running_mean")
    ids = {id(p) for p in noisy.values()}
    keys |= set(noisy)  # the bias, its .grad and .requires_grad
    for i, opt in enumerate(optimizers):
        params = [p for group in opt.param_groups for p in group["params"]]
        keys |= {f"opt{i}.{k}." for k, p in enumerate(params) if id(p) in ids}
    return keys


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("exact")
@pytest.mark.parametrize("case", sorted(jit_cases()))
def test_jit_cuda_graph_matches_uncaptured_on_gpu(case: str) -> None:
    # The WGAN-GP (double backward, two optimizers, random interpolates), the distillation
    # (a frozen teacher) and EMA+SAM bodies, among others, under Inductor on the GPU: the
    # captured run replays the very kernels the uncaptured one launches one by one, with
    # the same seed before each call, so the two agree bit for bit.
    from test_jit import assert_same, tensors_of

    runs = []
    for cuda_graphs in (True, False):
        step, modules, optimizers, data = on_gpu(case, cuda_graphs)
        outs = []
        for i, batch in enumerate(data * 2):  # warm-up, capture, then replays
            torch.manual_seed(i)
            outs.append(step(*batch))
        runs.append((outs, tensors_of(modules, optimizers)))
        if cuda_graphs:
            runner = step._engine.cache.programs()[-1].run
            assert isinstance(runner, cudagraph.CudaGraphRunner), type(runner)
            assert runner.captures == 1 and runner.calls >= 4, runner.describe()
    for x, y in zip(*(torch.utils._pytree.tree_leaves(r[0]) for r in runs), strict=True):
        assert x.is_cuda and torch.equal(x, y)
    assert_same(runs[0][1], runs[1][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("exact")
@pytest.mark.parametrize("case", ["accumulating", "distillation", "ema_sam"])
def test_jit_cuda_graph_matches_the_eager_body_on_gpu(case: str) -> None:
    # The captured, Inductor-compiled step against the same body run eagerly on the same
    # GPU, dropout off in both (Triton's random draws are not eager's). fp32 throughout (no
    # TF32); Inductor fuses and reorders reductions, so 6 steps agree to rounding, not to
    # the bit: rtol 1e-4 on the weights.
    from test_jit import tensors_of

    step, modules, optimizers, data = on_gpu(case, cuda_graphs=True)
    _, body, ref_modules, ref_optimizers, _ = jit_cases()[case]()
    for module in ref_modules:
        module.cuda()
    for m in [m for module in modules + ref_modules for m in module.modules()]:
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for batch in data * 2:
        got, expected = step(*batch), body(*batch)
        for x, y in zip(*map(torch.utils._pytree.tree_leaves, (got, expected)), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    got, expected = tensors_of(modules, optimizers), tensors_of(ref_modules, ref_optimizers)
    assert got.keys() == expected.keys()
    noise = noise_gradients(modules, optimizers)  # distillation's Linear -> BatchNorm1d
    assert case != "distillation" or noise
    for key, value in got.items():
        if isinstance(value, torch.Tensor) and not any(key.startswith(k) for k in noise):
            # Adam's step count: eager keeps it on the host, the step on the GPU (as torch
            # does with capturable=True) so that a replay advances it; the value must agree.
            count = key.startswith("opt") and key.endswith(".step")
            torch.testing.assert_close(
                value,
                expected[key],
                rtol=1e-4,
                atol=1e-5,
                check_device=not count,
                msg=lambda m, key=key: f"{key}: {m}",
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("exact")
def test_cuda_graph_step_matches_uncaptured_step_on_gpu() -> None:
    torch.manual_seed(0)
    model = models.cnn_bn().cuda()
    ref = copy.deepcopy(model)
    step = functacc.compile_step(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        cuda_graphs=True,
    )
    ref_step = functacc.compile_step(
        ref,
        nn.CrossEntropyLoss(),
        torch.optim.AdamW(ref.parameters(), lr=1e-3),
        cuda_graphs=False,
    )
    model[9].p = ref[9].p = 0.0  # the two runs draw dropout differently
    for _ in range(5):
        x = torch.randn(8, 3, 16, 16, device="cuda")
        y = torch.randint(0, 5, (8,), device="cuda")
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)
    assert_close(model.state_dict(), ref.state_dict(), rtol=1e-4, atol=1e-5, what="model")


@pytest.mark.parametrize("size", [0, 2.0, True])
def test_a_bad_cuda_graph_cache_size_is_a_clear_error_at_both_doors(size) -> None:
    model = models.mlp()
    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.RMSprop(model.parameters()),
    ):
        with pytest.raises(ValueError, match=r"cuda_graph_cache_size must be an int >= 1; got"):
            functacc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graph_cache_size=size)
    with pytest.raises(ValueError, match=r"cuda_graph_cache_size must be an int >= 1; got"):
        functacc.jit(lambda x: x * 2, cuda_graph_cache_size=size)
