"""One reconcile pass (JobReconciler) against the real test cluster, without kopf, as the
operator's ServiceAccount, with a real etcd: what it writes to the API and to etcd."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import JobReconciler, OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.cluster import Client, ControlPlane
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest, operator_client

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx(
    k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd
) -> Iterator[OperatorContext]:
    api = operator_client(k8s_cluster, k8s.namespace).api_client()
    context = OperatorContext(
        api=api,
        pod_settings=PodSettings(etcd_endpoints=(etcd_server.endpoint,)),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=3, time_retry=0.5)),
    )
    yield context
    context.stores.close()
    api.close()


def apply_job(k8s: Client, node: ManualNode) -> dict[str, Any]:
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(node=node))
    found = k8s.get("elasticjob", "digits")
    assert found is not None
    return found


def round_two(etcd: str, k8s: Client, uid: str) -> str:
    """What the sidecars would have written: round 2 with 2 x 2 workers, 1 restart spent."""
    prefix = contract.job_prefix(k8s.namespace, "digits", uid)
    keys = contract.Keys(prefix)
    with EtcdClient([etcd]) as store:
        store.put(keys.rdzv_state, json.dumps({"version": 1, "round": 2, "complete": True,
                  "participants": {"digits-0": 0, "digits-1": 1}}).encode())  # fmt: skip
        store.put(keys.restarts, json.dumps({"version": 1, "count": 1, "last_round": 1,
                  "history": []}).encode())  # fmt: skip
    return prefix


def events(k8s: Client) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in k8s.objects("events")]


def test_one_pass_creates_pods_writes_status_and_events(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode, etcd_server: EmbeddedEtcd
) -> None:
    job = apply_job(k8s, manual_node)
    round_two(etcd_server.endpoint, k8s, job["metadata"]["uid"])
    assert JobReconciler(ctx, k8s.namespace, "digits").reconcile_once() is None
    assert sorted(k8s.names("pods")) == ["digits-0", "digits-1"]
    job = k8s.get("elasticjob", "digits") or {}
    st = job["status"]
    assert (st["phase"], st["replicas"], st["round"], st["worldSize"], st["restartsSpent"]) == (
        "Pending", 2, 2, 4, 1)  # fmt: skip
    reasons = [r for _, r, _ in events(k8s)]
    assert "CreatingPods" in reasons and "WorkersRestarted" in reasons
    # a second pass changes nothing
    rv = job["metadata"]["resourceVersion"]
    JobReconciler(ctx, k8s.namespace, "digits").reconcile_once()
    assert (k8s.get("elasticjob", "digits") or {})["metadata"]["resourceVersion"] == rv


def test_a_pod_of_an_earlier_job_holds_its_name(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode
) -> None:
    apply_job(k8s, manual_node)
    stale = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "digits-1", "labels": {"kelastic.dev/job-name": "digits",
                                                         "kelastic.dev/job-uid": "old"}},
             "spec": {"nodeSelector": manual_node.selector,
                      "containers": [{"name": "trainer", "image": "x"}]}}  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=json.dumps(stale))
    JobReconciler(ctx, k8s.namespace, "digits").reconcile_once()
    pods = {p["metadata"]["name"]: p for p in k8s.objects("pods")}
    assert sorted(pods) == ["digits-0", "digits-1"]
    assert pods["digits-1"]["metadata"]["labels"]["kelastic.dev/job-uid"] == "old"  # untouched
    assert (k8s.get("elasticjob", "digits") or {})["status"]["replicas"] == 1  # not counted


def test_a_pod_refused_by_a_quota_is_reported_as_failed_create(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode
) -> None:
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one-pod"},
             "spec": {"hard": {"pods": "1"}}}  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=json.dumps(quota))
    k8s.claim("digits-checkpoints")

    def enforced() -> bool:
        used = ((k8s.get("resourcequota", "one-pod") or {}).get("status") or {}).get("hard")
        return bool(used)

    from tests.k8s.cluster import wait_until

    wait_until(enforced, 30, what="the quota controller to track the quota")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(node=manual_node))
    JobReconciler(ctx, k8s.namespace, "digits").reconcile_once()  # does not raise
    assert k8s.names("pods") == ["digits-0"]
    (failed,) = [m for _, r, m in events(k8s) if r == "FailedCreate"]
    assert failed.startswith('creating pod digits-1: pods "digits-1" is forbidden: exceeded quota')
    assert (k8s.get("elasticjob", "digits") or {})["status"]["phase"] == "Pending"


def test_the_finalizer_work_deletes_the_jobs_prefix(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode, etcd_server: EmbeddedEtcd
) -> None:
    job = apply_job(k8s, manual_node)
    prefix = round_two(etcd_server.endpoint, k8s, job["metadata"]["uid"])
    with EtcdClient([etcd_server.endpoint]) as store:
        assert store.get_prefix(prefix)
        JobReconciler(ctx, k8s.namespace, "digits").delete_prefix(job)
        assert not store.get_prefix(prefix)


def test_a_repeated_event_is_counted_on_one_event_object(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode
) -> None:
    """A restart storm: the same reason posted again updates one Event's count and message
    (Kubernetes' aggregation), also for a new operator process that did not post it."""
    from datetime import datetime, timezone

    from kelastic_operator.reconcile import Event

    job = apply_job(k8s, manual_node)
    uid = job["metadata"]["uid"]
    reconciler = JobReconciler(ctx, k8s.namespace, "digits")
    now = datetime.now(timezone.utc)
    for spent in (1, 2, 3):
        reconciler._post(Event("Warning", "WorkersRestarted", f"{spent}/10 restarts"), uid, now)
    fresh = OperatorContext(api=ctx.api, pod_settings=ctx.pod_settings)  # a restarted operator
    JobReconciler(fresh, k8s.namespace, "digits")._post(
        Event("Warning", "WorkersRestarted", "4/10 restarts"), uid, now
    )
    restarts = [e for e in k8s.objects("events") if e["reason"] == "WorkersRestarted"]
    assert len(restarts) == 1
    assert (restarts[0]["count"], restarts[0]["message"]) == (4, "4/10 restarts")


def test_an_in_process_restart_shows_in_the_status_events_and_metrics_once(
    k8s: Client, ctx: OperatorContext, manual_node: ManualNode, etcd_server: EmbeddedEtcd
) -> None:
    """The sidecars' in-process record, read in the same range request as the rest of the
    job's keys: the status shows it, an InProcessRestart Event announces it, the
    operator's restart counter counts every rung once (a second pass adds nothing)."""
    job = apply_job(k8s, manual_node)
    prefix = round_two(etcd_server.endpoint, k8s, job["metadata"]["uid"])
    record = {"iteration": 1, "round": 2, "restarts": 1, "cause": "exception",
              "node": "digits-1", "rank": 3, "message": "InjectedFault: SIGUSR1",
              "time": 1.7e9}  # fmt: skip
    with EtcdClient([etcd_server.endpoint]) as store:
        store.put(contract.Keys(prefix).inprocess_iteration, json.dumps(record).encode())
    sample = ctx.metrics.registry.get_sample_value
    for _ in range(2):
        JobReconciler(ctx, k8s.namespace, "digits").reconcile_once()
        st = (k8s.get("elasticjob", "digits") or {})["status"]
        assert st["inProcessRestarts"] == 1
        assert st["lastInProcessRestart"] == {
            "iteration": 1, "cause": "exception", "rank": 3, "node": "digits-1",
            "message": "InjectedFault: SIGUSR1", "time": "2023-11-14T22:13:20Z",
        }  # fmt: skip
        (message,) = [m for _, r, m in events(k8s) if r == "InProcessRestart"]
        assert message == ("in-process restart 1/10 (iteration 1): rank 3 on digits-1: "
                           "exception: InjectedFault: SIGUSR1")  # fmt: skip
        levels = {level: sample("kelastic_operator_restarts_total", {"level": level})
                  for level in ("inprocess", "process", "pod")}  # fmt: skip
        assert levels == {"inprocess": 1, "process": 1, "pod": 0}
