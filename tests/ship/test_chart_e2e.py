"""The operator, running in the cluster, runs the digits job on the real node: installed by
the chart (``helm install``) and by the plain manifests (``kubectl apply -k deploy/``).

Both installs use the image built here (``Dockerfile``, imported into the node's
containerd: no registry), etcd external (the test session's etcd, offered inside the node's
network: the bundled etcd's image cannot be pulled here), the operator watching the test's
namespace, and the test node's toleration and node selector. The chart takes these as its
values (``operator.tolerations``/``operator.nodeSelector``, ``etcd.bundled=false``); the
manifests take them as a kustomize overlay of ``deploy/`` (what ``deploy/README.md`` shows
for an etcd of one's own). The Deployment's two Pods run on the real node: in-cluster
config (the ``kubernetes`` Service, 10.96.0.1), their ServiceAccount's projected token and
exactly the shipped RBAC, leader election on the shipped Lease (one Pod holds it), liveness
and readiness probes passing (no restart). That operator runs the digits job (real torch DDP
in the trainer image) to Succeeded with its accuracy, then ``kubectl delete ej`` removes its
Pods and its etcd keys.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.k8s.cluster import Client, ControlPlane, wait_until
from tests.k8s.images import KELASTIC
from tests.k8s.node import PLACEMENT, RealNode

from .tools import DEPLOY, ROOT, Release, ToolMissing, helm_binary, release_name

DIGITS = ROOT / "examples/digits/elasticjob.yaml"
T = 180.0  # seconds a step may take on a loaded 2-core machine
LEASE = "kelastic-operator"  # the chart's operator.leaderElection.leaseName and deploy/'s
SYSTEM = "kelastic-system"  # deploy/'s namespace
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

Pods = Callable[[], list[dict[str, Any]]]


def _job(k8s: Client) -> dict[str, Any]:
    out = k8s.kubectl("get", "ej", "digits", "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _status(k8s: Client) -> dict[str, Any]:
    return _job(k8s).get("status") or {}


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _operator_trains_digits(
    k8s: Client, node: RealNode, etcd_server: EmbeddedEtcd, operators: Pods, lease_ns: str
) -> None:
    """The installed operator's two Pods become Ready, one holds the Lease ``LEASE`` in
    ``lease_ns``, and that one runs the digits job in ``k8s``'s namespace to Succeeded with
    accuracy >= 0.90; ``kubectl delete ej`` then removes the Pods and etcd keys, and no
    operator Pod was restarted. ``operators`` lists the installed operator's Pods."""
    ns = k8s.namespace

    def operators_ready() -> list[dict[str, Any]] | None:
        pods = operators()
        return pods if len(pods) == 2 and all(_ready(p) for p in pods) else None

    try:
        pods = wait_until(operators_ready, T, 0.5, what="the operator's 2 Pods Ready")
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{node.explain(lease_ns)}")
    names = {p["metadata"]["name"] for p in pods}

    def holder() -> str:
        lease = k8s.get("lease", LEASE, lease_ns) or {}
        # the identity is "<pod name>_<random suffix>" (POD_ID, made unique per process)
        return str(lease.get("spec", {}).get("holderIdentity")).split("_")[0]

    try:
        wait_until(lambda: holder() in names, T, 0.5, what="one operator Pod holding the Lease")
    except AssertionError as exc:
        leases = k8s.kubectl("get", "lease", "-n", lease_ns, "-o", "yaml").stdout[-2000:]
        pytest.fail(f"{exc}\n{leases}\n{node.explain(lease_ns, 40)}")
    leader = holder()

    k8s.claim("digits-checkpoints")
    job = yaml.safe_load(DIGITS.read_text())
    job["spec"]["template"]["spec"].update(PLACEMENT)
    k8s.kubectl("apply", "-f", "-", input=json.dumps(job))
    try:
        wait_until(lambda: _status(k8s).get("worldSize") == 4, T, 0.5, what="world size 4")
        wait_until(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"),
                   3 * T, 0.5, what="the job to finish")  # fmt: skip
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{node.explain(ns)}\n{node.explain(lease_ns)}")
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
    assert handled in node.log(lease_ns, leader, "operator")
    (follower,) = names - {leader}
    assert handled not in node.log(lease_ns, follower, "operator")
    assert holder() == leader

    # kubectl delete ej: the operator's finalizer removes the Pods, then the etcd keys
    uid = _job(k8s)["metadata"]["uid"]
    k8s.kubectl("delete", "ej", "digits", "--wait=false")
    wait_until(lambda: not _job(k8s), T, 0.5, what="the job deleted")
    wait_until(lambda: not [p for p in k8s.objects("pods")
                            if p["metadata"]["name"].startswith("digits-")],
               T, 0.5, what="the job's Pods gone")  # fmt: skip
    with EtcdClient([etcd_server.endpoint]) as store:
        prefix = contract.job_prefix(ns, "digits", uid)
        wait_until(lambda: not store.get_prefix(prefix), T, 0.5, what="the etcd keys gone")
    # neither operator Pod was restarted: the liveness probe passed throughout
    for pod in operators():
        restarts = [c["restartCount"] for c in pod["status"]["containerStatuses"]]
        assert restarts == [0], (pod["metadata"]["name"], restarts)


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

        def operators() -> list[dict[str, Any]]:
            return [p for p in k8s.objects("pods")
                    if p["metadata"]["name"].startswith(f"{release.prefix}-operator")]  # fmt: skip

        _operator_trains_digits(k8s, node, etcd_server, operators, ns)


