"""ElasticJobs admitted by the real Kueue 0.17 (tests/k8s/kueue.py, one manager for the
module) on the real control plane: the operator's kopf handlers as its ServiceAccount
(deploy/rbac.yaml's rights, Kueue's included), a real etcd, Pods on a Node no kubelet runs
(:class:`~tests.k8s.nodes.ManualNode`: the test writes their status, the node completes
their graceful deletions). Each test gets its own ResourceFlavor (its ``nodeLabels`` put
the Pods on that node), ClusterQueue and the LocalQueue ``team``.

Each digits Pod asks 550m CPU (trainer 500m, sidecar 50m) and 1088Mi: a quota of
``n * 550m`` CPU fits ``n`` Pods. The last test runs real training on the real node
(kubelet, containerd, runc) and is preempted by Kueue: its step survives on the claim.
The pure decisions are tests/operator/test_kueue.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from kelastic import contract, etcd_values
from kelastic.checkpoint.persist import complete_steps
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.kueue import (
    JOB_UID_LABEL,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    RESOURCE_IN_USE,
    QueueReason,
    workload_name,
)
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.suspend import RESUMED_REASON
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.kueue import API, KueueManager
from tests.k8s.node import PLACEMENT, RealNode
from tests.k8s.node import TOLERATION as NODE_TOLERATION
from tests.k8s.nodes import ManualNode

from .conftest import DIGITS, job_manifest, running_operator

pytestmark = pytest.mark.timeout(240)
T = 45.0  # seconds any single expectation may take
POD_CPU_MILLI = 550
Obj = dict[str, Any]
WORKLOADS = "workloads.kueue.x-k8s.io"
TOLERATION = {"key": "kelastic.dev/test-pool", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def kueue_operator(
    kueue: KueueManager,
    k8s_cluster: ControlPlane,
    k8s: Client,
    etcd_server: EmbeddedEtcd,
    manual_node: ManualNode,
) -> Iterator[OperatorContext]:
    """The operator, watching Kueue's Workloads too, serving the test's namespace (the
    node outlives it: it completes the Pods' graceful deletions as the jobs go)."""
    k8s.claim("digits-checkpoints")
    with running_operator(k8s_cluster, k8s, etcd_server.endpoint, watch_workloads=True) as ctx:
        yield ctx
        # the jobs go while the handlers still run (their finalizers release the
        # Workloads); the queues' deletion waits for them
        k8s.kubectl("delete", "elasticjobs", "--all", "--timeout=60s", check=False)


def make_queues(kueue: KueueManager, k8s: Client, node: ManualNode, pods: int,
                preemption: bool = False) -> str:  # fmt: skip
    """A ResourceFlavor whose node labels are ``node``'s (and a toleration), a ClusterQueue
    of ``pods`` digits Pods' CPU (memory plenty) and the LocalQueue ``team``; returns the
    ClusterQueue's (and flavor's) name. ``preemption``: within the queue, of lower
    priority."""
    name = k8s.namespace
    cq: Obj = {"namespaceSelector": {}, "resourceGroups": [{
        "coveredResources": ["cpu", "memory"],
        "flavors": [{"name": name, "resources": [
            {"name": "cpu", "nominalQuota": f"{pods * POD_CPU_MILLI}m"},
            {"name": "memory", "nominalQuota": "100Gi"}]}]}]}  # fmt: skip
    if preemption:
        cq["preemption"] = {"withinClusterQueue": "LowerPriority"}
    docs = [
        {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": {"nodeLabels": node.selector, "tolerations": [TOLERATION]}},
        {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": cq},
        {"apiVersion": API, "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": k8s.namespace},
         "spec": {"clusterQueue": name}},
    ]  # fmt: skip
    for doc in docs:
        k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))
    for kind, obj in (("clusterqueues", name), ("localqueues", "team")):
        wait(kueue, k8s, f"the {kind} active", lambda k=kind, o=obj: _true(
            k8s.get(f"{k}.kueue.x-k8s.io", o), "Active"))  # fmt: skip
    return name


@pytest.fixture
def queue_names(kueue: KueueManager, k8s: Client) -> Iterator[list[str]]:
    """Deletes the cluster-scoped queues a test made (after its jobs are gone)."""
    made: list[str] = []
    yield made
    for name in made:
        for kind in ("clusterqueues", "resourceflavors"):
            k8s.cluster.admin.kubectl("delete", f"{kind}.kueue.x-k8s.io", name,
                                      "--wait=false", check=False)  # fmt: skip


