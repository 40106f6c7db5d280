"""reconcile(): the pure decision function, table-driven over jobs, Pods, rendezvous and time."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kelastic_operator.model import ElasticJobSpec, ElasticJobStatus
from kelastic_operator.pods import pod_spec_hash
from kelastic_operator.reconcile import (
    JOB_FAILED_PREFIX,
    UPDATE_REASON,
    CreatePod,
    DeletePod,
    JobView,
    PodView,
    RendezvousView,
    Termination,
    backoff_seconds,
    format_time,
    parse_time,
    pod_view,
    reconcile,
)

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
TEMPLATE = {"spec": {"containers": [{"name": "trainer", "command": ["python", "t.py"]}]}}


def spec(**kw: Any) -> ElasticJobSpec:
    base: dict[str, Any] = {"replicas": 2, "template": TEMPLATE}
    base.update(kw)
    return ElasticJobSpec.model_validate(base)


def job(s: ElasticJobSpec | None = None, generation: int = 1, **status: Any) -> JobView:
    return JobView(
        name="j",
        namespace="ns",
        uid="u1",
        generation=generation,
        spec=s or spec(),
        status=ElasticJobStatus.model_validate(status),
    )


def pod(i: int, phase: str = "Running", ready: bool = True, age: float = 1.0,
        msg: str = "", code: int | None = None, at: datetime | None = None,
        deleting: bool = False, spec_hash: str | None = None) -> PodView:  # fmt: skip
    term = None
    if phase in ("Failed", "Succeeded"):
        code = code if code is not None else (0 if phase == "Succeeded" else 1)
        term = Termination(exit_code=code, message=msg, finished_at=at or T0)
    return PodView(
        name=f"j-{i}", index=i, phase=phase, ready=ready and phase == "Running",
        created=T0 - timedelta(seconds=age), deleting=deleting, trainer=term,
        spec_hash=spec_hash,
    )  # fmt: skip


def names(actions: list[CreatePod] | list[DeletePod]) -> list[str]:
    return [a.name for a in actions]


def cond(plan_status: ElasticJobStatus, kind: str) -> tuple[str, str, str | None]:
    (c,) = [c for c in plan_status.conditions if c.type == kind]
    return c.status, c.reason, c.last_transition_time


# ------------------------------------------------------------------- creation and phase


def test_a_new_job_creates_replicas_pods_named_by_index() -> None:
    plan = reconcile(job(spec(replicas=3)), [], T0)
    assert plan.create == [CreatePod("j-0", 0), CreatePod("j-1", 1), CreatePod("j-2", 2)]
    assert not plan.delete and not plan.remove_nodes
    st = plan.status
    assert (st.phase, st.replicas, st.ready_replicas) == ("Pending", 3, 0)
    assert st.selector == "kelastic.dev/job-name=j"
    assert (st.observed_generation, st.target_replicas, st.replacements) == (1, 3, 0)
    assert plan.status_changed
    assert [e.reason for e in plan.events] == ["CreatingPods", "Pending"]
    assert cond(st, "RendezvousReady") == ("False", "WaitingForPods", format_time(T0))
    assert [c.type for c in st.conditions] == ["RendezvousReady"]  # no Complete/Failed yet
    assert all(c.reason and c.message and c.observed_generation == 1 for c in st.conditions)


@pytest.mark.parametrize(
    ("pods", "min_replicas", "phase", "create"),
    [
        ([pod(0, "Pending"), pod(1, "Pending")], 2, "Pending", []),
        ([pod(0), pod(1, "Pending")], 2, "Pending", []),
        ([pod(0), pod(1, "Pending")], 1, "Running", []),
        ([pod(0), pod(1)], 2, "Running", []),
        ([pod(0)], 1, "Running", ["j-1"]),
        ([pod(1)], 1, "Running", ["j-0"]),
    ],
)
def test_phase_follows_running_pods(
    pods: list[PodView], min_replicas: int, phase: str, create: list[str]
) -> None:
    plan = reconcile(job(spec(minReplicas=min_replicas)), pods, T0)
    assert plan.status.phase == phase
    assert names(plan.create) == create
    assert (plan.status.start_time is not None) == (phase == "Running")


def test_ready_replicas_counts_running_ready_pods() -> None:
    plan = reconcile(job(), [pod(0), pod(1, ready=False)], T0)
    assert (plan.status.replicas, plan.status.ready_replicas) == (2, 1)


def test_nothing_changes_when_all_is_well() -> None:
    first = reconcile(job(), [pod(0), pod(1)], T0)
    again = reconcile(job(**first.status.as_patch()), [pod(0), pod(1)], T0 + timedelta(seconds=30))
    assert not again.status_changed
    assert not (again.create or again.delete or again.remove_nodes or again.events)
    assert again.requeue_after is None


def test_condition_times_move_only_on_transitions() -> None:
    p1 = reconcile(job(), [pod(0, "Pending"), pod(1, "Pending")], T0)
    t1 = T0 + timedelta(seconds=5)
    view = RendezvousView(round=1, world_size=4)
    p2 = reconcile(job(**p1.status.as_patch()), [pod(0), pod(1)], t1, view)
    assert cond(p2.status, "RendezvousReady") == ("True", "RoundComplete", format_time(t1))
    (ready,) = p2.status.conditions
    assert ready.message == "round 1: world size 4"
    p3 = reconcile(job(**p2.status.as_patch()), [pod(0), pod(1)], t1 + timedelta(seconds=9), view)
    assert cond(p3.status, "RendezvousReady") == ("True", "RoundComplete", format_time(t1))
    # pods running but no complete round known: Running, not RendezvousReady
    p4 = reconcile(job(**p1.status.as_patch()), [pod(0), pod(1)], t1)
    assert p4.status.phase == "Running"
    assert cond(p4.status, "RendezvousReady")[:2] == ("False", "WaitingForRendezvous")
    assert [e.reason for e in p2.events] == ["Running"]
    assert p2.events[0].message.startswith("Pending -> Running")


def test_observed_generation_follows_the_spec() -> None:
    plan = reconcile(job(generation=7, observedGeneration=6), [pod(0), pod(1)], T0)
    assert plan.status.observed_generation == 7
    assert all(c.observed_generation == 7 for c in plan.status.conditions)


# --------------------------------------------------------------------------- scaling


def test_scale_up_creates_the_next_indices() -> None:
    s = spec(replicas=3, minReplicas=1, maxReplicas=4)
    plan = reconcile(job(s, generation=2, observedGeneration=1, targetReplicas=2,
                         startTime=format_time(T0)), [pod(0), pod(1)], T0)  # fmt: skip
    assert plan.create == [CreatePod("j-2", 2)]
    assert plan.status.target_replicas == 3
    assert plan.remove_nodes == ["j-2"]  # a node of that name from before must not linger


def test_scale_down_deletes_highest_index_first_and_drops_their_nodes() -> None:
    s = spec(replicas=1, minReplicas=1, maxReplicas=4)
    pods = [pod(0), pod(3), pod(1), pod(2)]
    plan = reconcile(job(s, generation=2, observedGeneration=1), pods, T0)
    assert names(plan.delete) == ["j-3", "j-2", "j-1"]
    assert plan.remove_nodes == ["j-3", "j-2", "j-1"]
    # ...announced as a scale-down first, so the survivors spend no restart on them
    assert plan.depart_nodes == ["j-3", "j-2", "j-1"]
    assert not plan.create
    assert plan.status.replicas == 1
    assert "ScalingDown" in [e.reason for e in plan.events]


def test_pods_being_deleted_are_not_recreated_yet() -> None:
    plan = reconcile(job(), [pod(0), pod(1, deleting=True)], T0)
    assert not plan.create and not plan.delete
    assert plan.status.replicas == 1


# ------------------------------------------------------------------------- replacing


def test_a_deleted_pod_is_recreated_at_once_without_spending_the_budget() -> None:
    st = {"phase": "Running", "startTime": format_time(T0), "replacements": 0}
    plan = reconcile(job(spec(minReplicas=1), **st), [pod(0)], T0)
    assert plan.create == [CreatePod("j-1", 1)]
    assert plan.remove_nodes == ["j-1"]
    assert plan.status.replacements == 0
    assert plan.status.phase == "Running"


def test_a_failed_pod_leaves_rendezvous_at_once_and_is_replaced_after_backoff() -> None:
    s = spec(podReplacement={"backoffSeconds": 10, "maxBackoffSeconds": 300})
    st = {"phase": "Running", "startTime": format_time(T0), "observedGeneration": 1}
    failed = pod(1, "Failed", msg="worker: rank 3 on j-1 (round 2) exited with code 1: boom",
                 code=1, at=T0)  # fmt: skip
    early = reconcile(job(s, **st), [pod(0), failed], T0 + timedelta(seconds=4))
    assert early.remove_nodes == ["j-1"]
    assert not early.delete and not early.create
    assert early.status.phase == "Restarting"
    assert early.requeue_after == pytest.approx(6.0)
    assert early.status.next_replacement_time == format_time(T0 + timedelta(seconds=10))
    lf = early.status.last_failure
    assert lf is not None
    assert (lf.pod, lf.rank, lf.exit_code, lf.signal) == ("j-1", 3, 1, None)
    assert "boom" in lf.message
    assert [e.reason for e in early.events] == ["PodFailed", "Restarting"]
    assert cond(early.status, "RendezvousReady")[:2] == ("False", "ReplacingPods")

    late = reconcile(job(s, **early.status.as_patch()), [pod(0), failed], T0 + timedelta(10))
    assert late.delete == [DeletePod("j-1", "replacing a failed pod")]
    assert late.remove_nodes == ["j-1"]  # again: idempotent until the pod is gone
    assert late.status.replacements == 1
    assert "PodFailed" not in [e.reason for e in late.events]

    # the deletion failed (or is slow): the next pass deletes again, counting nothing
    again = reconcile(job(s, **late.status.as_patch()), [pod(0), failed], T0 + timedelta(12))
    assert again.delete == [DeletePod("j-1", "replacing a failed pod")]
    assert again.status.replacements == 1
    assert "ReplacingPod" not in [e.reason for e in again.events]

    after = reconcile(job(s, **again.status.as_patch()), [pod(0)], T0 + timedelta(13))
    assert after.create == [CreatePod("j-1", 1)]
    assert after.status.replacements == 1
    assert after.status.counted_failures is None  # the Pod is gone: forgotten


@pytest.mark.parametrize(
    ("replacements", "expected"), [(0, 10.0), (1, 20.0), (2, 40.0), (5, 300.0), (40, 300.0)]
)
def test_backoff_doubles_up_to_the_cap(replacements: int, expected: float) -> None:
    s = spec(podReplacement={"backoffSeconds": 10, "maxBackoffSeconds": 300})
    assert backoff_seconds(s, replacements) == expected


def test_a_spent_replacement_budget_fails_the_job_with_the_root_cause() -> None:
    s = spec(podReplacement={"maxReplacements": 2, "backoffSeconds": 0})
    st = {"phase": "Restarting", "startTime": format_time(T0), "replacements": 2}
    failed = pod(0, "Failed", msg="OOM in rank 0", code=137)
    plan = reconcile(job(s, **st), [failed, pod(1)], T0)
    assert plan.status.phase == "Failed"
    assert plan.status.completion_time == format_time(T0)
    status, reason, _ = cond(plan.status, "Failed")
    assert (status, reason) == ("True", "ReplacementBudgetSpent")
    (failed_cond,) = [c for c in plan.status.conditions if c.type == "Failed"]
    assert "budget spent (2/2 replaced)" in failed_cond.message
    assert "j-0: OOM in rank 0" in failed_cond.message
    assert plan.status.last_failure is not None and plan.status.last_failure.signal == 9
    assert names(plan.delete) == ["j-1"]  # cleanupPolicy Running: the running pod goes
    assert not plan.create


def test_a_pod_reporting_job_failure_fails_the_job_at_once() -> None:
    msg = f"{JOB_FAILED_PREFIX} after 3 restarts (budget spent); root cause: rank 1 crashed"
    st = {"phase": "Running", "startTime": format_time(T0)}
    plan = reconcile(job(**st), [pod(0, "Failed", msg=msg), pod(1, "Failed", msg=msg)], T0)
    assert plan.status.phase == "Failed"
    (c,) = [c for c in plan.status.conditions if c.type == "Failed"]
    assert (c.status, c.reason, c.message) == ("True", "JobFailed", msg)
    assert plan.status.last_failure is not None and plan.status.last_failure.rank == 1
    assert not plan.create and not plan.delete  # failed pods are kept for their logs
    assert plan.events[-1].type == "Warning" and plan.events[-1].reason == "Failed"


def test_a_failed_sidecar_report_fails_the_job() -> None:
    rdzv = RendezvousView(failed_reports={"j-1": "job failed: the rendezvous was closed"})
    plan = reconcile(job(phase="Running"), [pod(0), pod(1)], T0, rdzv)
    assert plan.status.phase == "Failed"
    assert plan.status.last_failure is not None and plan.status.last_failure.pod == "j-1"
    assert names(plan.delete) == ["j-1", "j-0"]


# ------------------------------------------------------------------------- finishing


@pytest.mark.parametrize(
    ("policy", "deleted"), [("None", []), ("Running", ["j-2"]), ("All", ["j-2", "j-1", "j-0"])]
)
def test_succeeded_when_no_pod_runs_any_more(policy: str, deleted: list[str]) -> None:
    s = spec(replicas=3, cleanupPolicy=policy)
    pods = [pod(0, "Succeeded"), pod(1, "Succeeded"), pod(2, "Pending")]
    plan = reconcile(job(s, phase="Running"), pods, T0)
    assert plan.status.phase == "Succeeded"
    assert names(plan.delete) == deleted
    assert cond(plan.status, "Complete")[:2] == ("True", "AllPodsSucceeded")
    assert cond(plan.status, "RendezvousReady")[:2] == ("False", "JobFinished")
    assert not [c for c in plan.status.conditions if c.type == "Failed"]
    assert not plan.create


def test_not_succeeded_while_a_pod_still_runs_and_nothing_is_created() -> None:
    plan = reconcile(job(spec(replicas=3), phase="Running"), [pod(0, "Succeeded"), pod(1)], T0)
    assert plan.status.phase == "Running"
    assert cond(plan.status, "RendezvousReady") == (
        "False",
        "WaitingForRendezvous",
        format_time(T0),
    )
    (ready,) = plan.status.conditions
    assert ready.message == "1 pod(s) succeeded, 1 still running"
    assert not plan.create


def test_terminal_jobs_only_clean_up() -> None:
    st = {"phase": "Failed", "completionTime": format_time(T0)}
    plan = reconcile(job(**st), [pod(1, "Pending")], T0 + timedelta(hours=1))
    assert plan.status.phase == "Failed"
    assert names(plan.delete) == ["j-1"]
    assert not plan.create and not plan.events
    assert plan.status.completion_time == format_time(T0)


# ------------------------------------------------------------------- elastic shrink


def test_pods_pending_past_the_timeout_shrink_towards_min_and_grow_back() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4, pendingTimeoutSeconds=60)
    pods = [pod(0, age=90), pod(1, "Pending", age=90), pod(2, age=90),
            pod(3, "Pending", age=30)]  # fmt: skip
    plan = reconcile(job(s), pods, T0)
    assert plan.status.target_replicas == 3  # one pod stuck: one step down
    assert names(plan.delete) == ["j-1"]  # the stuck pod goes, not a running one
    assert plan.remove_nodes == ["j-1"]
    assert not plan.create  # its index stays free while shrunk
    assert plan.status.last_resize_time == format_time(T0)
    assert "Shrinking" in [e.reason for e in plan.events]
    assert plan.requeue_after == pytest.approx(30.0)  # j-3's own pending deadline

    # one timeout after the resize it grows back, filling the lowest free index; the
    # resize restarted the pending clocks, so j-3 is not stuck yet
    t1 = T0 + timedelta(seconds=60)
    pods2 = [pod(0, age=150), pod(2, age=150), pod(3, "Pending", age=90)]
    p2 = reconcile(job(s, **plan.status.as_patch()), pods2, t1)
    assert [e.reason for e in p2.events] == ["GrowingBack", "CreatingPods"]
    assert p2.status.target_replicas == 4
    assert names(p2.create) == ["j-1"]
    assert not p2.delete


def test_only_unschedulable_pods_count_as_stuck_starting_ones_get_a_longer_timeout() -> None:
    """Pending is not stuck: a Pod the scheduler placed is starting (image pull,
    ContainerCreating) and is left alone until startTimeoutSeconds; only Unschedulable
    ones (or ones no scheduler has seen) shrink the job after pendingTimeoutSeconds."""
    s = spec(replicas=4, minReplicas=1, pendingTimeoutSeconds=60, startTimeoutSeconds=600)
    starting = dataclasses.replace(pod(1, "Pending", age=90), scheduled=True)
    unschedulable = dataclasses.replace(
        pod(2, "Pending", age=90), unschedulable_since=T0 - timedelta(seconds=61)
    )
    fresh_unschedulable = dataclasses.replace(
        pod(3, "Pending", age=90), unschedulable_since=T0 - timedelta(seconds=10)
    )
    plan = reconcile(job(s), [pod(0), starting, unschedulable, fresh_unschedulable], T0)
    assert names(plan.delete) == ["j-2"]
    assert plan.status.target_replicas == 3
    assert plan.requeue_after == pytest.approx(50.0)  # j-3: 60 s after it became unschedulable

    late = dataclasses.replace(starting, created=T0 - timedelta(seconds=601))
    s2 = spec(replicas=2, minReplicas=1, pendingTimeoutSeconds=60, startTimeoutSeconds=600)
    assert not reconcile(job(s2), [pod(0), starting], T0).delete
    plan = reconcile(job(s2), [pod(0), late], T0)
    assert names(plan.delete) == ["j-1"]  # stuck starting past startTimeoutSeconds


def test_pod_view_reads_the_scheduler_s_verdict() -> None:
    base = {"metadata": {"name": "j-0", "creationTimestamp": "2026-01-01T12:00:00Z"}}
    unsched = pod_view("j", {**base, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "lastTransitionTime": "2026-01-01T12:00:05Z"}]}})  # fmt: skip
    assert unsched is not None and not unsched.scheduled
    assert unsched.unschedulable_since == T0 + timedelta(seconds=5)
    placed = pod_view("j", {**base, "spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}})
    assert placed is not None and placed.scheduled and placed.unschedulable_since is None
    unseen = pod_view("j", {**base, "status": {"phase": "Pending"}})
    assert unseen is not None and not unseen.scheduled and unseen.unschedulable_since is None


def test_scale_down_with_holes_deletes_the_highest_indices() -> None:
    s = spec(replicas=2, minReplicas=1, maxReplicas=4)
    pods = [pod(0), pod(2), pod(3), pod(5)]
    plan = reconcile(job(s, generation=2, observedGeneration=1), pods, T0)
    assert names(plan.delete) == ["j-5", "j-3"]
    assert not plan.create


def test_shrink_never_goes_below_min_replicas() -> None:
    s = spec(replicas=3, minReplicas=3, maxReplicas=3, pendingTimeoutSeconds=10)
    pods = [pod(0, "Pending", age=99), pod(1, "Pending", age=99), pod(2, "Pending", age=99)]
    plan = reconcile(job(s), pods, T0)
    assert plan.status.target_replicas == 3
    assert not plan.delete
    assert "Shrinking" not in [e.reason for e in plan.events]


def test_grow_back_waits_one_timeout_after_the_resize() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4, pendingTimeoutSeconds=60)
    st = {"targetReplicas": 2, "lastResizeTime": format_time(T0), "observedGeneration": 1,
          "phase": "Running", "startTime": format_time(T0)}  # fmt: skip
    before = reconcile(job(s, **st), [pod(0), pod(1)], T0 + timedelta(seconds=59))
    assert not before.create and before.requeue_after == pytest.approx(1.0)
    after = reconcile(job(s, **st), [pod(0), pod(1)], T0 + timedelta(seconds=60))
    assert names(after.create) == ["j-2", "j-3"]
    assert after.status.target_replicas == 4


def test_a_new_generation_resets_the_target() -> None:
    s = spec(replicas=3, minReplicas=1, maxReplicas=4)
    st = {"targetReplicas": 1, "lastResizeTime": format_time(T0), "observedGeneration": 1}
    plan = reconcile(job(s, generation=2, **st), [pod(0)], T0)
    assert plan.status.target_replicas == 3
    assert plan.status.last_resize_time is None
    assert names(plan.create) == ["j-1", "j-2"]


# ---------------------------------------------------------------------- rendezvous


def test_rendezvous_view_feeds_round_world_size_and_restarts() -> None:
    rdzv = RendezvousView(round=4, world_size=8, restarts_spent=2)
    plan = reconcile(job(), [pod(0), pod(1)], T0, rdzv)
    assert (plan.status.round, plan.status.world_size, plan.status.restarts_spent) == (4, 8, 2)
    keep = reconcile(job(**plan.status.as_patch()), [pod(0), pod(1)], T0)
    assert (keep.status.round, keep.status.world_size) == (4, 8)  # etcd unreadable: kept


# ---------------------------------------------------------------------- observation


def test_pod_view_reads_a_pod_object() -> None:
    obj = {
        "metadata": {"name": "j-2", "creationTimestamp": "2026-01-01T11:59:00Z"},
        "status": {
            "phase": "Failed",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "other", "state": {"terminated": {"exitCode": 0}}},
                {"name": "trainer", "state": {"terminated": {
                    "exitCode": 143, "reason": "Error", "message": "rank 5 died\n",
                    "finishedAt": "2026-01-01T12:00:00Z"}}},
            ],
        },
    }  # fmt: skip
    view = pod_view("j", obj)
    assert view is not None
    assert (view.index, view.phase, view.ready, view.deleting) == (2, "Failed", False, False)
    assert view.trainer == Termination(143, None, "Error", "rank 5 died", T0)
    assert view.created == T0 - timedelta(minutes=1)
    gone = {"phase": "Failed", "reason": "Evicted", "message": "m"}
    evicted = pod_view("j", {"metadata": {"name": "j-0"}, "status": gone})
    assert evicted is not None and (evicted.reason, evicted.message, evicted.trainer) == (
        "Evicted", "m", None)  # fmt: skip
    assert pod_view("j", {"metadata": {"name": "j-x"}}) is None
    assert pod_view("j", {"metadata": {"name": "jj-1"}}) is None
    assert pod_view("j", {"metadata": {"name": "j-01"}}) is None


def test_time_helpers() -> None:
    assert parse_time(format_time(T0)) == T0
    assert parse_time("2026-01-01T13:00:00+01:00") == T0
    assert parse_time("nonsense") is None and parse_time(None) is None


def test_an_invalid_spec_fails_the_job_once() -> None:
    from kelastic_operator.reconcile import reconcile_invalid

    plan = reconcile_invalid(ElasticJobStatus(), 3, "invalid spec: spec.x: bad", T0)
    st = plan.status
    assert (st.phase, st.observed_generation, st.completion_time) == ("Failed", 3, format_time(T0))
    assert cond(st, "Failed") == ("True", "InvalidSpec", format_time(T0))
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Failed")]
    assert plan.status_changed and not plan.create
    again = reconcile_invalid(st, 3, "invalid spec: spec.x: bad", T0 + timedelta(seconds=5))
    assert not again.status_changed and not again.events


def test_a_pod_being_deleted_leaves_rendezvous_at_once() -> None:
    plan = reconcile(job(phase="Running"), [pod(0), pod(1, deleting=True)], T0)
    assert plan.remove_nodes == ["j-1"]
    # a failed Pod's node left when it failed; its deletion adds nothing more
    done = reconcile(job(phase="Running"), [pod(0), pod(1, "Failed", deleting=True)], T0)
    assert done.remove_nodes == []


def test_a_failure_without_a_finish_time_is_announced_once() -> None:
    evicted = PodView(name="j-1", index=1, phase="Failed", created=T0 - timedelta(hours=1),
                      reason="Evicted", message="The node was low on memory.")  # fmt: skip
    first = reconcile(job(phase="Running", startTime=format_time(T0)), [pod(0), evicted], T0)
    assert [e.reason for e in first.events if e.reason == "PodFailed"] == ["PodFailed"]
    assert first.status.last_failure is not None
    assert first.status.last_failure.message == "Evicted: The node was low on memory."
    later = T0 + timedelta(seconds=3)
    again = reconcile(job(**first.status.as_patch()), [pod(0), evicted], later)
    assert "PodFailed" not in [e.reason for e in again.events]
    assert again.remove_nodes == ["j-1"]


def test_worker_group_restarts_are_announced_once() -> None:
    rdzv = RendezvousView(round=5, world_size=4, restarts_spent=2)
    plan = reconcile(job(phase="Running", restartsSpent=1), [pod(0), pod(1)], T0, rdzv)
    (ev,) = [e for e in plan.events if e.reason == "WorkersRestarted"]
    assert ev.type == "Warning" and "2/3 restarts spent (round 5)" in ev.message
    again = reconcile(job(**plan.status.as_patch()), [pod(0), pod(1)], T0, rdzv)
    assert not again.events


# ------------------------------------------------------------------------ spec change


NEW_TEMPLATE = {"spec": {"containers": [{"name": "trainer", "command": ["python", "t2.py"]}]}}


def test_a_spec_change_replaces_every_pod_at_once_without_spending_restarts() -> None:
    old, new = spec(), spec(template=NEW_TEMPLATE)
    stale = pod_spec_hash(old)
    pods = [pod(0, spec_hash=stale), pod(1, spec_hash=stale)]
    plan = reconcile(job(new, generation=2, phase="Running", startTime="x"), pods, T0)
    assert plan.delete == [DeletePod("j-0", UPDATE_REASON), DeletePod("j-1", UPDATE_REASON)]
    assert plan.depart_nodes == ["j-0", "j-1"]  # planned departures: no restart spent
    assert set(plan.remove_nodes) == {"j-0", "j-1"}
    assert not plan.create  # re-created once gone (their slots are still taken)
    assert [e.reason for e in plan.events if e.reason == "UpdatingPods"] == ["UpdatingPods"]
    # next pass: both are being deleted -> nothing new until they are gone
    going = [pod(0, spec_hash=stale, deleting=True), pod(1, spec_hash=stale, deleting=True)]
    plan = reconcile(job(new, generation=2, phase="Restarting", startTime="x"), going, T0)
    assert not plan.delete and not plan.create
    # gone: re-created (by the handler, from the new spec)
    plan = reconcile(job(new, generation=2, phase="Restarting", startTime="x"), [], T0)
    assert plan.create == [CreatePod("j-0", 0), CreatePod("j-1", 1)]


@pytest.mark.parametrize(
    ("change", "replaced"),
    [
        ({"replicas": 3}, False),  # scaling is not a spec change of the Pods
        ({"cleanupPolicy": "All"}, False),
        ({"podReplacement": {"maxReplacements": 9}}, False),
        ({"pendingTimeoutSeconds": 5}, False),
        ({"startTimeoutSeconds": 5}, False),  # an operator policy (and a new field)
        ({"nprocPerNode": 2}, True),
        ({"maxRestarts": 7}, True),
        ({"warmStart": {"enabled": True}}, True),
        ({"rendezvous": {"leaseTTLSeconds": 3}}, True),
    ],
)
def test_which_spec_changes_replace_pods(change: dict[str, Any], replaced: bool) -> None:
    stale = pod_spec_hash(spec())
    pods = [pod(0, spec_hash=stale), pod(1, spec_hash=stale)]
    plan = reconcile(job(spec(**change), generation=2, phase="Running"), pods, T0)
    assert bool([d for d in plan.delete if d.reason == UPDATE_REASON]) is replaced


def test_pods_without_a_spec_hash_and_failed_or_finishing_jobs_are_left_alone() -> None:
    new = spec(template=NEW_TEMPLATE)
    stale = pod_spec_hash(spec())
    # Pods of an operator that did not record the hash: an upgrade rolls nothing
    plan = reconcile(job(new, phase="Running"), [pod(0), pod(1)], T0)
    assert not plan.delete
    # a finishing job (a Pod succeeded) is not disturbed
    done = [pod(0, phase="Succeeded", spec_hash=stale), pod(1, spec_hash=stale)]
    plan = reconcile(job(new, phase="Running"), done, T0)
    assert not [d for d in plan.delete if d.reason == UPDATE_REASON]
    # a failed Pod is left to the replacement rule (its backoff and budget)
    failed = [pod(0, phase="Failed", spec_hash=stale), pod(1, spec_hash=stale)]
    plan = reconcile(job(new, phase="Running"), failed, T0)
    assert plan.delete == [DeletePod("j-1", UPDATE_REASON)]
    assert plan.status.next_replacement_time is not None
    # current Pods stay
    current = [pod(0, spec_hash=pod_spec_hash(new)), pod(1, spec_hash=pod_spec_hash(new))]
    assert not reconcile(job(new, phase="Running"), current, T0).delete


def test_pod_view_reads_the_spec_hash() -> None:
    obj = {"metadata": {"name": "j-3", "annotations": {"kelastic.dev/pod-spec-hash": "abc"}}}
    view = pod_view("j", obj)
    assert view is not None and view.spec_hash == "abc"
