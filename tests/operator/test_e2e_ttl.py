"""spec.ttlSecondsAfterFinished on the real control plane: kopf handlers as the operator's
ServiceAccount (exactly deploy/rbac.yaml's rights: the delete verb it needs), a real etcd,
Pods on a Node no kubelet runs (:class:`~tests.k8s.nodes.ManualNode`, the test writes their
status). A finished job is deleted once its TTL passed, its Pods and etcd keys first (the
finalizer's work); a job without the field stays."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.ttl import TTL_EXPIRED_REASON
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest

pytestmark = pytest.mark.timeout(180)
T = 30.0  # seconds any single expectation may take


def status_of(k8s: Client, name: str) -> dict[str, Any]:
    found = k8s.get("elasticjob", name)
    return (found or {}).get("status") or {}


def keys_under(endpoint: str, prefix: str) -> list[str]:
    with EtcdClient([endpoint]) as store:
        return sorted(store.get_prefix(prefix))


def test_a_finished_job_is_deleted_after_its_ttl_pods_and_etcd_keys_first(
    k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd, manual_node: ManualNode
) -> None:
    k8s.claim("digits-checkpoints")
    ttl = 3
    for name, spec in (("brief", {"ttlSecondsAfterFinished": ttl}), ("kept", {})):
        manifest = job_manifest(name, manual_node, replicas=1, minReplicas=1,
                                cleanupPolicy="None", **spec)  # fmt: skip
        k8s.kubectl("apply", "-f", "-", input=manifest)
    assert json.loads(k8s.kubectl("get", "ej", "brief", "-o", "json").stdout)["spec"][
        "ttlSecondsAfterFinished"] == ttl  # fmt: skip
    for name in ("brief", "kept"):
        wait_until(lambda n=name: f"{n}-0" in pods_by_name(k8s), T, what=f"{name}-0")  # type: ignore[misc]
        manual_node.set_status(k8s.namespace, f"{name}-0", "Running", ready=True)
    uid = str(k8s.get("elasticjob", "brief")["metadata"]["uid"])  # type: ignore[index]
    prefix = contract.job_prefix(k8s.namespace, "brief", uid)
    with EtcdClient([etcd_server.endpoint]) as store:  # what its sidecar would have written
        store.put(contract.Keys(prefix).restarts, json.dumps(
            {"version": 1, "count": 0, "last_round": -1, "history": []}).encode())  # fmt: skip
    for name in ("brief", "kept"):
        manual_node.set_status(k8s.namespace, f"{name}-0", "Succeeded", exit_code=0,
                               message="succeeded")  # fmt: skip
    st = wait_until(lambda: (s := status_of(k8s, "brief")).get("phase") == "Succeeded" and s,
                    T, what="brief Succeeded")  # fmt: skip
    assert st["completionTime"]
    # cleanupPolicy None keeps the Pod until the TTL passes; then Pod, keys and job go
    wait_until(lambda: k8s.get("elasticjob", "brief") is None, T, what="brief deleted")
    assert "brief-0" not in pods_by_name(k8s)  # the finalizer let the job go after its Pods
    assert keys_under(etcd_server.endpoint, prefix) == []
    reasons = [e["reason"] for e in k8s.objects("events")
               if e["involvedObject"]["name"] == "brief"]  # fmt: skip
    assert TTL_EXPIRED_REASON in reasons
    # the job without a TTL finished too and stays, with its Pod (cleanupPolicy None)
    wait_until(lambda: status_of(k8s, "kept").get("phase") == "Succeeded", T, what="kept done")
    assert k8s.get("elasticjob", "kept") is not None and "kept-0" in pods_by_name(k8s)


@pytest.mark.parametrize("bad", [-1, 2**31, "60"])
def test_the_api_server_refuses_a_bad_ttl(k8s: Client, bad: object) -> None:
    result = k8s.kubectl("apply", "-f", "-", check=False,
                         input=job_manifest("bad", ttlSecondsAfterFinished=bad))  # fmt: skip
    assert result.returncode != 0 and "spec.ttlSecondsAfterFinished" in result.stderr