def submit(k8s: Client, name: str, queue: str | None = "team", priority: str | None = None,
           node: ManualNode | None = None, **spec: Any) -> str:  # fmt: skip
    """Apply the digits example as ``name`` (``spec`` fields replaced; placed on ``node``),
    labelled for the LocalQueue ``queue``; returns its uid."""
    doc = yaml.safe_load(job_manifest(name, node, **spec))
    labels = doc["metadata"].setdefault("labels", {})
    if queue:
        labels[QUEUE_LABEL] = queue
    if priority:
        labels[PRIORITY_LABEL] = priority
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return str(k8s.get("elasticjob", name)["metadata"]["uid"])  # type: ignore[index]


def _true(obj: Obj | None, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True"
               for c in ((obj or {}).get("status") or {}).get("conditions") or [])  # fmt: skip


def status_of(k8s: Client, job: str) -> Obj:
    return dict(((k8s.get("elasticjob", job) or {}).get("status")) or {})


def suspended(k8s: Client, job: str) -> tuple[str, str, str] | None:
    for c in status_of(k8s, job).get("conditions") or []:
        if c["type"] == "Suspended":
            return c["status"], c["reason"], c["message"]
    return None


def job_pods(k8s: Client, job: str) -> list[str]:
    """The job's Pods not being deleted, sorted."""
    live = [n for n, p in pods_by_name(k8s).items() if not p["metadata"].get("deletionTimestamp")]
    return sorted(n for n in live if n.rsplit("-", 1)[0] == job)


def wait(kueue: KueueManager, k8s: Client, what: str, cond: Callable[[], Any],
         timeout: float = T) -> Any:  # fmt: skip
    """:func:`wait_until` ``cond``; on a timeout the jobs', Workloads' status and Kueue's
    log go into the failure."""
    try:
        return wait_until(cond, timeout, 0.2, what=what)
    except AssertionError as exc:
        wls = {w["metadata"]["name"]: w.get("status") for w in k8s.objects(WORKLOADS)}
        jobs = {j["metadata"]["name"]: j.get("status") for j in k8s.objects("elasticjobs")}
        detail = f"workloads: {json.dumps(wls, indent=1)}\njobs: {json.dumps(jobs, indent=1)}"
        raise AssertionError(f"{exc}\n{detail}\n{kueue.log_tail()}") from None


def workload_of(k8s: Client, job: str, uid: str) -> Obj | None:
    return k8s.get(WORKLOADS, workload_name(job, uid))


def admitted_count(k8s: Client, job: str, uid: str) -> int | None:
    wl = workload_of(k8s, job, uid)
    if not (_true(wl, "Admitted") and _true(wl, "QuotaReserved")):
        return None
    return int(wl["status"]["admission"]["podSetAssignments"][0]["count"])  # type: ignore[index]


