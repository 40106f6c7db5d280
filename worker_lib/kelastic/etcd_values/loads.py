"""What a node's workers loaded as a round began, at
:meth:`kelastic.contract.Keys.checkpoint_load`: bytes <-> :class:`LoadDoc`.

Written once per round by the node's sidecar, when every one of its workers has loaded the
step the round agreed on (their ``rank-<R>.restored`` records,
:mod:`kelastic.checkpoint.restored`), read by the operator, which says in
``status.lastCheckpoint`` how many of the round's ranks have loaded it and how long the
slowest took (the restore's cost as the job sees it, beside where it came from)::

    {"round": 3, "step": 120, "tier": "disk", "ranks": 2, "seconds": 0.0123,
     "time": 1764190000.5}

``tier``: the round's tier (``memory``, ``peer`` or ``disk``:
:class:`~kelastic.etcd_values.checkpoints.RestoreTier`, never ``none``: nothing is
loaded then); ``ranks``: the node's workers that loaded it; ``seconds``: the slowest of
their ``load()`` calls; ``time``: when the sidecar saw the last of them (its clock).

Bounds (writer and reader alike): at most :data:`MAX_LOAD_BYTES` bytes; ``round`` and
``step`` integers in 0..2**53; ``ranks`` in 1..:data:`MAX_LOCAL_RANKS`; ``seconds``
finite, 0..86400; ``time`` a time. :func:`encode_load` is strict; :func:`decode_load`
refuses what it could not write (:class:`CorruptValueError`, nothing else, whatever the
bytes). Stdlib only, no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Final

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError, is_time

__all__ = ["MAX_LOAD_BYTES", "MAX_LOCAL_RANKS", "LoadDoc", "decode_load", "encode_load"]

#: Largest value accepted, bytes.
MAX_LOAD_BYTES: Final = 512
#: Most workers one node reports (as the checkpoints record's ranks).
MAX_LOCAL_RANKS: Final = 4096
_MAX: Final = 2**53
_MAX_SECONDS: Final = 86400.0
_TIERS: Final = frozenset({"memory", "peer", "disk"})
_FIELDS: Final = frozenset({"round", "step", "tier", "ranks", "seconds", "time"})


@dataclass(frozen=True)
class LoadDoc:
    """One node's workers' load of a round's step (the module doc's fields)."""

    round: int
    step: int
    tier: str
    ranks: int
    seconds: float
    time: float


def _check(doc: LoadDoc, where: str) -> LoadDoc:
    seconds = doc.seconds
    ok = (
        is_int(doc.round, 0, _MAX)
        and is_int(doc.step, 0, _MAX)
        and isinstance(doc.tier, str)
        and doc.tier in _TIERS
        and is_int(doc.ranks, 1, MAX_LOCAL_RANKS)
        and isinstance(seconds, int | float)
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and 0 <= seconds <= _MAX_SECONDS
        and is_time(doc.time)
    )
    if not ok:
        raise CorruptValueError(
            f"{where}: round and step must be integers in 0..2**53, tier one of "
            f"{sorted(_TIERS)}, ranks in 1..{MAX_LOCAL_RANKS}, seconds in 0..86400, time a "
            f"time: {asdict(doc)!r:.300}"
        )
    return LoadDoc(doc.round, doc.step, doc.tier, doc.ranks, float(seconds), float(doc.time))


def encode_load(doc: LoadDoc) -> bytes:
    """The value of ``doc``.

    Raises:
        CorruptValueError: a field outside its bounds.
    """
    raw = json.dumps(asdict(_check(doc, "checkpoint load")), separators=(",", ":"),
                     allow_nan=False).encode()  # fmt: skip
    if len(raw) > MAX_LOAD_BYTES:  # cannot happen within the bounds; kept as the rule
        raise CorruptValueError(f"checkpoint load: {len(raw)} bytes > {MAX_LOAD_BYTES}")
    return raw


def decode_load(raw: bytes, where: str = "checkpoint load", *, partial: bool = False) -> LoadDoc:
    """Read a value written by :func:`encode_load`.

    Args:
        partial: let unknown fields through (a newer sidecar's), as a reader that only
            reports does (the operator); the known ones are held to the same bounds.

    Raises:
        CorruptValueError: not that value (too large, not bounded JSON, fields missing,
            unknown (unless ``partial``) or out of bounds).
    """
    if len(raw) > MAX_LOAD_BYTES:
        raise CorruptValueError(f"{where}: {len(raw)} bytes > {MAX_LOAD_BYTES}")
    obj = load_object(raw, where, max_bytes=MAX_LOAD_BYTES, max_depth=2,
                      error=CorruptValueError)  # fmt: skip
    if not set(obj) >= _FIELDS or (set(obj) != _FIELDS and not partial):
        raise CorruptValueError(f"{where}: fields must be {sorted(_FIELDS)}: {sorted(obj)!r:.200}")
    doc = LoadDoc(obj["round"], obj["step"], obj["tier"], obj["ranks"], obj["seconds"],
                  obj["time"])  # fmt: skip
    return _check(doc, where)
