"""DeviceLoader keeps the user's sampler.

In one process the specification is iterating the DataLoader itself: the same batches,
drawn from the same random states, leaving the DataLoader's generator and the global RNG
where PyTorch leaves them. A resumed loader (a fresh one, as in a new process, given
``state_dict()``) continues with the very next batch, bit for bit. All comparisons are
exact: sampling is integer arithmetic on the same random streams.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from loader_cases import CASES, WORKER_CASES, content
from test_parallel import run_torchrun, workdir  # noqa: F401
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler

import functacc

ALL_CASES = {**CASES, **WORKER_CASES}
EPOCHS = 3


def _shard(items: list, world: int, rank: int) -> list:
    """DistributedSampler's split: pad to a multiple of ``world`` by repeating the start,
    then every ``world``-th item from ``rank`` on."""
    total = -(-len(items) // world) * world
    padded = (items * world)[:total]
    return padded[rank::world]


def generators(loader: DataLoader) -> list[torch.Generator]:
    """The generators the test's DataLoaders hold (named here, not found by functacc)."""
    sampler = loader.batch_sampler if loader.sampler is None else loader.sampler
    found = [loader.generator, getattr(sampler, "generator", None)]
    return [g for g in found if g is not None]


def train_like(batches, out: list) -> None:
    """Record each batch, then draw from the global RNG as a training step with dropout
    would: the loader must neither disturb nor depend on anything but its own draws."""
    for batch in batches:
        out.append(content(batch))
        out.append(float(torch.rand(())))


def run(make, epochs: int = EPOCHS, **loader_kw) -> tuple[list, torch.Tensor, list]:
    torch.manual_seed(0)
    source = make()
    loader = functacc.DeviceLoader(source, **loader_kw)
    seen: list = []
    for _ in range(epochs):
        train_like(loader, seen)
        seen.append("end of epoch")
    return seen, torch.get_rng_state(), [g.get_state() for g in generators(source)]


def plain(make, epochs: int = EPOCHS):
    """The specification: the DataLoader itself."""
    torch.manual_seed(0)
    source = make()
    seen: list = []
    for _ in range(epochs):
        train_like(source, seen)
        seen.append("end of epoch")
    return seen, torch.get_rng_state(), [g.get_state() for g in generators(source)]


# Worker cases run with prefetch only: prefetch does not change how workers are seeded.
@pytest.mark.parametrize(
    ("case", "prefetch"),
    [(c, p) for c in sorted(ALL_CASES) for p in (2, 0) if p or c not in WORKER_CASES],
)
def test_one_process_batches_are_the_dataloaders_own(case: str, prefetch: int) -> None:
    seen, rng, gens = run(ALL_CASES[case], prefetch=prefetch)
    ref_seen, ref_rng, ref_gens = plain(ALL_CASES[case])
    assert seen == ref_seen
    assert torch.equal(rng, ref_rng), "the global RNG was drawn from differently"
    assert all(torch.equal(a, b) for a, b in zip(gens, ref_gens, strict=True))


def _ids(batch_content) -> list[int]:
    first = batch_content[0]
    return first if isinstance(first, list) else [first]


def test_subset_sampler_does_not_leak_the_rest_of_the_dataset() -> None:
    # The reported bug: a train/validation split by SubsetRandomSampler leaked all samples.
    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = functacc.DeviceLoader(
        DataLoader(data, batch_size=2, sampler=SubsetRandomSampler([0, 1, 2]))
    )
    for _ in range(3):
        ids = sorted(i for batch in loader for i in batch[0].tolist())
        assert ids == [0, 1, 2]
    assert len(loader) == 2


def test_weighted_sampler_keeps_its_weights() -> None:
    loader = functacc.DeviceLoader(CASES["weighted"]())
    ids = [i for _ in range(4) for batch in loader for i in batch[0].tolist()]
    assert len(ids) == 4 * 15
    assert all(i % 3 for i in ids)  # weight 0: never drawn


STOPS = {
    "before_first_epoch": (0, 0),
    "mid_epoch": (1, 1),
    "end_of_epoch": (0, None),  # every batch of epoch 0 consumed, epoch 1 not begun
}


