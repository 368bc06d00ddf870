"""The per-call model check (functacc.core.guards, used by signature.ModelWatch): what must trip
it, what must not, and the key it guards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functacc.core.differences
import functacc.core.guards
import functacc.core.model_watch
import functacc.core.signature
from functacc.core.guards import model_guard
from functacc.core.model_watch import ModelWatch
from functacc.core.signature import BatchWatch


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(), nn.Linear(4, 2))


def guard_of(model: nn.Module):
    guard = model_guard(list(model.modules()), list(model.parameters()))
    assert guard is not None, "Dynamo's guard managers are missing in this torch"
    assert guard.passes()
    return guard


CHANGES = {
    "eval": lambda m: m.eval(),
    "one submodule in eval": lambda m: m[2].eval(),
    "requires_grad_": lambda m: m[0].weight.requires_grad_(False),
    "param.data dtype": lambda m: setattr(m[3].bias, "data", m[3].bias.data.double()),
    "buffer replaced": lambda m: m[1]._buffers.__setitem__("running_mean", torch.zeros(4)),
    "submodule.double()": lambda m: m[1].double(),
    "parameter replaced": lambda m: m[0]._parameters.__setitem__(
        "bias", nn.Parameter(torch.zeros(4))
    ),
    # Into a table that holds entries (BatchNorm's buffers). An empty table is not watched:
    # an entry added there goes through the registration hooks that StructureWatch
    # installs, and the step fails on it (test_errors.py, "new buffer").
    "buffer registered": lambda m: m[1].register_buffer("extra", torch.ones(1)),
    "dropout p": lambda m: setattr(m[2], "p", 0.3),
    "a new attribute": lambda m: setattr(m[0], "note", "hello"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_fails_the_check(change: str) -> None:
    model = small()
    guard = guard_of(model)
    CHANGES[change](model)
    assert not guard.passes()


SAME = {
    "train() again": lambda m: m.train(),
    "in-place copy": lambda m: m[0].weight.data.mul_(2),
    "load_state_dict": lambda m: m.load_state_dict(small().state_dict()),
    "the same value again": lambda m: setattr(m[2], "p", m[2].p),
    "a forward pass": lambda m: m(torch.randn(3, 4)),
}


@pytest.mark.parametrize("change", SAME)
def test_what_changes_no_signature_passes(change: str) -> None:
    model = small()
    guard = guard_of(model)
    SAME[change](model)
    assert guard.passes()


def test_model_watch_key_is_the_same_object_until_a_value_changes() -> None:
    model = small()
    params = dict(model.named_parameters())
    tensors = [*params.values(), *model.buffers()]
    watch = ModelWatch(list(model.modules()), params, tensors)
    key = watch.key()
    assert watch.key() is key
    # A table written with the tensor it held: the check fails, the key stays.
    model[1]._buffers["running_var"] = model[1]._buffers["running_var"]
    assert watch.key() is key
    model.eval()
    evaluated = watch.key()
    assert evaluated is not key and evaluated != key
    model.train()
    assert watch.key() == key  # back to the values of the first key
    # A plain attribute: changed, it changes the key; one added after the watch was built
    # (a cache a forward builds) fails the check but is not part of the key.
    model[2].p = 0.2
    assert ("module 3.p", 0.2) in watch.key()[-1][
        1
    ] and watch.key() != key  # module 0: the Sequential
    model[2].p = 0.5
    model[0].note = "hello"
    assert watch.key() == key


def test_without_working_dict_versions_the_watch_rereads_every_call(monkeypatch) -> None:
    monkeypatch.setattr(functacc.core.guards, "_dict_versions_work", lambda: False)
    model = small()
    params = dict(model.named_parameters())
    watch = ModelWatch(list(model.modules()), params, list(params.values()))
    key = watch.key()
    assert watch.key() is key
    model[1]._buffers["running_mean"] = torch.zeros(4)
    assert watch.key() != key


def test_batch_watch_keeps_its_key_for_a_tensor_passed_twice() -> None:
    # step(tokens, tokens): Dynamo's TensorGuards fails a repeated tensor, which made the
    # key be rebuilt on every call of a language model's step.
    tokens, others = torch.randint(0, 10, (8, 64)), torch.randint(0, 10, (8, 64))
    watch = BatchWatch()
    key = watch.key((tokens, tokens))
    assert watch.key((tokens, tokens)) is key
    assert watch.key((others, others)) is key  # new tensors, same specs and same repeats
    assert watch.key((tokens, others)) == key  # no repeat: rebuilt, equal specs
    shorter = torch.randint(0, 10, (8, 32))
    assert watch.key((shorter, shorter)) != key
    strided = torch.randint(0, 10, (64, 8)).t()
    assert watch.key((strided, strided)) != key


def test_model_watch_looks_inside_held_objects_once_and_survives_cycles() -> None:
    import types

    model = small()
    shared = types.SimpleNamespace(scale=1.0, extra={"k": [1, 2]})
    shared.me = shared  # a cycle: keyed by identity where it is met again
    loop: list = [0.5]
    loop.append(loop)
    for m in (model[0], model[3]):  # one object held by two modules
        m.cfg = shared
    model[2].loop = loop
    params = dict(model.named_parameters())
    watch = ModelWatch(list(model.modules()), params, list(params.values()))
    key = watch.key()
    assert watch.key() is key
    shared.extra["k"].append(3)  # two levels inside: a list in a dict in the object
    grown = watch.key()
    assert grown != key
    shared.extra["k"].pop()
    assert watch.key() == key
    loop[0] = 0.25
    assert watch.key() != key
    loop[0] = 0.5
    shared._private = 1  # a private attribute of a held object is not part of the key
    assert watch.key() == key
