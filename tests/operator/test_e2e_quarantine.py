"""Pods moved off a Node on the real control plane, the Node quarantined (the real
scheduler then places the replacement on the other Node): ``spec.stragglers.action:
Replace``, and two hardware-looking failures charged on one Node.

Replace: a straggler's verdict in
etcd (what its node's sidecar writes: ``stragglers/<node>``, by the value's codec) names a
running Pod; the operator lists it in ``status.stragglers``, replaces the Pod (a
departure notice first: nothing charged) and quarantines its Node, so the real scheduler
places the replacement on the other Node; the verdict, older than the new Pod, is not
taken for it. The Pods' kubelet is played by the test (:class:`~tests.k8s.nodes.ManualNode`).
The rule's cases: ``tests/operator/test_stragglers.py``; the sidecar writing the verdict:
``tests/faults/test_stragglers_run.py``."""

from __future__ import annotations

import time

import pytest
import yaml

from kelastic import contract
from kelastic.etcd_values import encode_stragglers
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE
from tests.k8s.nodes import node_pair, scheduled

from .conftest import job_manifest
from .test_e2e import Etcd, events, job, status_of

pytestmark = pytest.mark.timeout(300)
T = 30.0
POOL = {"kelastic.dev/test-pool": "stragglers"}
SLOW = {"local_rank": 1, "scope": "train_step", "median_s": 0.31, "others_median_s": 0.1,
        "ratio": 3.1}  # fmt: skip


def test_replace_moves_the_stragglers_pod_off_its_node(
    k8s_cluster: ControlPlane, k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd
) -> None:
    operator.taint_nodes = True  # with deploy/'s RBAC: no right to patch Nodes
    k8s.claim("digits-checkpoints")
    doc = yaml.safe_load(job_manifest("slow", replicas=2, minReplicas=1,
                                      stragglers={"action": "Replace"}))  # fmt: skip
    doc["spec"]["template"]["spec"]["nodeSelector"] = POOL
    with node_pair(k8s_cluster, "slow", POOL) as nodes:
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

        def placed() -> dict[str, dict] | None:
            pods = pods_by_name(k8s)
            ok = len(pods) == 2 and all(p.get("spec", {}).get("nodeName") for p in pods.values())
            return pods if ok else None

        pods = wait_until(placed, T, what="both Pods scheduled")
        for name, pod in pods.items():
            nodes[pod["spec"]["nodeName"]].set_status(k8s.namespace, name, "Running", ready=True)
        wait_until(lambda: status_of(k8s, "slow").get("readyReplicas") == 2, T, what="2 ready")
        first = pods["slow-0"]
        slow_node = first["spec"]["nodeName"]

        # slow-0's sidecar found its local rank 1 slow
        keys = contract.Keys(
            contract.job_prefix(k8s.namespace, "slow", job(k8s, "slow")["metadata"]["uid"])
        )
        Etcd(etcd_server.endpoint).client.put(
            keys.straggler("slow-0"),
            encode_stragglers("slow-0", first["metadata"]["uid"], time.time(), [SLOW]),
        )

        def replaced() -> dict | None:
            pod = pods_by_name(k8s).get("slow-0")
            new = pod is not None and pod["metadata"]["uid"] != first["metadata"]["uid"]
            return pod if new and pod.get("spec", {}).get("nodeName") else None

        second = wait_until(replaced, T, what="slow-0 replaced")
        assert second["spec"]["nodeName"] != slow_node  # its Node is quarantined
        st = status_of(k8s, "slow")
        assert st["quarantinedNodes"] == [slow_node], st
        assert st.get("replacements", 0) == 0 and st.get("restartsSpent", 0) == 0, st
        said = events(k8s, "slow")
        assert any(r == "StragglerDetected" and "local rank 1 on slow-0" in m for r, m in said)
        assert any(r == "ReplacingStraggler" and slow_node in m for r, m in said), said

        # the verdict, older than the new Pod, is not its: it runs on, listed nowhere
        nodes[second["spec"]["nodeName"]].set_status(k8s.namespace, "slow-0", "Running",
                                                     ready=True)  # fmt: skip
        wait_until(lambda: status_of(k8s, "slow").get("readyReplicas") == 2, T, what="2 ready")
        st = wait_until(lambda: (s := status_of(k8s, "slow")).get("stragglers") == [] and s, T,
                        what="no straggler listed")  # fmt: skip
        assert pods_by_name(k8s)["slow-0"]["metadata"]["uid"] == second["metadata"]["uid"]
        condition = next(c for c in st["conditions"] if c["type"] == "Stragglers")
        assert (condition["status"], condition["reason"]) == ("False", "NoStragglers")
        # told to taint, without the chart's RBAC for it (deploy/'s rights): it says so
        assert _taints(k8s, slow_node) == []
        assert any(r == "NodeTaintFailed" and "403" in m for r, m in events(k8s, "slow"))


