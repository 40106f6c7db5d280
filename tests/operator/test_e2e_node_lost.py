"""A Node that stops heart-beating, on the real control plane with its real node-lifecycle
controller (issue: dead nodes). Two Nodes of one pool whose kubelets the test plays
(:class:`~tests.k8s.nodes.ManualNode`); one of them dies (no more Lease renewals, no
deletion ever completed, as a dead kubelet). The controller marks it not Ready after its
grace period (about 50 s); ``nodeLostSeconds`` later the operator force-deletes the job's
Pod there and creates it again on the other Node, spending no replacement. Without the
operator's Node watch the Pod would stay Terminating for good once evicted, and the job's
deletion would wait on it for good: the job is deleted at the end with its replacement's
Node dead too, and goes.

The reconcile rule itself (which Pods, when, what is recorded) is tabled in
``tests/operator/test_node_lost.py``."""

from __future__ import annotations

import pytest
import yaml

from kelastic_operator.job_reconciler import OperatorContext
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.nodes import node_pair, scheduled

from .conftest import job_manifest
from .test_e2e import events, status_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
T = 30.0  # seconds an expectation the operator meets may take
#: the node-lifecycle controller's node-monitor grace period (50 s) and its 5 s monitor
#: period, with room for a loaded machine
NOT_READY_WITHIN = 120.0
POOL = {"kelastic.dev/test-pool": "node-lost"}
LOST_AFTER = 15  # the job's nodeLostSeconds


def test_a_pod_on_a_node_that_stops_heart_beating_is_replaced_elsewhere(
    k8s_cluster: ControlPlane, k8s: Client, operator: OperatorContext
) -> None:
    k8s.claim("digits-checkpoints")
    doc = yaml.safe_load(job_manifest("lost", replicas=1, minReplicas=1,
                                      nodeLostSeconds=LOST_AFTER))  # fmt: skip
    doc["spec"]["template"]["spec"]["nodeSelector"] = POOL
    with node_pair(k8s_cluster, "lost", POOL) as nodes:
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        first = scheduled(k8s, "lost-0", T)
        dying = nodes.pop(first["spec"]["nodeName"])
        (other,) = nodes.values()
        dying.set_status(k8s.namespace, "lost-0", "Running", ready=True)
        wait_until(lambda: status_of(k8s, "lost").get("phase") == "Running", T, what="Running")

        dying.die()
        wait_until(lambda: dying.ready() not in ("True", None), NOT_READY_WITHIN,
                   what=f"{dying.name} not Ready (the node-lifecycle controller)")  # fmt: skip
        # the control plane cannot hear it, but it may still train: not touched yet
        now = pods_by_name(k8s)["lost-0"]
        assert now["metadata"]["uid"] == first["metadata"]["uid"]
        assert not now["metadata"].get("deletionTimestamp")

        def replaced() -> dict | None:
            pod = pods_by_name(k8s).get("lost-0")
            if pod is None or pod["metadata"]["uid"] == first["metadata"]["uid"]:
                return None
            return pod if pod.get("spec", {}).get("nodeName") else None

        second = wait_until(replaced, LOST_AFTER + T, what="lost-0 force-deleted and replaced")
        assert second["spec"]["nodeName"] == other.name  # the dead Node is tainted
        st = status_of(k8s, "lost")
        assert st.get("replacements", 0) == 0  # a lost node spends no replacement
        message = st["lastFailure"]["message"]
        assert message.startswith(f"node_lost: node {dying.name} not Ready since "), st
        assert "pod lost-0 force-deleted and replaced" in message
        assert any(r == "PodLost" and dying.name in m for r, m in events(k8s, "lost"))
        sample = operator.metrics.registry.get_sample_value
        assert sample("kelastic_operator_pods_lost_total") == 1

        # the replacement's Node dies too, and the job is deleted: its finalizer waits for
        # the Pod, which only a forced deletion can end
        other.set_status(k8s.namespace, "lost-0", "Running", ready=True)
        other.die()
        wait_until(lambda: other.ready() not in ("True", None), NOT_READY_WITHIN,
                   what=f"{other.name} not Ready")  # fmt: skip
        k8s.kubectl("delete", "ej", "lost", "--wait=false")
        wait_until(lambda: not k8s.objects("elasticjobs"), LOST_AFTER + T,
                   what="the job gone though its Pod's Node is dead")  # fmt: skip
        assert "lost-0" not in pods_by_name(k8s)
