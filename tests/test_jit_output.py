"""What a jitted step prints, logs or shows in a progress bar, against the same body run
eagerly: the same text on every call (before, the trace printed once, with symbols such as
``loss zuf0``, and never again). Compared as text, exactly: the eager backend computes
eager's numbers bit for bit."""

from __future__ import annotations

import logging

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


def build(jit: bool, stream: Stream) -> tuple:
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
        log.info("loss %.4f after %d steps", loss.item(), run["step"] + 1)
        bar.update(1)
        bar.set_postfix(loss=loss.item())
        run["last"] = f"{loss.item():.3e}"  # a formatted string kept between calls
        run["step"] += 1
        return loss.detach()

    if jit:
        body = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    return body, bar, run


def test_print_logging_and_tqdm_in_the_step_show_eagers_output_every_call(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="functacc-test-output")
    outputs = {}
    for jit in (False, True):
        capsys.readouterr()
        caplog.clear()
        stream = Stream()
        step, bar, run = build(jit, stream)
        g = torch.Generator().manual_seed(1)
        losses = [step(torch.randn(4, 3, generator=g)).item() for _ in range(4)]
        bar.close()
        printed = capsys.readouterr().out
        logged = [r.getMessage() for r in caplog.records if r.name == "functacc-test-output"]
        outputs[jit] = (
            losses,
            printed,
            logged,
            bar.n,
            bar.postfix,
            "".join(stream.bars),
            dict(run),
        )
    eager, jitted = outputs[False], outputs[True]
    assert jitted[0] == eager[0]  # the same losses
    assert jitted[1] == eager[1] and jitted[1].count("step ") == 4, jitted[1]
    assert jitted[2] == eager[2] and len(jitted[2]) == 4
    assert jitted[3] == eager[3] == 4 and jitted[4] == eager[4]
    assert jitted[5].replace("\r", "") == eager[5].replace("\r", "")
    assert jitted[6] == eager[6] and jitted[6]["last"][-4] == "e"  # "-1.234e-01"