def _uninterrupted(make, stop: tuple[int, int | None], **kw):
    """Train EPOCHS epochs, taking a snapshot at ``stop`` (epoch, batches consumed): the
    loader's state and the global RNG, which a checkpoint holds."""
    torch.manual_seed(0)
    loader = functacc.DeviceLoader(make(), **kw)
    seen: list = []
    snapshot = None
    for epoch in range(EPOCHS):
        if stop == (epoch, 0):
            snapshot = (loader.state_dict(), torch.get_rng_state(), len(seen))
        for i, batch in enumerate(loader, 1):
            train_like([batch], seen)
            if stop == (epoch, i):
                snapshot = (loader.state_dict(), torch.get_rng_state(), len(seen))
        if stop == (epoch, None):
            snapshot = (loader.state_dict(), torch.get_rng_state(), len(seen))
        seen.append("end of epoch")
    return seen, torch.get_rng_state(), snapshot


def _resumed(make, snapshot, **kw):
    state, rng, _ = snapshot
    torch.manual_seed(1234)  # a new process: another global state, fresh generators
    loader = functacc.DeviceLoader(make(), **kw)
    torch.set_rng_state(rng)  # functacc.load restores the global RNG ...
    loader.load_state_dict(state)  # ... and the loader's position
    seen: list = []
    for _ in range(state["epoch"], EPOCHS):
        train_like(loader, seen)
        seen.append("end of epoch")
    return seen, torch.get_rng_state()


@pytest.mark.parametrize("stop", sorted(STOPS))
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_resume_continues_with_the_very_next_batch(case: str, stop: str) -> None:
    make = ALL_CASES[case]
    seen, rng, snapshot = _uninterrupted(make, STOPS[stop])
    assert seen == plain(make)[0]  # and the uninterrupted run is PyTorch's own
    resumed, resumed_rng = _resumed(make, snapshot)
    expected = seen[snapshot[2] :]
    if case == "persistent_workers" and stop == "mid_epoch":
        # Persistent workers carry their random streams across epochs, and a new process
        # starts new ones: the samples are the same, what the workers drew is not.
        resumed, expected = _samples_only(resumed), _samples_only(expected)
    assert resumed == expected
    assert torch.equal(resumed_rng, rng)


def _samples_only(seen: list) -> list:
    return [x[0] if isinstance(x, list) else x for x in seen]


def test_set_epoch_after_restore_keeps_the_restored_position() -> None:
    # The usual resumable loop: restore, then `for epoch in range(loader.epoch, E):
    # loader.set_epoch(epoch)`; set_epoch of the restored epoch must not restart it.
    make = CASES["subset_generator"]
    seen, _, snapshot = _uninterrupted(make, (1, 1))
    state, rng, at = snapshot
    loader = functacc.DeviceLoader(make())
    torch.set_rng_state(rng)
    loader.load_state_dict(state)
    resumed: list = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        train_like(loader, resumed)
        resumed.append("end of epoch")
    assert resumed == seen[at:]
    # set_epoch announces a new epoch: its state says it has not begun.
    loader.set_epoch(7)
    assert loader.state_dict()["epoch"] == 7 and loader.state_dict()["batch_index"] == 0


def test_seed_draws_epoch_from_seed_plus_epoch() -> None:
    # seed=int in one process: each epoch's order is drawn from seed + epoch, whatever the
    # global RNG or the sampler's generator hold; a plain shuffle is DistributedSampler's.
    def epoch_ids(make, epoch: int, global_seed: int) -> list:
        torch.manual_seed(global_seed)
        loader = functacc.DeviceLoader(make(), seed=3)
        loader.set_epoch(epoch)
        return [content(b) for b in loader]

    for case in ("subset_random", "subset_generator", "weighted", "batch_sampler"):
        make = CASES[case]
        assert epoch_ids(make, 1, 0) == epoch_ids(make, 1, 99)
        assert epoch_ids(make, 1, 0) != epoch_ids(make, 2, 0)
        if case == "subset_random":
            assert {i for b in epoch_ids(make, 1, 0) for i in b[0]} == set(range(3, 16))
    sampler = DistributedSampler(range(20), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    expected = [order[i : i + 3] for i in range(0, 20, 3)]
    assert [b[0] for b in epoch_ids(CASES["shuffle_generator"], 2, 0)] == expected


def test_user_distributed_sampler_is_kept() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20))

    def make() -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=4)
        return DataLoader(data, batch_size=3, sampler=sampler)

    loader, ref = functacc.DeviceLoader(make()), make()
    for epoch in range(2):
        ref.sampler.set_epoch(epoch)
        assert [content(b) for b in loader] == [content(b) for b in ref]


