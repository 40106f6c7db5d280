"""spec.ttlSecondsAfterFinished: the model's bounds and reconcile's decision (pure); the
deletion on the real control plane is tests/operator/test_e2e_ttl.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from kelastic_operator.model import MAX_TTL_SECONDS
from kelastic_operator.reconcile import JobView, format_time, reconcile
from kelastic_operator.ttl import TTL_EXPIRED_REASON, expiry

from .test_reconcile import T0, job, pod, spec


def finished(
    ttl: int | None, phase: str = "Succeeded", at: str | None = format_time(T0)
) -> JobView:
    return job(spec(ttlSecondsAfterFinished=ttl), phase=phase, completionTime=at)


@pytest.mark.parametrize("bad", [-1, MAX_TTL_SECONDS + 1, 10**30, 1.5, "60", True])
def test_the_model_refuses_a_ttl_out_of_range_or_not_an_integer(bad: object) -> None:
    with pytest.raises(ValidationError, match="ttlSecondsAfterFinished"):
        spec(ttlSecondsAfterFinished=bad)


def test_the_ttl_is_unset_by_default_and_a_finished_job_then_stays() -> None:
    assert spec().ttl_seconds_after_finished is None
    plan = reconcile(finished(None), [pod(0, "Succeeded")], T0 + timedelta(days=3650))
    assert not plan.delete_job and plan.requeue_after is None


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_job_is_deleted_once_its_ttl_passed_and_woken_for_it_before(phase: str) -> None:
    j = finished(60, phase)
    before = reconcile(j, [pod(0, phase)], T0 + timedelta(seconds=45))
    assert not before.delete_job
    assert before.requeue_after == pytest.approx(15.0)
    assert TTL_EXPIRED_REASON not in [e.reason for e in before.events]
    at = reconcile(j, [pod(0, phase)], T0 + timedelta(seconds=60))
    assert at.delete_job
    (event,) = [e for e in at.events if e.reason == TTL_EXPIRED_REASON]
    assert phase in event.message and "60 s" in event.message
    assert not at.create  # a finished job gets no Pods, deleted or not


def test_ttl_zero_deletes_the_job_in_the_pass_that_finishes_it() -> None:
    j = job(spec(replicas=1, minReplicas=1, ttlSecondsAfterFinished=0), phase="Running")
    plan = reconcile(j, [pod(0, "Succeeded")], T0)
    assert plan.status.phase == "Succeeded" and plan.status.completion_time == format_time(T0)
    assert plan.delete_job


def test_a_running_job_is_never_deleted_for_its_ttl() -> None:
    j = job(spec(ttlSecondsAfterFinished=0), phase="Running")
    plan = reconcile(j, [pod(0), pod(1)], T0 + timedelta(days=1))
    assert plan.status.phase == "Running" and not plan.delete_job


@pytest.mark.parametrize("at", [None, "", "yesterday"])
def test_a_finished_job_without_a_readable_completion_time_is_not_deleted(at: str | None) -> None:
    j = finished(0, at=at)
    assert expiry(j.spec, j.status) is None
    plan = reconcile(j, [pod(0, "Succeeded")], T0)
    if at is None:  # the pass stamps it (now), so TTL 0 has passed
        assert plan.status.completion_time == format_time(T0) and plan.delete_job
    else:
        assert not plan.delete_job and plan.requeue_after is None


def test_the_ttl_wakeup_does_not_postpone_an_earlier_one() -> None:
    # a failed pod of a finished job is no reason to wake; the TTL's wake-up is the
    # earlier of its own and any the plan had
    plan = reconcile(finished(MAX_TTL_SECONDS), [pod(0, "Succeeded")], T0)
    assert plan.requeue_after == pytest.approx(float(MAX_TTL_SECONDS))
