"""What a jitted step prints, logs or shows in a progress bar, against the same body run
eagerly: the same text on every call (before, the trace printed once, with symbols such as
``loss zuf0``, and never again). Compared as text, exactly: the eager backend computes
eager's numbers bit for bit."""

# ruff: noqa: UP031  (the "%" formats users write are tested here)
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import re

import pytest
import torch
from torch import nn
from tqdm import tqdm

import functacc


class Stream:
    """Where the progress bar writes."""

    def __init__(self) -> None:
        self.bars: list[str] = []

    def write(self, text: str) -> None:
        self.bars.append(text)

    def flush(self) -> None:
        pass


def build(jit: bool, stream: Stream, backend: str = "eager") -> tuple:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = logging.getLogger("functacc-test-output")
    bar = tqdm(total=4, file=stream, ascii=True, mininterval=0, bar_format="{n}/{total} {postfix}")
    run = {"step": 0, "last": ""}

    def body(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        print(f"step {run['step']}: loss {loss.item():.5f}", "raw", loss.item())
        print("%%: %.4f, %e" % (loss.item(), loss.item()))
        log.info("loss %.4f after %d steps", loss.item(), run["step"] + 1)
        bar.update(1)
        bar.set_postfix(loss=loss.item())
        run["last"] = f"{loss.item():.3e}"  # a formatted string kept between calls
        run["step"] += 1
        return loss.detach()

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
    return body, bar, run


def test_print_logging_and_tqdm_in_the_step_show_eagers_output_every_call(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    outputs = run_both(capsys, caplog, "eager")
    assert outputs[True] == outputs[False]  # the eager backend: the same numbers, bit for bit
    printed, logged, n, _, _, run = outputs[True]
    assert printed.count("step ") == 4 and len(logged) == 4 and n == 4
    assert run["last"][-4] == "e"  # "-1.234e-01"


@pytest.mark.inductor
def test_under_inductor_the_same_lines_with_inductors_numbers(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # Inductor's fused kernels may round the loss differently in the last bits: the lines
    # are compared with their numbers read back (rtol 1e-5), the rest as text.
    outputs = run_both(capsys, caplog, "inductor")
    number = re.compile(r"-?[0-9]+\.[0-9]+(?:e[-+][0-9]+)?")
    for got, want in zip(outputs[True], outputs[False], strict=True):
        got, want = str(got), str(want)
        assert number.sub("#", got) == number.sub("#", want)
        values = [float(v) for v in number.findall(got)]
        assert values == pytest.approx([float(v) for v in number.findall(want)], rel=1e-5)


def run_both(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, backend: str):
    caplog.set_level(logging.INFO, logger="functacc-test-output")
    outputs = {}
    for jit in (False, True):
        capsys.readouterr()
        caplog.clear()
        stream = Stream()
        step, bar, run = build(jit, stream, backend)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            step(torch.randn(4, 3, generator=g))
        bar.close()
        printed = capsys.readouterr().out
        logged = [r.getMessage() for r in caplog.records if r.name == "functacc-test-output"]
        bars = "".join(stream.bars).replace("\r", "")
        outputs[jit] = (printed, logged, bar.n, bar.postfix, bars, dict(run))
    return outputs


def checkpointing_run(jit: bool, folder) -> nn.Module:
    # A checkpoint every other step, written in the step (at the trace it wrote fake tensors
    # to disk and failed; now torch.save runs after each call that takes the branch).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run = {"step": 0}

    def body(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        if run["step"] % 2 == 0:
            torch.save(model.state_dict(), folder / f"model-{run['step']}.pt")
            torch.save({"step": run["step"], "loss": loss.item()}, folder / "last.pt")
        run["step"] += 1
        return loss.detach()

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        body(torch.randn(6, 3, generator=g))
    return model


def test_torch_save_in_the_step_writes_eagers_checkpoints(tmp_path) -> None:
    (tmp_path / "eager").mkdir()
    (tmp_path / "jit").mkdir()
    checkpointing_run(False, tmp_path / "eager")
    model = checkpointing_run(True, tmp_path / "jit")
    names = sorted(p.name for p in (tmp_path / "eager").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "jit").iterdir())
    assert names == ["last.pt", "model-0.pt", "model-2.pt", "model-4.pt"]
    for name in names:
        want = torch.load(tmp_path / "eager" / name)
        got = torch.load(tmp_path / "jit" / name)
        assert list(got) == list(want), name
        for key, value in want.items():
            same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
            assert same, (name, key)
    model.load_state_dict(torch.load(tmp_path / "jit" / "model-2.pt"))  # loads as eager's


def test_a_body_written_in_a_notebook_cell_prints_every_call(capsys) -> None:
    # IPython compiles a cell under a name such as "<ipython-input-3-...>".
    source = (
        "def body(x):\n"
        "    loss = model(x).pow(2).mean()\n"
        "    print(f'loss {loss.item():.4f}')\n"
        "    return loss.detach()\n"
    )
    torch.manual_seed(0)
    scope = {"model": nn.Linear(3, 2)}
    exec(compile(source, "<ipython-input-3-0123456789ab>", "exec"), scope)
    step = functacc.jit(scope["body"], modules=[scope["model"]], backend="eager")
    xs = [torch.randn(4, 3) for _ in range(3)]
    capsys.readouterr()
    for x in xs:
        scope["body"](x)
    eager = capsys.readouterr().out
    for x in xs:
        step(x)
    assert capsys.readouterr().out == eager and eager.count("loss ") == 3


def percent_run(jit: bool) -> tuple[str, dict, torch.Tensor]:
    # '%' formats as older code writes them (pytorch/examples' DCGAN prints its losses with
    # '%.4f'): str.__mod__ asks the traced number for a real float, which it has only
    # after the call.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"step": 0, "msg": ""}
    fmt = "%s: %+.3f (%5.1e)"

    def body(x: torch.Tensor, epoch: int) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        value = loss.item()
        print("[%d/%d][%x] Loss: %.4f %8.3e %g" % (epoch, 3, state["step"], value, value, value))
        print("%(loss).2f after %(n)04d" % {"loss": value, "n": state["step"]}, "%%")
        print(fmt % ("loss", value, value), "%s" % value)
        state["msg"] = "last %.6f, %.0f%%" % (value, 100 * value)  # kept between calls
        state["step"] += 1
        return loss.detach()

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i in range(4):
            body(torch.randn(4, 3), i // 2)
    assert not jit or body.num_traces == 2  # the epoch fed from its first change
    return out.getvalue(), state, model.weight.detach().clone()


def test_percent_formatting_of_traced_numbers_prints_eagers_text() -> None:
    eager, jitted = percent_run(False), percent_run(True)
    assert jitted[0] == eager[0] and eager[0].count("Loss: ") == 4
    assert jitted[1] == eager[1] and eager[1]["msg"].startswith("last 0.")
    assert torch.equal(jitted[2], eager[2])


def test_a_percent_format_not_written_at_the_operator_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    before = copy.deepcopy(model.state_dict())
    formats = {"loss": "loss %.4f"}

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        print(formats["loss"] % loss.item())
        return loss.detach()

    step = functacc.jit(body, modules=[model], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"formats a traced number with '%'.*f-string"):
        step(torch.randn(4, 3))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def tensor_text_run(jit: bool) -> tuple[str, torch.Tensor]:
    # Tensors put in text as tutorials do: print(loss) shows its grad_fn; str() and repr();
    # an f-string of a 0-dim tensor is its number, of a vector its repr; '%' takes both.
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print("loss", loss, [loss.detach()], out)
        print(str(loss), repr(norm), f"{loss} {norm:.3f} {out.detach()} {out.shape[0]}")
        print("%.4f %s|%r" % (norm.item(), loss, out))
        print(model.bias, model.weight.grad)  # "Parameter containing:" (a parameter's repr)

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for _ in range(3):
            body(torch.randn(3, 2))
    return out.getvalue(), model.weight.detach().clone()


def test_tensors_printed_or_formatted_in_the_step_read_as_in_eager() -> None:
    # Before: print(loss) lost ", grad_fn=<MeanBackward0>", str(loss) printed
    # "FakeTensor(..., size=())", f"{norm:.3f}" was an error.
    eager, jitted = tensor_text_run(False), tensor_text_run(True)
    assert jitted[0] == eager[0] and eager[0].count("grad_fn=<MeanBackward0>") == 9
    assert "grad_fn=<AddmmBackward0>" in eager[0] and "FakeTensor" not in jitted[0]
    assert eager[0].count("Parameter containing:\ntensor(") == 3
    assert torch.equal(jitted[1], eager[1])


def tensorboard_run(jit: bool, folder, library: str = "torch") -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if library == "tensorboardX":
        from tensorboardX import SummaryWriter
    else:
        from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer, state = SummaryWriter(folder), {"step": 0}

    def body(x: torch.Tensor) -> None:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        writer.add_scalar("Loss/train", loss.item(), state["step"])
        writer.add_scalar("loss_tensor", loss, state["step"])
        writer.add_histogram("weight", model.weight, state["step"])
        state["step"] += 1

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    for _ in range(4):
        body(torch.randn(4, 3))
    writer.close()
    events = EventAccumulator(str(folder), size_guidance={"histograms": 0})  # keep all
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    histograms = [(e.step, e.histogram_value) for e in events.Histograms("weight")]
    return {"scalars": scalars, "histograms": histograms}


@pytest.mark.parametrize("library", ["torch", "tensorboardX"])
def test_tensorboard_logged_in_the_step_gets_eagers_points(tmp_path, library: str) -> None:
    # Before: writer.add_scalar(...) ran once, while traced (one point, or an error); with
    # tensorboardX's SummaryWriter until 2026-11-27.
    eager, jitted = (
        tensorboard_run(False, tmp_path / "eager", library),
        tensorboard_run(True, tmp_path / "jit", library),
    )
    assert jitted == eager
    assert [s for s, _ in eager["scalars"]["Loss/train"]] == [0, 1, 2, 3]
    assert len(eager["histograms"]) == 4


def lr_logging_run(jit: bool, capsys: pytest.CaptureFixture, read) -> tuple:
    # WGAN's loop: RMSprop, weights clipped in place after the step, the learning rate
    # logged from inside the step while the scheduler is stepped outside it.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)

    def body(x: torch.Tensor) -> float:
        opt.zero_grad()
        loss = -model(x).mean()
        loss.backward()
        opt.step()
        for p in model.parameters():
            p.data.clamp_(-0.01, 0.01)
        print(f"lr {read(opt, sched):.3e} loss {loss.item():.5f}")
        return loss.item()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
    capsys.readouterr()
    losses = []
    for _ in range(4):
        losses.append(step(torch.randn(4, 3)))
        sched.step()
    return capsys.readouterr().out, losses, [p.detach().clone() for p in model.parameters()]


def test_a_learning_rate_logged_in_the_step_reads_as_in_eager(capsys) -> None:
    def last_lr(opt, sched):
        return sched.get_last_lr()[0]

    # get_last_lr() formatted, the scheduler not stepped in the step: the error said it was
    # ("after stepping the scheduler inside the step"); it now names what to read instead.
    with pytest.raises(functacc.TraceError, match=r"ExponentialLR.get_last_lr\(\).*param_groups"):
        lr_logging_run(True, capsys, last_lr)

    def group_lr(opt, sched):
        return opt.param_groups[0]["lr"]

    eager, jitted = lr_logging_run(False, capsys, group_lr), lr_logging_run(True, capsys, group_lr)
    assert jitted[0] == eager[0] and "lr 6.250e-03" in eager[0]
    assert jitted[1] == eager[1]
    assert all(torch.equal(a, b) for a, b in zip(jitted[2], eager[2], strict=True))


def test_a_tensor_formatted_with_percent_is_an_error_whose_advice_works() -> None:
    model = nn.Linear(3, 1)

    def body(x: torch.Tensor) -> str:
        loss = model(x).pow(2).mean()
        return "loss %.4f" % loss

    step = functacc.jit(body, modules=[model], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"(?s)formats a tensor with '%'.*loss.item\(\)"):
        step(torch.randn(4, 3))

    def advised(x: torch.Tensor) -> str:
        loss = model(x).pow(2).mean()
        return "loss %.4f" % loss.item()

    x = torch.randn(4, 3)
    assert functacc.jit(advised, modules=[model], backend="eager")(x) == advised(x)


def file_logging_run(jit: bool, folder) -> tuple[str, str]:
    # karpathy/build-nanogpt appends its train line to a log file inside the step; a
    # "last.txt" rewritten every call, and print(..., file=f) too.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log_file, last = folder / "log.txt", folder / "last.txt"
    log_file.write_text("")

    def body(x: torch.Tensor, step: int) -> float:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        with open(log_file, "a") as f:
            f.write(f"{step} train {loss.item():.6f}\n")
        with open(last, "w") as f:
            print("step", step, "loss", loss.item(), file=f)
            f.writelines([f"{loss.item():.2e}\n"])
        return loss.item()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
    for i in range(3):
        step(torch.ones(2, 3) * (i + 1), i)
    return log_file.read_text(), last.read_text()


def test_a_log_file_written_in_the_step_gets_eagers_lines(tmp_path) -> None:
    # Before: one line, written at the trace, with tokens for the numbers
    # ("0 train \x00functacc0:.6f\x00").
    (tmp_path / "eager").mkdir()
    (tmp_path / "jit").mkdir()
    eager = file_logging_run(False, tmp_path / "eager")
    jitted = file_logging_run(True, tmp_path / "jit")
    assert jitted == eager and eager[0].count("train") == 3 and eager[1].startswith("step 2 ")


def open_file_run(jit: bool, backend: str, path) -> tuple[str, list]:
    # A log opened before the loop and held by a variable, written in the step with an
    # f-string and a JSON line (json.dumps of the step's numbers, one rounded), and a
    # JSON line printed. Before 2026-11-28 the file got the trace's tokens once
    # ("\x00functacc0:.6f\x00"), silently, and json.dumps was a TypeError (SymFloat).
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    printed: list[str] = []
    log = open(path, "w")  # noqa: SIM115 (open across calls, as a training script keeps it)

    def body(x: torch.Tensor, step: int) -> None:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        log.write(f"{step} train {loss.item():.6f}\n")
        log.write(json.dumps({"step": step, "loss": round(loss.item(), 4)}) + "\n")
        print(json.dumps({"loss": loss.item(), "lr": opt.param_groups[0]["lr"]}), file=log)
        log.flush()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
    for i in range(3):
        step(torch.ones(2, 3) * (i + 1), i)
        printed.append(path.read_text())  # flushed by the step, as eager's
    log.close()
    return path.read_text(), printed


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_file_opened_before_the_step_gets_eagers_lines_and_json(tmp_path, backend) -> None:
    jitted, seen = open_file_run(True, backend, tmp_path / "jit.log")
    eager, eager_seen = open_file_run(False, backend, tmp_path / "eager.log")
    assert eager.count("\n") == 9 and json.loads(eager.splitlines()[4])["step"] == 1
    if backend == "eager":
        assert jitted == eager and seen == eager_seen
        return
    # Inductor's float32 kernels: the same lines, the numbers to rounding.
    for a, b in zip(jitted.splitlines(), eager.splitlines(), strict=True):
        if a.startswith("{"):
            x, y = json.loads(a), json.loads(b)
            assert x.keys() == y.keys() and all(
                x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6) for k in x
            )
        else:
            assert a.split()[:2] == b.split()[:2]
            assert float(a.split()[2]) == pytest.approx(float(b.split()[2]), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_json_dump_into_an_open_file_is_eagers(tmp_path, backend) -> None:
    # json.dump(stats, f) of the step's numbers (sorted keys, indented): eager's text after
    # every call. Before 2026-11-29 a TraceError ("Object of type SymFloat is not JSON
    # serializable"); json.dumps worked. Under Inductor the same text but for the loss's
    # last digits (float32 kernels fused otherwise): rel 1e-5, and abs 1e-8 for the third
    # loss, near 1e-5, where float32 rounding of the weights (1e-7) leaves 6e-10.
    def run(jit: bool, path) -> list[str]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = open(path, "w")  # noqa: SIM115 (open across calls, as a training script keeps it)

        def body(x: torch.Tensor, step: int) -> None:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            json.dump({"step": step, "loss": loss.item(), "lr": 0.1}, log, indent=1, sort_keys=True)
            log.write("\n")
            log.flush()

        call = (
            functacc.jit(body, modules=[model], optimizers=[opt], backend=backend) if jit else body
        )
        seen = []
        for i in range(3):
            call(torch.ones(2, 3) * (i + 1), i)
            seen.append(path.read_text())
        log.close()
        return seen

    eager = run(False, tmp_path / "eager.json")
    jitted = run(True, tmp_path / "jit.json")
    if backend == "eager":
        assert jitted == eager
    else:
        got, expected = (
            json.loads("[" + t[-1].replace("}\n{", "},{") + "]") for t in (jitted, eager)
        )
        assert [(d["step"], d["lr"]) for d in got] == [(d["step"], d["lr"]) for d in expected]
        losses = pytest.approx([d["loss"] for d in expected], rel=1e-5, abs=1e-8)
        assert [d["loss"] for d in got] == losses
    assert json.loads(eager[0])["step"] == 0 and eager[2].count('"loss"') == 3


def test_a_file_written_through_pathlib_in_the_step_is_eagers(tmp_path) -> None:
    def run(jit: bool, folder) -> list[str]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        folder.mkdir()

        def body(x: torch.Tensor, step: int) -> None:
            loss = model(x).pow(2).mean()
            (folder / f"metrics-{step}.txt").write_text(f"{loss.item():.4f}")
            (folder / "last.bin").write_bytes(b"step")

        step = functacc.jit(body, modules=[model], backend="eager") if jit else body
        for i in range(3):
            step(torch.ones(2, 3) * (i + 1), i)
        return [p.name + ":" + p.read_text() for p in sorted(folder.iterdir())]

    assert run(True, tmp_path / "jit") == run(False, tmp_path / "eager")


@pytest.mark.inductor
def test_this_sessions_python_features_under_inductor(tmp_path, capsys) -> None:
    # A number argument fed, a NumPy schedule looked up in the graph, a tensor printed, a
    # '%' format, a log file and a torch.compile'd loss, compiled by Inductor: eager's
    # text with Inductor's numbers (rtol 1e-5: fused kernels round the last bits), 2 compiles.
    import numpy as np

    def run(jit: bool) -> tuple[str, str, torch.Tensor, int]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        schedule, log = np.linspace(0.1, 0.01, 8), tmp_path / f"log{int(jit)}.txt"
        loss_fn = torch.compile(lambda out: out.pow(2).mean(), backend="eager")

        def body(x: torch.Tensor, it: int) -> None:
            opt.param_groups[0]["lr"] = schedule[it]
            opt.zero_grad()
            loss = loss_fn(model(x))
            loss.backward()
            opt.step()
            print("step %d" % it, loss)
            with open(log, "a") as f:
                f.write(f"{it} {loss.item():.6f}\n")

        step = functacc.jit(body, modules=[model], optimizers=[opt]) if jit else body
        capsys.readouterr()
        for i in range(4):
            step(torch.ones(2, 3) * (i + 1), i)
        return (
            capsys.readouterr().out,
            log.read_text(),
            model.weight.detach().clone(),
            (step.num_traces if jit else 0),
        )

    eager, jitted = run(False), run(True)
    number = re.compile(r"-?[0-9]+\.[0-9]+")
    for got, want in zip(jitted[:2], eager[:2], strict=True):
        assert number.sub("#", got) == number.sub("#", want)
        values = [float(v) for v in number.findall(got)]
        assert values == pytest.approx([float(v) for v in number.findall(want)], rel=1e-5)
    assert jitted[0].count("grad_fn=<MeanBackward0>") == 4 and jitted[1].count("\n") == 4
    torch.testing.assert_close(jitted[2], eager[2], rtol=1e-5, atol=1e-6)
    assert jitted[3] == 2  # the first call, then `it` fed


@pytest.mark.parametrize("read", ["param_groups", "get_last_lr"])
def test_the_learning_rate_read_after_a_scheduler_step_in_the_step_is_the_new_one(
    capsys, read: str
) -> None:
    # `scheduler.step(); lr = optimizer.param_groups[0]["lr"]` in the step, returned and
    # printed (a common log line): eager reads the rate the step just set. The jitted step
    # read the trace's value of the group, one step behind at every call, silently; now it
    # is the rate the replayed scheduler sets, as get_last_lr() was. With
    # CosineAnnealingWarmRestarts stepped by a fractional epoch of fed numbers.
    def run(jitted: bool) -> tuple[list, str]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2)

        def body(x: torch.Tensor, y: torch.Tensor, epoch: int, i: int) -> tuple:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step(epoch + i / 3)
            lr = opt.param_groups[0]["lr"] if read == "param_groups" else sched.get_last_lr()[0]
            print(f"epoch {epoch} lr {lr:.6f} loss {loss.item():.4f}")
            return loss.item(), lr

        step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        capsys.readouterr()
        out = [
            (step if jitted else body)(
                torch.randn(6, 4, generator=g), torch.arange(6) % 2, k // 3, k % 3
            )
            for k in range(6)
        ]
        return out, capsys.readouterr().out

    eager, jitted = run(False), run(True)
    assert jitted == eager and "lr 0.006699" in eager[1]


def wandb_run(jit: bool, folder, monkeypatch) -> list:
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = wandb.init(project="functacc-test", dir=str(folder), mode="offline")
    state = {"iter_num": 0}

    def body(x: torch.Tensor) -> None:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        # nanoGPT's log line, and the run's own method.
        wandb.log({"iter": state["iter_num"], "train/loss": loss.item(), "lr": 0.1})
        run.log({"weight_norm": model.weight.norm().item()})
        state["iter_num"] += 1

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    seen = []
    for _ in range(3):
        body(torch.randn(4, 3))
        seen.append((run.step, {k: v for k, v in dict(run.summary).items() if k[0] != "_"}))
    run.finish()
    return seen


def test_wandb_logged_in_the_step_gets_eagers_points(tmp_path, monkeypatch) -> None:
    # Before: wandb.log(...) in the step ran while traced: a TraceError deep in wandb (a
    # SymFloat is not JSON serializable), or, for constants only, one point at the trace.
    eager = wandb_run(False, tmp_path / "eager", monkeypatch)
    jitted = wandb_run(True, tmp_path / "jit", monkeypatch)
    assert jitted == eager
    assert [step for step, _ in eager] == [2, 4, 6] and eager[-1][1]["iter"] == 2


def test_stream_writes_tqdm_write_and_a_librarys_print_show_eagers_text(capsys) -> None:
    # sys.stdout.write and tqdm.write of an f-string, and Accelerate's accelerator.print
    # (a library method that calls print): before 2026-11-28 each wrote the trace's tokens
    # ("loss \x00functacc0:.4f\x00") once per trace and nothing on the other calls.
    import sys

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    def run(jit: bool) -> tuple[str, str]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def body(x: torch.Tensor) -> float:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            sys.stdout.write(f"write {loss.item():.5f}\n")
            tqdm.write(f"tqdm {loss.item():.4e}")
            accelerator.print(f"accelerate {loss.item():.3f}")
            sys.stderr.write("err %.4f\n" % loss.item())
            return loss.item()

        step = (
            functacc.jit(body, modules=[model], optimizers=[opt], backend="eager") if jit else body
        )
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 3, generator=g) for _ in range(4)]
        capsys.readouterr()
        for x in xs:
            step(x)
        captured = capsys.readouterr()
        return captured.out, captured.err

    eager, jitted = run(False), run(True)
    assert jitted == eager
    assert eager[0].count("write ") == eager[0].count("tqdm ") == 4
    assert eager[0].count("accelerate ") == eager[1].count("err ") == 4
