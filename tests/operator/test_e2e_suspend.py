"""spec.suspend on the real control plane: kopf handlers as the operator's ServiceAccount
(deploy/rbac.yaml's rights), a real etcd, Pods on a Node no kubelet runs
(:class:`~tests.k8s.nodes.ManualNode`: the test writes their status, the node completes
their graceful deletions). A job created suspended has no Pods; resumed, its Pods are
created and it runs; suspended again, its Pods go with departure notices, nothing charged.
The pure decisions are tests/operator/test_suspend.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kelastic import contract, etcd_values
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.suspend import RESUMED_REASON, SUSPENDED_REASON
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest

pytestmark = pytest.mark.timeout(180)
T = 30.0  # seconds any single expectation may take
PODS = ["paused-0", "paused-1"]


def status_of(k8s: Client) -> dict[str, Any]:
    found = k8s.get("elasticjob", "paused")
    return (found or {}).get("status") or {}


def suspended_condition(k8s: Client) -> tuple[str, str] | None:
    for c in status_of(k8s).get("conditions") or []:
        if c["type"] == "Suspended":
            return c["status"], c["reason"]
    return None


def patch_suspend(k8s: Client, value: bool) -> None:
    body = json.dumps({"spec": {"suspend": value}})
    k8s.kubectl("patch", "ej", "paused", "--type=merge", "-p", body)


def job_pods(k8s: Client) -> list[str]:
    return sorted(n for n in pods_by_name(k8s) if n.startswith("paused-"))


def test_a_job_created_suspended_resumed_and_suspended_again(
    k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd, manual_node: ManualNode
) -> None:
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(
        "paused", manual_node, replicas=2, minReplicas=1, suspend=True))  # fmt: skip
    # created suspended: the pass that says so creates nothing
    wait_until(lambda: status_of(k8s).get("phase") == "Suspended", T, what="Suspended")
    assert suspended_condition(k8s) == ("True", SUSPENDED_REASON)
    assert job_pods(k8s) == [] and status_of(k8s).get("replicas") == 0
    uid = str(k8s.get("elasticjob", "paused")["metadata"]["uid"])  # type: ignore[index]
    keys = contract.Keys(contract.job_prefix(k8s.namespace, "paused", uid))
    with EtcdClient([etcd_server.endpoint]) as store:  # one restart, as a sidecar records it
        store.put(keys.restarts, etcd_values.encode_restarts(
            {"count": 1, "last_round": 0, "history": []}))  # fmt: skip

    patch_suspend(k8s, False)  # resumed: the Pods are created and the job runs
    wait_until(lambda: job_pods(k8s) == PODS, T, what="pods created on resume")
    for name in PODS:
        manual_node.set_status(k8s.namespace, name, "Running", ready=True)
    st = wait_until(lambda: (s := status_of(k8s)).get("phase") == "Running" and s, T,
                    what="Running")  # fmt: skip
    assert st["startTime"] and suspended_condition(k8s) == ("False", RESUMED_REASON)
    wait_until(lambda: status_of(k8s).get("restartsSpent") == 1, T, what="restartsSpent 1")

    patch_suspend(k8s, True)  # suspended again: its Pods go (the node ends their grace)
    wait_until(lambda: job_pods(k8s) == [], T, what="pods deleted on suspend")
    st = wait_until(lambda: (s := status_of(k8s)).get("phase") == "Suspended" and s, T,
                    what="Suspended again")  # fmt: skip
    assert suspended_condition(k8s) == ("True", SUSPENDED_REASON)
    assert st["restartsSpent"] == 1 and not st.get("startTime")
    with EtcdClient([etcd_server.endpoint]) as store:  # posted before the Pods went
        notices = {k.rsplit("/", 1)[1]: etcd_values.decode_departure(v)
                   for k, (v, _) in store.get_prefix(keys.departing_prefix).items()}  # fmt: skip
    assert notices == {name: contract.DEPARTURE_SCALE_DOWN for name in PODS}
    # resumed again: the Pods come back without those notices (a later loss is charged)
    patch_suspend(k8s, False)
    wait_until(lambda: job_pods(k8s) == PODS, T, what="pods created on the second resume")
    with EtcdClient([etcd_server.endpoint]) as store:
        assert store.get_prefix(keys.departing_prefix) == {}
    reasons = [e["reason"] for e in k8s.objects("events")
               if e["involvedObject"]["name"] == "paused"]  # fmt: skip
    assert "Suspending" in reasons and "Suspended" in reasons


@pytest.mark.parametrize("bad", ["yes", 1])
def test_the_api_server_refuses_a_suspend_that_is_not_a_boolean(k8s: Client, bad: object) -> None:
    result = k8s.kubectl("apply", "-f", "-", check=False,
                         input=job_manifest("bad", suspend=bad))  # fmt: skip
    assert result.returncode != 0 and "spec.suspend" in result.stderr
