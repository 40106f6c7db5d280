"""Kueue on the test cluster: the real controller manager (tests/k8s/kueue.py) admits
Workloads written by hand, as the operator will write them for ElasticJobs: partial
admission of an elastic pod set within a ClusterQueue's quota, queueing behind it, the
reason a Workload waits, and its webhooks and conversion served on loopback."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .cluster import Client, wait_until
from .kueue import API, RESOURCE_IN_USE, KueueManager

pytestmark = pytest.mark.timeout(300)

Obj = dict[str, Any]
WORKLOADS = "workloads.kueue.x-k8s.io"
LOCAL_QUEUE = "team"
CPU_QUOTA = 3


@pytest.fixture
def queues(kueue: KueueManager, k8s: Client) -> Iterator[Obj]:
    """A ResourceFlavor, a ClusterQueue (3 CPUs of it, no cohort, every namespace) and the
    LocalQueue ``team`` in the test's namespace, all active; yields their names."""
    name = k8s.namespace  # cluster-scoped names of the test's own
    docs = [
        {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name}},
        {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{
             "coveredResources": ["cpu"],
             "flavors": [{"name": name,
                          "resources": [{"name": "cpu", "nominalQuota": CPU_QUOTA}]}]}]}},
        {"apiVersion": API, "kind": "LocalQueue",
         "metadata": {"name": LOCAL_QUEUE, "namespace": k8s.namespace},
         "spec": {"clusterQueue": name}},
    ]  # fmt: skip
    for doc in docs:
        _apply(k8s, doc)
    _wait(kueue, k8s, "the ClusterQueue to be active",
          lambda: _true(k8s.get("clusterqueues.kueue.x-k8s.io", name), "Active"))  # fmt: skip
    _wait(kueue, k8s, "the LocalQueue to be active",
          lambda: _true(k8s.get("localqueues.kueue.x-k8s.io", LOCAL_QUEUE), "Active"))  # fmt: skip
    try:
        yield {"flavor": name, "cluster_queue": name, "local_queue": LOCAL_QUEUE}
    finally:
        # Kueue (still running) lets them go once the namespace's Workloads are gone
        k8s.cluster.admin.kubectl("delete", "clusterqueues.kueue.x-k8s.io", name,
                                  "--wait=false", check=False)  # fmt: skip
        k8s.cluster.admin.kubectl("delete", "resourceflavors.kueue.x-k8s.io", name,
                                  "--wait=false", check=False)  # fmt: skip


def _apply(k8s: Client, doc: Obj) -> None:
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))


def _workload(name: str, queue: str, count: int = 5, min_count: int | None = 2) -> Obj:
    """A Workload of one pod set ``workers``: ``count`` Pods of 1 CPU, at least
    ``min_count`` of them (partial admission). Kueue's finalizer is on it from the start,
    as Kueue's own job integrations create theirs (``jobframework.NewWorkload``): the
    quota stays held until whoever runs the Pods lifts it."""
    pod_set: Obj = {
        "name": "workers",
        "count": count,
        "template": {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "trainer", "image": "ghcr.io/kelastic/digits-example:0.1.0",
            "resources": {"requests": {"cpu": "1"}}}]}},
    }  # fmt: skip
    if min_count is not None:
        pod_set["minCount"] = min_count
    return {"apiVersion": API, "kind": "Workload",
            "metadata": {"name": name, "finalizers": [RESOURCE_IN_USE]},
            "spec": {"queueName": queue, "podSets": [pod_set]}}  # fmt: skip


def _condition(obj: Obj | None, kind: str) -> Obj | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return None


def _true(obj: Obj | None, kind: str) -> bool:
    return (_condition(obj, kind) or {}).get("status") == "True"


def _admitted(obj: Obj | None) -> Obj | None:
    """The Workload once Kueue reserved its quota and admitted it, else None."""
    if obj and _true(obj, "QuotaReserved") and _true(obj, "Admitted"):
        return obj
    return None


