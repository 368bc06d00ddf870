"""Boolean switches read from the environment (``FUNCTACC_COMPILE_WORKER=0`` and the like)."""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: unset or empty gives ``default``; ``1/true/yes/on`` and
    ``0/false/no/off`` (any case) give on and off; anything else is an error naming the
    variable, since a typo must not silently keep the default.

    Example:
        >>> env_flag("FUNCTACC_NOT_SET_ANYWHERE", True)
        True
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"environment variable {name}={os.environ[name]!r} is not a switch: expected one of "
        f"{', '.join(_ON)} (on) or {', '.join(_OFF)} (off). Set it to one of those, or unset it "
        f"for the default ({'on' if default else 'off'})."
    )
