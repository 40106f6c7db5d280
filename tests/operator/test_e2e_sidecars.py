"""The operator with real sidecars and launchers in containers on the real node (no torch:
the workers sleep, in the kelastic image). Deleting a running job stops its Pods first and
only then deletes its etcd keys: a sidecar still running would write ``rdzv/state``,
``restarts``, ``reports/...`` and ``rounds/<n>/master`` again after the prefix went."""

from __future__ import annotations

import psutil
import pytest
import yaml

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.labels import SIDECAR_CONTAINER
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.images import KELASTIC
from tests.k8s.node import PLACEMENT, RealNode

from .conftest import job_manifest

pytestmark = pytest.mark.timeout(240)
T = 60.0
SLEEPER = "import time\nwhile True: time.sleep(0.2)"


def sleeper_job(name: str) -> str:
    """A 2-node job whose workers sleep (the kelastic image has python and the worker
    library), placed on the test's node."""
    doc = yaml.safe_load(job_manifest(name, replicas=2, minReplicas=2, maxReplicas=2,
                                      nprocPerNode=1))  # fmt: skip
    pod = doc["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    trainer.update(image=KELASTIC, command=["python", "-c", SLEEPER], args=[])
    trainer.pop("workingDir", None)
    pod.update(PLACEMENT)
    pod["terminationGracePeriodSeconds"] = 5
    return yaml.safe_dump(doc)


def test_deleting_a_running_job_stops_its_pods_before_its_etcd_keys_go(
    k8s: Client, node_operator: OperatorContext, node: RealNode, etcd_server: EmbeddedEtcd
) -> None:
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=sleeper_job("sleepy"))
    uid = k8s.get("elasticjob", "sleepy")["metadata"]["uid"]  # type: ignore[index]
    prefix = contract.job_prefix(k8s.namespace, "sleepy", uid)
    keys = contract.Keys(prefix)

    def status() -> dict[str, object]:
        return ((k8s.get("elasticjob", "sleepy") or {}).get("status")) or {}

    with EtcdClient([etcd_server.endpoint]) as store:
        # the sidecars form a round: the job runs with world size 2
        try:
            wait_until(lambda: status().get("worldSize") == 2, T, what="world size 2")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{node.explain(k8s.namespace)}")
        written = set(store.get_prefix(prefix))
        assert {keys.alive("sleepy-0"), keys.alive("sleepy-1")} <= written, written
        sidecars = [pid for pod in pods_by_name(k8s).values()
                    for pid in node.container_pids(pod, SIDECAR_CONTAINER)]  # fmt: skip
        assert len(sidecars) >= 2 and all(psutil.pid_exists(p) for p in sidecars)

        k8s.kubectl("delete", "ej", "sleepy", "--wait=false")
        wait_until(lambda: k8s.get("elasticjob", "sleepy") is None, T, what="the job gone")
        assert not pods_by_name(k8s), "the finalizer let the job go before its Pods"
        # every sidecar had exited before the keys went, so none can write them again
        assert not [p for p in sidecars
                    if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]  # fmt: skip
        assert not store.get_prefix(prefix), sorted(store.get_prefix(prefix))
