"""Each epoch's order of samples for :class:`functacc.DeviceLoader`.

Two ways to draw it, from the user's own sampler object (its subset, its weights, its
custom logic are always kept):

- **own** (one process, ``seed=None``): the sampler draws exactly as it would inside the
  user's ``DataLoader`` — from its generator, or from the global RNG. The random states at
  the epoch's start are recorded, so a resumed run draws the very same epoch again.
- **shared** (under torchrun, or ``seed=`` given): every rank seeds the sampler's random
  sources with ``seed + epoch``, draws the whole epoch, pads it to a multiple of the world
  size by repeating its start (as ``DistributedSampler``), and keeps every ``world``-th
  item from its rank on. Ranks check that they drew the same order.

The DataLoader that loads the data is fed by an :class:`EpochPlan`: a sampler whose items
are the current epoch's, drawn when the DataLoader first asks for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

__all__ = [
    "EpochItems",
    "EpochPlan",
    "RandomStates",
    "check_same_order",
    "draw_own",
    "draw_shared",
    "find_generators",
    "index_sampler",
    "loader_like",
    "loading_options",
    "plain_order",
    "samplers_with_epoch",
    "sharding_source",
    "shared_length",
]

_END = object()


def find_generators(loader: DataLoader) -> list[torch.Generator]:
    """The CPU generators the loader's sampling may draw from, other than the global one:
    those held as attributes of the DataLoader, its sampler and its batch sampler."""
    batch_sampler = loader.batch_sampler
    holders = [loader, loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    found: list[torch.Generator] = []
    for holder in holders:
        for value in getattr(holder, "__dict__", {}).values():
            if (
                isinstance(value, torch.Generator)
                and value.device.type == "cpu"
                and value is not torch.default_generator
                and all(value is not g for g in found)
            ):
                found.append(value)
    return found


class RandomStates:
    """The global CPU generator and the loader's own generators, saved and restored as one
    ``uint8`` tensor (one row per generator)."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.generators = [torch.default_generator, *generators]

    def get(self) -> Tensor:
        return torch.stack([g.get_state() for g in self.generators])

    def set(self, states: Tensor, *, include_global: bool = True) -> None:
        for i, (g, s) in enumerate(zip(self.generators, states, strict=True)):
            if i or include_global:
                # A copy: set_state of a row view (storage offset > 0) crashes torch 2.14.
                g.set_state(s.clone())

    def check(self, states: Any) -> Tensor:
        want = (len(self.generators), torch.default_generator.get_state().numel())
        if not isinstance(states, Tensor) or tuple(states.shape) != want:
            got = tuple(states.shape) if isinstance(states, Tensor) else type(states).__name__
            raise ValueError(
                f"state['rng'] must be a uint8 tensor of shape {want} (the global RNG and the "
                f"{want[0] - 1} generator(s) this loader's sampling holds); got {got}. Was the "
                "state saved from a loader with another sampler?"
            )
        return states.to(torch.uint8)


class EpochItems:
    """One epoch's items (index batches, or indices), drawn once, on first use."""

    def __init__(self, draw: Callable[[], Iterator[Any]], skip: int):
        self._draw = draw
        self._skip = skip
        self._items: Iterator[Any] | None = None

    def ensure_drawn(self) -> None:
        if self._items is None:
            self._items = itertools.islice(self._draw(), self._skip, None)

    def __iter__(self) -> EpochItems:
        return self

    def __next__(self) -> Any:
        self.ensure_drawn()
        return next(self._items)  # type: ignore[arg-type]


class EpochPlan(Sampler):
    """The batch sampler (or sampler) of the DataLoader that loads the data: it hands out
    the current epoch's items. ``iter()`` draws nothing: the DataLoader draws its workers'
    base seed first, then asks for items, as it does with the user's own sampler."""

    def __init__(self, length: Callable[[], int]):
        self._length = length
        self._epoch: EpochItems | None = None

    def start(self, draw: Callable[[], Iterator[Any]], skip: int) -> EpochItems:
        self._epoch = EpochItems(draw, skip)
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        if self._epoch is None:
            raise RuntimeError("internal: DeviceLoader's plan was iterated before an epoch began")
        return self._epoch

    def __len__(self) -> int:
        return self._length()


def draw_own(source: Any) -> Iterator[Any]:
    """The source's items as it yields them. The first is taken here, in the caller's
    thread, where samplers draw their randomness (a random permutation, a seed from the
    global RNG): not on the prefetch thread, where it would interleave with training."""
    items = iter(source)
    first = next(items, _END)
    return iter(()) if first is _END else itertools.chain((first,), items)


@contextlib.contextmanager
def _seeded(generators: Sequence[torch.Generator], seed: int) -> Iterator[None]:
    """Every generator (the global CPU one included) seeded with ``seed``; all put back
    afterwards, so drawing the shared order consumes none of the user's randomness."""
    every = [torch.default_generator, *generators]
    saved = [g.get_state() for g in every]
    try:
        for g in every:
            g.manual_seed(seed)
        yield
    finally:
        for g, s in zip(every, saved, strict=True):
            g.set_state(s)


