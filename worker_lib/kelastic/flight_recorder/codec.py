"""The one codec of a worker's flight record file (written by the worker when its sidecar
asks, read by the sidecar), and the reading of torch's flight-recorder dump it is made of.

torch's flight recorder (``TORCH_FR_BUFFER_SIZE`` > 0) keeps each process group's last
collectives in a ring; ``torch._C._distributed_c10d._dump_fr_trace_json()`` gives them as
JSON: ``{"entries": [{"collective_seq_id", "process_group": [name, desc],
"profiling_name", "state", "retired", "is_p2p", ...}]}`` (torch's
``torch/csrc/distributed/c10d/FlightRecorder*``; with gloo the state stays
``scheduled`` and ``retired`` says a collective finished). What a hang needs of it is, per
process group, the newest collective the rank *entered* (:class:`Collective`): the ranks
of a group number their collectives alike (``collective_seq_id`` 1, 2, ...), so a rank
whose newest is below its peers' never entered the one they wait in.

The file (:func:`encode_record`): ``{"version": 1, "pid", "rank", "last": [{"group",
"seq", "name", "done"}], "trace": [torch's entries, the oldest dropped to fit]}``, at
most :data:`MAX_RECORD_BYTES`. The reader (:func:`decode_record`) checks what it uses
(``last``) strictly and refuses anything a writer could not have produced; ``trace``
is kept for people, read only as a list. Pure: no torch, no files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._safejson import is_int, load_object

__all__ = [
    "MAX_GROUPS",
    "MAX_NAME",
    "MAX_RECORD_BYTES",
    "Collective",
    "FlightRecord",
    "FlightRecordError",
    "decode_collectives",
    "decode_record",
    "encode_record",
    "last_collectives",
    "record_name",
]

#: Largest record file, bytes (torch's entries past it are dropped, the oldest first).
MAX_RECORD_BYTES: Final = 1024 * 1024
#: Most process groups a record names.
MAX_GROUPS: Final = 64
#: Longest group or collective name, characters.
MAX_NAME: Final = 256
#: Deepest nesting of a record (torch's entries hold lists of shapes: 5 levels).
MAX_DEPTH: Final = 12
_MAX_SEQ: Final = 2**63 - 1
_MAX_PID: Final = 2**31 - 1
VERSION: Final = 1


class FlightRecordError(ValueError):
    """A flight record that no writer produced (corrupt, crafted, cut, another version)."""


@dataclass(frozen=True)
class Collective:
    """The newest collective a rank entered in one process group.

    Attributes:
        group: the process group (its description, e.g. ``default_pg``, else its name).
        seq: its ``collective_seq_id`` (1 for the group's first collective).
        name: torch's profiling name, e.g. ``gloo:all_reduce``, ``nccl:broadcast``.
        done: it finished (``retired``, or state ``completed``); False: the rank is in it.
    """

    group: str
    seq: int
    name: str
    done: bool

    def describe(self) -> str:
        """``gloo:all_reduce #5 of default_pg (in it)`` or ``(... done)``."""
        return f"{self.name} #{self.seq} of {self.group} ({'done' if self.done else 'in it'})"


@dataclass(frozen=True)
class FlightRecord:
    """A worker's flight record as its sidecar reads it.

    Attributes:
        pid: the worker's pid.
        rank: its global rank (``$RANK``); None when it had none.
        last: the newest collective it entered, per process group (at most
            :data:`MAX_GROUPS`, in group order).
        entries: how many of torch's entries the file keeps.
    """

    pid: int
    rank: int | None
    last: tuple[Collective, ...]
    entries: int


def record_name(pid: int, rank: int | None) -> str:
    """The record's file name: ``rank-<rank>-pid-<pid>.json`` (``pid-<pid>.json`` with no
    rank), beside the stacks' ``rank-<rank>-pid-<pid>.txt``."""
    return f"rank-{rank}-pid-{pid}.json" if rank is not None else f"pid-{pid}.json"


def _group_of(entry: Mapping[str, Any]) -> str | None:
    pg = entry.get("process_group")
    if not isinstance(pg, list) or not pg or not all(isinstance(p, str) for p in pg):
        return None
    name: str = pg[1] if len(pg) > 1 and pg[1] not in ("", "undefined") else pg[0]
    return name[:MAX_NAME]


def last_collectives(trace: object) -> tuple[Collective, ...]:
    """The newest collective entered per process group in torch's dump ``trace`` (its
    ``{"entries": [...]}`` document), groups in order of first mention; point-to-point
    operations and malformed entries are skipped. Never raises."""
    entries = trace.get("entries") if isinstance(trace, Mapping) else None
    newest: dict[str, Collective] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping) or entry.get("is_p2p") is True:
            continue
        group, seq = _group_of(entry), entry.get("collective_seq_id")
        name = entry.get("profiling_name")
        if group is None or not is_int(seq, 1, _MAX_SEQ) or not isinstance(name, str):
            continue
        done = entry.get("retired") is True or entry.get("state") == "completed"
        known = newest.get(group)
        if known is None and len(newest) >= MAX_GROUPS:
            continue
        if known is None or seq >= known.seq:
            newest[group] = Collective(group, seq, name[:MAX_NAME], done)
    return tuple(newest.values())


