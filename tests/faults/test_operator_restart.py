"""Fault matrix row: the operator SIGKILLed mid-reconcile, on the real test cluster.

A 150-replica job is being created when ``python -m kelastic_operator`` (the shipped
command, as its ServiceAccount) is killed; a new operator process picks up where it was:
the Pods made before the kill are kept (none deleted or made twice), the rest are created,
the status counts them, and no replacement is charged. Time lost is the restart itself.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.nodes import ManualNode
from tests.operator.conftest import job_manifest, operator_client
from tests.operator.test_leader_election import Replica, sample

pytestmark = pytest.mark.timeout(240)
REPLICAS = 150  # slow-start batches of up to 16: creating them takes seconds


def test_an_operator_killed_mid_reconcile_is_resumed_by_the_next_one(
    k8s_cluster: ControlPlane,
    k8s: Client,
    etcd_server: EmbeddedEtcd,
    manual_node: ManualNode,
    tmp_path: Path,
) -> None:
    client = operator_client(k8s_cluster, k8s.namespace)
    lease = f"restart-{k8s.namespace}"[:63]
    first = Replica("operator-1", client, etcd_server.endpoint, lease, tmp_path)
    second = None
    try:
        k8s.claim("digits-checkpoints")
        manifest = job_manifest("big", manual_node, replicas=REPLICAS, minReplicas=1,
                                maxReplicas=REPLICAS)  # fmt: skip
        k8s.kubectl("apply", "-f", "-", input=manifest)
        path = f"/api/v1/namespaces/{k8s.namespace}/pods?limit=1"

        def made() -> int:  # one item read: remainingItemCount says the rest
            _, body = k8s_cluster.request("GET", path)
            return len(body["items"]) + int(body["metadata"].get("remainingItemCount") or 0)

        wait_until(lambda: made() >= 3, 60, 0.01, what="the first Pods")
        first.stop(signal.SIGKILL)
        killed = time.monotonic()
        before = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
        assert 3 <= len(before) < REPLICAS, f"killed too late to be mid-reconcile: {len(before)}"

        second = Replica("operator-2", client, etcd_server.endpoint, lease, tmp_path)
        wait_until(lambda: made() == REPLICAS, 90, what="every Pod")
        resumed = time.monotonic() - killed
        now = pods_by_name(k8s)
        assert {n: now[n]["metadata"]["uid"] for n in before} == before  # kept, not remade
        status = wait_until(
            lambda: (s := ((k8s.get("elasticjob", "big") or {}).get("status") or {}))
            .get("replicas") == REPLICAS and s, 30, what="the status counting every Pod",
        )  # fmt: skip
        assert status.get("replacements", 0) == 0
        assert sample(second.port, "kelastic_operator_pods_created_total") == REPLICAS - len(before)
        assert sample(second.port, "kelastic_operator_pods_deleted_total") == 0
        # the time lost is the new leader's wait: the killed one's Lease had to expire
        assert resumed < 45, f"{resumed:.1f} s"
        print(f"operator killed with {len(before)}/{REPLICAS} Pods made; "
              f"all made {resumed:.1f} s later")  # fmt: skip
    finally:
        first.stop(signal.SIGKILL)
        if second is not None:
            k8s.kubectl("delete", "ej", "big", "--wait=false", check=False)
            wait_until(lambda: not pods_by_name(k8s), 60, what="the job's Pods gone")
            assert second.stop(signal.SIGTERM) == 0, second.tail()