def _wait(kueue: KueueManager, k8s: Client, what: str, cond: Callable[[], Any],
          timeout: float = 60) -> Any:  # fmt: skip
    """:func:`wait_until` ``cond``; on a timeout, the namespace's Workloads' status and
    Kueue's log go into the failure."""
    try:
        return wait_until(cond, timeout, 0.2, what=what)
    except AssertionError as exc:
        status = {w["metadata"]["name"]: w.get("status") for w in k8s.objects(WORKLOADS)}
        raise AssertionError(
            f"{exc}\nworkloads: {json.dumps(status, indent=1)}\n{kueue.log_tail()}"
        ) from None


def test_partial_admission_then_queueing(kueue: KueueManager, k8s: Client, queues: Obj) -> None:
    assert kueue.startup_seconds > 0
    _apply(k8s, _workload("first", LOCAL_QUEUE))
    first = _wait(kueue, k8s, "the first Workload admitted",
                  lambda: _admitted(k8s.get(WORKLOADS, "first")))  # fmt: skip
    # 5 Pods of 1 CPU asked, at least 2: the 3 CPUs of the queue admit 3 of them
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == queues["cluster_queue"]
    (assignment,) = admission["podSetAssignments"]
    assert assignment["name"] == "workers"
    assert assignment["count"] == 3
    assert assignment["flavors"] == {"cpu": queues["flavor"]}
    assert assignment["resourceUsage"] == {"cpu": "3"}
    assert _condition(first, "QuotaReserved")["reason"] == "QuotaReserved"  # type: ignore[index]
    # the deprecated v1beta1 is served through the conversion webhook on loopback
    old = json.loads(k8s.kubectl("get", f"{WORKLOADS.replace('.', '.v1beta1.', 1)}", "first",
                                 "-o", "json").stdout)  # fmt: skip
    assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert old["status"]["admission"]["podSetAssignments"][0]["count"] == 3

    # a second one needs 2 CPUs at least: none is left, it waits, and says why
    _apply(k8s, _workload("second", LOCAL_QUEUE))
    pending = _wait(kueue, k8s, "the second Workload to be found short of quota",
                    lambda: (_condition(k8s.get(WORKLOADS, "second"), "QuotaReserved") or {})
                    .get("reason") == "Pending" and k8s.get(WORKLOADS, "second"))  # fmt: skip
    reserved = _condition(pending, "QuotaReserved")
    assert reserved is not None and reserved["status"] == "False"
    # (the message is the full count's: Kueue tells not that 2 Pods do not fit either)
    assert f"insufficient quota for cpu in flavor {queues['flavor']}" in reserved["message"]
    assert "admission" not in pending["status"]
    assert not _true(pending, "Admitted")
    queue = _wait(kueue, k8s, "the ClusterQueue to count 1 admitted and 1 pending",
                  lambda: (lambda s: s.get("admittedWorkloads") == 1
                           and s.get("pendingWorkloads") == 1 and s)(
                      (k8s.get("clusterqueues.kueue.x-k8s.io", queues["cluster_queue"]) or {})
                      .get("status") or {}))  # fmt: skip
    (usage,) = queue["flavorsReservation"]
    assert usage["resources"] == [{"name": "cpu", "total": "3", "borrowed": "0"}], usage

    # the first goes (no owner: Kueue lifts its finalizer itself): the second gets the 3 CPUs
    k8s.kubectl("delete", WORKLOADS, "first", "--wait=false")
    _wait(kueue, k8s, "the first Workload deleted", lambda: k8s.get(WORKLOADS, "first") is None)
    second = _wait(kueue, k8s, "the second Workload admitted",
                   lambda: _admitted(k8s.get(WORKLOADS, "second")))  # fmt: skip
    assert second["status"]["admission"]["podSetAssignments"][0]["count"] == 3


