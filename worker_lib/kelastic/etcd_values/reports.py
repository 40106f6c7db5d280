"""A node's final report at :meth:`kelastic.contract.Keys.report`: bytes <-> document.

Written once by a node's sidecar as it ends (``kelastic_sidecar.supervisor``), read by
the operator (a failed *job* marks the job Failed; a succeeded node counts towards
success)::

    {"outcome": "failed", "node": "job-0", "summary": "job failed after 3 restarts: ...",
     "failure": {...} or null, "time": 1718000000.0}

Bounds (every reader and the writer alike): at most :data:`MAX_REPORT_BYTES` bytes nested
at most 32 deep, integers of at most 19 digits, finite numbers; ``outcome`` one of
:class:`ReportOutcome`; ``node`` a name of 1..1024 characters; ``summary`` at most
:data:`MAX_SUMMARY` characters (the writer's builder cuts a longer one); ``failure`` an
object (the sidecar's ``Failure.as_dict()``) or null; ``time`` in 0..1e11 seconds since
the epoch.

:func:`encode_report` is strict (every field, within the bounds); :func:`decode_report`
is strict too, and with ``partial`` (the operator's reader) tolerates missing and unknown
fields, each field present held to the same bounds. Stdlib only, no I/O.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any, Final, TypedDict

from kelastic._safejson import load_object

from ._fields import CorruptValueError, is_name, is_text, is_time

__all__ = [
    "MAX_REPORT_BYTES",
    "MAX_SUMMARY",
    "ReportDoc",
    "ReportOutcome",
    "decode_report",
    "encode_report",
]

#: Largest report accepted, bytes (over etcd's default request limit, 1.5 MiB: the codec
#: refuses no report etcd would take).
MAX_REPORT_BYTES: Final = 2 * 1024 * 1024
#: Longest ``summary``, characters.
MAX_SUMMARY: Final = 64 * 1024


class ReportOutcome(enum.StrEnum):
    """How a node ended (the report's ``outcome``)."""

    #: Its workers all exited 0.
    SUCCEEDED = "succeeded"
    #: The node, or the whole job, failed (the summary says which).
    FAILED = "failed"
    #: The operator took the node out of the job.
    REMOVED = "removed"


class ReportDoc(TypedDict, total=False):
    """The report's document (the module doc's layout)."""

    outcome: ReportOutcome
    node: str
    summary: str
    failure: dict[str, Any] | None
    time: float


_FIELDS: Final = tuple(ReportDoc.__annotations__)
_OUTCOMES: Final = frozenset(o.value for o in ReportOutcome)


def _field(name: str, value: object, where: str) -> Any:
    if name == "outcome":
        if not isinstance(value, str) or value not in _OUTCOMES:
            raise CorruptValueError(f"{where}: 'outcome' must be one of {sorted(_OUTCOMES)}, "
                                    f"got {value!r:.80}")  # fmt: skip
        return ReportOutcome(value)
    if name == "node" and not is_name(value):
        raise CorruptValueError(f"{where}: 'node' must be a node name")
    if name == "summary" and not is_text(value, MAX_SUMMARY):
        raise CorruptValueError(f"{where}: 'summary' must be a string of at most "
                                f"{MAX_SUMMARY} characters")  # fmt: skip
    if name == "failure" and value is not None and not isinstance(value, dict):
        raise CorruptValueError(f"{where}: 'failure' must be an object or null")
    if name == "time":
        if not is_time(value):
            raise CorruptValueError(f"{where}: 'time' must be a number in 0..1e11")
        return float(value)
    return value


def check_report(doc: Mapping[str, Any], where: str, *, partial: bool = False) -> ReportDoc:
    """Validate a decoded report document; see :func:`decode_report`.

    Raises:
        CorruptValueError: as :func:`decode_report`.
    """
    missing = [name for name in _FIELDS if name not in doc]
    if missing and not partial:
        raise CorruptValueError(f"{where}: no {', '.join(map(repr, missing))}")
    checked = {name: _field(name, doc[name], where) for name in _FIELDS if name in doc}
    report: ReportDoc = checked  # type: ignore[assignment]  # each field checked above
    return report


def decode_report(raw: bytes, where: str = "node report", *, partial: bool = False) -> ReportDoc:
    """Parse and validate a report (the module doc's bounds). Unknown fields are ignored
    (additions by a later version).

    Args:
        raw: the bytes read from etcd.
        where: the etcd key, for error messages.
        partial: the tolerant reader: missing fields let through.

    Raises:
        CorruptValueError: not bounded JSON, not an object, a field missing (not with
            ``partial``) or outside its bounds. Never another exception.
    """
    doc = load_object(raw, where, max_bytes=MAX_REPORT_BYTES, error=CorruptValueError)
    return check_report(doc, where, partial=partial)


def encode_report(doc: ReportDoc) -> bytes:
    """Serialize a report.

    Raises:
        CorruptValueError: a field missing or outside the module doc's bounds, or a
            ``failure`` that is no JSON (strict: what is written is never refused).
    """
    full = check_report(doc, "node report to write")
    try:
        raw = json.dumps({name: full.get(name) for name in _FIELDS}, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CorruptValueError(f"node report to write: not JSON: {exc}") from None
    decode_report(raw, "node report to write")  # bounds of the whole (size, depth)
    return raw
