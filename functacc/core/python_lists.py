"""Lists and deques a step body reaches, while it is traced, and what it did to them.

A list the body reaches (a rollout buffer's ``rewards``, a history it appends to) is
replaced for the trace by a :class:`RecordingList` copy, a deque by a
:class:`RecordingDeque`: they note whether the body read them (their length, their items,
through Python's methods) and what it appended. A list torch's C++ reads
(``torch.tensor(rewards)``, ``torch.stack(states)``) is read past those methods, unseen: a
list the body *took* (read as an attribute or an entry, held by a variable it loads) and
left as it was counts as read. A read list's length and numbers are part of the signature
and its tensors are fed (:class:`~.python_trace.Recorder`); :func:`list_effect` says what
is replayed after each call: the items appended, or, where the body emptied it
(``clear()``, ``del lst[:]``, PPO-PyTorch's ``buffer.clear()``), the items it holds then.

Example:
    >>> from functacc.core.python_location import Location, Root
    >>> here = Location(Root("closure variable 'rewards'", lambda: None, None))
    >>> list_effect(here, [1.0, 2.0], [], lambda v, where: ("const", v), cleared=True)
    ('clear', Location(closure variable 'rewards'), [])
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ..errors import TraceError
from .python_location import MISSING, Location
from .python_reach import is_scalar

__all__ = ["RecordingDeque", "RecordingList", "list_effect", "list_writes", "took_list"]


def _reading(cls: type, name: str) -> Callable[..., Any]:
    """``cls``'s method ``name``, noting first that the body read the container."""
    method = getattr(cls, name)

    def read(self: Any, *args: Any) -> Any:
        self._note()
        return method(self, *args)

    read.__name__ = name
    return read


_LIST_READS = ("__reversed__", "copy", "index", "count", "__add__", "__mul__", "__rmul__")
_LIST_READS += ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")


class RecordingList(list):
    """A list the body reaches, while it is traced: a copy that notes whether the body
    read it (its length, a loop over it; an item by a non-negative index is that item's
    read alone, as a dict entry's). Appends are replayed after each call; a
    list the body both reads and appends to would be read at its trace-time length on every
    call, which is refused (``read``)."""

    def __init__(self, original: list, location: Location, recorder: Any):
        super().__init__(original)
        self.location = location
        self.recorder = recorder
        self.read = False
        # The body took it (an attribute, an entry): torch's C++ reads a list it is given
        # (torch.stack(self.states)) past these methods, unseen (Recorder.unfed_tensors).
        self.taken = False
        self.cleared = False  # emptied whole (clear(), del lst[:]): a replayable change

    def clear(self) -> None:
        self.cleared = True
        list.clear(self)

    def __delitem__(self, index: Any) -> None:
        if index == slice(None):
            self.cleared = True
        list.__delitem__(self, index)

    def _note(self) -> None:
        if self.recorder.recording:
            self.read = True
            self.recorder.list_read(self)  # its tensors are fed to the graph

    def __len__(self) -> int:
        self._note()
        return list.__len__(self)

    def __getitem__(self, index: Any) -> Any:
        if type(index) is int and index >= 0 and self.recorder.recording:  # factors[0]:
            value = list.__getitem__(self, index)  # that item, whatever the length
            self.recorder.guard(self.location.child("item", index), value)
            if not is_scalar(value):  # a tensor: all the list's are fed (an index may vary)
                self.recorder.list_read(self)
            return value
        self._note()
        return list.__getitem__(self, index)

    def __iter__(self) -> Any:
        self._note()
        return list.__iter__(self)

    def __contains__(self, value: object) -> bool:
        self._note()
        return list.__contains__(self, value)

    def __bool__(self) -> bool:
        self._note()
        return list.__len__(self) > 0

    # Reads that list's own C code makes (reversed(rewards), rewards + [0.0], a copy).
    __reversed__, copy, index, count, __add__, __mul__, __rmul__ = (
        _reading(list, name) for name in _LIST_READS[:7]
    )
    __eq__, __ne__, __lt__, __le__, __gt__, __ge__ = (
        _reading(list, name) for name in _LIST_READS[7:]
    )


_DEQUE_READS = ("__len__", "__getitem__", "__iter__", "__reversed__", "__contains__")
_DEQUE_READS += ("count", "index")


