"""DeviceLoader: each rank its own slice of the data, on its device, prefetched."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from ..parallel.mesh import GroupRef, default_device, rank, world_size
from .buckets import make_padder
from .prefetch import prefetched
from .sampling import (
    EpochPlan,
    RandomStates,
    draw_own,
    draw_shared,
    find_generators,
    index_sampler,
    loader_like,
    loading_options,
    plain_order,
    samplers_with_epoch,
    sharding_source,
    shared_length,
)

__all__ = ["DeviceLoader"]

_DONE = object()


class DeviceLoader:
    """Wrap a ``DataLoader`` so that each rank gets its own batches, on its device.

    - **The user's sampler is kept** — a ``SubsetRandomSampler``'s subset, a
      ``WeightedRandomSampler``'s weights, a custom ``batch_sampler``'s batches.
    - **One process** (``seed=None``, the default): the batches are exactly those of
      iterating the ``DataLoader`` itself, drawn from its ``generator`` (or the global RNG,
      as PyTorch does), which advances as it would.
    - **Under torchrun** (``shard=True``): every rank draws the same epoch order from a
      shared seed (``seed + epoch``; ``seed=None`` means 0) and keeps its own slice, padded
      by repeating a few samples as ``DistributedSampler`` does, so every rank gets the same
      number of batches (ranks that disagree deadlock at the next collective). A plain
      ``RandomSampler`` or ``SequentialSampler`` becomes a ``DistributedSampler``; a
      ``DistributedSampler`` of the user's is kept as it is; another sampler is drawn with
      its random sources (the global torch RNG and the ``torch.Generator`` objects the
      sampler, batch sampler and DataLoader hold) seeded, then sharded — the ranks check
      they drew the same order, and a sampler that cannot be sharded (no ``__len__``, or
      randomness from Python's ``random`` or NumPy) is a clear error. An iterable dataset
      is split batch by batch and stops at the shortest rank.
    - **seed=int in one process**: each epoch is drawn from ``seed + epoch`` as under
      torchrun, so it is the union of what the ranks of a sharded run with that seed see.
    - **Device placement**: batches are moved to ``device`` (pinned memory and
      ``non_blocking`` copies on CUDA), ``prefetch`` batches ahead on a background thread.
      ``device=None`` is this process's own GPU where the node has one for every process,
      else the CPU (:func:`functacc.parallel.mesh.device_for`); pass ``device=`` to train
      a model on another device.
    - **Buckets** (``buckets=`` or ``max_length=``): the last dimension of the keys in
      ``pad_values`` is padded up to the smallest bucket that holds it, on the host before
      the copy, so a compiled step sees a few shapes; see :mod:`functacc.data.buckets`.
    - **Epochs**: each ``iter()`` is a new epoch; ``set_epoch(n)`` sets it explicitly (it
      picks the shuffle of a shared-seed order; in one process with ``seed=None`` the
      sampler draws anew each epoch, as in PyTorch). ``state_dict()`` /
      ``load_state_dict()`` record the epoch, the batch position and, in one process, the
      random states at the epoch's start, so a resumed run continues with the very next
      batch (what persistent workers draw inside themselves is not replayed).

    Example:
        >>> import torch, functacc
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
        >>> loader = functacc.DeviceLoader(torch.utils.data.DataLoader(data, batch_size=4))
        >>> [len(y) for _, y in loader]
        [4, 4, 2]
    """

    def __init__(
        self,
        loader: Iterable,
        *,
        device: torch.device | str | None = None,
        shard: bool = True,
        even_batches: bool = True,
        prefetch: int = 2,
        seed: int | None = None,
        buckets: list[int] | None = None,
        max_length: int | None = None,
        num_buckets: int | None = None,
        pad_values: Mapping[str | int, float] | None = None,
        bucket_spacing: Literal["uniform", "geometric"] = "uniform",
        truncation: bool = False,
    ):
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int or None; got {seed!r}")
        self.device = torch.device(device) if device is not None else default_device()
        self.padder = make_padder(
            buckets=buckets,
            max_length=max_length,
            num_buckets=num_buckets,
            pad_values=pad_values,
            bucket_spacing=bucket_spacing,
            truncation=truncation,
            pin_memory=self.device.type == "cuda",
        )
        self.world, self.rank = world_size(), rank()
        self.shard = shard
        self.even_batches = even_batches
        self.prefetch = prefetch
        self.seed = seed
        self.epoch = 0
        self._epoch_set = False
        self._skip = 0  # batches to skip on the next iteration (resume)
        self._position = 0
        self._source = loader
        self._split = False  # split batch by batch (an iterable dataset under torchrun)
        self._plan: EpochPlan | None = None  # the user's sampler, drawn by this loader
        self._generators: list[torch.Generator] = []
        self._own: RandomStates | None = None  # one process, seed=None: PyTorch's draws
        self._epoch_rng: Tensor | None = None  # random states at this epoch's start
        self._epoch_base_seed = True  # whether that start drew the workers' base seed
        self._resume: tuple[Tensor, bool] | None = None  # (states, base seed drawn)
        self._inner_iterated = False
        # Shared-seed modes: the workers' base seed comes from seed + epoch, never from the
        # global RNG (which keeps dropout's stream the same whether a run was resumed or
        # not), and a resumed epoch seeds its workers as the interrupted one did.
        self._worker_seeds = torch.Generator()
        self.loader = self._prepare(loader) if shard else loader
        self._epoch_samplers = samplers_with_epoch(loader, self.loader)
        # A group of its own for the ranks' agreements (a collective call: every rank
        # creates its loader at the same point).
        shared_plan = self._plan is not None and self._own is None
        needs_group = self.world > 1 and (self._split or shared_plan)
        # Held weakly: torch.distributed owns it (see GroupRef).
        self._agree_group = GroupRef(dist.new_group(backend="gloo")) if needs_group else None

    # -- how the loader is driven --------------------------------------------------------
    def _prepare(self, loader: Iterable) -> Iterable:
        if not isinstance(loader, DataLoader):
            return loader
        if isinstance(loader.dataset, IterableDataset):
            self._split = self.world > 1
            return loader
        source, _ = sharding_source(loader)
        if any(
            isinstance(s, DistributedSampler)
            for s in (loader.sampler, source, getattr(source, "sampler", None))
        ):
            return loader  # the user shards: kept as it is
        shared = self.world > 1 or self.seed is not None
        if shared and plain_order(loader):
            return self._with_distributed_sampler(loader)
        self._generators = find_generators(loader)
        if shared:
            self._plan = EpochPlan(lambda: shared_length(loader, self.world))
            generator = self._worker_seeds
        else:
            self._own = RandomStates(self._generators)
            self._plan = EpochPlan(lambda: len(index_sampler(loader)))
            generator = loader.generator  # the workers' base seed, drawn as PyTorch does
        return loader_like(loader, self._plan, generator, self.device)

    def _with_distributed_sampler(self, loader: DataLoader) -> DataLoader:
        seed = self.seed or 0
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=self.world,
            rank=self.rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=False,
        )
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            drop_last=loader.drop_last,
            generator=self._worker_seeds,
            **loading_options(loader, self.device),
        )

    # -- epochs and resumption ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (as ``DistributedSampler``): its shuffle
        under a shared seed. A position restored by ``load_state_dict`` for this very
        epoch is kept (the resumed epoch continues); for another epoch it is dropped."""
        if not (epoch == self.epoch and (self._skip or self._resume is not None)):
            self.epoch = epoch
            self._skip = self._position = 0
            self._resume = None
        self._epoch_set = True

    def state_dict(self) -> dict[str, Any]:
        """The position: ``epoch`` and ``batch_index``, the batches of it consumed. In one
        process with ``seed=None`` also ``rng``, the random states the epoch was drawn
        from (the current ones while it has not begun), and ``base_seed``, whether that
        draw began with the workers' base seed (with persistent workers, only the first)."""
        state: dict[str, Any] = {"epoch": self.epoch, "batch_index": self._position}
        if self._own is not None:
            if self._resume is not None:
                rng, drew = self._resume
            elif self._position and self._epoch_rng is not None:
                rng, drew = self._epoch_rng, self._epoch_base_seed
            else:
                rng, drew = self._own.get(), self._draws_base_seed()
            state["rng"] = rng.clone()
            state["base_seed"] = int(drew)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iteration resumes that epoch at that batch."""
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"epoch and batch_index must be >= 0; got {epoch}, {index}")
        resume = None
        if self._own is not None:
            if "rng" in state:
                resume = (self._own.check(state["rng"]), bool(int(state.get("base_seed", 1))))
            else:
                warnings.warn(
                    "the loader state has no 'rng' (saved by another version, or under "
                    "torchrun): the resumed epoch is drawn from the current random state "
                    "and may differ from the interrupted run's",
                    stacklevel=2,
                )
        self.epoch, self._skip, self._position = epoch, index, index
        self._resume = resume
        self._epoch_set = True

    def __len__(self) -> int:
        if self._plan is not None:
            return len(self._plan)
        n = len(self.loader)  # type: ignore[arg-type]
        return n // self.world if self._split else n

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if not self._epoch_set and self._position:
            self.epoch += 1  # a new pass over the data is a new epoch
        self._epoch_set = False
        skip, self._skip = self._skip, 0
        for sampler in self._epoch_samplers:
            sampler.set_epoch(self.epoch)
        self._worker_seeds.manual_seed((self.seed or 0) + self.epoch)
        data_skip = skip
        if self._plan is not None:
            # Without workers, skip indices: nothing is loaded. With workers, load and drop,
            # so each worker's random stream (augmentations) advances as it did.
            index_skip = skip if self._source.num_workers == 0 else 0  # type: ignore[attr-defined]
            batches = self._start_plan(index_skip, resumed=skip > 0)
            data_skip = skip - index_skip
        else:
            batches = self._batches()
        self._position = skip - data_skip
        for _ in range(data_skip):
            next(batches, None)
            self._position += 1
        if self.prefetch:
            source = prefetched(batches, self._to_device, self.prefetch)
        else:
            source = map(self._to_device, batches)
        for batch in source:
            self._position += 1
            yield batch

    def _draws_base_seed(self) -> bool:
        """Whether the next epoch's start draws the workers' base seed (as PyTorch: every
        epoch, or only the first with persistent workers)."""
        return not (self._source.persistent_workers and self._inner_iterated)  # type: ignore[attr-defined]

    def _start_plan(self, skip: int, *, resumed: bool) -> Iterator[Any]:
        """Start the epoch of the DataLoader fed by the plan; every random draw happens
        here, in the caller's thread."""
        assert self._plan is not None
        if self._own is None:
            items = draw_shared(
                self._source,  # type: ignore[arg-type]
                self._generators,
                seed=(self.seed or 0) + self.epoch,
                world=self.world,
                rank=self.rank,
                group=self._agree_group() if self._agree_group is not None else None,
            )
            self._plan.start(lambda: iter(items), skip)
            return iter(self.loader)
        own, loader = self._own, self._source
        current = torch.default_generator.get_state()
        fresh = self._draws_base_seed()
        drew = fresh
        resume, self._resume = self._resume, None
        if resume is not None:
            states, drew = resume
            # A begun epoch is drawn again from its start. One saved before it began goes
            # on from the saved states, except the global RNG: the caller restores that
            # (functacc.load does), and the caller may have drawn from it since.
            own.set(states, include_global=resumed)
        start = own.get()
        self._epoch_rng, self._epoch_base_seed = start, drew

        def draw() -> Iterator[Any]:
            # The DataLoader has just drawn its workers' base seed (or not, with persistent
            # workers): match what the interrupted run did before the sampler drew.
            if fresh and not drew:
                own.set(start)
            elif drew and not fresh:
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator)  # type: ignore[attr-defined]
            return draw_own(index_sampler(loader))  # type: ignore[arg-type]

        epoch = self._plan.start(draw, skip)
        try:
            batches = iter(self.loader)  # the workers' base seed, as PyTorch draws it
            self._inner_iterated = True
            epoch.ensure_drawn()  # then the sampler's draw
        finally:
            if resume is not None and resumed:
                # The global RNG goes back to where the caller had it (functacc.load put it
                # where the interrupted run was when it saved, after this epoch's draw).
                torch.default_generator.set_state(current)
        return batches

    def _batches(self) -> Iterator[Any]:
        batches = iter(self.loader)  # here, not on the prefetch thread: it may draw a seed
        if not self._split:
            return batches
        return self._split_batches(batches)

    def _split_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        mine = (b for i, b in enumerate(batches) if i % self.world == self.rank)
        try:
            limit: int | None = len(self)
        except TypeError:
            limit = None
        for index in itertools.count():
            if limit is not None and self.even_batches and index >= limit:
                return
            batch = next(mine, _DONE)
            # Unknown length: stop as soon as any rank runs out (one tiny all-reduce per
            # batch, on a group of its own so it never interleaves with training).
            if (
                limit is None
                and self.even_batches
                and not _agree_all_have_batch(batch is not _DONE, self._group())
            ):
                return
            if batch is _DONE:
                return
            yield batch

    def _group(self) -> Any:
        if self._agree_group is None:
            raise RuntimeError("internal: the loader's process group was not created")
        return self._agree_group()

    def _to_device(self, batch: Any) -> Any:
        if self.padder is not None:
            batch = self.padder(batch)
        non_blocking = self.device.type == "cuda"
        return pytree.tree_map(
            lambda x: (
                x.to(self.device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x
            ),
            batch,
        )


def _agree_all_have_batch(has_batch: bool, group: Any) -> bool:
    """Whether every rank still has a batch (one tiny all-reduce)."""
    flag = torch.tensor([1 if has_batch else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
