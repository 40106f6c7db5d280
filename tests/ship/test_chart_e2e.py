"""The chart's operator, running in the cluster, runs the digits job on the real node.

``helm install`` of charts/kelastic into the test's namespace, with the image built here
(``Dockerfile``, imported into the node's containerd: no registry), etcd external (the
test session's etcd, offered inside the node's network: the bundled etcd's image cannot be
pulled here), the operator watching that namespace, and the test node's toleration and
node selector as the chart's ``operator.tolerations``/``operator.nodeSelector`` values.
The Deployment's two Pods run on the real node: in-cluster config (the ``kubernetes``
Service, 10.96.0.1), their ServiceAccount's projected token and exactly the chart's RBAC,
leader election on the chart's Lease (one Pod holds it), liveness and readiness probes
passing (no restart). That operator runs the digits job (real torch DDP in the trainer
image) to Succeeded with its accuracy, then ``kubectl delete ej`` removes its Pods and its
etcd keys.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import yaml

from kelastic import contract
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_sidecar.etcd_store import EtcdStore
from tests.k8s.cluster import Client, wait_until
from tests.k8s.images import KELASTIC
from tests.k8s.node import PLACEMENT, RealNode

from .tools import ROOT, Release, ToolMissing, helm_binary, release_name

DIGITS = ROOT / "examples/digits/elasticjob.yaml"
T = 180.0  # seconds a step may take on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job(k8s: Client) -> dict[str, Any]:
    out = k8s.kubectl("get", "ej", "digits", "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _status(k8s: Client) -> dict[str, Any]:
    return _job(k8s).get("status") or {}


def _operator_pods(k8s: Client, prefix: str) -> list[dict[str, Any]]:
    return [
        p for p in k8s.objects("pods") if p["metadata"]["name"].startswith(f"{prefix}-operator")
    ]


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_the_charts_operator_runs_in_the_cluster_and_runs_the_digits_job(
    k8s: Client, node: RealNode, etcd_server: EmbeddedEtcd
) -> None:
    try:
        helm_binary()
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    ns = k8s.namespace
    etcd = node.expose(etcd_server.endpoint)
    repository, tag = KELASTIC.rsplit(":", 1)
    release = Release(k8s, release_name(ns))
    with release:
        release.install(
            f"image.repository={repository}", f"image.tag={tag}", "image.pullPolicy=Never",
            "etcd.bundled=false", f"etcd.external.endpoints={{{etcd}}}",
            f"operator.namespaces={{{ns}}}", "operator.resyncSeconds=30",
            json_values={"operator.tolerations": PLACEMENT["tolerations"],
                         "operator.nodeSelector": PLACEMENT["nodeSelector"]},
        )  # fmt: skip

        def operators_ready() -> list[dict[str, Any]] | None:
            pods = _operator_pods(k8s, release.prefix)
            return pods if len(pods) == 2 and all(_ready(p) for p in pods) else None

        try:
            pods = wait_until(operators_ready, T, 0.5, what="the operator's 2 Pods Ready")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{node.explain(ns)}")
        names = {p["metadata"]["name"] for p in pods}
        lease_name = "kelastic-operator"  # operator.leaderElection.leaseName's default
        try:
            # the identity is "<pod name>_<random suffix>" (POD_ID, made unique per process)
            lease = wait_until(lambda: str((k8s.get("lease", lease_name) or {}).get("spec", {})
                               .get("holderIdentity")).split("_")[0] in names
                               and k8s.get("lease", lease_name),
                               T, 0.5, what="one operator Pod holding the Lease")  # fmt: skip
        except AssertionError as exc:
            leases = k8s.kubectl("get", "lease", "-o", "yaml").stdout[-2000:]
            pytest.fail(f"{exc}\n{leases}\n{node.explain(ns, 40)}")
        leader = lease["spec"]["holderIdentity"].split("_")[0]

        k8s.claim("digits-checkpoints")
        job = yaml.safe_load(DIGITS.read_text())
        job["spec"]["template"]["spec"].update(PLACEMENT)
        k8s.kubectl("apply", "-f", "-", input=json.dumps(job))
        try:
            wait_until(lambda: _status(k8s).get("worldSize") == 4, T, 0.5, what="world size 4")
            wait_until(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"),
                       3 * T, 0.5, what="the job to finish")  # fmt: skip
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{node.explain(ns)}")
        assert _status(k8s)["phase"] == "Succeeded", _status(k8s)
        workers = [p for p in k8s.objects("pods") if p["metadata"]["name"].startswith("digits-")]
        assert len(workers) == 2
        for pod in workers:
            assert pod["spec"]["initContainers"][-1]["image"] == KELASTIC
            assert pod["spec"]["nodeName"] == node.name
        logs = node.logs(ns, "trainer")
        found = re.findall(r"final test accuracy (\d\.\d+)", logs)
        assert found and float(found[-1]) >= 0.90, logs[-3000:]
        # the leader ran the job's handlers and the other Pod did not; the leader kept the Lease
        handled = "Handler 'register.<locals>.job_changed' succeeded"
        assert handled in node.log(ns, leader, "operator")
        (follower,) = names - {leader}
        assert handled not in node.log(ns, follower, "operator")
        assert (k8s.get("lease", lease_name) or {})["spec"]["holderIdentity"].startswith(leader)

        # kubectl delete ej: the operator's finalizer removes the Pods, then the etcd keys
        uid = _job(k8s)["metadata"]["uid"]
        k8s.kubectl("delete", "ej", "digits", "--wait=false")
        wait_until(lambda: not _job(k8s), T, 0.5, what="the job deleted")
        wait_until(lambda: not [p for p in k8s.objects("pods")
                                if p["metadata"]["name"].startswith("digits-")],
                   T, 0.5, what="the job's Pods gone")  # fmt: skip
        with EtcdStore([etcd_server.endpoint]) as store:
            prefix = contract.job_prefix(ns, "digits", uid)
            wait_until(lambda: not store.get_prefix(prefix), T, 0.5, what="the etcd keys gone")
        # neither operator Pod was restarted: the liveness probe passed throughout
        for pod in _operator_pods(k8s, release.prefix):
            restarts = [c["restartCount"] for c in pod["status"]["containerStatuses"]]
            assert restarts == [0], (pod["metadata"]["name"], restarts)
