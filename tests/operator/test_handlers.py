"""One reconcile pass (JobReconciler) against the emulator, without kopf, with a fake
rendezvous store: what it writes to the API and asks of etcd."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kelastic import contract
from kelastic_operator import crd
from kelastic_operator.handlers import JobReconciler, OperatorContext
from kelastic_operator.pods import PodSettings
from kelastic_operator.reconcile import RendezvousView
from kelastic_operator.rendezvous_store import StoreCache
from tests.k8s.harness import K8sApi

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


class FakeStore:
    """A RendezvousStore in memory: records removals, serves a fixed view."""

    def __init__(self, view: RendezvousView) -> None:
        self.view = view
        self.removed: list[tuple[str, list[str]]] = []
        self.deleted: list[str] = []
        self.departing: list[tuple[str, list[str], str]] = []

    def read(self, prefix: str, nproc_per_node: int) -> RendezvousView:
        return self.view

    def remove_nodes(self, prefix: str, nodes: Sequence[str]) -> None:
        self.removed.append((prefix, list(nodes)))

    def mark_departing(self, prefix: str, nodes: Sequence[str], reason: str) -> None:
        self.departing.append((prefix, list(nodes), reason))

    def delete_prefix(self, prefix: str) -> None:
        self.deleted.append(prefix)


@pytest.fixture
def setup(k8s_api: K8sApi) -> Iterator[tuple[OperatorContext, FakeStore]]:
    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    store = FakeStore(RendezvousView(round=2, world_size=4, restarts_spent=1))
    api = k8s_api.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(etcd_endpoints=("etcd:2379",)),
        stores=StoreCache(lambda eps: store),
    )
    yield ctx, store
    api.close()


def events(k8s_api: K8sApi) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in k8s_api.objects("Event", "default")]


def test_one_pass_creates_pods_writes_status_and_events(
    k8s_api: K8sApi, setup: tuple[OperatorContext, FakeStore]
) -> None:
    ctx, store = setup
    k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
    assert JobReconciler(ctx, "default", "digits").reconcile_once() is None
    assert sorted(k8s_api.names("Pod", "default")) == ["digits-0", "digits-1"]
    (job,) = k8s_api.objects("ElasticJob", "default")
    st = job["status"]
    assert (st["phase"], st["replicas"], st["round"], st["worldSize"], st["restartsSpent"]) == (
        "Pending", 2, 2, 4, 1)  # fmt: skip
    reasons = [r for _, r, _ in events(k8s_api)]
    assert "CreatingPods" in reasons and "WorkersRestarted" in reasons
    assert store.removed == []  # a new job has no stale nodes
    # a second pass changes nothing
    rv = job["metadata"]["resourceVersion"]
    JobReconciler(ctx, "default", "digits").reconcile_once()
    assert k8s_api.objects("ElasticJob", "default")[0]["metadata"]["resourceVersion"] == rv


def test_a_pod_of_an_earlier_job_holds_its_name(
    k8s_api: K8sApi, setup: tuple[OperatorContext, FakeStore]
) -> None:
    ctx, _ = setup
    k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
    stale = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "digits-1", "labels": {"kelastic.dev/job-name": "digits",
                                                         "kelastic.dev/job-uid": "old"}},
             "spec": {"containers": [{"name": "trainer", "image": "x"}]}}  # fmt: skip
    k8s_api.create(stale)
    JobReconciler(ctx, "default", "digits").reconcile_once()
    pods = {p["metadata"]["name"]: p for p in k8s_api.objects("Pod", "default")}
    assert sorted(pods) == ["digits-0", "digits-1"]
    assert pods["digits-1"]["metadata"]["labels"]["kelastic.dev/job-uid"] == "old"  # untouched
    (job,) = k8s_api.objects("ElasticJob", "default")
    assert job["status"]["replicas"] == 1  # the stale pod is not counted


def test_a_refused_pod_is_reported_as_failed_create(
    k8s_api: K8sApi, setup: tuple[OperatorContext, FakeStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, _ = setup
    k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
    reconciler = JobReconciler(ctx, "default", "digits")

    def refuse(namespace: str, body: Any, **_: Any) -> None:
        exc = ApiException(status=403, reason="Forbidden")
        exc.body = json.dumps({"kind": "Status", "message": 'pods "digits-0" is forbidden: '
                               "exceeded quota: compute"})  # fmt: skip
        raise exc

    monkeypatch.setattr(reconciler.core, "create_namespaced_pod", refuse)
    reconciler.reconcile_once()  # does not raise
    assert ("Warning", "FailedCreate",
            'creating pod digits-0: pods "digits-0" is forbidden: exceeded quota: compute'
            ) in events(k8s_api)  # fmt: skip
    assert k8s_api.objects("ElasticJob", "default")[0]["status"]["phase"] == "Pending"


def test_the_finalizer_work_deletes_the_jobs_prefix(
    k8s_api: K8sApi, setup: tuple[OperatorContext, FakeStore]
) -> None:
    ctx, store = setup
    k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
    (job,) = k8s_api.objects("ElasticJob", "default")
    JobReconciler(ctx, "default", "digits").delete_prefix(job)
    assert store.deleted == [contract.job_prefix("default", "digits", job["metadata"]["uid"])]
