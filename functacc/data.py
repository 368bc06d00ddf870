"""DeviceLoader: each rank its own slice of the data, on its device, prefetched."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from .parallel.mesh import rank, world_size

__all__ = ["DeviceLoader"]

_DONE = object()


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DeviceLoader:
    """Wrap a ``DataLoader`` so that each rank gets its own batches, on its device.

    - **Sharding** (``shard=True``): a map-style ``DataLoader`` is rebuilt with a
      ``DistributedSampler``: disjoint per-rank slices, reshuffled every epoch from a shared
      ``seed`` (if the original shuffled) — also in a single process, where it makes the
      order of every epoch reproducible. Other loaders are split batch by batch.
    - **Even batches**: every rank yields the same number of batches (ranks that disagree
      deadlock at the next collective). The sampler pads by repeating a few samples, as
      ``DistributedSampler`` does; a loader of unknown length stops at the shortest rank.
    - **Device placement**: batches are moved to ``device`` (pinned memory and
      ``non_blocking`` copies on CUDA), ``prefetch`` batches ahead on a background thread.
    - **Epochs**: each ``iter()`` is a new epoch; ``set_epoch(n)`` sets it explicitly.
      ``state_dict()`` / ``load_state_dict()`` record the epoch and the batch position, so a
      resumed run continues with the very next batch.

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
        seed: int = 0,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0; got {prefetch}")
        self.device = torch.device(device) if device is not None else _default_device()
        self.world, self.rank = world_size(), rank()
        self.shard = shard
        self.even_batches = even_batches
        self.prefetch = prefetch
        self.epoch = 0
        self._epoch_set = False
        self._skip = 0  # batches to skip on the next iteration (resume)
        self._position = 0
        self.loader = self._rebuild(loader, seed) if self.shard else loader
        # No sampler to rebuild (iterable dataset, custom batch sampler): split by batch.
        self._split = self.shard and self.world > 1 and self.loader is loader
        # A group of its own for the end-of-data agreement (a collective call: every rank
        # creates its loader at the same point).
        self._agree_group = dist.new_group(backend="gloo") if self._split else None

    def _rebuild(self, loader: Iterable, seed: int) -> Iterable:
        if not isinstance(loader, DataLoader) or loader.batch_size is None:
            return loader  # an iterable dataset or a custom batch sampler: split by batch
        if isinstance(loader.sampler, DistributedSampler):
            return loader
        try:
            len(loader.dataset)
        except TypeError:
            return loader
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
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory or self.device.type == "cuda",
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor,
            # Its own generator: starting an epoch then never draws from the global RNG
            # (a DataLoader draws its workers' base seed), which keeps dropout's stream the
            # same whether a run was resumed or not.
            generator=torch.Generator().manual_seed(seed),
        )

    # -- epochs and resumption ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle for the next iteration (as ``DistributedSampler``)."""
        self.epoch = epoch
        self._epoch_set = True

    def state_dict(self) -> dict[str, int]:
        """The position: the current epoch and how many of its batches were consumed."""
        return {"epoch": self.epoch, "batch_index": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next iteration resumes that epoch at that batch."""
        self.epoch = int(state["epoch"])
        self._skip = int(state["batch_index"])
        self._epoch_set = True

    def __len__(self) -> int:
        n = len(self.loader)  # type: ignore[arg-type]
        return n // self.world if self._split else n

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if not self._epoch_set and self._position:
            self.epoch += 1  # a new pass over the data is a new epoch
        self._epoch_set = False
        self._position = 0
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        batches = self._batches()
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(batches, None)
            self._position += 1
        source = self._prefetched(batches) if self.prefetch else map(self._to_device, batches)
        for batch in source:
            self._position += 1
            yield batch

    def _batches(self) -> Iterator[Any]:
        if not self._split:
            yield from self.loader
            return
        mine = (b for i, b in enumerate(self.loader) if i % self.world == self.rank)
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
        return self._agree_group

    def _to_device(self, batch: Any) -> Any:
        non_blocking = self.device.type == "cuda"
        return pytree.tree_map(
            lambda x: (
                x.to(self.device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x
            ),
            batch,
        )

    def _prefetched(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Load and move up to ``prefetch`` batches ahead on a background thread."""
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for batch in batches:
                    if stop.is_set():
                        return
                    q.put(self._to_device(batch))
                q.put(_DONE)
            except BaseException as exc:  # re-raised in the consumer
                q.put(exc)

        thread = threading.Thread(target=work, name="functacc-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.01)


def _agree_all_have_batch(has_batch: bool, group: Any) -> bool:
    """Whether every rank still has a batch (one tiny all-reduce)."""
    flag = torch.tensor([1 if has_batch else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
