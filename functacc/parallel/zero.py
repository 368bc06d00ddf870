"""ZeRO (Rajbhandari et al., 2020) stages 1-3 as transforms of the pure step.

The parameters of each *wrap unit* (a module whose class is in ``wrap_layer_cls``, or the
rest of the model) and optimizer param group are flattened into one padded vector; rank r of
a shard group of n ranks owns the r-th of its n equal chunks.

- stage 1: the optimizer state is sharded: gradients are all-reduced, each rank updates its
  chunk, the chunks are all-gathered into the new parameters.
- stage 2: as stage 1, but gradients are reduce-scattered (each rank receives only its chunk).
- stage 3: the parameters are sharded too. Each unit is all-gathered just before its forward
  (a forward pre-hook) and again in backward (a saved-tensor hook re-gathers instead of
  keeping the full weights alive), so the full weights live only while used; the gather's
  backward is the reduce-scatter of the gradient.

With ``shard_size`` < world size (hybrid), chunks are sharded within groups of
``shard_size`` ranks and the chunk gradients all-reduced across the groups.

The optimizer works on *segments*: the part of each parameter inside this rank's chunk
(possibly empty), keyed by the parameter's name, with the parameter's own step count. So a
parameter that gets no gradient (unused in forward, or frozen with ``requires_grad_(False)``)
is skipped exactly as ``torch.optim`` skips a ``.grad`` of ``None``: no weight decay, no
moment update, no step count, while the rest of its unit trains.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..core.functional import check_module_classes
from .comm import all_gather, all_reduce, average_written, reduce_scatter
from .mesh import Topology
from .strategy import Strategy

__all__ = ["FlatUnit", "Segment", "Sharded", "ZeRO"]


@dataclass(frozen=True)
class ZeRO:
    """Shard optimizer state (stage 1), gradients (2) and parameters (3) over the ranks.

    Example:
        >>> import functacc
        >>> zero3 = functacc.parallel.ZeRO(3, wrap_layer_cls={"Bottleneck"})
        >>> hybrid = functacc.parallel.ZeRO(2, shard_size=8)  # shard in 8s, replicate across
    """

    stage: int
    """1: optimizer state; 2: also gradients; 3: also parameters."""
    _: KW_ONLY
    shard_size: int | None = None
    """Ranks per shard group (None: all ranks). Must divide the world size."""
    wrap_layer_cls: Collection[str] | None = None
    """Class names of the modules whose parameters form one unit (gathered together in stage
    3), e.g. ``{"Bottleneck"}`` or ``{"TransformerEncoderLayer"}``; the rest is one unit."""
    bucket_mb: float = 25.0
    """Bucket size for the all-reduces of buffers and of unsharded parameters' gradients."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {self.stage!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0; got {self.bucket_mb}")
        if isinstance(self.wrap_layer_cls, str):
            object.__setattr__(self, "wrap_layer_cls", {self.wrap_layer_cls})

    def build(self, model: nn.Module, groups: Sequence[Sequence[str]] | None) -> Sharded:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        topology = Topology.build(self.shard_size, device_type=device_type)
        return Sharded(self, topology, model, groups)


