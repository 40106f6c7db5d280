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

``history`` keeps the last :data:`HISTORY_LIMIT` charges. The bytes are the one codec's
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


class RestartBudget:
    """The job's restart budget in etcd (shared by all nodes).

    Args:
        store: the etcd client.
        keys: the job's key layout (record at ``keys.restarts``).
        max_restarts: restarts allowed (>= 0); the job fails on restart ``max_restarts + 1``.
        on_repair: called after a corrupt record was replaced by :meth:`charge` (for a
            metric); keep it quick.

    Raises:
        ValueError: ``max_restarts`` < 0.
    """

    def __init__(
        self,
        store: EtcdClient,
        keys: Keys,
        max_restarts: int,
        on_repair: Callable[[], object] | None = None,
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._store = store
        self._key = keys.restarts
        self.max_restarts = max_restarts
        self._known = 0  # highest count this node has read or written
        self._on_repair = on_repair
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

    def charge(self, round_: int, cause: str, node: str, detail: dict[str, Any]) -> BudgetCharge:
        """Spend one restart for a failure of ``round_``, unless that round was charged.

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
            new = apply_charge(record, round_, cause, node, detail, time.time())
            if new is None:
                return BudgetCharge(record.count, False, record.count > self.max_restarts)
            ok, _, _ = self._store.cas(self._key, encode_record(new), got[1] if got else None)
            if ok:
                self._known = max(self._known, new.count)
                exhausted = new.count > self.max_restarts
                log.warning(
                    "restart %d of %d charged for round %d by %s (%s)%s",
                    new.count, self.max_restarts, round_, node, cause,
                    ": budget exhausted" if exhausted else "",
                )  # fmt: skip
                return BudgetCharge(new.count, True, exhausted)
        raise RuntimeError(f"could not update {self._key} after {_MAX_ATTEMPTS} attempts")
