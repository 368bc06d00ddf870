"""Batches loaded and moved to their device on a background thread, ahead of the step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["prefetched"]

_DONE = object()


def prefetched(
    batches: Iterator[Any], to_device: Callable[[Any], Any], depth: int
) -> Iterator[Any]:
    """``to_device(batch)`` for each batch, up to ``depth`` batches ahead on a thread; an
    exception in the thread is raised here, and closing the iterator stops the thread.

    Example:
        >>> list(prefetched(iter(range(4)), lambda b: b * 10, depth=2))
        [0, 10, 20, 30]
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for batch in batches:
                if stop.is_set():
                    return
                q.put(to_device(batch))
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