@dataclass
class FlatUnit:
    """Parameters flattened into one padded vector, sharded in equal chunks."""

    key: str
    module: str
    group: int
    names: list[str]
    shapes: list[torch.Size]
    dtype: torch.dtype
    device: torch.device
    shard_size: int
    numels: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.numels = [math.prod(s) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def chunk(self) -> int:
        return -(-self.total // self.shard_size)

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """Concatenate and zero-pad to ``shard_size`` equal chunks."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.chunk * self.shard_size - self.total
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def my_chunk(self, flat: Tensor, shard_rank: int) -> Tensor:
        return flat[shard_rank * self.chunk : (shard_rank + 1) * self.chunk]

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        pieces = flat[: self.total].split(self.numels)
        return {n: p.view(s) for n, p, s in zip(self.names, pieces, self.shapes, strict=True)}

    def segments(self, shard_rank: int) -> dict[str, Segment]:
        """Where each parameter's part inside chunk ``shard_rank`` lies (possibly empty)."""
        lo, hi = shard_rank * self.chunk, (shard_rank + 1) * self.chunk
        out, offset = {}, 0
        for name, numel in zip(self.names, self.numels, strict=True):
            a = min(max(offset, lo), hi)
            b = max(min(offset + numel, hi), a)
            out[name] = Segment(self, a - lo, b - lo, a - offset if b > a else 0)
            offset += numel
        return out

    def covered(self, shard_rank: int) -> int:
        """Elements of chunk ``shard_rank`` that hold parameters (the rest is padding)."""
        lo = shard_rank * self.chunk
        return max(0, min(lo + self.chunk, self.total) - lo)


@dataclass(frozen=True, eq=False)
class Segment:
    """The part of one parameter inside this rank's chunk of its unit: chunk elements
    ``[start, stop)``, which are the parameter's flat elements from ``offset``."""

    unit: FlatUnit
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _wrap_modules(model: nn.Module, classes: Collection[str] | None) -> list[str]:
    """Qualified names of the outermost modules whose class is in ``classes``."""
    if not classes:
        return []
    check_module_classes(model, classes, "wrap_layer_cls")
    out: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(
            name.startswith(prefix + ".") for prefix in out
        ):
            out.append(name)
    return out


class Sharded(Strategy):
    """The ZeRO strategy built by :class:`ZeRO`."""

    named_state = False

    def __init__(
        self,
        config: ZeRO,
        topology: Topology,
        model: nn.Module,
        groups: Sequence[Sequence[str]] | None,
    ):
        self.config = config
        self.stage = config.stage
        self.topology = topology
        self.name = f"ZeRO-{config.stage}" + (
            f" (hybrid: {topology.replicas} x {topology.shard_size})"
            if topology.replicas > 1
            else ""
        )
        self.model = model
        self._model_full = True  # until live_params() empties the model (ZeRO-3)
        self.bucket_bytes = config.bucket_mb * 2**20
        params = dict(model.named_parameters())
        self._param_objects = params
        if groups is None:  # a GradientTransformation: every trainable parameter
            groups = [[n for n, p in params.items() if p.requires_grad]]
        group_of = {n: i for i, g in enumerate(groups) for n in g}
        wraps = _wrap_modules(model, config.wrap_layer_cls)
        self.units: list[FlatUnit] = []
        by_key: dict[tuple, FlatUnit] = {}
        for name, p in params.items():
            if name not in group_of:
                continue  # not optimised: stays whole on every rank
            module = next((w for w in wraps if name.startswith(w + ".")), "")
            unit_key = (module, group_of[name], p.dtype, p.device)
            if unit_key not in by_key:
                label = f"{module or '<root>'}[group {group_of[name]}]"
                if any(k[:2] == unit_key[:2] for k in by_key):
                    label += f"[{p.dtype}]"
                by_key[unit_key] = FlatUnit(
                    label,
                    module,
                    group_of[name],
                    [],
                    [],
                    p.dtype,
                    p.device,
                    topology.shard_size,
                )
                self.units.append(by_key[unit_key])
            by_key[unit_key].names.append(name)
            by_key[unit_key].shapes.append(p.shape)
            by_key[unit_key].__post_init__()
        self.sharded_names = {n for u in self.units for n in u.names}
        self.unit_of = {n: u for u in self.units for n in u.names}
        self.segment_of: dict[str, Segment] = {
            n: seg for u in self.units for n, seg in u.segments(topology.shard_rank).items()
        }
        self._used: set[str] = set()  # ZeRO-3, while tracing: parameters that got gradients
        # Tied parameters: every other name under which a sharded parameter is reachable.
        canonical = {id(p): n for n, p in params.items()}
        self.aliases: dict[str, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            first = canonical[id(p)]
            if name != first and first in self.sharded_names:
                self.aliases.setdefault(first, []).append(name)
                owner = next((w for w in wraps if name.startswith(w + ".")), "")
                if config.stage == 3 and owner != self.unit_of[first].module:
                    raise ValueError(
                        f"parameter {first!r} is tied to {name!r}, which lies in another ZeRO-3 "
                        f"unit ({owner or 'the root'!r} vs "
                        f"{self.unit_of[first].module or 'the root'!r}); a unit's weights are "
                        "gathered only while that unit runs. Keep tied modules in one unit "
                        "(drop their class from wrap_layer_cls) or use ZeRO stage 1 or 2."
                    )

    # -- construction (eager) ------------------------------------------------------------
    def live_params(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.stage < 3:
            return params
        live = {n: p for n, p in params.items() if n not in self.sharded_names}
        with torch.no_grad():
            for unit in self.units:
                flat = unit.flatten([params[n].detach() for n in unit.names])
                live[unit.key] = unit.my_chunk(flat, self.topology.shard_rank).clone()
                for n in unit.names:
                    # The model keeps no full copy under ZeRO-3: sync_model() restores it.
                    params[n].data = torch.empty(0, dtype=unit.dtype, device=unit.device)
        self._model_full = False
        return live

    @property
    def model_synced(self) -> bool:
        return self.stage < 3 or self._model_full

    def write_model_params(self, params: Mapping[str, Tensor], model_params: dict) -> None:
        super().write_model_params(params, model_params)
        self._model_full = True

    def release_model_params(self, model_params: Mapping[str, Tensor]) -> None:
        if self.stage < 3 or not self._model_full:
            return
        # Back to the empty placeholders live_params() left: the step's graph never reads
        # the model's own tensors (the gathered views replace them), and the full copies
        # would otherwise stay resident for the rest of training.
        for name in self.sharded_names:
            unit = self.unit_of[name]
            model_params[name].data = torch.empty(0, dtype=unit.dtype, device=unit.device)
        self._model_full = False

    def state_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        model_full = self._model_full  # copies are emptied, not the model
        live = self.live_params({n: p.detach().clone() for n, p in params.items()})
        self._model_full = model_full
        return live

    def full_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if self.stage < 3:
            return dict(params)
        out = {n: p for n, p in params.items() if n not in {u.key for u in self.units}}
        for unit in self.units:
            shard = params[unit.key].detach()
            flat = shard.new_empty(unit.chunk * unit.shard_size)
            if self.topology.shard_group is None:
                flat.copy_(shard)
            else:
                dist.all_gather_into_tensor(flat, shard.contiguous(), self.topology.shard_group)
            out.update(unit.unflatten(flat))
        return out

    def optimizer_groups(self, groups: list[list[str]]) -> list[list[str]]:
        return [[n for n in g if n in self.sharded_names] for g in groups]

    def load_full_params(self, model_params: Mapping[str, Tensor], live: dict) -> None:
        if self.stage < 3:
            return
        with torch.no_grad():
            for unit in self.units:
                flat = unit.flatten([model_params[n].detach() for n in unit.names])
                live[unit.key].copy_(unit.my_chunk(flat, self.topology.shard_rank))

    def shard_optimizer_state(self, named_state: Any, transform: Any, opt_params: dict) -> Any:
        """Shard a named optimizer state (torch's, when resuming) like the parameters: each
        per-parameter tensor becomes its segment; per-parameter scalars (Adam's ``step``)
        stay whole."""
        fresh = transform.init(opt_params)
        out = []
        for fresh_group, named_group in zip(fresh, named_state, strict=True):
            fields = {}
            for field_name in fresh_group._fields:
                new, old = getattr(fresh_group, field_name), getattr(named_group, field_name)
                if isinstance(new, dict) and any(n in self.sharded_names for n in new):
                    fields[field_name] = {
                        name: self._segment_of(name, old[name], like) for name, like in new.items()
                    }
                else:
                    fields[field_name] = old
            out.append(fresh_group._replace(**fields))
        return tuple(out)

    def _segment_of(self, name: str, full: Tensor, like: Tensor) -> Tensor:
        if like.dim() == 0:
            return full.detach().clone().to(like)
        seg = self.segment_of[name]
        return full.detach().reshape(-1)[seg.offset : seg.offset + seg.numel].clone().to(like)

    def full_optimizer_state(self, opt_state: Any) -> tuple:
        """The named, full optimizer state (as data parallelism holds it) from this rank's
        segments: each per-parameter tensor is all-gathered over the shard group, unit by
        unit. A collective call: every rank of the shard group must make it."""
        out = []
        for group_state in opt_state:
            fields = {}
            for field_name in group_state._fields:
                value = getattr(group_state, field_name)
                if isinstance(value, dict) and any(n in self.sharded_names for n in value):
                    fields[field_name] = self._gather_named(value)
                else:
                    fields[field_name] = value
            out.append(group_state._replace(**fields))
        return tuple(out)

    def _gather_named(self, segments: Mapping[str, Tensor]) -> dict[str, Tensor]:
        full: dict[str, Tensor] = {}
        for unit in self.units:
            names = [n for n in unit.names if n in segments]
            vectors = [n for n in names if segments[n].dim() > 0]
            for n in names:
                if segments[n].dim() == 0:
                    full[n] = segments[n].detach().clone()
            if not vectors:
                continue
            like = segments[vectors[0]]
            rank_ = self.topology.shard_rank
            pad = unit.chunk - unit.covered(rank_)
            chunk = torch.cat(
                [segments[n].detach().reshape(-1) for n in unit.names] + [like.new_zeros(pad)]
            )
            flat = chunk.new_empty(unit.chunk * unit.shard_size)
            if self.topology.shard_group is None:
                flat.copy_(chunk)
            else:
                dist.all_gather_into_tensor(flat, chunk, self.topology.shard_group)
            full.update({n: t.clone() for n, t in unit.unflatten(flat).items() if n in vectors})
        return full

    def link_optimizer(self, link: Any, live: Callable[[], Any], transform: Callable) -> None:
        """Make the ``torch.optim`` optimizer of ``link`` show the full state, as under data
        parallelism: ``optimizer.state_dict()`` gathers it (a collective call: every rank
        must make it) and ``optimizer.load_state_dict()`` shards what it loads into the
        step's state. Between these calls ``optimizer.state`` stays empty (no full copy).
        ``live()`` is the step's current TrainState (``None`` once the step is gone);
        ``transform()`` its optimizer transformation."""
        optimizer = link.optimizer

        def before_state_dict(opt: Any) -> None:
            state = live()
            if state is None:
                return
            full = self.full_optimizer_state(state.opt_state)
            link.install(full, _names_with_state(state.opt_state))

        def after_state_dict(opt: Any, state_dict: dict) -> dict:
            opt.state.clear()  # the returned dict keeps the gathered tensors
            return state_dict

        def after_load(opt: Any) -> None:
            state = live()
            if state is None:
                return
            like = dict(self._param_objects)
            for name in self.sharded_names:  # ZeRO-3 holds empty placeholders in the model
                unit = self.unit_of[name]
                shape = unit.shapes[unit.names.index(name)]
                like[name] = torch.empty(shape, dtype=unit.dtype, device=unit.device)
            named = link.read_state(like, copy=True)
            params = self.optimizer_params(state.params)
            sharded = self.shard_optimizer_state(named, transform(), params)
            with torch.no_grad():
                leaves = pytree.tree_leaves(state.opt_state)
                for old, new in zip(leaves, pytree.tree_leaves(sharded), strict=True):
                    old.copy_(new)
            opt.state.clear()

        optimizer.register_state_dict_pre_hook(before_state_dict)
        optimizer.register_state_dict_post_hook(after_state_dict)
        optimizer.register_load_state_dict_post_hook(after_load)

    # -- inside the traced step ----------------------------------------------------------
    def differentiable(self, params: Mapping[str, Tensor], trainable: set[str]) -> list[str]:
        self._used = set()  # a new trace starts: materialize() records what gets gradients
        if self.stage < 3:
            return [n for n in params if n in trainable]
        return [u.key for u in self.units] + [
            n for n in params if n in trainable and n not in self.sharded_names
        ]

    @contextlib.contextmanager
    def materialize(self, params: dict[str, Tensor], model: nn.Module) -> Iterator[dict]:
        if self.stage < 3:
            yield params
            return
        gatherer = _Gatherer(self, params, model)
        with gatherer.active():
            # The sharded names keep the model's own (emptied) tensors as placeholders until
            # the unit's pre-hook swaps the gathered weights in.
            placeholders = {n: gatherer.accessor.get_tensor(n) for n in self.sharded_names}
            yield {
                **{n: t for n, t in params.items() if n not in gatherer.unit_keys},
                **placeholders,
            }

    def optimizer_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for name, seg in self.segment_of.items():
            if self.stage == 3:
                out[name] = params[seg.unit.key][seg.start : seg.stop]
            else:
                out[name] = params[name].reshape(-1)[seg.offset : seg.offset + seg.numel]
        return out

    def reduce_gradients(
        self, grads: dict[str, Tensor], extra: dict[str, Any], signature: tuple
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        topo, world = self.topology, self.topology.world
        out = {}
        for unit in self.units:
            if self.stage == 3:
                if unit.key not in grads:
                    continue
                chunk = grads[unit.key]  # the gather's backward already reduce-scattered
                with_grads = [n for n in unit.names if n in self._used]
            else:
                present = [n for n in unit.names if n in grads]
                with_grads = present
                if not present:
                    continue
                flat = (
                    unit.flatten(
                        [
                            grads[n] if n in grads else grads[present[0]].new_zeros(s)
                            for n, s in zip(unit.names, unit.shapes, strict=True)
                        ]
                    )
                    / world
                )
                if self.stage == 1:
                    chunk = unit.my_chunk(all_reduce(flat, dist.group.WORLD), topo.shard_rank)
                else:
                    chunk = reduce_scatter(flat, topo.shard_group)
            if self.stage == 3:
                chunk = chunk / world
            if topo.replicate_group is not None and self.stage != 1:
                chunk = all_reduce(chunk, topo.replicate_group)
            # Only the parameters that got a gradient are updated (torch.optim skips a
            # .grad of None); the unit's chunk still travels whole.
            for name in with_grads:
                seg = self.segment_of[name]
                out[name] = chunk[seg.start : seg.stop]
        return out, extra

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return average_written(
            buffers, dist.group.WORLD, world=self.topology.world, bucket_bytes=self.bucket_bytes
        )

    def global_norm(self, grads: Mapping[str, Tensor]) -> Tensor:
        squares = torch.stack([g.pow(2).sum() for g in grads.values()]).sum()
        if self.topology.shard_group is not None:
            squares = all_reduce(squares, self.topology.shard_group)
        return squares.sqrt()

    def any_rank(self, flag: Tensor) -> Tensor:
        if self.topology.shard_group is None:
            return flag
        return all_reduce(flag.to(torch.float32), self.topology.shard_group) > 0

    def new_params(
        self, updated: Mapping[str, Tensor], params: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        new = dict(params)
        old = self.optimizer_params(params)
        shard_rank = self.topology.shard_rank
        for unit in self.units:
            if not any(n in updated for n in unit.names):
                continue
            pieces = [updated.get(n, old[n]) for n in unit.names]
            pad = unit.chunk - unit.covered(shard_rank)
            if pad:  # padding stays zero
                pieces.append(pieces[0].new_zeros(pad))
            chunk = torch.cat(pieces)
            if self.stage == 3:
                new[unit.key] = chunk
                continue
            flat = chunk
            if self.topology.shard_group is not None:
                flat = all_gather(chunk, self.topology.shard_group)
            new.update(unit.unflatten(flat))
        return new


def _names_with_state(opt_state: Any) -> set[str]:
    """Parameters that have had a gradient (torch.optim creates their state then): Adam's
    step count is positive, SGD's momentum buffer initialised."""
    names = set()
    for group in opt_state:
        if hasattr(group, "step"):
            names.update(n for n, t in group.step.items() if float(t) > 0)
        elif hasattr(group, "initialized"):
            names.update(n for n, t in group.initialized.items() if bool(t))
    return names


class _Gatherer:
    """ZeRO-3's lazy all-gathers: a forward pre-hook per unit module swaps in the gathered
    weights just before the module runs; a saved-tensor hook stores views of them as
    (unit, layout) and re-gathers in backward instead of keeping the full weights alive."""

    def __init__(self, strategy: Sharded, params: Mapping[str, Tensor], model: nn.Module):
        self.strategy = strategy
        self.params = params
        self.model = model
        self.accessor = NamedMemberAccessor(model)
        self.unit_keys = {u.key for u in strategy.units}
        self.by_module: dict[str, list[FlatUnit]] = {}
        for unit in strategy.units:
            self.by_module.setdefault(unit.module, []).append(unit)
        self.gathered: dict[int, FlatUnit] = {}  # id(full flat tensor) -> unit
        self.regathered: dict[str, Tensor] = {}

    def gather(self, unit: FlatUnit, shard: Tensor) -> Tensor:
        group = self.strategy.topology.shard_group
        return shard if group is None else all_gather(shard, group)

    def pre_hook(self, module_name: str):
        def hook(module: nn.Module, args: Any) -> None:
            for unit in self.by_module[module_name]:
                full = self.gather(unit, self.params[unit.key])
                self.gathered[id(full)] = unit
                for name, view in unit.unflatten(full).items():
                    if not self.strategy._param_objects[name].requires_grad:
                        view = view.detach()  # frozen: no gradient, as in eager
                    elif view.requires_grad:
                        # Which parameters get a gradient (torch.optim skips the others):
                        # the hook runs while backward is traced, only for used views.
                        view.register_hook(self._record(name))
                    for alias in (name, *self.strategy.aliases.get(name, ())):
                        self.accessor.swap_tensor(alias, view)

        return hook

    def _record(self, name: str):
        def hook(grad: Tensor) -> None:
            self.strategy._used.add(name)

        return hook

    def pack(self, t: Tensor) -> Any:
        base = t._base
        if base is not None and id(base) in self.gathered:
            unit = self.gathered[id(base)]
            return ("functacc.regather", unit, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, packed: Any) -> Tensor:
        if not (isinstance(packed, tuple) and packed and packed[0] == "functacc.regather"):
            return packed
        _, unit, size, stride, offset = packed
        # One re-gather per unit serves all its saved weights. Keeping the gathered tensor
        # here costs no memory by itself: in the graph a tensor lives from its producer to
        # its last use, and a unit's backward uses are adjacent, except for the root unit
        # (first and last layers), which stays gathered in between, as FSDP keeps its root.
        if unit.key not in self.regathered:
            shard = self.params[unit.key].detach()
            self.regathered[unit.key] = self.gather(unit, shard)
        return self.regathered[unit.key].as_strided(size, stride, offset)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        handles = []
        for module_name in self.by_module:
            module = self.model.get_submodule(module_name)
            handles.append(module.register_forward_pre_hook(self.pre_hook(module_name)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()
