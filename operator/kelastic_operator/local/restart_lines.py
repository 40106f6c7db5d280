"""What ``kelastic run`` says of process restarts: one line per restart the job's budget
record charged, ``process restart k/N: <root cause>`` (``process restart budget (N)
spent: ...`` for the failure past the budget), each named by the failure that best
explains it (:func:`root_cause`).

Each sidecar's ``/status`` says its node's ``last_failure`` and the record's last
``charges`` (:func:`kelastic_sidecar.restart_budget.recent_charges`: each with its
``count``, the restart it spent, and its ``round``), as it last read or wrote them. A
poll can miss a restart: two rounds may fail between two polls (the second one fast,
a warm start failing again at once, and exhausting the budget). So every failure seen
at any poll is kept by node and round, and each restart not said yet is said from the
charge of its count, with the failures seen of its round. Pure bookkeeping; every value
read is checked (a crafted status says nothing):
:class:`~kelastic_operator.local.progress.ProgressReporter` polls and says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

from kelastic._safejson import is_int
from kelastic.etcd_values.restarts import MAX_COUNT  # the record's bound on counts, rounds

__all__ = ["CAUSE_WAIT", "MAX_SAID", "ProcessRestarts", "root_cause"]

#: Seconds a restart's line waits for every node to report its failure of the round
#: (they do within moments of each other) before it is said with what is known.
CAUSE_WAIT = 1.0
#: Most restart lines said at once; an older restart past them is said as one line.
MAX_SAID = 16
#: Failures kept, by node and round (the oldest dropped first).
MAX_FAILURES_KEPT = 64
#: Readings of one charge kept (each sidecar reads the record when its round starts: a
#: charge amended to name a stopped worker reads two ways for a while).
MAX_READINGS = 4
#: What a restart no status describes is named by.
UNKNOWN = "see the sidecar logs"


def root_cause(failures: list[dict[str, Any]], charges: Sequence[Any] = ()) -> str:
    """The summary that best explains a restart, from the sidecars' ``last_failure``
    and, for a node no running sidecar speaks for (its sidecar killed right after the
    fault), the budget record's charges (``charges``, each sidecar's reading).

    Among the failures and charges of the latest round: a hung worker that was stopped
    (its peers' timers expire too, while they wait for it), then the earliest (a fault's
    time is when it was raised: the fault, not the errors it caused in peers). "see
    the sidecar logs" only when no sidecar knows any.
    """
    known = [f for f in [*failures, *charges] if described_failure(f)]
    if not known:
        return UNKNOWN
    latest = max(int(f["round"]) for f in known)
    pool = [f for f in known if int(f["round"]) == latest]
    pool.sort(key=lambda f: (f.get("stopped") is not True, float(f.get("time") or 0)))
    return str(pool[0]["summary"])


def described_failure(value: object) -> TypeGuard[dict[str, Any]]:
    """``value`` is a failure's description (``Failure.as_dict()``: a non-empty summary,
    an integer round, a numeric or absent time), as a sidecar's status or the budget
    record, which other nodes wrote, may hold it."""
    if not isinstance(value, dict) or not isinstance(value.get("summary"), str):
        return False
    when = value.get("time")
    numeric = when is None or (isinstance(when, (int, float)) and not isinstance(when, bool))
    return bool(value["summary"]) and is_int(value.get("round"), 0, MAX_COUNT) and numeric


def _count(value: object) -> int:
    return int(value) if is_int(value, 0, MAX_COUNT) else 0


class ProcessRestarts:
    """The process restarts said so far, and what the polls saw to name the next ones.

    Args:
        max_restarts: the job's restart budget (``spec.maxRestarts``).
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        #: restarts said (the count of the last one)
        self.said = 0
        self._failures: dict[tuple[str, int], dict[str, Any]] = {}  # (node, round) -> failure
        # count -> each sidecar's reading of that charge (one may say it amended)
        self._charges: dict[int, dict[str, dict[str, Any]]] = {}
        self._waiting_since: float | None = None

    def observe(self, statuses: list[dict[str, Any]], moved_on: bool, now: float) -> list[str]:
        """The lines to say after a poll: none until a restart not said yet is charged;
        then one per restart not said, once every node reported its failure of the
        latest round, a new round runs or the job ended (``moved_on``) or
        :data:`CAUSE_WAIT` seconds passed since the restart was first seen (``now``:
        monotonic seconds)."""
        self._remember(statuses)
        spent = max((_count(s.get("restarts_spent")) for s in statuses), default=0)
        if spent <= self.said:
            return []
        failures = [s["last_failure"] for s in statuses if described_failure(s.get("last_failure"))]
        latest = max((int(f["round"]) for f in failures), default=-1)
        each = len(failures) == len(statuses) and all(int(f["round"]) == latest for f in failures)
        if self._waiting_since is None:
            self._waiting_since = now
        if not (each or moved_on or now - self._waiting_since >= CAUSE_WAIT):
            return []
        lines = []
        if spent - self.said > MAX_SAID:
            skipped = spent - MAX_SAID
            lines.append(f"process restarts {self.said + 1}..{skipped}: no running sidecar "
                         f"describes them any more; {UNKNOWN}")  # fmt: skip
            self.said = skipped
        lines += [self._line(k, spent, failures) for k in range(self.said + 1, spent + 1)]
        self.said, self._waiting_since = spent, None
        self._charges = {k: c for k, c in self._charges.items() if k > spent}
        return lines

    def _remember(self, statuses: list[dict[str, Any]]) -> None:
        """Keep each node's failure of each round and each charge, as last seen."""
        for status in statuses:
            failure = status.get("last_failure")
            if described_failure(failure):
                key = (str(failure.get("node")), int(failure["round"]))
                self._failures.pop(key, None)  # re-inserted: the newest last
                self._failures[key] = failure
            charges = status.get("charges")
            for charge in charges[-MAX_SAID:] if isinstance(charges, list) else ():
                counted = described_failure(charge) and is_int(charge.get("count"), 1, MAX_COUNT)
                if counted and charge["count"] > self.said:
                    readings = self._charges.setdefault(charge["count"], {})
                    if len(readings) < MAX_READINGS or charge["summary"] in readings:
                        readings[charge["summary"]] = charge
        while len(self._failures) > MAX_FAILURES_KEPT:
            del self._failures[next(iter(self._failures))]
        while len(self._charges) > MAX_SAID:
            del self._charges[min(self._charges)]

    def _line(self, count: int, spent: int, failures: list[dict[str, Any]]) -> str:
        """The line of the ``count``-th restart (``spent``: the newest; ``failures``: the
        nodes' last ones now); the failure past the budget is no restart: it fails the job."""
        top = self.max_restarts
        what = (
            f"process restart {count}/{top}"
            if count <= top
            else f"process restart budget ({top}) spent"
        )
        readings = list(self._charges.get(count, {}).values())
        if readings:  # the sidecars agree on its round; an amended reading names the culprit
            rnd = max(int(c["round"]) for c in readings)
            seen = [f for (_, r), f in self._failures.items() if r == rnd]
            return f"{what}: {root_cause(seen, readings)}"
        if count == spent:  # no sidecar said its charge: the newest round's failures
            return f"{what}: {root_cause(failures)}"
        return f"{what}: {UNKNOWN}"
