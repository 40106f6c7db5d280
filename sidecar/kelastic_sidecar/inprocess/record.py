"""The in-process restart record and the termination-barrier keys in etcd (pure: no I/O
but through the store handed to :func:`advance_iteration`).

The record at :attr:`kelastic.contract.Keys.inprocess_iteration` is one JSON object,
encoded and decoded by the one codec its every reader shares (:mod:`kelastic.inprocess_record`:
strict for the writer, bounded for the reader; re-exported here under the names this
package used)::

    {"iteration": 3, "round": 2, "restarts": 3, "cause": "exception", "node": "job-1",
     "rank": 5, "message": "ValueError: boom", "time": 1718000000.0}

``iteration`` is the job's current in-process iteration and the *fencing token* of every
in-process restart (NVIDIA's in-process restart calls it the restart iteration,
``nvidia_resiliency_ext.inprocess``): a fault of iteration ``n`` moves the record
from ``n`` to ``n + 1`` by compare-and-set on its ``mod_revision``, so that however many
ranks and nodes report a fault of ``n``, one restart happens. ``restarts`` counts the
in-process restarts the job spent (the budget, job-wide); the other fields describe the
fault that caused the latest one (``rank`` is the global rank, -1 when unknown).
A missing record is iteration 0 with nothing spent.

A node whose local ranks all passed the termination barrier of iteration ``m`` writes
:meth:`kelastic.contract.Keys.inprocess_ready` ``(m, node)``::

    {"group_rank": 0, "addr": "10.0.0.7", "port": 29517, "round": 4}

(``addr``/``port``: where this node's group rank 0 would serve the c10d store, used as
``MASTER_ADDR``/``MASTER_PORT`` of iteration ``m`` when this node is group rank 0;
``round``, an addition to the fields the contract names: the rendezvous round the node
was in, so that a key left by an earlier round at the same iteration never counts).

Every decoder is bounded like the product's others (:func:`kelastic._safejson.loads_bounded`,
:mod:`~kelastic_sidecar.restart_budget`) and raises only its error, whatever the bytes. A
corrupt record met by a fault is replaced by :func:`advance_iteration` (compare-and-set
on the corrupt value's revision), so that the fault still restarts in process.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from typing import Final, Protocol

from kelastic._safejson import is_int, load_object
from kelastic.inprocess_record import (
    MAX_ITERATION,
    MAX_TEXT,
    IterationRecord,
    RecordError,
    RestartCause,
    next_record,
)
from kelastic.inprocess_record import decode_record as decode_iteration_record
from kelastic.inprocess_record import encode_record as encode_iteration_record

__all__ = [
    "MAX_COUNTER",
    "MAX_ITERATION",
    "MAX_RECORD_BYTES",
    "MAX_TEXT",
    "Advance",
    "AdvanceOutcome",
    "IterationRecord",
    "IterationRecordError",
    "ReadyRecord",
    "RecordStore",
    "RestartCause",
    "advance_iteration",
    "decode_iteration_record",
    "decode_ready",
    "encode_iteration_record",
    "encode_ready",
    "next_record",
]

#: Largest ready value accepted, bytes.
MAX_RECORD_BYTES: Final = 64 * 1024
#: Highest group rank or round of a ready value accepted (2**53: exact as a float).
MAX_COUNTER: Final = 2**53
_MAX_ADDR: Final = 255
_MAX_CAS: Final = 100  # compare-and-set tries; each failure means another node's write

#: An in-process record or ready value in etcd is corrupt (the message says how); the
#: shared codec's error.
IterationRecordError = RecordError


@dataclass(frozen=True)
class ReadyRecord:
    """A node passed the termination barrier (see the module doc).

    Attributes:
        group_rank: the node's rank in the round.
        addr: its pod IP.
        port: a free TCP port picked on it for the c10d store of the next iteration.
        round: the rendezvous round (-1 when the writer did not say).
    """

    group_rank: int
    addr: str
    port: int
    round: int = -1


def decode_ready(raw: bytes, where: str = "in-process ready key") -> ReadyRecord:
    """Parse and validate a termination-barrier value ``{"group_rank", "addr", "port"}``.

    Raises:
        IterationRecordError: not bounded JSON (as :func:`decode_iteration_record`), a
            group rank outside 0..2**53, an address that is not a string of 1..255
            characters, a port outside 1..65535, a round outside -1..2**53. Never another
            exception.
    """
    doc = load_object(raw, where, max_bytes=MAX_RECORD_BYTES, max_depth=4,
                      error=IterationRecordError)  # fmt: skip
    addr, port = doc.get("addr"), doc.get("port")
    if not isinstance(addr, str) or not 0 < len(addr) <= _MAX_ADDR:
        raise IterationRecordError(f"{where}: bad 'addr': {raw[:120]!r}")
    if not is_int(port, 1, 65535):
        raise IterationRecordError(f"{where}: bad 'port': {raw[:120]!r}")
    round_ = doc.get("round", -1)
    if not is_int(round_, -1, MAX_COUNTER):
        raise IterationRecordError(f"{where}: bad 'round': {raw[:120]!r}")
    group_rank = doc.get("group_rank")
    if not is_int(group_rank, 0, MAX_COUNTER):
        raise IterationRecordError(f"{where}: bad 'group_rank': {raw[:120]!r}")
    return ReadyRecord(group_rank, addr, port, round_)


def encode_ready(ready: ReadyRecord) -> bytes:
    """Serialize a termination-barrier value (strict: what :func:`decode_ready` refuses
    is not written).

    Raises:
        IterationRecordError: ``ready`` is outside :func:`decode_ready`'s bounds.
    """
    doc = {"group_rank": ready.group_rank, "addr": ready.addr, "port": ready.port,
           "round": ready.round}  # fmt: skip
    raw = json.dumps(doc, separators=(",", ":")).encode()
    decode_ready(raw, "in-process ready value to write")
    return raw


class RecordStore(Protocol):
    """What :func:`advance_iteration` needs of an etcd client
    (:class:`kelastic_etcd.EtcdClient` is one)."""

    def get(self, key: str) -> tuple[bytes, int] | None: ...

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None
    ) -> tuple[bool, bytes | None, int]: ...


class Advance(enum.Enum):
    """How :func:`advance_iteration` ended."""

    #: This call moved the record to the next iteration (replacing a corrupt one:
    #: :attr:`AdvanceOutcome.replaced` says how it was corrupt).
    ADVANCED = "advanced"
    #: The record is already past the faulted iteration (another node won the race).
    SUPERSEDED = "superseded"
    #: ``restarts`` reached the budget: no in-process restart for this fault.
    EXHAUSTED = "exhausted"
    #: No next record can be written (the iteration at
    #: :data:`~kelastic.inprocess_record.MAX_ITERATION`; :attr:`AdvanceOutcome.error`).
    CORRUPT = "corrupt"
    #: Another node's restart into the next iteration spent nothing (a change of
    #: membership); this call charged it to its own cause (``take_over``).
    TAKEN_OVER = "taken_over"


@dataclass(frozen=True)
class AdvanceOutcome:
    """Outcome of :func:`advance_iteration`.

    Attributes:
        kind: what happened.
        record: the record as stored now (the one written on :attr:`Advance.ADVANCED`);
            ``None`` on :attr:`Advance.CORRUPT`.
        revision: its ``mod_revision`` (0 when missing or corrupt).
        error: why no record could be written, on :attr:`Advance.CORRUPT`; on
            :attr:`Advance.SUPERSEDED`, why a take-over's write failed (the record as is).
        replaced: on :attr:`Advance.ADVANCED` over a corrupt record, the decoder's
            message about it (``""`` otherwise).
        replaced_revision: that corrupt record's ``mod_revision`` (0 when none).
    """

    kind: Advance
    record: IterationRecord | None
    revision: int = 0
    error: str = ""
    replaced: str = ""
    replaced_revision: int = 0


def advance_iteration(
    store: RecordStore,
    key: str,
    faulted: int,
    max_restarts: int,
    *,
    round_: int,
    cause: RestartCause,
    node: str,
    rank: int,
    message: str,
    now: float,
    known: tuple[bytes | None, int] | None = None,
    charge: bool = True,
    known_restarts: int = 0,
    take_over: bool = False,
) -> AdvanceOutcome:
    """Move the record from iteration ``faulted`` to ``faulted + 1`` (one restart spent),
    by compare-and-set on its ``mod_revision`` (the fencing of every in-process restart).

    One etcd request when ``known`` is the stored record (the compare-and-set returns
    the current value when it fails, so a lost race needs no read either).

    A record *behind* ``faulted`` (deleted, or rewritten by hand) is moved to
    ``faulted + 1`` as well, keeping its ``restarts``: iterations never go back. A
    *corrupt* record (refused by :func:`decode_iteration_record`: forged, or written by
    something else) is replaced the same way, by compare-and-set on its revision, with
    ``known_restarts`` as the restarts spent before (the caller's count: a corrupt record
    never refills the budget); the outcome's :attr:`AdvanceOutcome.replaced` says so.

    Args:
        store: the etcd client.
        key: :attr:`kelastic.contract.Keys.inprocess_iteration`.
        faulted: the iteration the fault happened in.
        max_restarts: in-process restarts the job may spend (>= 0).
        round_, cause, node, rank, message, now: the fault (see :func:`next_record`).
        known: the record as last read (``(value, mod_revision)``; ``(None, 0)``: it did
            not exist); None: read it first.
        charge: spend one restart (checked against ``max_restarts``); False: a restart
            that is not a fault (nodes joining or leaving on purpose), neither checked
            nor counted.
        known_restarts: restarts the caller knows were spent (used over a corrupt record).
        take_over: a charged restart that finds another node's restart into
            ``faulted + 1`` that spent nothing (``membership``: a lost node's own sidecar
            sees its lease lost before its SIGTERM, and may win the race) makes it its
            own: the record keeps its iteration (nobody aborts again) and gets this
            cause and one restart spent (:attr:`Advance.TAKEN_OVER`;
            :attr:`Advance.EXHAUSTED` when the budget is spent). One compare-and-set; a
            failed one leaves the record as it is (:attr:`Advance.SUPERSEDED`).

    Returns:
        the outcome; :attr:`Advance.SUPERSEDED` is the fenced-out loser of a race.

    Raises:
        kelastic_etcd.EtcdError: etcd did not answer (or refused).
        RuntimeError: the record kept changing for 100 tries.
    """
    got: tuple[bytes, int] | None
    if known is None:
        got = store.get(key)
    else:
        value, known_revision = known
        got = None if value is None else (value, known_revision)
    for _ in range(_MAX_CAS):
        revision = got[1] if got else 0
        try:
            record = IterationRecord() if got is None else decode_iteration_record(got[0], key)
            corrupt = ""
        except IterationRecordError as exc:
            record, corrupt = IterationRecord(iteration=faulted, restarts=known_restarts), str(exc)
        if record.iteration > faulted:
            if take_over and charge and not corrupt and record.iteration == faulted + 1 \
                    and record.cause == RestartCause.MEMBERSHIP:  # fmt: skip
                return _take_over(store, key, record, revision, max_restarts, cause=cause,
                                  node=node, message=message)  # fmt: skip
            if charge and not corrupt and record.iteration == faulted + 1 \
                    and record.cause != RestartCause.MEMBERSHIP and now < record.time:  # fmt: skip
                return _earlier_fault(store, key, record, revision, cause=cause, node=node,
                                      rank=rank, message=message, now=now)  # fmt: skip
            return AdvanceOutcome(Advance.SUPERSEDED, record, revision)
        if charge and record.restarts >= max_restarts:
            return AdvanceOutcome(Advance.EXHAUSTED, record, revision)
        base = IterationRecord(iteration=faulted, restarts=record.restarts)
        try:
            new = next_record(
                base, round_=round_, cause=cause, node=node, rank=rank, message=message,
                now=now, charge=charge,
            )  # fmt: skip
        except IterationRecordError as exc:
            return AdvanceOutcome(Advance.CORRUPT, None, revision, f"{key}: {exc}")
        ok, current, new_revision = store.cas(
            key, encode_iteration_record(new), revision if got else None
        )
        if ok:
            return AdvanceOutcome(Advance.ADVANCED, new, new_revision, "", corrupt,
                                  revision if corrupt else 0)  # fmt: skip
        got = None if current is None else (current, new_revision)
    raise RuntimeError(f"could not update {key} after {_MAX_CAS} tries")


def _earlier_fault(
    store: RecordStore,
    key: str,
    record: IterationRecord,
    revision: int,
    *,
    cause: RestartCause,
    node: str,
    rank: int,
    message: str,
    now: float,
) -> AdvanceOutcome:
    """:func:`advance_iteration`'s lost race to a restart into our iteration whose fault
    came after ours (``now`` < ``record.time``, by the reporting sidecars' clocks): ours
    names it. Faults of one iteration follow each other: a rank's exception aborts its
    process group, and its peers' collectives then fail with "Connection closed by peer"
    on other nodes, whose sidecars may win the compare-and-set when etcd was slow to
    answer both. One compare-and-set at ``revision`` rewrites the fault's fields
    (cause, node, rank, message, time), keeping the iteration and the restarts spent: no
    node aborts again, nothing more is charged. Returns :attr:`Advance.SUPERSEDED` with
    the record as stored now (renamed, or ``record`` when the write lost or failed: the
    name then stays the later fault's)."""
    renamed = replace(record, cause=cause, node=node, rank=rank, message=message[:MAX_TEXT],
                      time=now)  # fmt: skip
    try:
        ok, _, new_revision = store.cas(key, encode_iteration_record(renamed), revision)
    except (ConnectionError, ValueError):  # etcd failing, or a value the codec refuses
        return AdvanceOutcome(Advance.SUPERSEDED, record, revision)
    if not ok:
        return AdvanceOutcome(Advance.SUPERSEDED, record, revision)
    return AdvanceOutcome(Advance.SUPERSEDED, renamed, new_revision)


def _take_over(
    store: RecordStore,
    key: str,
    record: IterationRecord,
    revision: int,
    max_restarts: int,
    *,
    cause: RestartCause,
    node: str,
    message: str,
) -> AdvanceOutcome:
    """:func:`advance_iteration`'s ``take_over``: charge ``record`` (at ``revision``) to
    ``cause``, its iteration unchanged, by one compare-and-set."""
    if record.restarts >= max_restarts:
        return AdvanceOutcome(Advance.EXHAUSTED, record, revision)
    charged = replace(record, restarts=record.restarts + 1, cause=cause, node=node,
                      message=message[:MAX_TEXT])  # fmt: skip
    try:
        ok, _, new_revision = store.cas(key, encode_iteration_record(charged), revision)
    except ConnectionError as exc:  # etcd's errors are ConnectionErrors: go on uncharged
        return AdvanceOutcome(Advance.SUPERSEDED, record, revision, str(exc))
    if not ok:
        return AdvanceOutcome(Advance.SUPERSEDED, record, revision)
    return AdvanceOutcome(Advance.TAKEN_OVER, charged, new_revision)
