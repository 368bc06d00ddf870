"""A pytest plugin (``-p stream_failures``) that appends each failure's traceback to
``$OUT/failures.log`` the moment it is reported, so a run cut by a time limit still says why
its tests failed (pytest, with or without xdist, prints them only at the end)."""

import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "out/gpu"), "failures.log")
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
