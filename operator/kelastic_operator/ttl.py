"""``spec.ttlSecondsAfterFinished``: when a finished job is deleted (pure functions).

batch/v1 Job's meaning (the TTL-after-finished controller): a job that finished
(``status.phase`` Succeeded or Failed) is deleted ``ttlSecondsAfterFinished`` seconds after
``status.completionTime``; unset, it stays until someone deletes it. The deletion is the one
``kubectl delete`` makes: the operator's finalizer (:mod:`kelastic_operator.handlers`) stops
the job's Pods, waits until they are gone, deletes its etcd keys, and only then lets the API
server remove the job. Until the TTL passes, ``cleanupPolicy`` says which of a finished job's
Pods are deleted (rule 1 of :mod:`kelastic_operator.reconcile`).

:func:`apply_ttl` adds this to a reconcile pass's :class:`~kelastic_operator.reconcile_views.Plan`:
``delete_job`` once the TTL has passed, else a wake-up (``requeue_after``) when it will.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from .model import TERMINAL_PHASES, ElasticJobSpec, ElasticJobStatus
from .reconcile_views import Event, Plan, parse_time

__all__ = ["TTL_EXPIRED_REASON", "apply_ttl", "expiry"]

#: Reason of the Event posted when a finished job is deleted for its TTL.
TTL_EXPIRED_REASON = "TTLExpired"


def expiry(spec: ElasticJobSpec, status: ElasticJobStatus) -> datetime | None:
    """When the finished job is to be deleted.

    Args:
        spec: the job's spec (``ttl_seconds_after_finished``, seconds, 0..2**31-1).
        status: its status (``phase``, ``completion_time`` RFC 3339).

    Returns:
        ``completionTime + ttlSecondsAfterFinished`` (timezone-aware); None when the field
        is unset, the job has not finished, or its completion time is missing or not a
        time (a hand-written status: nothing is deleted on a guess).
    """
    ttl = spec.ttl_seconds_after_finished
    if ttl is None or status.phase not in TERMINAL_PHASES:
        return None
    finished = parse_time(status.completion_time)
    if finished is None:
        return None
    return finished + timedelta(seconds=ttl)


def apply_ttl(spec: ElasticJobSpec, plan: Plan, now: datetime) -> Plan:
    """Add the TTL's decision to ``plan`` (modified in place and returned).

    Once ``now`` reaches :func:`expiry` of ``plan.status`` the plan deletes the job
    (``delete_job``) and posts a :data:`TTL_EXPIRED_REASON` Event; before, it asks to be
    run again when the TTL passes (``requeue_after``, the earlier of that and what the
    plan already asked).

    Args:
        spec: the job's spec.
        plan: the pass's plan (its ``status`` is the new status).
        now: the current time, timezone-aware.
    """
    due = expiry(spec, plan.status)
    if due is None:
        return plan
    if now >= due:
        plan.delete_job = True
        plan.events.append(
            Event(
                "Normal",
                TTL_EXPIRED_REASON,
                f"deleting the job: finished ({plan.status.phase}) at "
                f"{plan.status.completion_time}, ttlSecondsAfterFinished "
                f"{spec.ttl_seconds_after_finished} s passed",
            )
        )
        return plan
    wait = (due - now).total_seconds()
    plan.requeue_after = wait if plan.requeue_after is None else min(plan.requeue_after, wait)
    return plan