def encode_record(pid: int, rank: int | None, trace: Mapping[str, Any],
                  max_bytes: int = MAX_RECORD_BYTES) -> bytes:  # fmt: skip
    """The record file of ``pid`` (rank ``rank``) from torch's dump ``trace``: its
    :func:`last_collectives` and its entries, the oldest dropped until the file is at
    most ``max_bytes``.

    Raises:
        ValueError: ``pid`` or ``rank`` out of bounds, ``max_bytes`` < 4096.
    """
    if not is_int(pid, 1, _MAX_PID) or (rank is not None and not is_int(rank, 0, _MAX_PID)):
        raise ValueError(f"pid {pid!r} / rank {rank!r} out of bounds")
    if max_bytes < 4096:
        raise ValueError(f"max_bytes must be >= 4096, got {max_bytes}")
    last = [
        {"group": c.group, "seq": c.seq, "name": c.name, "done": c.done}
        for c in last_collectives(trace)
    ]
    raw_entries = trace.get("entries")
    entries = list(raw_entries) if isinstance(raw_entries, list) else []
    while True:
        doc = {"version": VERSION, "pid": pid, "rank": rank, "last": last, "trace": entries}
        raw = json.dumps(doc, separators=(",", ":"), default=str).encode()
        if len(raw) <= max_bytes and _depth(entries) <= MAX_DEPTH - 2:
            return raw
        if not entries:  # a group is at most ~600 bytes: max_bytes // 1024 of them fit
            doc["last"] = last[: max_bytes // 1024]
            return json.dumps(doc, separators=(",", ":")).encode()
        entries = entries[max(1, len(entries) // 4) :]


def _depth(value: object, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of ``value`` (lists and objects), counted up to ``limit`` + 1."""
    if limit < 0 or not isinstance(value, list | dict):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def decode_record(raw: bytes) -> FlightRecord:
    """A record file back (:func:`encode_record`'s form).

    Raises:
        FlightRecordError: not bounded JSON, another version, or a field missing, of
            another type or out of bounds (a name over :data:`MAX_NAME`, a sequence
            number past 2**63 - 1, more than :data:`MAX_GROUPS` groups, one twice).
            Nothing else, whatever ``raw`` holds.
    """
    doc = load_object(raw, "flight record", max_bytes=MAX_RECORD_BYTES, max_depth=MAX_DEPTH,
                      error=FlightRecordError)  # fmt: skip
    pid, rank, last, trace = doc.get("pid"), doc.get("rank"), doc.get("last"), doc.get("trace")
    if doc.get("version") != VERSION or type(doc.get("version")) is not int:
        raise FlightRecordError(f"flight record: version {doc.get('version')!r}, not {VERSION}")
    if not is_int(pid, 1, _MAX_PID) or not (rank is None or is_int(rank, 0, _MAX_PID)):
        raise FlightRecordError(f"flight record: pid {pid!r} or rank {rank!r} out of bounds")
    if not isinstance(last, list) or len(last) > MAX_GROUPS or not isinstance(trace, list):
        raise FlightRecordError("flight record: 'last' or 'trace' is not a list of its bounds")
    out = decode_collectives(last)
    if out is None:
        raise FlightRecordError(f"flight record: bad collectives {str(last)[:120]!r}")
    return FlightRecord(pid, rank, out, len(trace))


def decode_collectives(items: object, limit: int = MAX_GROUPS) -> tuple[Collective, ...] | None:
    """``[{"group", "seq", "name", "done"}, ...]`` back (a record's ``last``, a hang
    document's ``collectives``); None when not a list of at most ``limit`` of them, one
    out of bounds or of another type, or a group twice. Never raises."""
    if not isinstance(items, list) or len(items) > limit:
        return None
    out: list[Collective] = []
    for item in items:
        c = item if isinstance(item, dict) else {}
        group, seq, name, done = c.get("group"), c.get("seq"), c.get("name"), c.get("done")
        if not (
            isinstance(group, str) and 0 < len(group) <= MAX_NAME
            and is_int(seq, 1, _MAX_SEQ)
            and isinstance(name, str) and len(name) <= MAX_NAME
            and type(done) is bool
            and all(o.group != group for o in out)
        ):  # fmt: skip
            return None
        out.append(Collective(group, seq, name, done))
    return tuple(out)