def test_a_short_quota_admits_a_job_partially_and_it_runs_that_many_pods(
    kueue: KueueManager, k8s: Client, kueue_operator: OperatorContext,
    manual_node: ManualNode, queue_names: list[str],
) -> None:  # fmt: skip
    queue_names.append(make_queues(kueue, k8s, manual_node, pods=3))
    uid = submit(k8s, "partial", replicas=4, minReplicas=2, maxReplicas=4)
    wl = wait(kueue, k8s, "the job's Workload", lambda: workload_of(k8s, "partial", uid))
    meta, (pod_set,) = wl["metadata"], wl["spec"]["podSets"]
    assert meta["labels"][JOB_UID_LABEL] == uid and meta["finalizers"] == [RESOURCE_IN_USE]
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ElasticJob", "partial", uid, True)  # fmt: skip
    assert wl["spec"]["queueName"] == "team"
    assert (pod_set["count"], pod_set["minCount"]) == (4, 2)
    # 4 asked, at least 2; 3 fit: Kueue admits 3 and the operator runs 3 Pods
    wait(kueue, k8s, "3 of 4 admitted", lambda: admitted_count(k8s, "partial", uid) == 3)
    pods = [f"partial-{i}" for i in range(3)]
    wait(kueue, k8s, "3 pods", lambda: job_pods(k8s, "partial") == pods)
    for name in pods:  # placed by the admission's flavor, which the template did not name
        spec = k8s.get("pod", name)["spec"]  # type: ignore[index]
        assert spec["nodeSelector"] == manual_node.selector
        assert TOLERATION in spec["tolerations"]
    for name in pods:
        manual_node.set_status(k8s.namespace, name, "Running", ready=True)
    st = wait(kueue, k8s, "Running at 3", lambda: (s := status_of(k8s, "partial")).get("phase")
              == "Running" and s)  # fmt: skip
    assert st["admittedReplicas"] == 3 and st["replicas"] == 3
    # (admitted at once, the job may never have been seen held: no condition then)
    held = suspended(k8s, "partial")
    assert held is None or held[:2] == ("False", RESUMED_REASON), held
    # kubectl scale above the admission: no Pod beyond it (Kueue 0.17 cannot grow an
    # admitted Workload without its alpha workload slices), and the status says so
    k8s.kubectl("scale", "elasticjob", "partial", "--replicas=4")
    wait(kueue, k8s, "the scale seen", lambda: status_of(k8s, "partial").get(
        "observedGeneration") == k8s.get("elasticjob", "partial")["metadata"]["generation"])  # type: ignore[index]  # fmt: skip
    assert job_pods(k8s, "partial") == pods
    ready = next(c for c in status_of(k8s, "partial")["conditions"]
                 if c["type"] == "RendezvousReady")  # fmt: skip
    assert "Kueue admitted 3 of the 4 wanted" in ready["message"]
    # scaled down to 2: once the third Pod is gone its quota goes back to the queue
    # (reclaimablePods 4 - 2), and a job of one Pod that did not fit is admitted at once
    k8s.kubectl("scale", "elasticjob", "partial", "--replicas=2")
    wait(kueue, k8s, "2 pods", lambda: job_pods(k8s, "partial") == pods[:2])
    given = wait(kueue, k8s, "the quota given back", lambda: (w := workload_of(
        k8s, "partial", uid)) and (w.get("status") or {}).get("reclaimablePods") and w)  # fmt: skip
    assert given["status"]["reclaimablePods"] == [{"name": "workers", "count": 2}]
    one = submit(k8s, "one", replicas=1, minReplicas=1, maxReplicas=1)
    wait(kueue, k8s, "the one-Pod job admitted", lambda: admitted_count(k8s, "one", one) == 1)
    wait(kueue, k8s, "its pod", lambda: job_pods(k8s, "one") == ["one-0"])
    # scaling back up cannot take that quota again: the job stays at the 2 it kept
    k8s.kubectl("scale", "elasticjob", "partial", "--replicas=3")
    wait(kueue, k8s, "the scale seen", lambda: (s := status_of(k8s, "partial")).get(
        "observedGeneration") == k8s.get("elasticjob", "partial")["metadata"]["generation"]
        and s["admittedReplicas"] == 2)  # type: ignore[index]  # fmt: skip
    assert job_pods(k8s, "partial") == pods[:2]
    # deleting the job releases its Workload (Kueue leaves an owned one's finalizer)
    k8s.kubectl("delete", "elasticjob", "partial", "one", "--wait=false")
    gone = lambda: workload_of(k8s, "partial", uid) is None and not job_pods(k8s, "partial")  # noqa: E731
    wait(kueue, k8s, "the Workload gone with the job", gone)


