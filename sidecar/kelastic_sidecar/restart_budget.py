"""The job's global restart budget, a JSON record at ``Keys.restarts`` in etcd.

torch counts restarts per agent (``--max-restarts``), so a job of N nodes may restart up
to N times as often as asked, and scale events spend the budget too
(pytorch/pytorch#108158). kelastic counts once per *round* for the whole job: the first
node to report a failure of round ``r`` spends one restart; later reports for the same
round (the other nodes seeing the same failure) spend nothing. Rounds only grow, so the
record keeps the last charged round. Scale events never charge: the supervisor does not
call :meth:`RestartBudget.charge` for them.

Record (``version`` 1)::

    {"version": 1, "count": 2, "last_round": 5,
     "history": [{"round": 3, "cause": "worker_failure", "node": "job-1",
                  "detail": {...}, "time": 1718000000.0}, ...]}

``history`` keeps the last :data:`HISTORY_LIMIT` charges. A round's charge names the
first node's failure, which for a hang is often a peer that waited on the culprit (its
timer expired first); a stopped worker found later on another node (the likely culprit:
:attr:`~kelastic_sidecar.failure.Failure.stopped`) **amends** the round's entry to name it
(:func:`apply_amend`: the count unchanged, the first summary kept as ``detail.waited``).
The bytes are the one codec's
(:mod:`kelastic.etcd_values.restarts`, shared with the operator's reader); this module
converts its :class:`RestartRecord` to and from the codec's document.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kelastic import etcd_values
from kelastic.contract import Keys
from kelastic_etcd import EtcdClient, EtcdError

from .failure import CAUSE_HANG

log = logging.getLogger("kelastic_sidecar.rendezvous")

#: Charges kept in ``history`` (the codec's bound).
HISTORY_LIMIT = etcd_values.HISTORY_LIMIT
_MAX_ATTEMPTS = 1000  # CAS retries; each failure means another node's write landed


class RestartRecordError(RuntimeError):
    """The restart record in etcd is corrupt (or written by an incompatible version)."""


class CorruptRecordError(RestartRecordError):
    """The restart record cannot be used by any reader (not bounded JSON, a bad field);
    unlike a record of another version, replacing it loses nothing readable."""


@dataclass(frozen=True)
class BudgetCharge:
    """Outcome of :meth:`RestartBudget.charge`.

    Attributes:
        count: restarts spent by the job so far (including this one, if charged).
        charged: True when this call spent the restart (first report of the round).
        exhausted: ``count > max_restarts``: the job must fail.
    """

    count: int
    charged: bool
    exhausted: bool


@dataclass(frozen=True)
class RestartRecord:
    """The stored record.

    Attributes:
        count: restarts spent.
        last_round: the last round charged (-1 before any).
        history: the last charges, oldest first: ``{round, cause, node, detail, time}``.
    """

    count: int = 0
    last_round: int = -1
    history: tuple[dict[str, Any], ...] = ()


def encode_record(record: RestartRecord) -> bytes:
    """Serialize ``record`` to the JSON stored in etcd, by the one codec of the value
    (:func:`kelastic.etcd_values.encode_restarts`).

    Raises:
        RestartRecordError: ``record`` is outside the codec's bounds (strict: nothing
            written is refused when read back), e.g. over 2 MiB with its history; the
            caller's write fails as when etcd refuses it.
    """
    doc: etcd_values.RestartsDoc = {
        "count": record.count, "last_round": record.last_round, "history": list(record.history)
    }  # fmt: skip
    try:
        return etcd_values.encode_restarts(doc)
    except etcd_values.CorruptValueError as exc:
        raise RestartRecordError(f"refusing to write the restart record: {exc}") from None


def decode_record(raw: bytes, where: str = "restart record") -> RestartRecord:
    """Parse and validate a record, by the one codec of the value
    (:func:`kelastic.etcd_values.decode_restarts`: at most 2 MiB nested at most 32 deep,
    integers of at most 19 digits, finite numbers; ``count`` and ``last_round`` at most
    2**53, at most :data:`HISTORY_LIMIT` history entries).

    Raises:
        CorruptRecordError: (a :class:`RestartRecordError`) not JSON, over a bound, or a
            malformed field.
        RestartRecordError: another version. Never another exception, whatever ``raw``
            holds.
    """
    try:
        doc = etcd_values.decode_restarts(raw, where)
    except etcd_values.CorruptValueError as exc:
        raise CorruptRecordError(str(exc)) from None
    except etcd_values.ForeignValueError as exc:
        raise RestartRecordError(str(exc)) from None
    return RestartRecord(doc["count"], doc["last_round"], tuple(doc["history"]))


def apply_charge(
    record: RestartRecord, round_: int, cause: str, node: str, detail: dict[str, Any], now: float
) -> RestartRecord | None:
    """The record after charging a failure of ``round_``; ``None`` when already charged."""
    if round_ <= record.last_round:
        return None
    entry = {"round": round_, "cause": cause, "node": node, "detail": detail, "time": now}
    history = (*record.history, entry)[-HISTORY_LIMIT:]
    return RestartRecord(count=record.count + 1, last_round=round_, history=history)


#: Charges a sidecar's ``/status`` says (``charges``: :func:`recent_charges`).
RECENT_CHARGES = 8
#: The fields of a charge's failure a ``charges`` entry keeps (the stderr tail stays in
#: the record: a status stays small).
CHARGE_FIELDS = ("cause", "node", "rank", "summary", "time", "stopped")


def charge_entry(count: int, round_: int, detail: dict[str, Any]) -> dict[str, Any]:
    """A ``charges`` entry of a sidecar's ``/status``: the restart ``count`` spent (1 for
    the job's first), the ``round`` it was charged for and, of the failure it names
    (``detail``, :meth:`~kelastic_sidecar.failure.Failure.as_dict`), the
    :data:`CHARGE_FIELDS` it has."""
    kept = {k: detail[k] for k in CHARGE_FIELDS if k in detail}
    return {**kept, "count": count, "round": round_}


def recent_charges(record: RestartRecord, limit: int = RECENT_CHARGES) -> list[dict[str, Any]]:
    """The record's last ``limit`` charged restarts as :func:`charge_entry` entries, oldest
    first. ``history``'s entries an Ignore rule left uncharged (``detail.ignored``) spent
    nothing and are skipped; counting back from ``count``, the newest charged entry spent
    the ``count``-th restart. A record replaced after corruption (its history gone)
    gives what it holds."""
    out: list[dict[str, Any]] = []
    count = record.count
    for entry in reversed(record.history):
        if len(out) >= limit or count < 1:
            break
        if entry["detail"].get("ignored") is True:
            continue
        out.append(charge_entry(count, entry["round"], entry["detail"]))
        count -= 1
    return out[::-1]


#: Ignored restarts (an Ignore rule's, marked ``detail.ignored``) among the record's last
#: :data:`HISTORY_LIMIT` entries past which another is counted after all: a failure an
#: Ignore rule matches over and over is the program's, not a disruption, and must not
#: restart the job for ever.
MAX_IGNORED = 50


def apply_ignore(
    record: RestartRecord, round_: int, cause: str, node: str, detail: dict[str, Any], now: float
) -> RestartRecord | None:
    """The record with an uncharged entry for ``round_`` (``detail["ignored"]``: an
    Ignore rule's restart), the count unchanged; ``None`` when the round has an entry, or
    when :data:`MAX_IGNORED` of the last entries are ignored ones (charge it instead)."""
    if round_ <= record.last_round:
        return None
    if sum(1 for h in record.history if h["detail"].get("ignored") is True) >= MAX_IGNORED:
        return None
    entry = {"round": round_, "cause": cause, "node": node, "time": now,
             "detail": {**detail, "ignored": True}}  # fmt: skip
    history = (*record.history, entry)[-HISTORY_LIMIT:]
    return RestartRecord(count=record.count, last_round=round_, history=history)


#: Longest first summary an amended entry keeps (``detail.waited``), characters.
MAX_WAITED = 1024


def apply_amend(
    record: RestartRecord, round_: int, cause: str, node: str, detail: dict[str, Any]
) -> RestartRecord | None:
    """The record with its charge of ``round_`` naming this failure instead, or ``None``
    when it must not: only a ``hang`` whose worker was stopped (``detail["stopped"]``)
    amends, only the newest entry, only of ``round_``, only a ``hang`` charge that does
    not name a stopped worker itself. The count and the entry's time stay; the first
    summary is kept as ``detail["waited"]`` (at most :data:`MAX_WAITED` characters)."""
    last = record.history[-1] if record.history else None
    if (
        last is None
        or last.get("round") != round_
        or record.last_round != round_
        or cause != CAUSE_HANG
        or detail.get("stopped") is not True
        or last.get("cause") != CAUSE_HANG
        or last["detail"].get("stopped") is True
    ):
        return None
    waited = last["detail"].get("summary")
    amended = {**detail, "waited": waited[:MAX_WAITED] if isinstance(waited, str) else ""}
    if last["detail"].get("ignored") is True:  # an uncharged round stays uncharged
        amended["ignored"] = True
    entry = {**last, "cause": cause, "node": node, "detail": amended}
    return RestartRecord(record.count, record.last_round, (*record.history[:-1], entry))


class RestartBudget:
    """The job's restart budget in etcd (shared by all nodes).

    Args:
        store: the etcd client.
        keys: the job's key layout (record at ``keys.restarts``).
        max_restarts: restarts allowed (>= 0); the job fails on restart ``max_restarts + 1``.
        on_repair: called after a corrupt record was replaced by :meth:`charge` (for a
            metric); keep it quick.
        host: the Kubernetes Node this sidecar runs on; each charge or amend it writes
            carries it as ``detail["host"]`` (the operator counts the failures of each
            Node); ``""``: none added.

    Raises:
        ValueError: ``max_restarts`` < 0.
    """

    def __init__(
        self,
        store: EtcdClient,
        keys: Keys,
        max_restarts: int,
        on_repair: Callable[[], object] | None = None,
        host: str = "",
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._store = store
        self._key = keys.restarts
        self.max_restarts = max_restarts
        self._known = 0  # highest count this node has read or written
        self._on_repair = on_repair
        self.host = host
        #: Corrupt records replaced by :meth:`charge`.
        self.repaired = 0

    def read(self) -> RestartRecord:
        """The current record (an empty one before the first charge).

        Raises:
            RestartRecordError: the record is corrupt.
            EtcdError: etcd did not answer, or refused the request.
        """
        got = self._store.get(self._key)
        record = RestartRecord() if got is None else decode_record(got[0], self._key)
        self._known = max(self._known, record.count)
        return record

    def last_cause(self, round_: int) -> str | None:
        """The cause charged for ``round_`` when it is the record's last charge (e.g. a
        peer's ``hang``, read as that peer restarts the round); None when not, or when
        the record cannot be read (logged)."""
        try:
            history = self.read().history
        except (EtcdError, RestartRecordError) as exc:
            log.warning("cannot read the restart record: %s", exc)
            return None
        last = history[-1] if history else {}
        return str(last.get("cause")) if last.get("round") == round_ else None

    def charge(
        self, round_: int, cause: str, node: str, detail: dict[str, Any], ignored: bool = False
    ) -> BudgetCharge:
        """Spend one restart for a failure of ``round_``, unless that round was charged
        (then the charge may be amended to name this failure: :func:`apply_amend`).
        ``ignored`` (an Ignore rule's verdict): record the round without spending one
        (:func:`apply_ignore`), unless the record holds :data:`MAX_IGNORED` ignored
        restarts already: then it is charged, marked ``detail["ignore_cap"]``.

        Idempotent per round across all nodes (compare-and-set loop). ``detail`` must be
        JSON-serializable (e.g. the failure's root cause).

        A corrupt record (:class:`CorruptRecordError`) is logged, counted in
        :attr:`repaired` and replaced, by compare-and-set on its revision, with a fresh
        record whose count is the highest this node has seen (never a refill beyond
        what this node knew was spent); the charge then goes on.

        Raises:
            ValueError: ``round_ < 0`` or ``detail`` is not JSON-serializable.
            RestartRecordError: the record is of another version (never overwritten), or
                the charged record is outside the codec's bounds (:func:`encode_record`).
            EtcdError: etcd did not answer, or refused the request.
        """

        detail = self._hosted(detail)

        def change(record: RestartRecord) -> RestartRecord | None:
            now = time.time()
            if ignored and round_ > record.last_round:
                spared = apply_ignore(record, round_, cause, node, detail, now)
                if spared is not None:
                    return spared
                return apply_charge(record, round_, cause, node, {**detail, "ignore_cap": True},
                                    now)  # fmt: skip
            return apply_charge(record, round_, cause, node, detail, now) or apply_amend(
                record, round_, cause, node, detail
            )

        record, new = self._update(round_, detail, change)
        if new is None:
            return BudgetCharge(record.count, False, record.count > self.max_restarts)
        exhausted = new.count > self.max_restarts
        if new.last_round > record.last_round and new.count == record.count:
            log.warning("restart for round %d not charged (an Ignore rule; %s)", round_, cause)
            return BudgetCharge(new.count, False, exhausted)
        if new.count > record.count:
            log.warning(
                "restart %d of %d charged for round %d by %s (%s)%s",
                new.count, self.max_restarts, round_, node, cause,
                ": budget exhausted" if exhausted else "",
            )  # fmt: skip
            return BudgetCharge(new.count, True, exhausted)
        log.warning("the charge of round %d amended by %s: a stopped worker (%s)", round_,
                    node, detail.get("summary", cause))  # fmt: skip
        return BudgetCharge(new.count, False, exhausted)

    def amend(self, round_: int, cause: str, node: str, detail: dict[str, Any]) -> bool:
        """Make the charge of ``round_`` name this failure when :func:`apply_amend` says
        so (a stopped worker found by a node whose peers' restart ended the round); never
        spends. Returns True when the record was changed.

        Raises:
            as :meth:`charge`.
        """
        detail = self._hosted(detail)
        _, new = self._update(
            round_, detail, lambda record: apply_amend(record, round_, cause, node, detail)
        )
        if new is not None:
            log.warning("the charge of round %d amended by %s: a stopped worker (%s)", round_,
                        node, detail.get("summary", cause))  # fmt: skip
        return new is not None

    def _hosted(self, detail: dict[str, Any]) -> dict[str, Any]:
        return {**detail, "host": self.host} if self.host else detail

    def _update(
        self,
        round_: int,
        detail: dict[str, Any],
        change: Callable[[RestartRecord], RestartRecord | None],
    ) -> tuple[RestartRecord, RestartRecord | None]:
        """Compare-and-set ``change(record)`` until it lands (``None``: nothing to
        write); a corrupt record is replaced first (see :meth:`charge`). Returns the
        record it was applied to, and what was written."""
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        json.dumps(detail, allow_nan=False)
        for _ in range(_MAX_ATTEMPTS):
            got = self._store.get(self._key)
            try:
                record = RestartRecord() if got is None else decode_record(got[0], self._key)
            except CorruptRecordError as exc:
                assert got is not None
                log.error("%s; replacing it with a fresh record of count %d", exc, self._known)
                self.repaired += 1
                self._store.cas(self._key, encode_record(RestartRecord(self._known)), got[1])
                if self._on_repair is not None:
                    self._on_repair()
                continue
            self._known = max(self._known, record.count)
            new = change(record)
            if new is None:
                return record, None
            ok, _, _ = self._store.cas(self._key, encode_record(new), got[1] if got else None)
            if ok:
                self._known = max(self._known, new.count)
                return record, new
        raise RuntimeError(f"could not update {self._key} after {_MAX_ATTEMPTS} attempts")
