"""The job's restart record at :attr:`kelastic.contract.Keys.restarts`: bytes <-> document.

Written by the sidecars by compare-and-set (``kelastic_sidecar.restart_budget``: one
restart charged per failed round, job-wide), read by them and by the operator (the
restarts spent, in the job's status)::

    {"version": 1, "count": 2, "last_round": 5,
     "history": [{"round": 3, "cause": "worker_failure", "node": "job-1",
                  "detail": {...}, "time": 1718000000.0}, ...]}

Bounds (every reader and the writer alike): at most :data:`MAX_RECORD_BYTES` bytes nested
at most 32 deep, integers of at most 19 digits, finite numbers; ``count`` in
0..:data:`MAX_COUNT`, ``last_round`` in -1..:data:`MAX_COUNT`, at most
:data:`HISTORY_LIMIT` history entries, each with ``round`` in 0..:data:`MAX_COUNT`,
``cause`` and ``node`` strings of at most :data:`MAX_TEXT` characters, ``detail`` an
object, ``time`` in 0..1e11 seconds since the epoch.

- :func:`encode_record` (the sidecars' writer) is strict: a document outside the bounds
  is refused (:class:`CorruptValueError`), so nothing written is refused when read back.
- :func:`decode_record` (the sidecars' reader) is strict: every field, this version
  (:class:`ForeignValueError` for another: a record never overwritten).
- :func:`decode_record` with ``partial`` (the operator's reader) tolerates missing fields
  and another version (a record of an older or newer sidecar still shows its count);
  each field present is held to the same bounds. Stdlib only, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, TypedDict

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError, ForeignValueError, is_text, is_time

__all__ = [
    "HISTORY_LIMIT",
    "MAX_COUNT",
    "MAX_RECORD_BYTES",
    "MAX_TEXT",
    "RECORD_VERSION",
    "RestartsDoc",
    "decode_record",
    "encode_record",
]

#: Version of the record this codec reads and writes.
RECORD_VERSION: Final = 1
#: Charges kept in ``history``.
HISTORY_LIMIT: Final = 100
#: Largest record accepted, bytes.
MAX_RECORD_BYTES: Final = 2 * 1024 * 1024
#: Highest count or round accepted (2**53: exact as a float).
MAX_COUNT: Final = 2**53
#: Longest ``cause`` or ``node`` of a history entry, characters.
MAX_TEXT: Final = 1024


class RestartsDoc(TypedDict, total=False):
    """The record's document (the module doc's layout); :func:`encode_record` needs every
    field but ``version``."""

    version: int
    count: int
    last_round: int
    history: list[dict[str, Any]]


def _is_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    return (
        is_int(entry.get("round"), 0, MAX_COUNT)
        and is_text(entry.get("cause"), MAX_TEXT)
        and is_text(entry.get("node"), MAX_TEXT)
        and isinstance(entry.get("detail"), dict)
        and is_time(entry.get("time"))
    )


def check_record(doc: Mapping[str, Any], where: str, *, partial: bool = False) -> RestartsDoc:
    """Validate a decoded record document; see :func:`decode_record`.

    Raises:
        CorruptValueError, ForeignValueError: as :func:`decode_record`.
    """
    out: RestartsDoc = {}
    if not partial or "version" in doc:
        version = doc.get("version")
        if not is_int(version, 1):
            raise CorruptValueError(f"{where}: no record version")
        if version != RECORD_VERSION and not partial:
            raise ForeignValueError(
                f"{where}: version {version}, this kelastic reads {RECORD_VERSION}"
            )
        out["version"] = version
    if not partial or "count" in doc:
        count = doc.get("count")
        if not is_int(count, 0, MAX_COUNT):
            raise CorruptValueError(f"{where}: 'count' must be an integer in 0..{MAX_COUNT}")
        out["count"] = count
    if not partial or "last_round" in doc:
        last_round = doc.get("last_round")
        if not is_int(last_round, -1, MAX_COUNT):
            raise CorruptValueError(f"{where}: 'last_round' must be an integer in -1..{MAX_COUNT}")
        out["last_round"] = last_round
    if not partial or "history" in doc:
        history = doc.get("history")
        if not isinstance(history, list) or len(history) > HISTORY_LIMIT:
            raise CorruptValueError(f"{where}: 'history' must be a list of <= {HISTORY_LIMIT}")
        for entry in history:
            if not _is_entry(entry):
                raise CorruptValueError(
                    f"{where}: history entries need round, cause, node, detail, time: "
                    f"{entry!r:.200}"
                )
        out["history"] = list(history)
    return out


def decode_record(
    raw: bytes, where: str = "restart record", *, partial: bool = False
) -> RestartsDoc:
    """Parse and validate a record (the module doc's bounds).

    Args:
        raw: the bytes read from etcd.
        where: the etcd key, for error messages.
        partial: the tolerant reader: only the fields present, each checked; another
            version let through.

    Raises:
        CorruptValueError: not bounded JSON, not an object, a missing (not with
            ``partial``) or malformed field.
        ForeignValueError: another version (not with ``partial``). Never another
            exception, whatever ``raw`` holds.
    """
    doc = load_object(raw, where, max_bytes=MAX_RECORD_BYTES, error=CorruptValueError)
    return check_record(doc, where, partial=partial)


def encode_record(doc: RestartsDoc) -> bytes:
    """Serialize a record document with this codec's :data:`RECORD_VERSION`.

    Raises:
        CorruptValueError: a field missing or outside the module doc's bounds (strict:
            what is written is never refused when read), or a ``detail`` that is no JSON.
    """
    full = check_record({**doc, "version": RECORD_VERSION}, "restart record to write")
    try:
        raw = json.dumps(
            {"version": full["version"], "count": full["count"],
             "last_round": full["last_round"], "history": full["history"]},
            separators=(",", ":"), allow_nan=False,
        ).encode()  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise CorruptValueError(f"restart record to write: not JSON: {exc}") from None
    decode_record(raw, "restart record to write")  # bounds of the whole (size, depth)
    return raw
