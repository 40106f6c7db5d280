"""The operator running the real digits job: kubectl, kopf, real etcd, and the local
kubelet running each Pod's sidecar and trainer as processes (real torch DDP training).

One job goes through the issue's scenarios in order: Running with its world size ->
``kubectl scale`` mid-training (a third node joins at the next round) -> ``kubectl delete
pod`` mid-training (replaced; training resumes from its checkpoint; the restart shows in
the status) -> Succeeded -> ``kubectl delete ej`` (Pods and etcd keys gone).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest

from kelastic import contract
from kelastic_operator import crd
from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from kelastic_sidecar.etcd_store import EtcdStore
from tests.k8s.harness import K8sApi, KopfThread, wait_until
from tests.k8s.kubelet import LocalKubelet

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples/digits/elasticjob.yaml"
IMAGE = "ghcr.io/kelastic/digits-example:0.1.0"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
T = 120.0  # seconds a step of the scenario may take on a loaded 2-core machine


@pytest.fixture
def cluster(
    k8s_api: K8sApi, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> Iterator[tuple[K8sApi, LocalKubelet]]:
    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    registry = kopf.OperatorRegistry()
    api = k8s_api.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(
            sidecar_image="kelastic:test", etcd_endpoints=(etcd_server.endpoint,), stop_grace=3
        ),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=3, time_retry=0.5)),
        resync_seconds=0.5,
    )
    register(registry, ctx)
    kubelet = LocalKubelet(k8s_api, tmp_path / "kubelet", {IMAGE: DIGITS.parent}, stop_grace=5)
    with KopfThread(k8s_api, registry), kubelet:
        yield k8s_api, kubelet
    ctx.stores.close()
    api.close()


def _status(api: K8sApi) -> dict[str, Any]:
    out = api.kubectl("get", "ej", "digits", "-o", "json", check=False)
    return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}


def _trainer_logs(kubelet: LocalKubelet) -> str:
    return "\n".join(
        kubelet.log(ns, name, "trainer") for (ns, name) in list(kubelet.pods) if ns == "default"
    )


def test_digits_runs_scales_survives_a_pod_deletion_and_succeeds(
    cluster: tuple[K8sApi, LocalKubelet], etcd_server: EmbeddedEtcd
) -> None:
    api, kubelet = cluster
    api.kubectl("apply", "-f", str(DIGITS))

    # Running, world size 4, as kubectl shows it.
    wait_until(lambda: _status(api).get("worldSize") == 4, T, what="world size 4")
    table = api.kubectl("get", "ej", "digits").stdout
    assert re.search(r"digits\s+Running\s+2\s+\d\s+4\s+0", table), table
    wait_until(lambda: "epoch 2/" in _trainer_logs(kubelet), T, what="training")

    # Scale up mid-training: a third node joins at the next round; no restart is spent.
    api.kubectl("scale", "ej/digits", "--replicas=3")
    wait_until(lambda: _status(api).get("worldSize") == 6, T, what="world size 6")
    wait_until(lambda: re.search(r"world 6", _trainer_logs(kubelet)), T, what="a step at 6")
    assert (_status(api).get("restartsSpent") or 0) == 0

    # Delete a Pod mid-training: replaced, the group restarts and resumes from checkpoint.
    old_uid = next(p["metadata"]["uid"] for p in api.objects("Pod", "default")
                   if p["metadata"]["name"] == "digits-1")  # fmt: skip
    resumed_before = _trainer_logs(kubelet).count("resumed from checkpoint")
    api.kubectl("delete", "pod", "digits-1", "--wait=false")
    wait_until(
        lambda: any(p["metadata"]["name"] == "digits-1" and p["metadata"]["uid"] != old_uid
                    for p in api.objects("Pod", "default")),
        T, what="a replacement digits-1",
    )  # fmt: skip
    wait_until(lambda: (_status(api).get("restartsSpent") or 0) >= 1, T, what="restart shown")
    wait_until(
        lambda: _trainer_logs(kubelet).count("resumed from checkpoint") > resumed_before,
        T, what="training resumed from the checkpoint",
    )  # fmt: skip

    # The job finishes.
    wait_until(lambda: _status(api).get("phase") == "Succeeded", 3 * T, what="Succeeded")
    accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)",
                                               _trainer_logs(kubelet))]  # fmt: skip
    assert accuracies and accuracies[-1] >= 0.90
    # The deleted Pod cost exactly one restart; the scale-up none.
    assert _status(api)["restartsSpent"] == 1
    uid = json.loads(api.kubectl("get", "ej", "digits", "-o", "json").stdout)["metadata"]["uid"]

    # Deleting the job removes its Pods and its etcd keys.
    api.kubectl("delete", "ej", "digits")
    wait_until(lambda: not api.objects("Pod", "default"), T, what="pods gone")
    prefix = contract.job_prefix("default", "digits", uid)
    with EtcdStore([etcd_server.endpoint]) as store:
        wait_until(lambda: not store.get_prefix(prefix), T, what="etcd keys gone")
    assert kubelet.warnings == []
