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

``history`` keeps the last :data:`HISTORY_LIMIT` charges.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

from kelastic.contract import Keys

from .etcd_store import EtcdStore

log = logging.getLogger("kelastic_sidecar.rendezvous")

RECORD_VERSION = 1
#: Charges kept in ``history``.
HISTORY_LIMIT = 100
_MAX_ATTEMPTS = 1000  # CAS retries; each failure means another node's write landed


class RestartRecordError(RuntimeError):
    """The restart record in etcd is corrupt (or written by an incompatible version)."""


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
    """Serialize ``record`` to the JSON stored in etcd."""
    doc = {
        "version": RECORD_VERSION,
        "count": record.count,
        "last_round": record.last_round,
        "history": list(record.history),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_record(raw: bytes, where: str = "restart record") -> RestartRecord:
    """Parse and validate a record.

    Raises:
        RestartRecordError: not JSON, another version, or a malformed field.
    """
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RestartRecordError(f"{where}: not JSON ({exc}): {raw[:80]!r}") from exc
    if not isinstance(doc, dict):
        raise RestartRecordError(f"{where}: not a JSON object")
    if doc.get("version") != RECORD_VERSION:
        raise RestartRecordError(
            f"{where}: version {doc.get('version')!r}, this kelastic reads {RECORD_VERSION}"
        )
    count, last_round, history = doc.get("count"), doc.get("last_round"), doc.get("history")
    if not _is_int(count) or count < 0:
        raise RestartRecordError(f"{where}: 'count' must be an integer >= 0")
    if not _is_int(last_round) or last_round < -1:
        raise RestartRecordError(f"{where}: 'last_round' must be an integer >= -1")
    if not isinstance(history, list):
        raise RestartRecordError(f"{where}: 'history' must be a list")
    for entry in history:
        if (
            not isinstance(entry, dict)
            or not _is_int(entry.get("round"))
            or not isinstance(entry.get("cause"), str)
            or not isinstance(entry.get("node"), str)
            or not isinstance(entry.get("detail"), dict)
            or not isinstance(entry.get("time"), int | float)
        ):
            raise RestartRecordError(
                f"{where}: history entries need round, cause, node, detail, time: {entry!r}"
            )
    return RestartRecord(count=count, last_round=last_round, history=tuple(history))


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
    """

    def __init__(self, store: EtcdStore, keys: Keys, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._store = store
        self._key = keys.restarts
        self.max_restarts = max_restarts

    def read(self) -> RestartRecord:
        """The current record (an empty one before the first charge).

        Raises:
            RestartRecordError: the record is corrupt.
            EtcdUnavailableError: etcd did not answer.
        """
        got = self._store.get(self._key)
        return RestartRecord() if got is None else decode_record(got[0], self._key)

    def charge(self, round_: int, cause: str, node: str, detail: dict[str, Any]) -> BudgetCharge:
        """Spend one restart for a failure of ``round_``, unless that round was charged.

        Idempotent per round across all nodes (compare-and-set loop). ``detail`` must be
        JSON-serializable (e.g. the failure's root cause).

        Raises:
            ValueError: ``round_ < 0`` or ``detail`` is not JSON-serializable.
            RestartRecordError: the record is corrupt.
            EtcdUnavailableError: etcd did not answer.
        """
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        json.dumps(detail, allow_nan=False)
        for _ in range(_MAX_ATTEMPTS):
            got = self._store.get(self._key)
            record = RestartRecord() if got is None else decode_record(got[0], self._key)
            new = apply_charge(record, round_, cause, node, detail, time.time())
            if new is None:
                return BudgetCharge(record.count, False, record.count > self.max_restarts)
            ok, _, _ = self._store.cas(self._key, encode_record(new), got[1] if got else None)
            if ok:
                exhausted = new.count > self.max_restarts
                log.warning(
                    "restart %d of %d charged for round %d by %s (%s)%s",
                    new.count, self.max_restarts, round_, node, cause,
                    ": budget exhausted" if exhausted else "",
                )  # fmt: skip
                return BudgetCharge(new.count, True, exhausted)
        raise RuntimeError(f"could not update {self._key} after {_MAX_ATTEMPTS} attempts")