def test_two_jobs_compete_for_one_quota_the_second_waits_then_runs(
    kueue: KueueManager, k8s: Client, kueue_operator: OperatorContext,
    manual_node: ManualNode, queue_names: list[str],
) -> None:  # fmt: skip
    queue_names.append(make_queues(kueue, k8s, manual_node, pods=3))
    first = submit(k8s, "first", replicas=3, minReplicas=2, maxReplicas=3)
    wait(kueue, k8s, "first admitted", lambda: admitted_count(k8s, "first", first) == 3)
    wait(kueue, k8s, "first's pods", lambda: len(job_pods(k8s, "first")) == 3)
    second = submit(k8s, "second", replicas=2, minReplicas=2, maxReplicas=2)  # none fits
    held = wait(kueue, k8s, "second queued", lambda: (s := suspended(k8s, "second"))
                and s[0] == "True" and "insufficient unused quota" in s[2] and s)  # fmt: skip
    assert held[1] == QueueReason.QUEUED.value and "LocalQueue team" in held[2]
    st = status_of(k8s, "second")
    assert st["phase"] == "Suspended" and st["admittedReplicas"] == 0
    assert job_pods(k8s, "second") == []
    # its sizes edited while it waits: its Workload is made again with them
    old_uid = workload_of(k8s, "second", second)["metadata"]["uid"]  # type: ignore[index]
    k8s.kubectl("patch", "ej", "second", "--type=merge", "-p", '{"spec":{"minReplicas":1}}')
    wl = wait(kueue, k8s, "second's Workload replaced", lambda: (w := workload_of(
        k8s, "second", second)) and w["metadata"]["uid"] != old_uid and w)  # fmt: skip
    assert wl["spec"]["podSets"][0]["minCount"] == 1 and wl["spec"]["podSets"][0]["count"] == 2
    # its Pods' requests edited while it waits: made again, asking for what they will
    k8s.kubectl("patch", "ej", "second", "--type=json", "-p", json.dumps([{
        "op": "replace", "value": "2Gi",
        "path": "/spec/template/spec/containers/0/resources/requests/memory"}]))  # fmt: skip
    sized = wl["metadata"]["uid"]
    wl = wait(kueue, k8s, "replaced for its requests", lambda: (w := workload_of(
        k8s, "second", second)) and w["metadata"]["uid"] != sized and w)  # fmt: skip
    (trainer,) = [c for c in wl["spec"]["podSets"][0]["template"]["spec"]["containers"]
                  if c["name"] == "trainer"]  # fmt: skip
    assert trainer["resources"]["requests"]["memory"] == "2Gi"
    assert job_pods(k8s, "second") == []  # still no quota: first holds all of it
    k8s.kubectl("delete", "elasticjob", "first", "--wait=false")
    wait(kueue, k8s, "second admitted", lambda: admitted_count(k8s, "second", second) == 2)
    wait(kueue, k8s, "second's pods", lambda: job_pods(k8s, "second") == ["second-0", "second-1"])
    assert workload_of(k8s, "first", first) is None
    assert status_of(k8s, "second")["admittedReplicas"] == 2


def test_a_job_without_the_label_runs_as_before_with_kueue_there(
    kueue: KueueManager, k8s: Client, kueue_operator: OperatorContext, manual_node: ManualNode
) -> None:
    submit(k8s, "plain", queue=None, node=manual_node, replicas=2, minReplicas=1)
    wait(kueue, k8s, "its pods", lambda: job_pods(k8s, "plain") == ["plain-0", "plain-1"])
    st = status_of(k8s, "plain")
    assert "admittedReplicas" not in st and suspended(k8s, "plain") is None
    assert k8s.objects(WORKLOADS) == []


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_later(
    kueue: KueueManager, k8s: Client, kueue_operator: OperatorContext,
    manual_node: ManualNode, queue_names: list[str], etcd_server: EmbeddedEtcd,
) -> None:  # fmt: skip
    queue_names.append(make_queues(kueue, k8s, manual_node, pods=3, preemption=True))
    for name, value in (("kelastic-test-low", 10), ("kelastic-test-high", 1000)):
        k8s.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": API, "kind": "WorkloadPriorityClass",
            "metadata": {"name": name}, "value": value}))  # fmt: skip
    low = submit(k8s, "low", priority="kelastic-test-low", replicas=3, minReplicas=2,
                 maxReplicas=3)  # fmt: skip
    assert wait(kueue, k8s, "low's Workload", lambda: workload_of(k8s, "low", low))["spec"][
        "priority"] == 10  # fmt: skip
    pods = ["low-0", "low-1", "low-2"]
    wait(kueue, k8s, "low's pods", lambda: job_pods(k8s, "low") == pods)
    for name in pods:
        manual_node.set_status(k8s.namespace, name, "Running", ready=True)
    wait(kueue, k8s, "low Running", lambda: status_of(k8s, "low").get("phase") == "Running")
    high = submit(k8s, "high", priority="kelastic-test-high", replicas=2, minReplicas=2,
                  maxReplicas=2)  # fmt: skip
    # low is evicted: its Pods stop (the node completes their graceful deletion), the
    # operator gives its quota back, high is admitted and runs
    evicted = wait(kueue, k8s, "low evicted", lambda: (s := suspended(k8s, "low"))
                   and s[1] == QueueReason.EVICTED.value and s)  # fmt: skip
    assert evicted[0] == "True" and "Preempted" in evicted[2]
    wait(kueue, k8s, "low's pods gone", lambda: job_pods(k8s, "low") == [])
    wait(kueue, k8s, "high admitted", lambda: admitted_count(k8s, "high", high) == 2)
    wait(kueue, k8s, "high's pods", lambda: job_pods(k8s, "high") == ["high-0", "high-1"])
    requeued = workload_of(k8s, "low", low)
    assert requeued is not None and not _true(requeued, "QuotaReserved")
    assert "admission" not in requeued["status"] and _true(requeued, "Requeued")
    reasons = [e["reason"] for e in k8s.objects("events")
               if e["involvedObject"]["name"] == "low"]  # fmt: skip
    assert "Suspending" in reasons
    # each stopped Pod's departure notice was posted first: its peers charge no restart
    keys = contract.Keys(contract.job_prefix(k8s.namespace, "low", low))
    with EtcdClient([etcd_server.endpoint]) as store:
        notices = {k.rsplit("/", 1)[1]: etcd_values.decode_departure(v)
                   for k, (v, _) in store.get_prefix(keys.departing_prefix).items()}  # fmt: skip
    assert notices == dict.fromkeys(pods, contract.DEPARTURE_SCALE_DOWN)
    # 1 Pod's quota is left, low needs 2 at least: it waits; high goes, low comes back
    assert status_of(k8s, "low")["phase"] == "Suspended" and job_pods(k8s, "low") == []
    k8s.kubectl("delete", "elasticjob", "high", "--wait=false")
    wait(kueue, k8s, "low re-admitted", lambda: admitted_count(k8s, "low", low) == 3)
    wait(kueue, k8s, "low's pods back", lambda: job_pods(k8s, "low") == pods)
    assert suspended(k8s, "low")[:2] == ("False", RESUMED_REASON)  # type: ignore[index]
    k8s.cluster.admin.kubectl("delete", "workloadpriorityclasses.kueue.x-k8s.io",
                              "kelastic-test-low", "kelastic-test-high", check=False)  # fmt: skip


