"""spec.suspend: the model's field and reconcile's decisions (pure); on the real control
plane it is tests/operator/test_e2e_suspend.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from kelastic_operator.pods import pod_spec_hash
from kelastic_operator.reconcile import (
    JOB_FAILED_PREFIX,
    CreatePod,
    DeletePod,
    RendezvousView,
    reconcile,
)
from kelastic_operator.suspend import (
    RESUMED_REASON,
    SUSPEND_DELETE_REASON,
    SUSPENDED_CONDITION,
    SUSPENDED_REASON,
)

from .test_reconcile import T0, cond, job, names, pod, spec

LATER = T0 + timedelta(minutes=5)


@pytest.mark.parametrize("bad", ["true", 1, "yes"])
def test_the_model_refuses_a_suspend_that_is_not_a_boolean(bad: object) -> None:
    with pytest.raises(ValidationError, match="suspend"):
        spec(suspend=bad)


def test_suspend_defaults_to_false_and_does_not_shape_the_pods() -> None:
    assert spec().suspend is False
    assert pod_spec_hash(spec(suspend=True)) == pod_spec_hash(spec())


def test_a_job_created_suspended_creates_no_pods() -> None:
    plan = reconcile(job(spec(suspend=True)), [], T0)
    assert not plan.create and not plan.delete
    assert plan.status.phase == "Suspended" and plan.status.replicas == 0
    assert cond(plan.status, SUSPENDED_CONDITION)[:2] == ("True", SUSPENDED_REASON)
    assert cond(plan.status, "RendezvousReady")[0] == "False"
    assert plan.status.start_time is None
    # and stays so, pass after pass, with nothing to do
    again = reconcile(job(spec(suspend=True), **plan.status.as_patch()), [], LATER)
    assert not again.create and not again.delete and not again.events
    assert not again.status_changed


def test_suspending_a_running_job_stops_its_pods_with_departure_notices() -> None:
    s = spec(replicas=3, minReplicas=2, suspend=True)
    running = job(s, generation=2, phase="Running", startTime="2026-01-01T11:00:00Z",
                  restartsSpent=1, replacements=1)  # fmt: skip
    pods = [pod(0), pod(1), pod(2, phase="Failed")]
    rdzv = RendezvousView(round=4, world_size=3, restarts_spent=1)
    plan = reconcile(running, pods, T0, rdzv)
    assert plan.delete == [DeletePod(f"j-{i}", SUSPEND_DELETE_REASON) for i in (2, 1, 0)]
    assert set(plan.depart_nodes) == {"j-0", "j-1", "j-2"}  # planned: nothing charged
    assert set(plan.remove_nodes) == {"j-0", "j-1", "j-2"}
    assert not plan.create
    st = plan.status
    assert st.phase == "Suspended" and st.replicas == 0
    assert st.restarts_spent == 1 and st.replacements == 1  # a failed Pod is not counted
    assert st.start_time is None and st.next_replacement_time is None
    assert cond(st, SUSPENDED_CONDITION) == ("True", SUSPENDED_REASON, "2026-01-01T12:00:00Z")
    assert "Suspending" in [e.reason for e in plan.events]
    assert ("Normal", "Suspended") in [(e.type, e.reason) for e in plan.events]
    # next pass: they are terminating (their grace period): nothing deleted again or created
    going = [pod(i, deleting=True) for i in range(3)]
    plan = reconcile(job(s, generation=2, **st.as_patch()), going, LATER, rdzv)
    assert not plan.delete and not plan.create and not plan.depart_nodes
    assert "3 pod(s) stopping" in next(c.message for c in plan.status.conditions
                                       if c.type == SUSPENDED_CONDITION)  # fmt: skip
    # the condition keeps the time it became True
    assert cond(plan.status, SUSPENDED_CONDITION)[2] == "2026-01-01T12:00:00Z"


def test_resuming_creates_the_pods_again_and_the_condition_goes_false() -> None:
    s = spec(replicas=2)
    suspended = reconcile(job(spec(replicas=2, suspend=True)), [], T0).status.as_patch()
    plan = reconcile(job(s, generation=2, **suspended), [], LATER)
    assert plan.create == [CreatePod("j-0", 0), CreatePod("j-1", 1)]
    assert plan.status.phase == "Pending"
    resumed_at = "2026-01-01T12:05:00Z"
    assert cond(plan.status, SUSPENDED_CONDITION) == ("False", RESUMED_REASON, resumed_at)
    assert ("Normal", "Pending") in [(e.type, e.reason) for e in plan.events]
    # the resumed job runs: startTime is the time it ran again
    resumed = job(s, generation=2, **plan.status.as_patch())
    plan = reconcile(resumed, [pod(0), pod(1)], LATER + timedelta(seconds=30))
    assert plan.status.phase == "Running"
    assert plan.status.start_time == "2026-01-01T12:05:30Z"
    assert cond(plan.status, SUSPENDED_CONDITION)[:2] == ("False", RESUMED_REASON)


def test_resuming_clears_the_departure_notices_of_the_pods_it_creates() -> None:
    # left by the suspension: a resumed Pod's later loss must not look planned (uncharged)
    suspended = reconcile(job(spec(replicas=3, suspend=True)), [], T0).status.as_patch()
    rdzv = RendezvousView(departing=frozenset({"j-0", "j-1", "j-7"}))
    plan = reconcile(job(spec(replicas=3), generation=2, **suspended), [], LATER, rdzv)
    assert names(plan.create) == ["j-0", "j-1", "j-2"]
    assert plan.clear_departures == ["j-0", "j-1"]  # only notices of Pods created now
    # a suspended pass clears none (its own notices are what spares the restart)
    plan = reconcile(job(spec(suspend=True), phase="Running"), [pod(0), pod(1)], T0, rdzv)
    assert plan.clear_departures == []


def test_resuming_waits_for_the_stopped_pods_to_be_gone() -> None:
    suspended = reconcile(job(spec(suspend=True)), [], T0).status.as_patch()
    plan = reconcile(job(spec(), generation=2, **suspended), [pod(0, deleting=True)], LATER)
    assert plan.create == [CreatePod("j-1", 1)]  # j-0 keeps its slot until it is gone


def test_a_finished_job_ignores_suspend() -> None:
    done = job(spec(suspend=True), phase="Succeeded", completionTime="2026-01-01T11:00:00Z")
    plan = reconcile(done, [pod(0, "Succeeded"), pod(1, "Succeeded")], T0)
    assert plan.status.phase == "Succeeded" and not plan.delete
    assert SUSPENDED_CONDITION not in [c.type for c in plan.status.conditions]


def test_a_job_failing_as_it_is_suspended_fails() -> None:
    msg = f"{JOB_FAILED_PREFIX} restart budget spent"
    plan = reconcile(job(spec(suspend=True), phase="Running"), [pod(0, "Failed", msg=msg),
                     pod(1)], T0)  # fmt: skip
    assert plan.status.phase == "Failed"  # the job's own verdict wins over the suspension
    assert not [d for d in plan.delete if d.reason == SUSPEND_DELETE_REASON]


def test_a_suspended_job_whose_pod_succeeded_keeps_that_pod_and_then_succeeds() -> None:
    s = spec(suspend=True)
    plan = reconcile(job(s, phase="Running"), [pod(0, "Succeeded"), pod(1)], T0)
    assert plan.delete == [DeletePod("j-1", SUSPEND_DELETE_REASON)]
    plan = reconcile(job(s, **plan.status.as_patch()), [pod(0, "Succeeded")], LATER)
    assert plan.status.phase == "Succeeded"
