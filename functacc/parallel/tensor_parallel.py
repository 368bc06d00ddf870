"""Tensor parallelism: a layer's matrices split over the ranks of a group (Megatron-LM).

``TensorParallel(plan, size=2)`` splits the layers that ``plan`` names over groups of
``size`` consecutive ranks (one node's GPUs under torchrun); with more ranks than ``size``,
the groups replicate each other and the other strategy of ``parallel=[TensorParallel(...),
DataParallel()]`` averages gradients across them (a 2-D mesh: tensor parallel inside,
data parallel across).

The split is a transform of the model that the step is traced through: each split layer keeps
only its rank's slice of its parameters (the same ``nn.Parameter`` objects, so optimizers,
tied weights and ``state_dict`` names stay) and computes with the collectives of
:mod:`functacc.parallel.tp_ops`, which tracing turns into nodes of the step graph:

- ``"colwise"`` (``nn.Linear``): output features split, bias too; the input is whole on
  every rank, its gradient summed over the group in backward.
- ``"colwise_gather_output"`` (alias ``"colwise_rep"``): the same, its output gathered
  whole (Hugging Face's ``lm_head`` style, when the loss needs whole logits).
- ``"rowwise"`` (``nn.Linear``): input features split (the previous layer's colwise
  output); the partial products are summed over the group, the bias added once after.
- ``"vocab"`` (``nn.Embedding``; Hugging Face writes ``"rowwise"`` there, which means the
  same): rows split by vocabulary, ids outside a rank's rows give zeros, summed over the group.
- ``"replicate"``: left whole (to name an exception in a plan).

Plans follow Hugging Face's ``base_model_tp_plan``: keys are module names relative to any
parent, ``*`` standing for one name component (``"layers.*.self_attn.q_proj"``), so
``LlamaConfig().base_model_tp_plan`` works as is on ``LlamaForCausalLM`` (whose modules are
``model.layers.0...``). Styles of Hugging Face's that do not split an ``nn.Linear`` or an
``nn.Embedding`` as above (sequence parallel, ``local_*``, expert parallel) are an error.

Attention after a column-wise split sees ``1 / size`` of its heads: a reshape written with
``-1`` or the layer's ``head_dim`` (as Hugging Face's models are) works; one that bakes the
full head count (``view(b, s, n_heads, d)``) fails with a note naming the module.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .mesh import GroupRef
from .tp_ops import copy_to, gather_from, reduce_from

__all__ = ["TensorParallel", "TensorParallelLayout", "split_norm"]

ALIASES = {"colwise_rep": "colwise_gather_output"}
STYLES = ("colwise", "colwise_gather_output", "rowwise", "vocab", "replicate")


@dataclass(frozen=True)
class TensorParallel:
    """Split the layers ``plan`` names over groups of ``size`` ranks (``None``: all ranks).

    Example:
        >>> import functacc
        >>> tp = functacc.parallel.TensorParallel(
        ...     {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}, size=2
        ... )
        >>> tp.style_of("model.layers.3.mlp.up_proj"), tp.style_of("model.norm")
        ('colwise', None)
    """

    plan: Mapping[str, str]
    """Module name pattern -> style (see the module's docstring)."""
    size: int | None = None
    """Ranks per tensor-parallel group (consecutive ranks); must divide the world size."""
    _patterns: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Mapping) or not self.plan:
            raise TypeError(
                "TensorParallel's plan must be a non-empty mapping of module name patterns to "
                f"styles, e.g. {{'layers.*.mlp.up_proj': 'colwise'}}; got {self.plan!r}"
            )
        if self.size is not None and (not isinstance(self.size, int) or self.size < 1):
            raise ValueError(
                f"TensorParallel's size must be an int >= 1 or None; got {self.size!r}"
            )
        patterns = []
        for key, style in self.plan.items():
            style = ALIASES.get(style, style)
            if style not in STYLES:
                raise ValueError(
                    f"TensorParallel: the plan's style {self.plan[key]!r} for {key!r} is not one "
                    f"functacc splits; the styles are {', '.join(STYLES)} (and 'colwise_rep'). "
                    "Leave the module out of the plan (or 'replicate') to keep it whole."
                )
            body = r"[^.]+".join(re.escape(part) for part in key.split("*"))
            patterns.append((key, re.compile(rf"(?:.*\.)?{body}"), style))
        object.__setattr__(self, "_patterns", tuple(patterns))

    def style_of(self, name: str) -> str | None:
        """The style of the module called ``name``, ``None`` if the plan does not name it."""
        styles = {style for _, pattern, style in self._patterns if pattern.fullmatch(name)}
        if len(styles) > 1:
            raise ValueError(
                f"TensorParallel: module {name!r} matches plan entries of different styles "
                f"({', '.join(sorted(styles))}); make the patterns name it once"
            )
        return styles.pop() if styles else None

    def split(
        self, models: Sequence[nn.Module], group: dist.ProcessGroup | None
    ) -> list[TensorParallelLayout]:
        """Split each of ``models`` in place over ``group`` (``None``: one rank; the plan is
        checked all the same) and return where their parameters are split. Every plan entry
        must name a module of one of them."""
        size = dist.get_world_size(group) if group is not None else 1
        names = [n for m in models for n, _ in m.named_modules()]
        unused = [k for k, p, _ in self._patterns if not any(map(p.fullmatch, names))]
        if unused:
            raise ValueError(
                f"TensorParallel: the plan's {unused} name no module of "
                f"{', '.join(type(m).__name__ for m in models)} (whose modules are e.g. "
                f"{names[1:6]}); fix the pattern or leave it out"
            )
        return [self._split(m, group, size) for m in models]

    def _split(
        self, model: nn.Module, group: dist.ProcessGroup | None, size: int
    ) -> TensorParallelLayout:
        if hasattr(model, "_functacc_tensor_parallel"):
            raise ValueError(
                f"TensorParallel: this {type(model).__name__} is split already (a step was "
                "built on it with TensorParallel); build the model again for another step"
            )
        rank = dist.get_rank(group) if group is not None else 0
        chosen = [(n, m, self.style_of(n)) for n, m in model.named_modules()]
        chosen = [
            (n, m, "vocab" if s == "rowwise" and isinstance(m, nn.Embedding) else s)
            for n, m, s in chosen
            if s not in (None, "replicate")
        ]
        dims: dict[int, int] = {}  # id(parameter) -> the dimension split
        for name, module, style in chosen:
            for pname, dim in _split_dims(name, module, style, size).items():
                param = getattr(module, pname)
                if dims.setdefault(id(param), dim) != dim:
                    raise ValueError(
                        f"TensorParallel: {name}.{pname} is tied to a parameter split along "
                        f"dimension {dims[id(param)]}, but {style!r} splits it along {dim}: "
                        "give tied modules styles that split the same dimension (an embedding "
                        "'vocab' and its output layer 'colwise')"
                    )
        layout = TensorParallelLayout(GroupRef(group) if group is not None else None, size, rank)
        for pname, param in model.named_parameters(remove_duplicate=False):
            if id(param) in dims:
                layout.dims[pname] = dims[id(param)]
        done: set[int] = set()
        with torch.no_grad():
            for name, module, style in chosen:
                for pname, dim in _split_dims(name, module, style, size).items():
                    param = getattr(module, pname)
                    if id(param) not in done:
                        done.add(id(param))
                        param.data = param.data.chunk(size, dim)[rank].clone()
                _install(module, style, layout)
        # Where the heads are split: the parents of column-wise layers (not the model).
        for parent in {n.rpartition(".")[0] for n, _, s in chosen if s.startswith("colwise")}:
            if parent:
                _note_reshapes(model.get_submodule(parent), parent, size)
        model._functacc_tensor_parallel = layout
        return layout


