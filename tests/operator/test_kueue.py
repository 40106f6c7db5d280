"""Kueue admission as a gang (kelastic_operator.kueue): the Workload the operator builds,
what it reads from Kueue's, and reconcile's decisions under the gate (pure); on the real
control plane with the real Kueue it is tests/operator/test_e2e_kueue.py."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from datetime import timedelta
from typing import Any

import pytest

from kelastic_operator.kueue import (
    JOB_UID_LABEL,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    QUOTA_HASH_ANNOTATION,
    RESOURCE_IN_USE,
    Placement,
    QueueGate,
    QueueReason,
    build_workload,
    cleared_reservation,
    finished,
    is_finished,
    needs_clearing,
    place_pod,
    placement,
    queue_gate,
    queue_name,
    quota_hash,
    reclaim,
    reclaim_patch,
    workload_name,
    workload_view,
)
from kelastic_operator.pods import PodSettings, build_pod
from kelastic_operator.reconcile import CreatePod, reconcile
from kelastic_operator.suspend import (
    RESUMED_REASON,
    SUSPEND_DELETE_REASON,
    SUSPENDED_CONDITION,
    SUSPENDED_REASON,
)

from .test_reconcile import T0, cond, job, names, pod, spec

SETTINGS = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd.kelastic:2379",))
UID = "0b5c1c0e-1111-2222-3333-444455556666"
LABELS = {QUEUE_LABEL: "team"}
STAMP = "2026-01-01T12:00:00Z"


def _cond(kind: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T11:00:00Z"}  # fmt: skip


HASH = "0123456789abcdef"


def kueue_workload(count: int | None = None, *conds: dict[str, Any], flavors: Any = None,
                   reclaimable: int | None = None) -> dict[str, Any]:  # fmt: skip
    """A Workload as Kueue leaves it (made with template hash :data:`HASH`): admitted
    ``count`` Pods when given, ``reclaimable`` of them given back when given."""
    status: dict[str, Any] = {"conditions": list(conds)}
    if reclaimable is not None:
        status["reclaimablePods"] = [{"name": "workers", "count": reclaimable}]
    if count is not None:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [{
            "name": "workers", "count": count,
            "flavors": flavors or {"cpu": "default", "memory": "default"}}]}  # fmt: skip
    return {"metadata": {"name": "wl", "resourceVersion": "7",
                         "annotations": {QUOTA_HASH_ANNOTATION: HASH},
                         "finalizers": [RESOURCE_IN_USE]},
            "spec": {"podSets": [{"name": "workers", "count": 4, "minCount": 2}]},
            "status": status}  # fmt: skip


ADMITTED = (_cond("QuotaReserved", "True"), _cond("Admitted", "True"))


def gate(count: int | None, *conds: dict[str, Any], **kw: Any) -> QueueGate | None:
    s = spec(replicas=kw.pop("replicas", 4), minReplicas=2, maxReplicas=4)
    return queue_gate("team", workload_view(kueue_workload(count, *conds)), s)


def queued(s: Any, g: QueueGate | None, generation: int = 1, **status: Any) -> Any:
    return dataclasses.replace(job(s, generation, **status), queue=g)


# ------------------------------------------------------------------ the Workload built


def test_the_workload_asks_for_max_replicas_at_least_min_and_the_pods_requests() -> None:
    s = spec(replicas=3, minReplicas=2, maxReplicas=4)
    s.template["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "2"}}
    pod_ = build_pod("j", "ns", UID, s, 0, SETTINGS)
    wl = build_workload("j", "ns", UID, s, {**LABELS, PRIORITY_LABEL: "high"}, pod_, 1000)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    meta = wl["metadata"]
    assert meta["name"] == workload_name("j", UID) and meta["namespace"] == "ns"
    assert meta["labels"] == {JOB_UID_LABEL: UID}
    assert meta["finalizers"] == [RESOURCE_IN_USE]
    (owner,) = meta["ownerReferences"]
    assert owner == {"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob", "name": "j",
                     "uid": UID, "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    assert wl["spec"]["queueName"] == "team"
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}  # fmt: skip
    assert wl["spec"]["priority"] == 1000
    (pod_set,) = wl["spec"]["podSets"]
    assert (pod_set["name"], pod_set["count"], pod_set["minCount"]) == ("workers", 4, 2)
    # the template is the Pod the operator runs: the trainer and the sidecar both count
    template = pod_set["template"]["spec"]
    assert template == pod_["spec"]
    assert template["containers"][0]["resources"] == {"requests": {"cpu": "2"}}
    assert [c["name"] for c in template["initContainers"]] == ["kelastic-sidecar"]
    assert template["initContainers"][0]["restartPolicy"] == "Always"


def test_a_fixed_size_job_asks_for_all_its_pods_and_no_priority_without_the_label() -> None:
    s = spec(replicas=3)
    wl = build_workload("j", "ns", UID, s, LABELS, build_pod("j", "ns", UID, s, 0, SETTINGS))
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["count"] == 3 and "minCount" not in pod_set
    assert "priorityClassRef" not in wl["spec"] and "priority" not in wl["spec"]


def test_the_workload_name_is_kueues_for_the_job() -> None:
    # jobframework.GetWorkloadNameForOwnerWithGVK: <kind>-<name>-<sha1(kind, group, name,
    # uid)[:5]>
    digest = hashlib.sha1(f"ElasticJob\nkelastic.dev\ndigits\n{UID}".encode()).hexdigest()
    assert workload_name("digits", UID) == f"elasticjob-digits-{digest[:5]}"
    assert workload_name("digits", "other-uid") != workload_name("digits", UID)


def test_no_label_no_queue_and_no_workload() -> None:
    assert queue_name({}) is None and queue_name(None) is None
    assert queue_name({QUEUE_LABEL: ""}) is None
    assert queue_name(LABELS) == "team"
    with pytest.raises(ValueError, match="queue-name"):
        build_workload("j", "ns", UID, spec(), {}, {"spec": {}})
    assert queue_gate(None, None, spec()) is None


# ----------------------------------------------------------------------- the gate


def test_the_gate_is_closed_until_admitted_and_says_why() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4)
    none_yet = queue_gate("team", None, s)
    assert none_yet == QueueGate("team", None, QueueReason.QUEUED,
                                 "waiting for Kueue to admit it (LocalQueue team)")  # fmt: skip
    pending = gate(None, _cond("QuotaReserved", "False", "Pending", "insufficient quota"))
    assert pending is not None and pending.admitted is None
    assert pending.reason is QueueReason.QUEUED
    assert pending.message.endswith(": insufficient quota")
    # quota reserved but admission checks not yet: not admitted
    assert gate(3, _cond("QuotaReserved", "True"), _cond("Admitted", "False")).admitted is None
    admitted = gate(3, *ADMITTED)
    assert admitted is not None and admitted.admitted == 3
    assert "admitted by Kueue (LocalQueue team, ClusterQueue cq): 3 of 4 pods" in admitted.message


def test_an_evicted_workload_closes_the_gate_even_while_its_quota_is_held() -> None:
    evicted = gate(3, *ADMITTED, _cond("Evicted", "True", "Preempted", "by default/high"))
    assert evicted is not None and evicted.admitted is None
    assert evicted.reason is QueueReason.EVICTED
    assert evicted.message == "evicted by Kueue (Preempted): by default/high"


# ------------------------------------------------------------------ reconcile's decisions


def test_a_queued_job_runs_no_pods_and_says_it_waits() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4)
    plan = reconcile(queued(s, queue_gate("team", None, s)), [], T0)
    assert not plan.create and not plan.delete
    st = plan.status
    assert st.phase == "Suspended" and st.replicas == 0 and st.admitted_replicas == 0
    assert cond(st, SUSPENDED_CONDITION)[:2] == ("True", QueueReason.QUEUED.value)
    (c,) = [c for c in st.conditions if c.type == SUSPENDED_CONDITION]
    assert c.message.startswith("waiting for Kueue to admit it (LocalQueue team)")


def test_an_admitted_job_runs_the_admitted_count_and_not_beyond() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4)
    held = reconcile(queued(s, queue_gate("team", None, s)), [], T0).status.as_patch()
    plan = reconcile(queued(s, gate(3, *ADMITTED), **held), [], T0 + timedelta(seconds=5))
    assert plan.create == [CreatePod(f"j-{i}", i) for i in range(3)]
    st = plan.status
    assert st.admitted_replicas == 3 and st.target_replicas == 3 and st.replicas == 3
    assert cond(st, SUSPENDED_CONDITION)[:2] == ("False", RESUMED_REASON)
    (c,) = [c for c in st.conditions if c.type == SUSPENDED_CONDITION]
    assert c.message.startswith("admitted by Kueue")
    # running at 3: no fourth Pod while replicas says 4 (it waits for quota), and says so
    running = reconcile(queued(s, gate(3, *ADMITTED), **st.as_patch()),
                        [pod(0), pod(1), pod(2)], T0 + timedelta(minutes=30))  # fmt: skip
    assert not running.create and not running.delete
    assert running.status.phase == "Running"
    assert "Kueue admitted 3 of the 4 wanted" in next(
        c.message for c in running.status.conditions if c.type == "RendezvousReady"
    )
    # replicas below the admission: replicas wins
    fewer = spec(replicas=2, minReplicas=2, maxReplicas=4)
    plan2 = reconcile(queued(fewer, queue_gate("team", workload_view(kueue_workload(
        4, *ADMITTED)), fewer)), [], T0)  # fmt: skip
    assert names(plan2.create) == ["j-0", "j-1"]


def test_eviction_stops_the_pods_as_suspend_does_nothing_charged() -> None:
    s = spec(replicas=4, minReplicas=2, maxReplicas=4)
    evicted = gate(3, *ADMITTED, _cond("Evicted", "True", "Preempted", "preempted"))
    run = queued(s, evicted, phase="Running", startTime="2026-01-01T11:00:00Z",
                 restartsSpent=1, targetReplicas=3, admittedReplicas=3)  # fmt: skip
    plan = reconcile(run, [pod(0), pod(1), pod(2)], T0)
    assert plan.delete and {d.reason for d in plan.delete} == {SUSPEND_DELETE_REASON}
    assert names(plan.delete) == ["j-2", "j-1", "j-0"]
    assert set(plan.depart_nodes) == {"j-0", "j-1", "j-2"}  # departure notices: no charge
    assert not plan.create
    st = plan.status
    assert st.phase == "Suspended" and st.restarts_spent == 1 and st.start_time is None
    assert st.target_replicas is None and st.admitted_replicas == 0
    assert cond(st, SUSPENDED_CONDITION)[:2] == ("True", QueueReason.EVICTED.value)
    assert [e.reason for e in plan.events if e.reason == "Suspending"] == ["Suspending"]
    # re-admitted at 4 this time: 4 Pods (the earlier target is forgotten)
    again = reconcile(queued(s, gate(4, *ADMITTED), **st.as_patch()), [], T0 + timedelta(1))
    assert names(again.create) == ["j-0", "j-1", "j-2", "j-3"]


def test_spec_suspend_still_wins_over_an_admission() -> None:
    s = spec(replicas=2, suspend=True)
    plan = reconcile(queued(s, gate(2, *ADMITTED)), [pod(0)], T0)
    assert names(plan.delete) == ["j-0"]
    assert cond(plan.status, SUSPENDED_CONDITION)[:2] == ("True", SUSPENDED_REASON)


def test_a_job_without_the_label_is_reconciled_as_before() -> None:
    s = spec(replicas=3)
    plain = reconcile(job(s), [], T0)
    assert names(plain.create) == ["j-0", "j-1", "j-2"]
    assert plain.status.admitted_replicas is None
    assert "admittedReplicas" not in plain.status.as_patch()
    assert all(c.type != SUSPENDED_CONDITION for c in plain.status.conditions)


# ------------------------------------------------------------- eviction, finish, flavors


def test_the_reservation_is_cleared_only_once_the_evicted_pods_are_gone() -> None:
    evicted = workload_view(kueue_workload(
        3, *ADMITTED, _cond("Evicted", "True", "Preempted", "preempted by ns/high")))  # fmt: skip
    admitted = workload_view(kueue_workload(3, *ADMITTED))
    assert needs_clearing(evicted, 0) and not needs_clearing(evicted, 1)
    assert not needs_clearing(admitted, 0) and not needs_clearing(None, 0)
    patch = cleared_reservation(evicted, STAMP)
    assert patch["metadata"] == {"resourceVersion": "7"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == (
        "False", "Pending")  # fmt: skip
    assert by_type["QuotaReserved"]["lastTransitionTime"] == STAMP
    assert by_type["QuotaReserved"]["message"] == "preempted by ns/high"
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == (
        "False", "NoReservation")  # fmt: skip
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == (
        "True", "Preempted")  # fmt: skip
    assert by_type["Evicted"]["status"] == "True"  # Kueue's own, kept
    cleared = workload_view({**kueue_workload(None), "status": patch["status"]})
    assert not needs_clearing(cleared, 0)
    # a deactivation is not requeued
    off = workload_view(kueue_workload(3, *ADMITTED, _cond("Evicted", "True", "Deactivated")))
    requeued = {c["type"]: c for c in cleared_reservation(off, STAMP)["status"]["conditions"]}
    assert requeued["Requeued"]["status"] == "False"


def test_a_finished_jobs_workload_is_marked_finished_once() -> None:
    wl = workload_view(kueue_workload(3, *ADMITTED))
    assert not is_finished(wl)
    patch = finished(wl, True, "3 pod(s) succeeded", STAMP)
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["Finished"]["status"], by_type["Finished"]["reason"]) == ("True", "Succeeded")
    assert "admission" not in patch["status"]
    assert is_finished(workload_view({**kueue_workload(3), "status": patch["status"]}))
    failed = finished(wl, False, "", STAMP)["status"]["conditions"]
    assert {c["type"]: c["reason"] for c in failed}["Finished"] == "Failed"


def test_the_flavors_place_the_pods() -> None:
    flavors = [
        {"spec": {"nodeLabels": {"pool": "a100", "zone": "z1"},
                  "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
        {"spec": {"nodeLabels": {"zone": "z1"},
                  "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
        {"metadata": {"name": "plain"}},
    ]  # fmt: skip
    where = placement(flavors)
    assert where.node_selector == {"pool": "a100", "zone": "z1"}
    assert where.tolerations == ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},)
    pod_ = {"spec": {"nodeSelector": {"team": "x"},
                     "tolerations": [{"key": "spot", "operator": "Exists"}]}}  # fmt: skip
    place_pod(pod_, where)
    assert pod_["spec"]["nodeSelector"] == {"team": "x", "pool": "a100", "zone": "z1"}
    assert [t["key"] for t in pod_["spec"]["tolerations"]] == ["spot", "gpu"]
    bare: dict[str, Any] = {"spec": {}}
    place_pod(bare, Placement({}))
    assert bare == {"spec": {}}


def test_the_admitted_flavors_are_read_from_the_admission() -> None:
    wl = workload_view(kueue_workload(3, *ADMITTED, flavors={"cpu": "b", "nvidia.com/gpu": "a"}))
    assert wl.flavors == ("a", "b") and wl.count == 3 and wl.cluster_queue == "cq"
    assert wl.pod_set_count == 4 and wl.pod_set_min_count == 2
    assert wl.finalizers == (RESOURCE_IN_USE,) and wl.resource_version == "7"


# ---------------------------------------------------- the API side, against a fake API


class _FakeCustom:
    """The CustomObjectsApi calls workload_client makes, answering from ``objects``
    (``(plural, name) -> object``; missing: 404) or failing with ``fail`` on reads."""

    def __init__(self, objects: dict[tuple[str, str], Any], fail: int | None = None) -> None:
        self.objects, self.fail, self.created = objects, fail, []  # type: ignore[var-annotated]

    def _get(self, plural: str, name: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        if self.fail is not None:
            raise ApiException(status=self.fail, reason="Forbidden")
        if (plural, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return self.objects[(plural, name)]

    def get_namespaced_custom_object(self, g: str, v: str, ns: str, plural: str, name: str) -> Any:
        return self._get(plural, name)

    def get_cluster_custom_object(self, g: str, v: str, plural: str, name: str) -> Any:
        return self._get(plural, name)

    def create_namespaced_custom_object(self, g: str, v: str, ns: str, plural: str, body: Any
                                        ) -> Any:  # fmt: skip
        self.created.append(body)
        return body


def _ensure(custom: Any, labels: dict[str, str], finished_job: bool = False) -> Any:
    from kelastic_operator.workload_client import ensure_workload

    obj = {"metadata": {"name": "j", "namespace": "ns", "uid": UID, "labels": labels}}
    return ensure_workload(custom, SETTINGS, obj, spec(replicas=2), finished_job,
                           queue_name(labels))  # fmt: skip


def test_ensure_workload_creates_it_once_and_never_for_an_unqueued_or_finished_job() -> None:
    custom = _FakeCustom({("workloadpriorityclasses", "high"): {"value": 500}})
    assert _ensure(custom, {}) == (None, []) and custom.created == []
    assert _ensure(custom, LABELS, finished_job=True) == (None, []) and custom.created == []
    made, events = _ensure(custom, {**LABELS, PRIORITY_LABEL: "high"})
    assert events == [] and made is not None and made.name == workload_name("j", UID)
    (body,) = custom.created
    assert body["spec"]["priority"] == 500
    assert body["spec"]["priorityClassRef"]["name"] == "high"


def test_ensure_workload_says_why_it_cannot_make_one() -> None:
    missing, events = _ensure(_FakeCustom({}), {**LABELS, PRIORITY_LABEL: "nope"})
    assert missing is None
    assert [(e.type, e.reason) for e in events] == [("Warning", "FailedCreateWorkload")]
    assert "WorkloadPriorityClass nope not found" in events[0].message
    # no rights on Kueue's workloads (the chart's operator.kueue false): the job waits
    forbidden, events = _ensure(_FakeCustom({}, fail=403), LABELS)
    assert forbidden is None and [e.reason for e in events] == ["FailedCreateWorkload"]
    # a class named but its value unknown: no reference (Kueue's CRD wants both)
    s = spec(replicas=2)
    wl = build_workload("j", "ns", UID, s, {**LABELS, PRIORITY_LABEL: "high"}, {"spec": {}})
    assert "priorityClassRef" not in wl["spec"] and "priority" not in wl["spec"]


def test_a_waiting_workload_of_other_sizes_or_pods_is_outdated_an_admitted_one_is_kept() -> None:
    from kelastic_operator.kueue import outdated

    waiting = workload_view(kueue_workload(None))  # asks 4, at least 2
    same = spec(replicas=4, minReplicas=2, maxReplicas=4)
    assert not outdated(waiting, same, HASH)
    assert outdated(waiting, spec(replicas=4, minReplicas=3, maxReplicas=4), HASH)
    assert outdated(waiting, spec(replicas=4, minReplicas=2, maxReplicas=6), HASH)
    assert outdated(waiting, spec(replicas=4), HASH)  # fixed size: no minCount
    assert outdated(waiting, same, "fedcba9876543210")  # its Pods ask for other things
    unmarked = workload_view({**kueue_workload(None), "metadata": {"name": "wl"}})
    assert outdated(unmarked, same, HASH)  # an older operator's: made again while it waits
    admitted = workload_view(kueue_workload(3, *ADMITTED))
    assert not outdated(admitted, spec(replicas=4, minReplicas=3, maxReplicas=6), "other")
    evicted_held = workload_view(kueue_workload(3, *ADMITTED, _cond("Evicted", "True")))
    assert not outdated(evicted_held, same, "other")  # its quota is not given back yet


def test_the_quota_hash_follows_requests_and_placement_not_images_or_commands() -> None:
    s = spec(replicas=2)
    base = build_pod("j", "ns", UID, s, 0, SETTINGS)["spec"]
    h = quota_hash(base)
    assert len(h) == 16 and int(h, 16) >= 0 and quota_hash(base) == h
    # what Kueue's quota and placement read changes it
    more = dataclasses.replace(SETTINGS, sidecar_image="kelastic:other")
    assert quota_hash(build_pod("j", "ns", UID, s, 0, more)["spec"]) == h  # image: no
    for path, value in (
        (("containers", 0, "resources"), {"requests": {"cpu": "3", "nvidia.com/gpu": "8"}}),
        (("initContainers", 0, "resources"), {"requests": {"memory": "9Gi"}}),
        (("nodeSelector",), {"pool": "h100"}),
        (("tolerations",), [{"key": "gpu", "operator": "Exists"}]),
        (("priorityClassName",), "high"),
    ):
        edited = copy.deepcopy(base)
        where: Any = edited
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
        assert quota_hash(edited) != h, path
    for key, value in (("image", "other:1"), ("command", ["sleep"]), ("env", [])):
        edited = copy.deepcopy(base)
        edited["containers"][0][key] = value
        assert quota_hash(edited) == h, key
    # the Workload carries the hash of its template
    wl = build_workload("j", "ns", UID, s, LABELS, {"spec": base})
    assert wl["metadata"]["annotations"] == {QUOTA_HASH_ANNOTATION: h}
    assert workload_view(wl).quota_hash == h


def test_a_job_scaled_down_gives_the_quota_of_its_pods_gone_back() -> None:
    # admitted 3 of 4 (at least 2): count 4 in the pod set, Kueue holds 3 Pods' quota
    wl = workload_view(kueue_workload(3, *ADMITTED))
    assert reclaim(wl, spec(replicas=3, minReplicas=2, maxReplicas=4), 3) is None
    assert reclaim(wl, spec(replicas=4, minReplicas=2, maxReplicas=4), 3) is None
    two = spec(replicas=2, minReplicas=2, maxReplicas=4)
    assert reclaim(wl, two, 3) is None  # the third Pod still there (stopping): not yet
    assert reclaim(wl, two, 2) == 2  # Kueue then counts min(3, 4 - 2) = 2 Pods
    patch = reclaim_patch(wl, 2)
    assert patch == {"metadata": {"resourceVersion": "7"},
                     "status": {"reclaimablePods": [{"name": "workers", "count": 2}]}}  # fmt: skip
    given = workload_view(kueue_workload(3, *ADMITTED, reclaimable=2))
    assert given.reclaimable == 2
    assert reclaim(given, two, 2) is None  # written already: nothing again
    assert reclaim(given, spec(replicas=4, minReplicas=2, maxReplicas=4), 2) is None
    assert reclaim(given, spec(replicas=1, minReplicas=1, maxReplicas=4), 1) == 3
    # the gate holds the job at what it kept: growing back waits for a new admission
    g = queue_gate("team", given, spec(replicas=4, minReplicas=2, maxReplicas=4))
    assert g is not None and g.admitted == 2 and "2 of 4 pods, 1 given back" in g.message
    # nothing is given back while not admitted, evicted, or without a Workload
    assert reclaim(None, two, 0) is None
    assert reclaim(workload_view(kueue_workload(None)), two, 0) is None
    evicted = workload_view(kueue_workload(3, *ADMITTED, _cond("Evicted", "True")))
    assert reclaim(evicted, two, 0) is None
    # crafted counts read as none given back
    for bad in (-1, "2", None, 2.5):
        odd = kueue_workload(3, *ADMITTED)
        odd["status"]["reclaimablePods"] = [{"name": "workers", "count": bad}]
        assert workload_view(odd).reclaimable == 0, bad
    other = kueue_workload(3, *ADMITTED)
    other["status"]["reclaimablePods"] = [{"name": "driver", "count": 2}, "junk"]
    assert workload_view(other).reclaimable == 0


def test_a_cleared_reservation_gives_the_reclaimed_count_back_too() -> None:
    evicted = workload_view(kueue_workload(3, *ADMITTED, _cond("Evicted", "True", "Preempted"),
                                           reclaimable=2))  # fmt: skip
    patch = cleared_reservation(evicted, STAMP)
    assert patch["status"]["reclaimablePods"] is None  # re-admitted anew, all of it