# ------------------------------------------------- preempted while training, on the real node


@pytest.fixture
def training_operator(
    kueue: KueueManager, k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd,
    node: RealNode,
) -> Iterator[OperatorContext]:  # fmt: skip
    """The operator, watching Workloads, for jobs whose Pods the real node runs (kubelet,
    containerd, runc: the images built here), with the example's checkpoint claim."""
    k8s.kubectl("label", "namespace", k8s.namespace,
                "pod-security.kubernetes.io/enforce=restricted")  # fmt: skip
    k8s.claim("digits-checkpoints")
    etcd = node.expose(etcd_server.endpoint)
    with running_operator(k8s_cluster, k8s, etcd, watch_workloads=True, stop_grace=3) as ctx:
        yield ctx
        k8s.kubectl("delete", "elasticjobs", "--all", "--timeout=90s", check=False)


def _epoch_steps(logs: str) -> int:
    """The step count of the newest ``epoch N/M step S`` line of the digits trainer."""
    return max((int(s) for s in re.findall(r"epoch \d+/\d+ step (\d+)", logs)), default=0)


def _training_queues(k8s: Client) -> str:
    """A flavor of the real node (its label and taint), a ClusterQueue of two digits Pods'
    CPU that preempts within itself by priority, the LocalQueue ``team``, and the two
    WorkloadPriorityClasses; returns the ClusterQueue's (and flavor's) name."""
    name = k8s.namespace
    quota = [{"name": "cpu", "nominalQuota": f"{2 * POD_CPU_MILLI}m"},
             {"name": "memory", "nominalQuota": "100Gi"}]  # fmt: skip
    docs: list[Obj] = [
        {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": {"nodeLabels": PLACEMENT["nodeSelector"], "tolerations": [NODE_TOLERATION]}},
        {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": {
            "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["cpu", "memory"],
                                "flavors": [{"name": name, "resources": quota}]}]}},
        {"apiVersion": API, "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": k8s.namespace},
         "spec": {"clusterQueue": name}},
    ]  # fmt: skip
    for prio, value in (("kelastic-test-low", 10), ("kelastic-test-high", 1000)):
        docs.append({"apiVersion": API, "kind": "WorkloadPriorityClass",
                     "metadata": {"name": prio}, "value": value})  # fmt: skip
    for doc in docs:
        k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))
    return name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_preempted_while_training_persists_and_resumes_from_its_step(
    kueue: KueueManager, k8s: Client, training_operator: OperatorContext, node: RealNode,
    queue_names: list[str],
) -> None:  # fmt: skip
    """Real DDP training on the real node, admitted by Kueue; a job of higher priority
    preempts it: its Pods stop (their sidecars write the newest step every rank holds in
    memory to the claim), the quota goes to the other job; re-admitted, its ranks load
    that step from disk and train on, nothing charged."""
    queue_names.append(_training_queues(k8s))
    logs = lambda: node.logs(k8s.namespace, "trainer")  # noqa: E731
    slow = 4 * T
    # the stop's write is the only one (everySteps far beyond the run)
    ckpt = {"memory": "64Mi", "persist": {"volume": "checkpoints", "everySteps": 1_000_000}}
    # (a gang of 2: with minReplicas 1 Kueue admits it again at once at 1 beside high)
    low = submit(k8s, "low", priority="kelastic-test-low", replicas=2, minReplicas=2,
                 maxReplicas=2, checkpoint=ckpt)  # fmt: skip
    wait(kueue, k8s, "low admitted", lambda: admitted_count(k8s, "low", low) == 2, slow)
    wait(kueue, k8s, "low training", lambda: "epoch 3/" in logs(), slow)
    trained = _epoch_steps(logs())
    # a job of higher priority that never runs a Pod here (its selector matches no Node)
    nowhere = yaml.safe_load(DIGITS.read_text())["spec"]["template"]
    nowhere["spec"]["nodeSelector"] = {"kelastic.dev/nowhere": "true"}
    high = submit(k8s, "high", priority="kelastic-test-high", replicas=1, minReplicas=1,
                  maxReplicas=1, checkpoint={"memory": "64Mi"}, template=nowhere)  # fmt: skip
    evicted = wait(kueue, k8s, "low evicted", lambda: (s := suspended(k8s, "low"))
                   and s[1] == QueueReason.EVICTED.value and s, slow)  # fmt: skip
    assert evicted[0] == "True" and "Preempted" in evicted[2], evicted
    wait(kueue, k8s, "low's pods gone", lambda: not [
        n for n in pods_by_name(k8s) if n.startswith("low-")], slow)  # fmt: skip
    root = k8s.cluster.workdir / "volumes" / f"{k8s.namespace}-digits-checkpoints"[:63]
    steps = complete_steps(root / "kelastic-checkpoints")
    assert steps, "the stopped Pods' sidecars persisted no complete step"
    persisted = max(steps)
    assert persisted >= trained > 0, (persisted, trained)  # what it had trained is kept
    wait(kueue, k8s, "high admitted", lambda: admitted_count(k8s, "high", high) == 1, slow)
    # high goes; low is admitted again and its ranks load the persisted step from disk
    k8s.kubectl("delete", "elasticjob", "high", "--wait=false")
    wait(kueue, k8s, "low re-admitted", lambda: admitted_count(k8s, "low", low) == 2, slow)
    line = wait(kueue, k8s, "low resumed", lambda: re.search(
        r"resumed from checkpoint: epoch (\d+) step \d+ \(on disk, update (\d+)", logs()),
        slow)  # fmt: skip
    assert int(line.group(2)) == persisted, (line.group(0), persisted)
    epoch = int(line.group(1))
    wait(kueue, k8s, "an epoch trained after it", lambda: f"epoch {epoch + 2}/" in logs(), slow)
    st = status_of(k8s, "low")
    assert (st.get("restartsSpent") or 0) == 0, st  # a preemption charges nothing
    last = st.get("lastCheckpoint") or {}
    assert (last.get("tier"), last.get("step")) == ("disk", persisted), last
    # and how long the slowest of the 4 ranks took to load it, once both nodes said so
    last = wait(kueue, k8s, "the load time", lambda: (c := status_of(k8s, "low").get(
        "lastCheckpoint") or {}).get("loadedRanks") == 4 and c, slow)  # fmt: skip
    assert 0 < last["loadSeconds"] < 60, last
    k8s.cluster.admin.kubectl("delete", "workloadpriorityclasses.kueue.x-k8s.io",
                              "kelastic-test-low", "kelastic-test-high", check=False)  # fmt: skip