@dataclass
class TensorParallelLayout:
    """Where a split model's parameters are split: ``dims`` maps each split parameter's
    name to the dimension split in ``size`` equal slices, slice ``rank`` kept here."""

    group_ref: GroupRef | None
    size: int
    rank: int
    dims: dict[str, int] = field(default_factory=dict)

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.group_ref() if self.group_ref is not None else None

    def gather(self, name: str, local: Tensor) -> Tensor:
        """``name``'s whole value from this rank's slice (a collective of the group)."""
        dim = self.dims.get(name)
        if dim is None or self.group is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim)

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """``model.state_dict()`` with every split tensor whole (a collective of the group:
        every rank of it calls this), e.g. to save the model for a run without tensor
        parallelism."""
        return {n: self.gather(n, t.detach()) for n, t in model.state_dict().items()}

    def slice(self, name: str, whole: Tensor) -> Tensor:
        """This rank's slice of ``name``'s whole value."""
        dim = self.dims.get(name)
        return whole if dim is None else whole.chunk(self.size, dim)[self.rank]

    def global_norm(self, grads: Mapping[str, Tensor]) -> Tensor:
        """The 2-norm of the whole gradient from each rank's slices (as
        :func:`functacc.optim.global_norm` of the whole one)."""
        whole = [g for n, g in grads.items() if n not in self.dims]
        return split_norm(whole, [g for n, g in grads.items() if n in self.dims], self.group)


