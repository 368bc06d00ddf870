"""``python -m functacc <command>``; the command is ``bench``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m functacc bench [--help] ...")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    print(f"unknown command {command!r}; the commands are: bench", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
