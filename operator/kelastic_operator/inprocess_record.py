"""The operator's reading of the in-process restart record in etcd (pure).

The sidecars keep one record per job at :attr:`kelastic.contract.Keys.inprocess_iteration`
(written by compare-and-set)::

    {"iteration": 3, "round": 2, "restarts": 3, "cause": "exception", "node": "job-1",
     "rank": 5, "message": "ValueError: boom", "time": 1718000000.0}

The operator only reads it, to show in-process restarts in the job's status, with the one
codec every reader and writer of the record shares (:mod:`kelastic.inprocess_record`:
bounded, so a record the sidecars refuse the operator refuses too). Where the
sidecars raise, the operator shows no record (the sidecars decide, the operator reports),
and texts are cut to :data:`MAX_TEXT` characters for the status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kelastic import inprocess_record as codec

__all__ = ["MAX_COUNTER", "MAX_RECORD_BYTES", "MAX_TEXT", "InProcessRecord", "decode_record"]

#: Largest record read, bytes (the codec's bound).
MAX_RECORD_BYTES: Final = codec.MAX_RECORD_BYTES
#: Highest iteration or restart count accepted (the codec's bound).
MAX_COUNTER: Final = codec.MAX_ITERATION
#: Longest ``cause``, ``node`` or ``message`` kept in the status, characters (longer ones
#: are cut).
MAX_TEXT: Final = 1024


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


def decode_record(raw: bytes | None) -> InProcessRecord | None:
    """Read the in-process record's value.

    Args:
        raw: the value stored at ``inprocess/iteration`` (None: no such key).

    Returns:
        The record; None when there is none, or when the shared codec refuses it
        (:func:`kelastic.inprocess_record.decode_record`: not bounded JSON, not an object,
        a field out of its bounds or of the wrong type). A rank of -1 reads as None, a
        time of 0 as None. Never raises, whatever ``raw`` holds.
    """
    if raw is None:
        return None
    try:
        record = codec.decode_record(raw)
    except codec.RecordError:
        return None
    return InProcessRecord(
        iteration=record.iteration,
        restarts=record.restarts,
        cause=str(record.cause)[:MAX_TEXT],
        node=record.node[:MAX_TEXT],
        rank=record.rank if record.rank >= 0 else None,
        message=record.message[:MAX_TEXT],
        time=record.time or None,
    )