def deploy_overlay(folder: Path, etcd: str, namespace: str) -> Path:
    """A kustomize overlay of ``deploy/`` in ``folder`` for an etcd of one's own at ``etcd``
    (``host:port``; the bundled etcd's StatefulSet and Service deleted), an operator
    watching ``namespace`` only, and Pods placed on the test node (``PLACEMENT``): the
    overlay ``deploy/README.md`` shows. Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    deploy = os.path.relpath(DEPLOY, folder)  # kustomize refuses an absolute resource path
    ops = [
        {"op": "replace", "path": "/spec/template/spec/containers/0/args/0",
         "value": f"--etcd-endpoints={etcd}"},
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-",
         "value": f"--namespace={namespace}"},
        {"op": "add", "path": "/spec/template/spec/tolerations",
         "value": PLACEMENT["tolerations"]},
        {"op": "add", "path": "/spec/template/spec/nodeSelector",
         "value": PLACEMENT["nodeSelector"]},
    ]  # fmt: skip
    gone = [
        {"$patch": "delete", "apiVersion": api, "kind": kind,
         "metadata": {"name": "kelastic-etcd", "namespace": SYSTEM}}
        for api, kind in (("apps/v1", "StatefulSet"), ("v1", "Service"))
    ]  # fmt: skip
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [deploy],
        "patches": [{"patch": yaml.safe_dump(g)} for g in gone]
        + [{"target": {"kind": "Deployment", "name": "kelastic-operator"},
            "patch": yaml.safe_dump(ops)}],
    }  # fmt: skip
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def test_kubectl_apply_k_deploy_runs_the_operator_in_the_cluster(
    k8s_cluster: ControlPlane, k8s: Client, node: RealNode, etcd_server: EmbeddedEtcd,
    tmp_path: Path,
) -> None:  # fmt: skip
    admin = k8s_cluster.admin
    overlay = deploy_overlay(tmp_path / "overlay", node.expose(etcd_server.endpoint),
                             k8s.namespace)  # fmt: skip
    rendered = admin.kubectl("kustomize", str(overlay)).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered) if d]
    assert "StatefulSet" not in kinds and kinds.count("Deployment") == 1, kinds
    result = admin.kubectl("apply", "-k", str(overlay))
    assert "deployment.apps/kelastic-operator" in result.stdout
    assert "Warning" not in result.stderr, result.stderr
    try:

        def operators() -> list[dict[str, Any]]:
            return [p for p in k8s.objects("pods", SYSTEM)
                    if p["metadata"]["name"].startswith("kelastic-operator-")
                    and not p["metadata"].get("deletionTimestamp")]  # fmt: skip

        _operator_trains_digits(k8s, node, etcd_server, operators, SYSTEM)
    finally:
        # the namespace, CRD and RBAC stay: the session's other tests use them
        for ref in ("deployment/kelastic-operator", "service/kelastic-operator-metrics"):
            admin.kubectl("delete", "-n", SYSTEM, ref, "--ignore-not-found", "--wait=false")
        admin.kubectl("delete", "lease", LEASE, "-n", SYSTEM, "--ignore-not-found")