def _shard(items: list[Any], world: int, rank: int) -> list[Any]:
    """This rank's items: the list padded to a multiple of ``world`` by repeating its start
    (as ``DistributedSampler``), then every ``world``-th item from ``rank`` on."""
    if not items:
        return []
    total = -(-len(items) // world) * world
    padded = items + (items * (-(-total // len(items))))[: total - len(items)]
    return padded[rank::world]


def _batches(indices: list[Any], batch_size: int, drop_last: bool) -> list[list[Any]]:
    out = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out


def sharding_source(loader: DataLoader) -> tuple[Any, bool]:
    """What to draw and shard: ``(sampler, True)`` for a standard ``BatchSampler`` (shard
    samples, then batch them per rank), else ``(index sampler, False)`` (shard its items:
    a custom batch sampler's batches, or single indices without automatic batching)."""
    if type(loader.batch_sampler) is BatchSampler:
        return loader.batch_sampler.sampler, True
    if loader.batch_sampler is not None:
        return loader.batch_sampler, False
    return loader.sampler, False


def shared_length(loader: DataLoader, world: int) -> int:
    """Batches per rank and epoch when the sampler is sharded (from its ``len``)."""
    source, rebatch = sharding_source(loader)
    per_rank = -(-len(source) // world)
    if not rebatch:
        return per_rank
    size = loader.batch_sampler.batch_size
    return per_rank // size if loader.batch_sampler.drop_last else -(-per_rank // size)


def draw_shared(
    loader: DataLoader,
    generators: Sequence[torch.Generator],
    *,
    seed: int,
    world: int,
    rank: int,
    group: Any,
) -> list[Any]:
    """This rank's items of the epoch whose shared seed is ``seed``."""
    source, rebatch = sharding_source(loader)
    try:
        len(source)
    except TypeError:
        raise TypeError(
            f"DeviceLoader cannot shard {type(source).__name__} over {world} ranks: it has no "
            "__len__, so the ranks cannot draw one finite order and split it. Give it a "
            "__len__, pass a torch.utils.data.DistributedSampler, or shard it yourself "
            "(DeviceLoader(..., shard=False))."
        ) from None
    with _seeded(generators, seed):
        items = list(source)
    if group is not None:
        check_same_order(items, type(source).__name__, seed, group)
    mine = _shard(items, world, rank)
    if rebatch:
        return _batches(mine, loader.batch_sampler.batch_size, loader.batch_sampler.drop_last)
    return mine


def check_same_order(items: list[Any], name: str, seed: int, group: Any) -> None:
    """Raise on every rank if the ranks drew different orders (a random source that
    seeding torch's generators does not reach): their slices would overlap and miss
    samples without a word."""
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(d, every[0]) for d in every):
        raise RuntimeError(
            f"the sampler {name} drew different orders on different ranks from the same seed "
            f"({seed}): it draws from a random source DeviceLoader cannot seed (Python's "
            "random, NumPy, a torch.Generator it does not hold as an attribute). Every rank "
            "must draw the same order to take its own slice; draw from torch's global RNG or "
            "a torch.Generator attribute, pass a DistributedSampler, or shard it yourself "
            "(DeviceLoader(..., shard=False))."
        )


def index_sampler(loader: DataLoader) -> Any:
    """What the DataLoader draws indices from: its batch sampler, or its sampler when it
    does not batch (``batch_size=None``)."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def plain_order(loader: DataLoader) -> bool:
    """A DataLoader-made batch sampler over a plain shuffle or sequence, which a
    ``DistributedSampler`` reproduces (with its shared seed)."""
    source, rebatch = sharding_source(loader)
    if not rebatch or source is not loader.sampler or loader.batch_size is None:
        return False
    if type(source) is SequentialSampler:
        return True
    # Sampling with replacement, or a num_samples of its own, is not a permutation.
    return type(source) is RandomSampler and not source.replacement and source._num_samples is None


def loading_options(loader: DataLoader, device: torch.device) -> dict[str, Any]:
    """How the user's DataLoader loads (workers, collation, pinning), to load the same way."""
    return {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory or device.type == "cuda",
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }


def loader_like(
    loader: DataLoader, plan: EpochPlan, generator: torch.Generator | None, device: torch.device
) -> DataLoader:
    """The user's DataLoader with its indices coming from ``plan``."""
    options = loading_options(loader, device)
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=plan, generator=generator, **options)
    return DataLoader(loader.dataset, batch_size=None, sampler=plan, generator=generator, **options)


def samplers_with_epoch(*loaders: Any) -> list[Any]:
    """The samplers to tell each epoch (``set_epoch``), each once."""
    found: list[Any] = []
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        for obj in (
            getattr(loader, "sampler", None),
            batch_sampler,
            getattr(batch_sampler, "sampler", None),
        ):
            if (
                obj is not None
                and callable(getattr(obj, "set_epoch", None))
                and all(obj is not f for f in found)
            ):
                found.append(obj)
    return found
