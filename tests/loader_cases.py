"""DataLoaders with samplers of every kind, for the DeviceLoader tests (one process, and
under torchrun in tests/dist/worker.py). Each builder makes a fresh DataLoader whose
generators start from the same seed, as a script run twice would."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)


def numbers(n: int = 20) -> TensorDataset:
    """Sample i is the tensor i: a batch tells which samples it holds."""
    return TensorDataset(torch.arange(n))


class NoisyItems(Dataset):
    """Sample i is (i, a random number): with workers, the number comes from the worker's
    seed (the DataLoader's base seed + worker id)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.randint(0, 1000, ())


class RandomBatches(Sampler[list[int]]):
    """A custom batch sampler: a random permutation (global RNG) cut into batches of 3, 1
    and 2 samples in turn."""

    sizes = (3, 1, 2)

    def __init__(self, n: int):
        self.n = n

    def _cuts(self) -> list[tuple[int, int]]:
        cuts, start, i = [], 0, 0
        while start < self.n:
            end = min(self.n, start + self.sizes[i % 3])
            cuts.append((start, end))
            start, i = end, i + 1
        return cuts

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n).tolist()
        for start, end in self._cuts():
            yield order[start:end]

    def __len__(self) -> int:
        return len(self._cuts())


class PythonRandomSampler(Sampler[int]):
    """Shuffles with Python's random module, seeded by rank: no seed DeviceLoader sets
    reaches it, so it cannot be sharded."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng = n, random.Random(seed)

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


class Endless(Sampler[int]):
    """A sampler without ``__len__``."""

    def __iter__(self) -> Iterator[int]:
        yield from range(20)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


WEIGHTS = torch.tensor([0.0 if i % 3 == 0 else 1.0 + i for i in range(20)])

CASES: dict[str, Callable[[], DataLoader]] = {
    # The global RNG draws the permutation (PyTorch's default).
    "subset_random": lambda: DataLoader(
        numbers(), batch_size=3, sampler=SubsetRandomSampler(list(range(3, 16)))
    ),
    "subset_generator": lambda: DataLoader(
        numbers(), batch_size=2, sampler=SubsetRandomSampler([0, 3, 5, 7, 11], generator=_gen(1))
    ),
    # With replacement: samples repeat, samples of weight 0 never come.
    "weighted": lambda: DataLoader(
        numbers(),
        batch_size=4,
        sampler=WeightedRandomSampler(WEIGHTS, num_samples=15, generator=_gen(2)),
    ),
    "shuffle_generator": lambda: DataLoader(
        numbers(), batch_size=3, shuffle=True, generator=_gen(5)
    ),
    "shuffle_global": lambda: DataLoader(numbers(), batch_size=3, shuffle=True),
    "replacement": lambda: DataLoader(
        numbers(),
        batch_size=2,
        sampler=RandomSampler(numbers(), replacement=True, num_samples=9, generator=_gen(3)),
    ),
    "batch_sampler": lambda: DataLoader(numbers(), batch_sampler=RandomBatches(14)),
    "no_batching": lambda: DataLoader(
        numbers(), batch_size=None, sampler=SubsetRandomSampler(list(range(5, 12)))
    ),
}

WORKER_CASES: dict[str, Callable[[], DataLoader]] = {
    # The workers' base seed comes from the DataLoader's generator, once per epoch ...
    "workers": lambda: DataLoader(
        NoisyItems(), batch_size=3, shuffle=True, generator=_gen(7), num_workers=2
    ),
    # ... or once for all epochs with persistent workers.
    "persistent_workers": lambda: DataLoader(
        NoisyItems(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True
    ),
}


def content(batch) -> list:
    """A batch as nested lists of numbers, for exact comparison."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    return [content(x) for x in batch]
