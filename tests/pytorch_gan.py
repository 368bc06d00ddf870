"""Running one of eriklindernoren/PyTorch-GAN's scripts eagerly and through functacc.jit.

Each test file holds its script's text (``SCRIPT``, the loop body as ``iteration``); this
runs it from a file in a folder of its own, as ``python <name>.py`` would, once eagerly and
once with ``iteration`` jitted over the script's generator and discriminator.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import functacc


def script(text: str, name: str, folder: str) -> dict:
    """The script ``text`` run as ``python <name>.py`` would, from a file in ``folder``."""
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    namespace = {"__name__": name}
    exec(compile(text, path, "exec"), namespace)
    return namespace


def images(folder: Path) -> dict[str, bytes]:
    """The files a run saved into ``folder``, by name."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def eager_and_jit(
    text: str, name: str, tmp_path: Path, monkeypatch: Any, capsys: Any,
    batches: Sequence[tuple], call: Callable[[Callable, int, tuple], Any],
) -> dict[str, tuple]:  # fmt: skip
    """Per run ("eager", "jit"): the script's namespace, what it printed, NumPy's generator
    key after it and the step; ``call(step, i, batch)`` calls the loop body for a batch."""
    runs = {}
    for run in ("eager", "jit"):
        (tmp_path / run / "images").mkdir(parents=True)
        monkeypatch.chdir(tmp_path / run)
        ns = script(text, name, str(tmp_path / run))
        step = ns["iteration"]
        if run == "jit":
            step = functacc.jit(
                step,
                modules=[ns["generator"], ns["discriminator"]],
                optimizers=[ns["optimizer_G"], ns["optimizer_D"]],
                backend="eager",
            )
        capsys.readouterr()
        for i, batch in enumerate(batches):
            call(step, i, batch)
        runs[run] = (ns, capsys.readouterr().out, np.random.get_state()[1].copy(), step)
    return runs