def test_a_workload_of_a_missing_local_queue_is_not_admitted(
    kueue: KueueManager, k8s: Client, queues: Obj
) -> None:
    _apply(k8s, _workload("lost", "missing"))
    wl = _wait(kueue, k8s, "the Workload found inadmissible",
               lambda: (_condition(k8s.get(WORKLOADS, "lost"), "QuotaReserved") or {})
               .get("reason") == "Inadmissible" and k8s.get(WORKLOADS, "lost"))  # fmt: skip
    reserved = _condition(wl, "QuotaReserved")
    assert reserved is not None and reserved["status"] == "False"
    assert reserved["message"] == "LocalQueue missing doesn't exist"
    assert "admission" not in wl["status"]
    assert not _true(wl, "Admitted")
    # the queue that does exist still has all its quota
    _apply(k8s, _workload("found", LOCAL_QUEUE, count=3, min_count=None))
    found = _wait(kueue, k8s, "the Workload of the real queue admitted",
                  lambda: _admitted(k8s.get(WORKLOADS, "found")))  # fmt: skip
    assert found["status"]["admission"]["podSetAssignments"][0]["count"] == 3


def test_the_validating_webhook_allows_one_elastic_pod_set(
    kueue: KueueManager, k8s: Client, queues: Obj
) -> None:
    wl = _workload("two-elastic", LOCAL_QUEUE)
    wl["spec"]["podSets"].append({**wl["spec"]["podSets"][0], "name": "more"})
    result = k8s.kubectl("apply", "-f", "-", input=json.dumps(wl), check=False)
    assert result.returncode != 0
    assert 'admission webhook "vworkload.kb.io" denied the request' in result.stderr
    assert "at most one podSet can use minCount" in result.stderr
    assert k8s.get(WORKLOADS, "two-elastic") is None


def test_a_workload_owned_by_an_elastic_job_is_admitted_and_collected_with_it(
    kueue: KueueManager, k8s: Client, queues: Obj
) -> None:
    # the shape the operator will write: the Workload controlled by its ElasticJob, whose
    # kind Kueue knows as an external framework
    trainer = {"name": "trainer", "image": "ghcr.io/kelastic/digits-example:0.1.0",
               "command": ["python", "train.py"]}  # fmt: skip
    job = {"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
           "metadata": {"name": "digits"},
           "spec": {"replicas": 4, "minReplicas": 2, "maxReplicas": 4, "suspend": True,
                    "template": {"spec": {"containers": [trainer]}}}}  # fmt: skip
    _apply(k8s, job)
    uid = k8s.get("elasticjobs", "digits")["metadata"]["uid"]  # type: ignore[index]
    wl = _workload("elasticjob-digits", LOCAL_QUEUE, count=4, min_count=2)
    wl["metadata"]["ownerReferences"] = [{
        "apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob", "name": "digits",
        "uid": uid, "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    _apply(k8s, wl)
    admitted = _wait(kueue, k8s, "the ElasticJob's Workload admitted",
                     lambda: _admitted(k8s.get(WORKLOADS, "elasticjob-digits")))  # fmt: skip
    assert admitted["status"]["admission"]["podSetAssignments"][0]["count"] == 3
    # the job's deletion takes the Workload (garbage collector); Kueue lifts the finalizer
    # of an owned Workload no more (workload_controller.go: only of one without owner):
    # it is its job controller's, here the operator's, to lift it
    k8s.kubectl("delete", "elasticjob", "digits", "--wait=false")
    deleting = _wait(kueue, k8s, "the Workload's deletion by the garbage collector",
                     lambda: (lambda w: w and w["metadata"].get("deletionTimestamp") and w)(
                         k8s.get(WORKLOADS, "elasticjob-digits")))  # fmt: skip
    assert deleting["metadata"]["finalizers"] == [RESOURCE_IN_USE]
    k8s.kubectl("patch", WORKLOADS, "elasticjob-digits", "--type=json", "-p",
                '[{"op": "remove", "path": "/metadata/finalizers/0"}]')  # fmt: skip
    _wait(kueue, k8s, "the Workload gone with its finalizer",
          lambda: k8s.get(WORKLOADS, "elasticjob-digits") is None)  # fmt: skip
