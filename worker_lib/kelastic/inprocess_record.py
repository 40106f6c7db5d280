"""The in-process restart record: the one codec of every writer and reader of it.

The sidecars keep one record per job at :attr:`kelastic.contract.Keys.inprocess_iteration`
(written by compare-and-set, ``kelastic_sidecar.inprocess.record``); the operator reads it
into the job's status; ``kelastic run`` reads its fields from the sidecars' ``/status``::

    {"iteration": 3, "round": 2, "restarts": 3, "cause": "exception", "node": "job-1",
     "rank": 5, "message": "ValueError: boom", "time": 1718000000.0}

One codec for all of them, so that they agree on every value (with a reader each, the
sidecar's took iteration 2**53, which its writer then moved past what the same reader
accepts, while the operator's own reader and ``kelastic run`` took anything):

- :func:`encode_record` is strict: it refuses (:class:`RecordError`) a record outside
  the bounds below, so nothing a writer stores is refused by a reader;
- :func:`decode_record` (etcd bytes) and :func:`record_from_mapping` (an object already
  decoded, e.g. ``/status``'s ``last``) are bounded: at most :data:`MAX_RECORD_BYTES`
  bytes nested at most 4 deep, integers of at most 19 digits, finite numbers
  (:func:`kelastic._safejson.loads_bounded`), and the same bounds as the writer's: a
  value no writer could have produced is refused by every reader alike, and raises
  :class:`RecordError` and nothing else, whatever the bytes.

Bounds: ``iteration`` and ``restarts`` in 0..:data:`MAX_ITERATION` (a writer moves the
iteration by one per restart or round change, and refuses to move past it; 2**31 - 1
restarts are beyond any job); ``round`` in -1..2**53 (the rendezvous' bound); ``rank``
in -1..:data:`MAX_RANK`; ``cause`` one of :class:`RestartCause`; ``node`` and
``message`` at most :data:`MAX_TEXT` characters; ``time`` a finite number of seconds
since the epoch in 0..1e11. Stdlib only, no I/O.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kelastic._safejson import is_int, load_object

__all__ = [
    "MAX_ITERATION",
    "MAX_RANK",
    "MAX_RECORD_BYTES",
    "MAX_ROUND",
    "MAX_TEXT",
    "MAX_TIME",
    "IterationRecord",
    "RecordError",
    "RestartCause",
    "check_record",
    "decode_record",
    "encode_record",
    "next_record",
    "record_from_mapping",
]

#: Largest record accepted, bytes.
MAX_RECORD_BYTES: Final = 64 * 1024
#: Highest ``iteration`` or ``restarts`` a writer stores and a reader accepts.
MAX_ITERATION: Final = 2**31 - 1
#: Highest ``round`` (the rendezvous' bound, 2**53: exact as a float).
MAX_ROUND: Final = 2**53
#: Highest global ``rank`` (the rendezvous' node-rank bound times the most local ranks).
MAX_RANK: Final = 2**32
#: Longest ``node`` or ``message``, characters (the writer cuts longer ones).
MAX_TEXT: Final = 8 * 1024
#: Latest ``time`` accepted, seconds since the epoch (year 5138).
MAX_TIME: Final = 1e11


class RecordError(ValueError):
    """An in-process record is outside the codec's bounds: corrupt, forged, or (from
    :func:`encode_record`) a record no writer may store. The message says how."""


class RestartCause(enum.StrEnum):
    """Why the latest in-process restart happened (the record's ``cause``)."""

    #: No restart yet (a fresh record).
    NONE = ""
    #: The wrapped function raised.
    EXCEPTION = "exception"
    #: No progress within the soft timeout.
    SOFT_TIMEOUT = "soft_timeout"
    #: A rank's health check failed after an abort.
    HEALTH_CHECK = "health_check"
    #: A rank's abort failed.
    ABORT_FAILED = "abort_failed"
    #: A worker process died (the hybrid rung).
    WORKER_DIED = "worker_died"
    #: A hung worker was reaped, or killed at the hard timeout (the hybrid rung).
    HANG = "hang"
    #: A node of the round was lost (the node-change rung; spends a restart).
    NODE_LOST = "node_lost"
    #: Nodes joined or left on purpose (the node-change rung; spends none).
    MEMBERSHIP = "membership"


@dataclass(frozen=True)
class IterationRecord:
    """The decoded iteration record (see the module doc).

    Attributes:
        iteration: the job's current in-process iteration (the fencing token).
        round: the rendezvous round of the latest restart (-1 before any).
        restarts: in-process restarts the job spent.
        cause: why the latest restart happened (:attr:`RestartCause.NONE` before any).
        node: the node that reported the fault (``""`` before any).
        rank: the global rank that faulted (-1 when unknown).
        message: the fault's one-line summary.
        time: ``time.time()`` of the write, seconds (0 before any).
    """

    iteration: int = 0
    round: int = -1
    restarts: int = 0
    cause: RestartCause = RestartCause.NONE
    node: str = ""
    rank: int = -1
    message: str = ""
    time: float = 0.0


_CAUSES: Final = frozenset(c.value for c in RestartCause)
_FIELDS: Final = ("iteration", "round", "restarts", "cause", "node", "rank", "message", "time")


def _int(doc: Mapping[str, Any], name: str, where: str, low: int, high: int, dflt: int) -> int:
    value = doc.get(name, dflt)
    if not is_int(value, low, high):
        raise RecordError(f"{where}: {name!r} must be an integer in {low}..{high}, "
                          f"got {value!r:.80}")  # fmt: skip
    return value


def _text(doc: Mapping[str, Any], name: str, where: str) -> str:
    value = doc.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise RecordError(f"{where}: {name!r} must be a string of at most {MAX_TEXT} characters")
    return value


def _cause(doc: Mapping[str, Any], where: str) -> RestartCause:
    value = doc.get("cause", "")
    value = "" if value is None else value
    if isinstance(value, str) and value in _CAUSES:
        return RestartCause(value)
    raise RecordError(f"{where}: 'cause' must be one of {sorted(_CAUSES)}, got {value!r:.80}")


def _time(doc: Mapping[str, Any], where: str) -> float:
    value = doc.get("time", 0.0)
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or not 0 <= value <= MAX_TIME):  # fmt: skip
        raise RecordError(f"{where}: 'time' must be a number in 0..{MAX_TIME:g}, got {value!r:.80}")
    return float(value)


