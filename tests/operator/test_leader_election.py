"""Two operators with kopf peering: only the higher priority one acts; when it stops, the
other takes over."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest

from kelastic_operator import crd
from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from tests.k8s.harness import KOPF_PEERING_CRDS, K8sApi, KopfThread, fast_kopf_settings, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def operator(
    k8s_api: K8sApi, etcd: EmbeddedEtcd, priority: int
) -> tuple[KopfThread, OperatorContext]:
    ctx = OperatorContext(
        api=k8s_api.api_client(),
        pod_settings=PodSettings(etcd_endpoints=(etcd.endpoint,)),
        resync_seconds=0.5,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    settings = fast_kopf_settings()
    settings.peering.priority = priority
    thread = KopfThread(k8s_api, registry, settings=settings, standalone=False,
                        peering_name="kelastic")  # fmt: skip
    return thread, ctx


def reconciles(ctx: OperatorContext) -> float:
    value = ctx.metrics.registry.get_sample_value(
        "kelastic_operator_reconciles_total", {"outcome": "ok"}
    )
    return value or 0.0


def test_only_the_leader_acts_and_the_other_takes_over(
    k8s_api: K8sApi, etcd_server: EmbeddedEtcd
) -> None:
    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE), "-f", str(KOPF_PEERING_CRDS))
    wait_until(lambda: k8s_api.kubectl("get", "clusterkopfpeerings", check=False).returncode == 0,
               what="peering CRD")  # fmt: skip
    k8s_api.kubectl("apply", "-f", str(ROOT / "deploy/peering.yaml"))
    leader, leader_ctx = operator(k8s_api, etcd_server, priority=10)
    follower, follower_ctx = operator(k8s_api, etcd_server, priority=1)
    with follower:
        with leader:
            wait_until(lambda: len(k8s_api.objects("ClusterKopfPeering")[0].get("status") or {})
                       == 2, what="both peers announced")  # fmt: skip
            k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
            wait_until(lambda: len(k8s_api.names("Pod", "default")) == 2, what="the pods")
            wait_until(lambda: reconciles(leader_ctx) >= 2, what="the leader reconciling")
            assert reconciles(follower_ctx) == 0
        # the leader is gone: the follower resumes and replaces a deleted pod
        k8s_api.kubectl("delete", "pod", "digits-1")
        wait_until(lambda: "digits-1" in k8s_api.names("Pod", "default"), timeout=30,
                   what="the follower to replace the pod")  # fmt: skip
        assert reconciles(follower_ctx) >= 1
    leader_ctx.api.close()
    follower_ctx.api.close()