def _taints(k8s: Client, node: str) -> list[dict[str, str]]:
    return list(((k8s.get("node", node) or {}).get("spec") or {}).get("taints") or [])


#: What the chart grants with ``operator.taintQuarantinedNodes`` (``tests/ship`` checks
#: the chart renders it), bound to the operator's ServiceAccount for one test.
TAINT_RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {name}}}
rules: [{{apiGroups: [""], resources: [nodes], verbs: [get, patch]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {name}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {name}}}
subjects: [{{kind: ServiceAccount, name: {account}, namespace: {namespace}}}]
"""


def test_a_node_charged_with_two_hardware_failures_is_left_for_another(
    k8s_cluster: ControlPlane, k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd
) -> None:
    """The restart record (what the sidecars write) has two charges on one Node whose
    text looks like a bad GPU: the Node is quarantined and the job's Pod there replaced on
    the other Node, nothing charged by the operator. With ``--taint-quarantined-nodes``
    (and the chart's RBAC for it) the Node is tainted for every workload."""
    operator.taint_nodes = True
    rbac = TAINT_RBAC.format(name=f"taint-{k8s.namespace}", account=OPERATOR_ACCOUNT,
                             namespace=OPERATOR_NAMESPACE)  # fmt: skip
    k8s_cluster.admin.kubectl("apply", "-f", "-", input=rbac)
    try:
        _hardware_failures(k8s_cluster, k8s, etcd_server)
    finally:
        k8s_cluster.admin.kubectl("delete", "-f", "-", input=rbac, check=False)


def _hardware_failures(k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd) -> None:
    k8s.claim("digits-checkpoints")
    doc = yaml.safe_load(job_manifest("xid", replicas=1, minReplicas=1))
    doc["spec"]["template"]["spec"]["nodeSelector"] = POOL
    with node_pair(k8s_cluster, "xid", POOL) as nodes:
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        first = scheduled(k8s, "xid-0", T)
        bad = first["spec"]["nodeName"]
        nodes[bad].set_status(k8s.namespace, "xid-0", "Running", ready=True)
        wait_until(lambda: status_of(k8s, "xid").get("phase") == "Running", T, what="Running")
        keys = contract.Keys(
            contract.job_prefix(k8s.namespace, "xid", job(k8s, "xid")["metadata"]["uid"])
        )
        xid = "NCCL error: unhandled system error; NVRM: Xid 79, GPU has fallen off the bus"
        history = [{"round": r, "cause": "worker_failure", "node": "xid-0", "time": 1.0 + r,
                    "detail": {"summary": f"worker_failure: rank 0 (round {r}): {xid}",
                               "host": bad}} for r in (1, 2)]  # fmt: skip
        Etcd(etcd_server.endpoint).put(
            keys.restarts, {"version": 1, "count": 2, "last_round": 2, "history": history}
        )

        def moved() -> dict | None:
            pod = pods_by_name(k8s).get("xid-0")
            new = pod is not None and pod["metadata"]["uid"] != first["metadata"]["uid"]
            return pod if new and pod.get("spec", {}).get("nodeName") else None

        second = wait_until(moved, T, what="xid-0 moved")
        assert second["spec"]["nodeName"] != bad
        st = status_of(k8s, "xid")
        assert st["quarantinedNodes"] == [bad] and st.get("replacements", 0) == 0, st
        said = events(k8s, "xid")
        assert any(r == "NodeQuarantined" and "2 hardware-looking failures" in m
                   for r, m in said), said  # fmt: skip
        taint = {"key": "kelastic.dev/quarantined", "value": f"{k8s.namespace}.xid",
                 "effect": "NoSchedule"}  # fmt: skip
        (found,) = _taints(k8s, bad)
        assert {k: found[k] for k in taint} == taint and found.get("timeAdded"), found
        assert any(r == "NodeTainted" and bad in m for r, m in said), said
        assert _taints(k8s, second["spec"]["nodeName"]) == []
