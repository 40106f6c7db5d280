"""The test cluster itself: a real API server that refuses what a real one refuses, RBAC,
the garbage collector, the scheduler, and the local kubelet's Pod lifecycle (Pending with
ContainerCreating, Running, exit codes and termination messages, graceful deletion)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from .cluster import Client, ControlPlane, wait_until
from .kubelet import PLACEMENT, LocalKubelet

pytestmark = pytest.mark.timeout(180)
SLEEPER = "import time\nwhile True: time.sleep(0.05)"


def _pod(name: str, main: str, *, sidecar: bool = False, image: str = "local/test",
         grace: int | None = None) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **PLACEMENT,
        "containers": [{
            "name": "main", "image": image, "command": ["python", "-c", main],
            "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "DATA", "value": "/data/out.txt"}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }],
        "volumes": [{"name": "data", "emptyDir": {}}],
    }  # fmt: skip
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if sidecar:
        spec["initContainers"] = [
            {"name": "side", "image": image, "restartPolicy": "Always",
             "command": ["python", "-c", SLEEPER]}
        ]  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _apply(k8s: Client, doc: dict[str, Any]) -> None:
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))


def _status(k8s: Client, name: str) -> dict[str, Any]:
    pod = k8s.get("pod", name)
    return (pod or {}).get("status") or {}


def test_the_control_plane_is_real(k8s_cluster: ControlPlane, k8s: Client) -> None:
    assert k8s_cluster.startup_seconds > 0
    version = json.loads(k8s.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"].startswith("v1.")
    # built-in kinds are validated: a Pod without containers is refused
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad"}, "spec": {}}
    result = k8s.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode and "spec.containers: Required value" in result.stderr
    # metadata.name rules hold
    upper = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Not_Valid"}}
    result = k8s.kubectl("apply", "-f", "-", input=json.dumps(upper), check=False)
    assert result.returncode and "a lowercase RFC 1123 subdomain" in result.stderr
    # field selectors are checked per resource
    result = k8s.kubectl("get", "pods", "--field-selector", "spec.nope=x", check=False)
    assert result.returncode and "field label not supported" in result.stderr


def test_rbac_is_enforced_for_service_accounts(k8s_cluster: ControlPlane, k8s: Client) -> None:
    k8s.kubectl("create", "serviceaccount", "nobody")
    nobody = k8s_cluster.service_account_client(k8s.namespace, "nobody")
    result = nobody.kubectl("get", "pods", check=False)
    assert result.returncode and "Forbidden" in result.stderr
    # the operator's account has exactly deploy/rbac.yaml's rights
    operator = k8s_cluster.service_account_client("kelastic-system", "kelastic-operator",
                                                  default_namespace=k8s.namespace)  # fmt: skip
    assert operator.kubectl("get", "pods").returncode == 0
    assert (
        operator.kubectl("auth", "can-i", "delete", "elasticjobs", check=False).stdout.strip()
        == "no"
    )
    can = operator.kubectl("auth", "can-i", "update", "elasticjobs", "--subresource=finalizers")
    assert can.stdout.strip() == "yes"
    result = operator.kubectl("get", "secrets", check=False)
    assert result.returncode and "Forbidden" in result.stderr


def test_pods_run_and_report_exit_codes_and_termination_messages(
    k8s: Client, kubelet: LocalKubelet, tmp_path: Path
) -> None:
    kubelet.images["local/test"] = tmp_path
    ok_code = (
        "import os, pathlib\n"
        "pathlib.Path(os.environ['DATA']).write_text(os.environ['POD'])\n"
        "print('hello from', os.environ['POD'])"
    )
    fail_code = (
        "import os, pathlib, sys\n"
        "pathlib.Path(os.environ['KELASTIC_TERMINATION_LOG']).write_text('root cause: boom')\n"
        "sys.exit(3)"
    )
    _apply(k8s, _pod("ok", ok_code, sidecar=True))
    _apply(k8s, _pod("bad", fail_code))
    wait_until(lambda: _status(k8s, "ok").get("phase") == "Succeeded", 60, what="ok succeeded")
    wait_until(lambda: _status(k8s, "bad").get("phase") == "Failed", 60, what="bad failed")
    assert "hello from ok" in kubelet.log(k8s.namespace, "ok", "main")
    (out,) = kubelet.workdir.glob(f"{k8s.namespace}/ok/volumes/data/out.txt")
    assert out.read_text() == "ok"
    bad = _status(k8s, "bad")["containerStatuses"][0]["state"]["terminated"]
    assert (bad["exitCode"], bad["message"], bad["reason"]) == (3, "root cause: boom", "Error")
    ok = _status(k8s, "ok")
    assert ok["podIP"] == "127.0.0.1"
    assert ok["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    scheduled = [c for c in ok["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled and scheduled[0]["status"] == "True"  # the real scheduler placed it


def test_a_slow_image_pull_keeps_a_pod_pending_in_container_creating(
    k8s: Client, kubelet: LocalKubelet, tmp_path: Path
) -> None:
    kubelet.images["local/slow"] = tmp_path
    kubelet.pull_seconds["local/slow"] = 3.0
    _apply(k8s, _pod("slow", SLEEPER, image="local/slow", grace=1))
    st = wait_until(lambda: (s := _status(k8s, "slow")).get("containerStatuses") and s, 30,
                    what="the kubelet's first status")  # fmt: skip
    assert st["phase"] == "Pending"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "ContainerCreating"
    wait_until(lambda: _status(k8s, "slow").get("phase") == "Running", 30, what="running")
    k8s.kubectl("delete", "pod", "slow", "--wait=false")


def test_deletion_is_graceful_terminating_then_gone(
    k8s: Client, kubelet: LocalKubelet, tmp_path: Path
) -> None:
    kubelet.images["local/test"] = tmp_path
    ignore_term = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    _apply(k8s, _pod("long", ignore_term, sidecar=True, grace=3))
    wait_until(lambda: _status(k8s, "long").get("phase") == "Running", 60, what="running")
    local = kubelet.pods[(k8s.namespace, "long")]
    pids = [c.proc.pid for c in local.pod.containers]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    k8s.kubectl("delete", "pod", "long", "--wait=false")
    # Terminating: still there with a deletionTimestamp while the grace period runs
    pod = k8s.get("pod", "long")
    assert pod is not None and pod["metadata"].get("deletionTimestamp")
    wait_until(lambda: k8s.get("pod", "long") is None, 30, what="the pod gone")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_owner_references_are_garbage_collected(k8s: Client) -> None:
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
    _apply(k8s, owner)
    uid = k8s.get("configmap", "owner")["metadata"]["uid"]  # type: ignore[index]
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child",
             "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                  "uid": uid}]}}  # fmt: skip
    _apply(k8s, child)
    k8s.kubectl("delete", "configmap", "owner")
    wait_until(lambda: k8s.get("configmap", "child") is None, 30, what="the child collected")