def test_bad_state_is_a_clear_error() -> None:
    loader = functacc.DeviceLoader(CASES["subset_generator"]())
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"state\['rng'\] must be a uint8 tensor of shape"):
        loader.load_state_dict({**state, "rng": torch.zeros(1, 5056, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="must be >= 0"):
        loader.load_state_dict({**state, "batch_index": -1})
    with pytest.warns(UserWarning, match="no 'rng'"):
        loader.load_state_dict({"epoch": 0, "batch_index": 0})


def test_checkpoint_resume_with_a_custom_sampler_is_bit_exact(tmp_path) -> None:
    # functacc.save / load of a step and its loader, mid-epoch, with dropout drawing from
    # the same global RNG the SubsetRandomSampler draws its permutations from.
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 16, generator=g), torch.arange(40))
    subset = list(range(5, 27))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
        step = functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            backend="eager",
        )
        sampler = SubsetRandomSampler(subset)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        return model, step, functacc.DeviceLoader(loader, device="cpu")

    def epochs(loader):
        while True:
            yield from loader

    def train(step, batches, steps: int, seen: list) -> list[float]:
        losses = []
        for _ in range(steps):
            x, index = next(batches)
            seen.append(index)
            losses.append(float(step(x, index % 5)))
        return losses

    model, step, loader = build()
    seen: list = []
    batches = epochs(loader)
    train(step, batches, 8, seen)  # epoch 0 (6 batches) and 2 of epoch 1
    functacc.save(step, tmp_path / "ckpt", loader=loader)
    rest = train(step, batches, 9, seen)
    assert sorted(torch.cat(seen[:6]).tolist()) == subset  # one epoch: the subset, once
    assert set(torch.cat(seen).tolist()) <= set(subset)

    torch.manual_seed(42)  # the new process's RNG is elsewhere until load restores it
    resumed_model, resumed_step, resumed_loader = build()
    functacc.load(resumed_step, tmp_path / "ckpt", loader=resumed_loader)
    assert train(resumed_step, epochs(resumed_loader), 9, []) == rest
    assert_close(resumed_model.state_dict(), model.state_dict(), rtol=0, atol=0, what="model")


def test_torchrun_shards_the_users_sampler(workdir) -> None:  # noqa: F811
    result = run_torchrun(workdir, "samplers", 2, timeout=300)
    for case, ranks in result["epochs"].items():
        # The reference: one process drawing each epoch from the same seed (seed=0).
        reference = functacc.DeviceLoader(CASES[case](), seed=0)
        for epoch in range(2):
            reference.set_epoch(epoch)
            whole = [content(b) for b in reference]
            mine = [r[epoch] for r in ranks]
            assert len(mine[0]) == len(mine[1]) == result["len"][case][0]
            if case == "batch_sampler":  # batches are sharded whole
                expected = [_shard(whole, 2, r) for r in range(2)]
                assert mine == expected, case
            else:
                size = CASES[case]().batch_size
                order = [i for b in whole for i in _ids(b)]
                for r in range(2):
                    got = [i for b in mine[r] for i in _ids(b)]
                    assert got == _shard(order, 2, r), (case, r)
                    if size:  # batches of the DataLoader's size, per rank
                        assert all(len(b[0]) <= size for b in mine[r])
            # Together the ranks cover the epoch; apart from padding they are disjoint.
            flat = [sorted(i for b in m for i in _ids(b)) for m in mine]
            if case in ("subset_random", "no_batching", "batch_sampler"):
                assert set(flat[0]) | set(flat[1]) == {i for b in whole for i in _ids(b)}
                padding = len(flat[0]) + len(flat[1]) - len(set(flat[0]) | set(flat[1]))
                # Padding repeats fewer items than ranks: samples, or whole batches.
                most = max(len(_ids(b)) for b in whole) if case == "batch_sampler" else 1
                assert padding <= most, case
    for case, same in result["resumed"].items():
        assert same, f"{case}: a resumed loader did not continue with the next batch"
    for rank_errors in result["errors"]:
        assert "drew different orders on different ranks" in rank_errors["python_random"]
        assert "has no __len__" in rank_errors["no_len"]
