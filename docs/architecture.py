"""Draw docs/architecture.png: functacc's modules grouped by the stage of the pipeline they
belong to, with the imports between the groups read from the source (ast), so the
picture follows the code.

    python docs/architecture.py            # writes docs/architecture.png (needs matplotlib)
    python docs/architecture.py --check    # fails if a module of functacc is in no group
"""

from __future__ import annotations

import argparse
import ast
import itertools
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "functacc"

# The stages, left to right in the picture, and the modules of each (package-relative).
STAGES: dict[str, list[str]] = {
    "front doors": ["frontends/*", "__init__", "__main__"],
    "engine: capture + trace": [
        "core/engine",
        "core/tracer",
        "core/body",
        "core/capture",
        "core/optimizers",
        "core/traced_state_view",
        "core/state_seen",
        "core/own_step",
        "core/own_step_state",
        "core/own_step_trace",
        "core/scalar_reads",
        "core/body_trace",
        "core/body_errors",
        "core/grad_clears",
        "core/python_state",
        "core/python_replay",
        "core/python_tensors",
        "core/python_numpy",
        "core/python_reach",
        "core/python_code",
        "core/python_memo",
        "core/python_location",
        "core/python_numbers",
        "core/python_clock",
        "core/python_trace",
        "core/python_recording",
        "core/python_lists",
        "core/python_effects",
        "core/python_schedulers",
        "core/python_draws",
        "core/generator_objects",
        "core/drawn_arrays",
        "core/python_made",
        "core/python_sets",
        "core/python_output",
        "core/host_calls",
        "core/python_percent",
        "core/python_files",
        "core/python_iterators",
        "core/c10d_in_trace",
        "core/value_checks",
        "core/constant_values",
        "core/host_values",
        "core/tensor_equal",
        "core/metric_checks",
        "core/averaged_model",
        "core/data_assign",
        "core/python_args",
        "core/mapping_args",
        "core/lookup_tables",
        "core/torch_checkpoint",
        "core/grad_scaler",
        "core/held_objects",
        "core/donation",
        "core/graph_passes",
        "core/eager_inplace",
        "core/recurrent",
        "core/packed",
        "core/functional",
        "core/watches",
        "core/diagnostics",
        "core/failure_sites",
        "core/foreach_versions",
    ],
    "signatures + cache": [
        "core/signature",
        "core/model_watch",
        "core/guards",
        "core/cache",
        "core/retrace_advice",
        "core/differences",
    ],
    "transforms": ["parallel/*", "transforms/*", "backends/split"],
    "compile": [
        "backends/__init__",
        "backends/compile",
        "backends/compile_worker",
        "backends/graph_transport",
        "backends/background",
        "backends/rnn",
        "backends/inductor/*",
    ],
    "run": ["backends/cudagraph", "backends/host_memory"],
}
# Beside the pipeline: what the stages use.
SUPPORT: dict[str, list[str]] = {
    "optimizers": ["optim/*"],
    "data": ["data/*"],
    "state": ["state/*"],
    "shared": ["errors", "_env", "_compat", "core/__init__"],
    "bench": ["bench/*"],
}
GROUPS = {**STAGES, **SUPPORT}


def modules() -> dict[str, Path]:
    """Every module of the package, by its package-relative name without .py."""
    return {str(p.relative_to(PACKAGE).with_suffix("")): p for p in PACKAGE.rglob("*.py")}


