"""In-process restarts in the job's status, Events and the operator's restart counter
(pure: a part of :func:`kelastic_operator.reconcile.reconcile`'s rules, in a module of its
own).

The sidecars agree on every in-process restart in etcd (the iteration record,
:mod:`kelastic_operator.inprocess_record`); the operator reads that record with the rest of
the job's keys, in the range request it makes anyway (no extra etcd request), and:

- shows it: ``status.inProcessRestarts`` (the record's ``restarts``) and
  ``status.lastInProcessRestart`` (iteration, cause, rank, node, message, time);
- announces it: a Warning Event ``InProcessRestart`` when the count grows (one Event
  object per job, its ``count`` raised on each repeat: the operator's aggregation);
- counts it: :func:`restart_increases` gives, per rung of the restart ladder (the ``level``
  label of ``kelastic_operator_restarts_total``: ``inprocess``, ``process``, ``pod``), how
  much the stored status grew in one pass, so that the counter is job-wide (one per
  restart, however many nodes took part) and never counts a restart twice (the status is
  what a newly elected operator starts from).
"""

from __future__ import annotations

from datetime import datetime, timezone

from .inprocess_record import InProcessRecord
from .model import ElasticJobSpec, ElasticJobStatus, InProcessRestart
from .reconcile_views import Event, format_time

__all__ = ["EVENT_REASON", "LEVELS", "apply_inprocess", "restart_increases"]

#: The Event's reason when the job's in-process restart count grows.
EVENT_REASON = "InProcessRestart"
#: ``level`` values of ``kelastic_operator_restarts_total``, cheapest rung first:
#: ``inprocess`` (every rank re-entered the training function in the same processes; the
#: sidecars' ``kelastic_restarts_total`` uses the same value), ``process`` (the worker
#: group's processes restarted: ``status.restartsSpent``; the sidecars' ``process``),
#: ``pod`` (the operator replaced a failed Pod: ``status.replacements``).
LEVELS: tuple[str, ...] = ("inprocess", "process", "pod")


def _restart(record: InProcessRecord) -> InProcessRestart:
    when = None
    if record.time is not None:
        when = format_time(datetime.fromtimestamp(record.time, timezone.utc))
    return InProcessRestart(
        iteration=record.iteration,
        cause=record.cause,
        rank=record.rank,
        node=record.node,
        message=record.message,
        time=when,
    )


def apply_inprocess(
    spec: ElasticJobSpec,
    old: ElasticJobStatus,
    st: ElasticJobStatus,
    record: InProcessRecord | None,
) -> Event | None:
    """Put what the in-process record says into the new status ``st``.

    Without a record (none yet, etcd unreachable, or unreadable) ``st`` keeps what it had.
    With one, ``inProcessRestarts`` is its ``restarts`` and, once it has restarted at
    least once, ``lastInProcessRestart`` describes the latest restart.

    Args:
        spec: the job's spec (its ``inProcess.maxRestarts`` goes into the Event's text).
        old: the status as stored; st: the new status being made (changed in place).
        record: the record as read this pass.

    Returns:
        The ``InProcessRestart`` Warning Event when the count grew past ``old``'s, None
        otherwise.
    """
    if record is None:
        return None
    st.in_process_restarts = record.restarts
    if record.restarts > 0 or record.iteration > 0:
        st.last_in_process_restart = _restart(record)
    before = old.in_process_restarts or 0
    if record.restarts <= before:
        return None
    rank = f"rank {record.rank}" if record.rank is not None else "a rank"
    where = f" on {record.node}" if record.node else ""
    what = ": ".join(x for x in (record.cause, record.message) if x) or "a fault"
    return Event(
        "Warning",
        EVENT_REASON,
        f"in-process restart {record.restarts}/{spec.in_process.max_restarts} "
        f"(iteration {record.iteration}): {rank}{where}: {what}",
    )


def restart_increases(old: ElasticJobStatus, new: ElasticJobStatus) -> dict[str, int]:
    """How many restarts of each rung (:data:`LEVELS`) ``new`` counts beyond ``old``.

    Returns:
        ``level`` -> increase (> 0 only; a counter that went down, e.g. a record
        rewritten by hand, adds nothing).
    """
    pairs = {
        "inprocess": (old.in_process_restarts, new.in_process_restarts),
        "process": (old.restarts_spent, new.restarts_spent),
        "pod": (old.replacements, new.replacements),
    }
    out = {}
    for level, (before, after) in pairs.items():
        grew = (after or 0) - (before or 0)
        if grew > 0:
            out[level] = grew
    return out
