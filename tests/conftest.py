"""What the whole suite shares: the test process made like a user's, where pytest is not.

pytest (9.x) hands its log-capture handlers to every logger that does not propagate, and
one of those is torch's structured-trace logger ``torch.__trace``. torch checks that
logger's handlers to decide whether to write its structured trace (``TORCH_TRACE``), so
under pytest every fake tensor and every symbol made while tracing captured a Python
stack for a record nobody reads: a sixth to a fifth of a jit trace's time (measured on
tests/test_real_code_transformer.py, 2026-11-29). A user's process has no handler there
(torch drops its own lazy one at the first record when ``TORCH_TRACE`` is unset), so
during each test's call the capture handlers are taken off that one logger and put back
after; pytest's capture of every other logger (``caplog``) is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

TORCH_TRACE_LOGGER = "torch.__trace"


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    trace_log = logging.getLogger(TORCH_TRACE_LOGGER)
    # pytest's handlers are the ones torch did not put there itself.
    borrowed = [h for h in trace_log.handlers if not hasattr(h, "_torch_logging_internal_handler")]
    for handler in borrowed:
        trace_log.removeHandler(handler)
    try:
        return (yield)
    finally:
        for handler in borrowed:
            trace_log.addHandler(handler)
