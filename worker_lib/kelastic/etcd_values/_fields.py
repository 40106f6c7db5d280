"""What every etcd value's codec shares: its two errors and the checks of a name, a text
and a point in time (a leaf of :mod:`kelastic.etcd_values`; stdlib only)."""

from __future__ import annotations

import math
from typing import Final, TypeGuard

__all__ = [
    "MAX_NAME_LEN",
    "MAX_TIME",
    "CorruptValueError",
    "ForeignValueError",
    "is_name",
    "is_text",
    "is_time",
]

#: Longest node name, run id or reason, characters.
MAX_NAME_LEN: Final = 1024
#: Latest point in time accepted, seconds since the epoch (year 5138).
MAX_TIME: Final = 1e11


class CorruptValueError(ValueError):
    """An etcd value no writer of this codec could have produced: not bounded JSON, a
    missing, unknown or ill-typed field, a number out of range, inconsistent contents.
    Replacing it loses nothing a reader could use. The message names the key and how."""


class ForeignValueError(ValueError):
    """A well-formed value this kelastic must not read nor overwrite: another version of
    the value, or another run's. The message names the key and what it found."""


def is_name(value: object) -> TypeGuard[str]:
    """A node name, run id or reason: a string of 1..:data:`MAX_NAME_LEN` characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_LEN


def is_text(value: object, limit: int) -> TypeGuard[str]:
    """A string of at most ``limit`` characters (empty allowed)."""
    return isinstance(value, str) and len(value) <= limit


def is_time(value: object) -> TypeGuard[float | int]:
    """Seconds since the epoch: a finite number (not bool) in 0..:data:`MAX_TIME`."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_TIME
    )
