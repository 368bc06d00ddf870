"""The supported torch range: declared once, warned about at import, and the shims
working on the torch that runs the suite (see ``make test-torch``)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import functacc
from functacc import _compat

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_supported_range() -> None:
    # (a regex, not tomllib: Python 3.10 is supported and has none)
    declared = re.findall(r'^\s*"torch([<>=][^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    (low, high) = _compat.SUPPORTED
    assert declared == [f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"]


@pytest.mark.parametrize(
    ("version", "warns"),
    [((2, 10), True), ((2, 11), False), ((2, 13), False), ((2, 15), False), ((2, 16), True)],
)
def test_a_torch_outside_the_range_warns(version: tuple[int, int], warns: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.check_version(version)
    messages = [str(w.message) for w in caught]
    if warns:
        assert len(messages) == 1 and "supports torch 2.11 through 2.15" in messages[0]
    else:
        assert messages == []


def test_import_functacc_warns_on_an_unsupported_torch() -> None:
    # In a fresh process: the check runs once, when functacc is first imported.
    code = (
        "import warnings, torch\n"
        "torch.__version__ = '2.16.0a0+git1234'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import functacc\n"
        "print([str(w.message) for w in caught if 'functacc supports torch' in str(w.message)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert "torch 2.16.0a0+git1234" in out and "through 2.15" in out


@pytest.mark.parametrize(
    ("version", "release"), [("2.15.0+cu130", (2, 15)), ("2.11.0", (2, 11)), ("3.0.1", (3, 0))]
)
def test_release_of_a_version_string(version: str, release: tuple[int, int]) -> None:
    assert _compat._release(version) == release


def test_optimization_hint_reads_a_size_without_adding_a_guard() -> None:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(7, ConstantSource("n")), hint=7)
    assert _compat.optimization_hint(n) == 7
    assert _compat.optimization_hint(3) == 3
    assert not env.guards  # a choice of speed must not specialise the graph on the size
    unbacked = env.create_unbacked_symint()
    assert _compat.optimization_hint(unbacked, fallback=5) == 5


def _two_dropouts_in_bf16() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 4), nn.Dropout(0.1)).to(
        torch.bfloat16
    )


def test_inductor_differences_are_named_on_the_torch_that_has_them(monkeypatch) -> None:
    # Two dropouts in bf16: on torch 2.11 both differences apply (and warn once each);
    # after 2.11 neither does (and nothing warns).
    monkeypatch.setattr(_compat, "_WARNED", set())
    model = _two_dropouts_in_bf16()
    gm = make_fx(model)(torch.randn(4, 8, dtype=torch.bfloat16))
    expected = [] if _compat.TORCH > (2, 11) else ["random order", "16-bit rounding"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _compat.warn_where_inductor_differs(gm) == expected
        assert _compat.warn_where_inductor_differs(gm) == expected  # warned once only
    assert len([w for w in caught if "Inductor" in str(w.message)]) == len(expected)
    float32 = make_fx(nn.Linear(8, 4))(torch.randn(2, 8))
    assert _compat.warn_where_inductor_differs(float32) == []


@pytest.mark.inductor
def test_an_inductor_step_warns_where_this_torch_differs_from_eager(monkeypatch) -> None:
    monkeypatch.setattr(_compat, "_WARNED", set())
    model = _two_dropouts_in_bf16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = functacc.compile_step(model, lambda out, y: out.float().pow(2).mean(), opt)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(x, torch.zeros(4))
    messages = [str(w.message) for w in caught if "Inductor" in str(w.message)]
    assert len(messages) == (0 if _compat.TORCH > (2, 11) else 2), messages