class RecordingDeque(collections.deque):
    """A ``collections.deque`` the body reaches (torchvision's ``SmoothedValue`` window),
    while it is traced: a copy that notes its appends, replayed after each call on the
    deque itself (its ``maxlen`` drops from the left then, as in eager), and whether the
    body read it, as :class:`RecordingList` does. Other changes are refused at once."""

    def __init__(self, original: collections.deque, location: Location, recorder: Any):
        super().__init__(original, original.maxlen)
        self.location, self.recorder = location, recorder
        self.read, self.before, self.appended = False, list(original), []

    def items_now(self) -> list:
        """The items as if the deque had no ``maxlen``: the appends after the original's."""
        return self.before + self.appended

    def append(self, value: Any) -> None:
        self.appended.append(value)
        super().append(value)

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def _changed(self, *args: Any, **kwargs: Any) -> None:
        raise TraceError(
            f"the step changes the deque {self.location.label} other than by appending to "
            "it. functacc.jit replays a step's appends after each call, as eager makes them; "
            "other changes (popleft, appendleft, rotate, clear, assigning an item) it cannot "
            "replay. Fix: append only, or return the values and keep the deque outside the "
            "step."
        )

    appendleft = extendleft = pop = popleft = rotate = clear = remove = insert = _changed
    __delitem__ = __iadd__ = _changed

    def __setitem__(self, index: Any, value: Any) -> None:
        if self.recorder.recording:
            self._changed()
        super().__setitem__(index, value)  # a fed tensor, put where the body reads it

    def _note(self) -> None:
        if self.recorder.recording:
            self.read = True
            self.recorder.list_read(self)

    # Reads (bool() goes through __len__).
    __len__, __getitem__, __iter__, __reversed__, __contains__, count, index = (
        _reading(collections.deque, name) for name in _DEQUE_READS
    )


def list_effect(
    location: Location,
    before: list,
    after: list,
    template: Callable[[Any, str], tuple],
    read: bool = False,
    noun: str = "list",
    cleared: bool = False,
) -> tuple | None:
    """The effect of the body on a list (or a deque): ``None`` (untouched), the items it
    appended, or, where it emptied it (``cleared``: ``clear()``, ``del lst[:]``), the items
    it holds then; ``read``: the body also read the list, which an append then cannot
    keep."""
    if len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True)):
        return None
    if cleared and not {id(a) for a in after} & {id(b) for b in before}:
        # buffer.clear(), del states[:] (then appends): as eager leaves it, whatever it held
        added = [template(v, f"an item put in {location.label}") for v in after]
        return ("clear", location, added)
    appended = len(after) > len(before) and all(
        a is b for a, b in zip(after[: len(before)], before, strict=True)
    )
    if not appended:
        raise TraceError(
            f"the step changes the {noun} {location.label} other than by appending to it (it "
            f"held {len(before)} items, then {len(after)}). functacc.jit replays a step's "
            f"appends after each call, as eager makes them; other changes of a {noun} (pop, "
            "insert, assigning an item, clear) it cannot replay. Fix: append only, or return "
            f"the values and keep the {noun} outside the step."
        )
    if read:
        raise TraceError(
            f"the step reads the {noun} {location.label} (its length or its items) and appends "
            "to it. functacc.jit replays the appends after each call, but what the step read "
            f"of the {noun} is fixed when it is traced, where eager reads it afresh (len(history) "
            f"as a step count would stay {len(before)}). Fix: keep a counter (self.step += 1) "
            f"and read that, or return the values and keep the {noun} outside the step."
        )
    added = [template(v, f"an item appended to {location.label}") for v in after[len(before) :]]
    return ("append", location, added)


def took_list(lst: RecordingList, unrecorded: set[int]) -> bool:
    """Whether the body took ``lst``: read as an attribute or an entry, held by a variable
    its code loads, or by an object whose reads are unseen (``unrecorded``, by id)."""
    steps = lst.location.steps
    if lst.taken or (not steps and getattr(lst.location.root, "loaded", False)):
        return True
    return bool(steps) and id(Location(lst.location.root, steps[:-1]).get()) in unrecorded


def list_writes(
    obj: RecordingList | RecordingDeque,
    location: Location,
    contents: list,
    fed: dict,
    original: Callable[[Any], Any],
    template: Callable[[Any, str], tuple],
    unrecorded: set[int],
) -> tuple[tuple | None, bool]:
    """After a trace: the effect of the body on a recording list or deque (``contents``:
    what it held before; ``fed``: the trace's fed values, by location), and whether the
    body read it whole, so that its length and items are part of the signature."""
    now = obj.items_now() if isinstance(obj, RecordingDeque) else list(list.__iter__(obj))
    now = [  # items still holding what was fed: the originals
        contents[i] if v is fed.get(location.child("item", i), MISSING) else v
        for i, v in enumerate(map(original, now))
    ]
    noun = "deque" if isinstance(obj, RecordingDeque) else "list"
    cleared = getattr(obj, "cleared", False)
    # Items fed to the graph were read, by torch's C++ where not by Python (torch.stack of
    # a list it also appends to): an append then cannot keep what the step read.
    read = obj.read or any(location.child("item", i) in fed for i in range(len(contents)))
    effect = list_effect(location, contents, now, template, read, noun, cleared)
    took = isinstance(obj, RecordingList) and took_list(obj, unrecorded)
    return effect, (effect is None or effect[0] == "clear") and (obj.read or took)
