"""The operator's bounded reader of the in-process restart record in etcd (pure).

The sidecars keep one record per job at :attr:`kelastic.contract.Keys.inprocess_iteration`
(written by compare-and-set; the sidecar's own codec is
``kelastic_sidecar.inprocess_record``, which the operator may not import)::

    {"iteration": 3, "round": 2, "restarts": 3, "cause": "exception", "node": "job-1",
     "rank": 5, "message": "ValueError: boom", "time": 1718000000.0}

The operator only reads it, to show in-process restarts in the job's status. The reader
is tolerant where the sidecar's is strict (a record the operator cannot read shows as
none, never as an error: the sidecars decide, the operator reports) and bounded like
every decoder of data that crosses a trust boundary: at most :data:`MAX_RECORD_BYTES`
bytes nested at most 4 deep, integers of at most 19 digits and finite numbers
(:func:`kelastic._safejson.loads_bounded`), counters in 0..2**53, texts cut to
:data:`MAX_TEXT` characters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from kelastic._safejson import UnsafeJSONError, loads_bounded

__all__ = ["MAX_COUNTER", "MAX_RECORD_BYTES", "MAX_TEXT", "InProcessRecord", "decode_record"]

#: Largest record read, bytes (the sidecar's bound).
MAX_RECORD_BYTES: Final = 64 * 1024
#: Highest iteration, restart count or rank accepted (2**53: exact as a float).
MAX_COUNTER: Final = 2**53
#: Longest ``cause``, ``node`` or ``message`` kept, characters (longer ones are cut).
MAX_TEXT: Final = 1024
#: Latest accepted ``time``, seconds since the epoch (year 5138): beyond, no time is shown.
_MAX_TIME: Final = 1e11


@dataclass(frozen=True)
class InProcessRecord:
    """What the operator reads of the in-process record.

    Attributes:
        iteration: the job's current in-process iteration (0: no restart yet).
        restarts: in-process restarts the job spent (job-wide).
        cause: why the latest restart happened (``exception``, ``hang``...; ``""``).
        node: the node (Pod) whose sidecar reported the fault (``""`` when unknown).
        rank: the global rank that faulted, None when unknown.
        message: the fault's one-line summary (at most :data:`MAX_TEXT` characters).
        time: when the latest restart was agreed, seconds since the epoch (None when
            missing or out of range).
    """

    iteration: int = 0
    restarts: int = 0
    cause: str = ""
    node: str = ""
    rank: int | None = None
    message: str = ""
    time: float | None = None


def _counter(doc: dict[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNTER:
        return value
    return None


def _text(doc: dict[str, Any], name: str) -> str:
    value = doc.get(name)
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def _time(value: object) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    when = float(value)  # an int of 19 digits at most: no OverflowError
    return when if math.isfinite(when) and 0 < when < _MAX_TIME else None


def decode_record(raw: bytes | None) -> InProcessRecord | None:
    """Read the in-process record's value.

    Args:
        raw: the value stored at ``inprocess/iteration`` (None: no such key).

    Returns:
        The record; None when there is none, or when it is not bounded JSON, not an
        object, or its ``iteration`` or ``restarts`` is not an integer in 0..2**53.
        Other fields that are missing or mistyped read as unknown (``""``, None).
        Never raises, whatever ``raw`` holds.
    """
    if raw is None:
        return None
    try:
        doc = loads_bounded(raw, max_bytes=MAX_RECORD_BYTES, max_depth=4)
    except UnsafeJSONError:
        return None
    if not isinstance(doc, dict):
        return None
    iteration, restarts = _counter(doc, "iteration"), _counter(doc, "restarts")
    if iteration is None or restarts is None:
        return None
    when = _time(doc.get("time"))
    return InProcessRecord(
        iteration=iteration,
        restarts=restarts,
        cause=_text(doc, "cause"),
        node=_text(doc, "node"),
        rank=_counter(doc, "rank"),
        message=_text(doc, "message"),
        time=when,
    )