def split_norm(whole: list[Tensor], split: list[Tensor], group: Any) -> Tensor:
    """The 2-norm of tensors of which ``whole`` are the same on every rank of ``group`` and
    ``split`` are this rank's slices: the slices' squared norms summed over the group, the
    others' counted once."""
    first = (whole + split)[0] if whole + split else torch.zeros(())
    squares = [torch.linalg.vector_norm(t, 2.0).square() for t in whole]
    total = torch.stack(squares).sum() if squares else first.new_zeros(())
    if split:
        mine = torch.stack([torch.linalg.vector_norm(t, 2.0).square() for t in split])
        total = total + reduce_from(mine.sum(), group)
    return total.sqrt()


def _split_dims(name: str, module: nn.Module, style: str, size: int) -> dict[str, int]:
    """The parameter -> dimension split for ``module`` in ``style``, checked."""
    # Hugging Face's Conv1D (GPT-2) is a linear layer with its weight transposed.
    out_dim = 1 if _is_conv1d(module) else 0
    if _is_linear(module) and style in ("colwise", "colwise_gather_output"):
        dims = {"weight": out_dim, "bias": 0} if module.bias is not None else {"weight": out_dim}
    elif _is_linear(module) and style == "rowwise":
        dims = {"weight": 1 - out_dim}
    elif isinstance(module, nn.Embedding) and style in ("vocab", "rowwise"):
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(
                f"TensorParallel: embedding {name!r} has max_norm, sparse=True or "
                "scale_grad_by_freq, which a "
                "vocabulary split cannot keep; leave it out of the plan"
            )
        dims = {"weight": 0}
    else:
        kinds = {"colwise": "nn.Linear", "colwise_gather_output": "nn.Linear"}
        kinds = {k: f"{v} (or Hugging Face's Conv1D)" for k, v in kinds.items()}
        raise TypeError(
            f"TensorParallel: {style!r} splits {kinds.get(style, 'nn.Linear or nn.Embedding')}"
            f"; the plan gives it to {name!r}, a {type(module).__module__}."
            f"{type(module).__qualname__}. Split its nn.Linear children instead, or leave it "
            "out of the plan"
        )
    for pname, dim in dims.items():
        extent = getattr(module, pname).shape[dim]
        if extent % size:
            raise ValueError(
                f"TensorParallel: {name}.{pname} has {extent} entries along dimension {dim}, "
                f"which {size} ranks cannot split evenly; pick a size that divides {extent}"
            )
    return dims


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _weight(module: nn.Module) -> Tensor:
    """The weight as ``F.linear`` takes it (out, in)."""
    return module.weight.t() if _is_conv1d(module) else module.weight


def _install(module: nn.Module, style: str, layout: TensorParallelLayout) -> None:
    """Give ``module`` the forward of its style (an instance attribute: the class and its
    other instances are untouched)."""
    if style == "colwise":

        def forward(self: nn.Linear, x: Tensor) -> Tensor:
            return F.linear(copy_to(x, layout.group), _weight(self), self.bias)

    elif style == "colwise_gather_output":

        def forward(self: nn.Linear, x: Tensor) -> Tensor:
            y = F.linear(copy_to(x, layout.group), _weight(self), self.bias)
            return gather_from(y, -1, layout.group)

    elif style == "rowwise":

        def forward(self: nn.Linear, x: Tensor) -> Tensor:
            y = reduce_from(F.linear(x, _weight(self)), layout.group)
            return y if self.bias is None else y + self.bias

    else:  # a vocabulary split of an embedding

        def forward(self: nn.Embedding, ids: Tensor) -> Tensor:
            rows = self.weight.shape[0]
            start = layout.rank * rows
            outside = (ids < start) | (ids >= start + rows)
            local = torch.where(outside, torch.zeros_like(ids), ids - start)
            pad = self.padding_idx
            pad = pad - start if pad is not None and start <= pad < start + rows else None
            out = F.embedding(local, self.weight, pad)
            return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), layout.group)

    module.forward = types.MethodType(forward, module)


def _note_reshapes(parent: nn.Module, name: str, size: int) -> None:
    """Wrap ``parent``'s forward so that an error inside it (a reshape to the full head
    count) says which module computes on a split width."""
    inner = parent.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        except RuntimeError as e:
            if "shape" in str(e) or "size" in str(e):
                e.add_note(
                    f"TensorParallel: {name} ({type(parent).__name__}) computes on 1/{size} "
                    "of its column-wise layers' output features (its heads, on this rank); if "
                    "this is a reshape to the full head count (view(b, s, n_heads, d)), write "
                    "it with -1 or the layer's head_dim, or leave these layers out of the plan."
                )
            raise

    parent.forward = forward