def record_from_mapping(
    doc: Mapping[str, Any], where: str = "in-process record", *, complete: bool = True
) -> IterationRecord:
    """Validate an already decoded record. Unknown fields are ignored (additions by a
    later version).

    Args:
        doc: the decoded JSON object.
        where: what it is, for the error message.
        complete: every field the writer writes must be there (the record in etcd);
            False: only ``iteration`` (a part of it, e.g. ``/status``'s ``last``), the
            others take :class:`IterationRecord`'s defaults.

    Raises:
        RecordError: a missing field, a field outside the module doc's bounds, or of the
            wrong type. Never another exception.
    """
    missing = [f for f in (_FIELDS if complete else ("iteration",)) if f not in doc]
    if missing:
        raise RecordError(f"{where}: no {', '.join(map(repr, missing))}")
    return IterationRecord(
        iteration=_int(doc, "iteration", where, 0, MAX_ITERATION, 0),
        round=_int(doc, "round", where, -1, MAX_ROUND, -1),
        restarts=_int(doc, "restarts", where, 0, MAX_ITERATION, 0),
        cause=_cause(doc, where),
        node=_text(doc, "node", where),
        rank=_int(doc, "rank", where, -1, MAX_RANK, -1),
        message=_text(doc, "message", where),
        time=_time(doc, where),
    )


def decode_record(raw: bytes, where: str = "in-process record") -> IterationRecord:
    """Parse and validate the record's bytes (the module doc's bounds).

    Raises:
        RecordError: not bounded JSON, not an object, a field outside the bounds or of
            the wrong type. Never another exception, whatever ``raw`` holds.
    """
    doc = load_object(raw, where, max_bytes=MAX_RECORD_BYTES, max_depth=4, error=RecordError)
    return record_from_mapping(doc, where)


def check_record(record: IterationRecord) -> IterationRecord:
    """``record`` when every reader accepts it.

    Raises:
        RecordError: a field outside the module doc's bounds (the writer's refusal).
    """
    return record_from_mapping(_as_doc(record), "in-process record to write")


def _as_doc(record: IterationRecord) -> dict[str, Any]:
    return {
        "iteration": record.iteration, "round": record.round, "restarts": record.restarts,
        "cause": str(record.cause), "node": record.node, "rank": record.rank,
        "message": record.message, "time": record.time,
    }  # fmt: skip


def encode_record(record: IterationRecord) -> bytes:
    """Serialize ``record`` to the JSON stored in etcd (the module doc's layout).

    Raises:
        RecordError: ``record`` is outside the bounds every reader checks (strict: nothing
            written is refused when read back).
    """
    check_record(record)
    return json.dumps(_as_doc(record), separators=(",", ":"), allow_nan=False).encode()


def next_record(
    record: IterationRecord,
    *,
    round_: int,
    cause: RestartCause,
    node: str,
    rank: int,
    message: str,
    now: float,
    charge: bool = True,
) -> IterationRecord:
    """The record after a fault of ``record.iteration``: the next iteration, one more
    restart spent (none when not ``charge``: a round change that is no fault), the fault
    described (``node`` and ``message`` cut to :data:`MAX_TEXT`).

    Raises:
        RecordError: the next record would be outside the bounds (``record`` at
            :data:`MAX_ITERATION`, a rank or round out of range): no writer stores it.
    """
    doc = {
        **_as_doc(record), "iteration": record.iteration + 1, "round": round_,
        "restarts": record.restarts + int(charge), "cause": str(cause), "node": node[:MAX_TEXT],
        "rank": rank, "message": message[:MAX_TEXT], "time": now,
    }  # fmt: skip
    return record_from_mapping(doc, "in-process record to write")