def group_of(name: str) -> str | None:
    for group, members in GROUPS.items():
        for member in members:
            if member == name or (member.endswith("/*") and name.startswith(member[:-1])):
                return group
    return None


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports (relative and absolute imports). A name that
    a package's ``__init__`` re-exports counts as an import of the module it comes from
    (``from ..backends import compile_graph`` imports ``backends/compile``)."""
    found = set()
    package = name.split("/")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif node.module and node.module.startswith("functacc"):
                base, node.level = [], 1
                node.module = node.module.removeprefix("functacc").lstrip(".") or None
            else:
                continue
            target = "/".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                found.add(resolve(target, alias.name, known))
    return found


def resolve(target: str, name: str, known: dict[str, Path]) -> str:
    """The module that ``from target import name`` reads ``name`` from: the submodule
    ``name``, the module that ``target``'s ``__init__`` re-exports it from, or ``target``."""
    sub = f"{target}/{name}".lstrip("/")
    for candidate in (sub, f"{sub}/__init__"):
        if candidate in known:
            return candidate
    init = f"{target}/__init__".lstrip("/")
    if init not in known:
        return target
    tree = ast.parse(known[init].read_text())
    for node in tree.body:  # the __init__'s own re-exports: from .module import name
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 1
            and node.module
            and any((alias.asname or alias.name) == name for alias in node.names)
        ):
            return resolve(f"{target}/{node.module.replace('.', '/')}".lstrip("/"), name, known)
    return init


def edges() -> Counter:
    """Imports between groups: (from group, to group) -> count. A subpackage's ``__init__``
    re-exporting its own modules is not counted (its importers are, by :func:`resolve`)."""
    known = modules()
    counted: Counter = Counter()
    for name, path in known.items():
        source = group_of(name)
        package = name.removesuffix("__init__") if "/" in name else None
        for target in imports(path, name, known):
            if package and target.startswith(package):
                continue
            if target in known and (group := group_of(target)) and group != source:
                counted[source, group] += 1
    return counted


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    width = 0.2 + 2.55 * max(len(STAGES), len(SUPPORT))
    fig, ax = plt.subplots(figsize=(width, 7.2))
    ax.set_xlim(0, width)
    ax.set_ylim(0, 6.9)
    ax.axis("off")
    boxes = {}
    known = modules()

    def box(group: str, x: float, y: float, w: float, h: float, color: str) -> None:
        members = sorted(n for n in known if group_of(n) == group and not n.endswith("__"))
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color, ec="k"))
        ax.text(x + w / 2, y + h - 0.25, group, ha="center", va="top", weight="bold")
        # A folder that all members share is written once, above them.
        folder = os.path.commonpath(members) if len(members) > 1 else ""
        lines = [f" {m.removeprefix(folder + '/')}" for m in members] if folder else members
        text = "\n".join(([f"{folder}/"] if folder else []) + lines[:12])
        text += "\n..." if len(members) > 12 else ""
        ax.text(x + 0.1, y + h - 0.6, text, va="top", fontsize=7, family="monospace")
        boxes[group] = (x, y, w, h)

    colors = ["#f4cccc", "#fce5cd", "#fde9d9", "#fff2cc", "#d9ead3", "#cfe2f3"]
    for i, (group, color) in enumerate(zip(STAGES, colors, strict=True)):
        box(group, 0.2 + i * 2.55, 2.9, 2.3, 3.6, color)
    for i, group in enumerate(SUPPORT):
        box(group, 0.2 + i * 2.55, 0.2, 2.3, 2.3, "#eeeeee")
    counted = edges()
    stages = list(STAGES)
    for a, b in itertools.pairwise(stages):  # the pipeline, left to right
        xa, ya, wa, ha = boxes[a]
        xb, _, _, _ = boxes[b]
        ax.add_patch(
            FancyArrowPatch(
                (xa + wa, ya + ha / 2), (xb, ya + ha / 2), arrowstyle="-|>", mutation_scale=18
            )
        )
    summary = ", ".join(f"{a} -> {b}: {n}" for (a, b), n in sorted(counted.items()) if a and b)
    ax.text(
        0.2, 6.75, "imports between groups (from the source): " + summary, fontsize=6, wrap=True
    )
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    missing = sorted(n for n in modules() if group_of(n) is None)
    if missing:
        sys.exit(f"modules in no group of docs/architecture.py: {missing}")
    if not args.check:
        draw(Path(__file__).with_name("architecture.png"))


if __name__ == "__main__":
    main()
