"""What each rank loaded as its round began: ``rank-<R>.restored`` in the slot folder,
written by the worker's :func:`kelastic.checkpoint.load` once it has loaded the agreed
step, read by its sidecar (which shares the folder) for its ``/status``, so that
``kelastic run`` can say how long the slowest rank took to load (the restore's cost seen
by the job, beside the sidecar's own check of the slots). One codec, writer and reader::

    {"round": 3, "step": 120, "tier": "memory", "seconds": 0.0123}

The file is the trainer's (user code runs there): the reader takes at most
:data:`MAX_BYTES`, bounded JSON, and passes over a file that is not exactly that
(a crafted one says nothing). Written under a temporary name and renamed: never half
read. Pure stdlib.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kelastic import contract
from kelastic._safejson import is_int, loads_bounded

__all__ = [
    "MAX_BYTES",
    "Restored",
    "decode_restored",
    "read_restored",
    "restored_path",
    "write_restored",
]

#: Largest record read, bytes.
MAX_BYTES: Final = 512
#: Largest round and step accepted (as the slot format's).
_MAX: Final = 2**53
#: Largest load time accepted, seconds (a day).
_MAX_SECONDS: Final = 86400.0
_NAME: Final = re.compile(r"rank-(0|[1-9][0-9]{0,9})\.restored")
_TIERS: Final = frozenset({contract.CHECKPOINT_TIER_MEMORY, contract.CHECKPOINT_TIER_DISK})


@dataclass(frozen=True)
class Restored:
    """One rank's load: the round it began, the step, where from
    (:data:`kelastic.contract.CHECKPOINT_TIER_MEMORY` or ``..._DISK``), and the seconds
    its ``load()`` took."""

    rank: int
    round: int
    step: int
    tier: str
    seconds: float


def restored_path(directory: Path, rank: int) -> Path:
    """``directory/rank-<rank>.restored``."""
    return directory / f"rank-{rank}.restored"


def write_restored(directory: Path, restored: Restored) -> None:
    """Write ``restored`` for its rank (replacing the rank's previous one).

    Raises:
        ValueError: a field outside the reader's bounds (nothing written).
        OSError: the folder cannot be written.
    """
    if _check(restored.round, restored.step, restored.tier, restored.seconds) is None:
        raise ValueError(f"not a restore record: {restored}")
    body = json.dumps({"round": restored.round, "step": restored.step, "tier": restored.tier,
                       "seconds": round(restored.seconds, 6)}).encode()  # fmt: skip
    target = restored_path(directory, restored.rank)
    tmp = directory / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "xb") as fh:
            fh.write(body)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _check(round_: object, step: object, tier: object, seconds: object) -> float | None:
    """The seconds as a float when every field is within bounds, else None."""
    if not (is_int(round_, 0, _MAX) and is_int(step, 0, _MAX) and isinstance(tier, str)
            and tier in _TIERS):  # fmt: skip
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    value = float(seconds)
    return value if math.isfinite(value) and 0.0 <= value <= _MAX_SECONDS else None


def decode_restored(raw: bytes, rank: int) -> Restored | None:
    """The record of ``rank`` in ``raw``, or None when it is not one (bounded: never
    raises, whatever ``raw`` holds)."""
    try:
        doc = loads_bounded(raw, max_bytes=MAX_BYTES)
    except ValueError:
        return None
    if not isinstance(doc, dict) or set(doc) != {"round", "step", "tier", "seconds"}:
        return None
    seconds = _check(doc["round"], doc["step"], doc["tier"], doc["seconds"])
    if seconds is None:
        return None
    return Restored(rank, doc["round"], doc["step"], doc["tier"], seconds)


def read_restored(directory: Path, round_: int) -> list[Restored]:
    """The records in ``directory`` of loads in round ``round_``, by rank; a file that is
    not a record, of another round, or unreadable is passed over."""
    found: list[Restored] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        try:
            with open(directory / name, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
        except OSError:
            continue
        got = decode_restored(raw, int(m.group(1)))
        if got is not None and got.round == round_:
            found.append(got)
    return found
