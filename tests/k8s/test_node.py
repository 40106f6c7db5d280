"""The real test node (tests/k8s/node.py): a real kubelet, containerd and runc run Pods from
images built here, with Pod IPs on the node's CNI bridge, probes, logs through the API,
graceful deletion, and nothing left on the machine when a node stops."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from .cluster import Client, ControlPlane, wait_until
from .images import KELASTIC, PAUSE
from .node import KERNEL_TUNABLES, PLACEMENT, RealNode

pytestmark = pytest.mark.timeout(300)
IMAGE = KELASTIC  # has python, runs as a non-root user
SLEEPER = "import time\nwhile True: time.sleep(0.05)"


def _pod(name: str, main: str, *, sidecar: str | None = None, grace: int | None = None,
         probe: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **PLACEMENT,
        "containers": [{
            "name": "main", "image": IMAGE, "imagePullPolicy": "Never",
            "command": ["python", "-c", main],
            "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "DATA", "value": "/data/out.txt"}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }],
        "volumes": [{"name": "data", "emptyDir": {}}],
    }  # fmt: skip
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if sidecar is not None:
        side: dict[str, Any] = {
            "name": "side",
            "image": IMAGE,
            "imagePullPolicy": "Never",
            "restartPolicy": "Always",
            "command": ["python", "-c", sidecar],
        }
        if probe:
            side["readinessProbe"] = probe
        spec["initContainers"] = [side]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _apply(k8s: Client, doc: dict[str, Any]) -> None:
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))


def _status(k8s: Client, name: str) -> dict[str, Any]:
    return (k8s.get("pod", name) or {}).get("status") or {}


def _wait_phase(k8s: Client, node: RealNode, name: str, phase: str, timeout: float = 90) -> None:
    """Wait for Pod ``name`` to reach ``phase``; on timeout fail with its status, its events
    and the kubelet's log."""
    try:
        wait_until(lambda: _status(k8s, name).get("phase") == phase, timeout,
                   what=f"pod {name} {phase}")  # fmt: skip
    except AssertionError as exc:
        events = k8s.kubectl("get", "events", "-o", "wide", check=False).stdout[-3000:]
        pytest.fail(f"{exc}\nstatus: {json.dumps(_status(k8s, name), indent=1)[-3000:]}\n"
                    f"events:\n{events}\n{node.log_tail('kubelet', 40)}")  # fmt: skip


def test_pods_run_with_pod_ips_logs_exit_codes_and_termination_messages(
    k8s: Client, node: RealNode
) -> None:
    ok_code = (
        "import os, pathlib\n"
        "pathlib.Path(os.environ['DATA']).write_text(os.environ['POD'])\n"
        "print('hello from', os.environ['POD'], 'as uid', os.getuid(), flush=True)\n"
        "print(pathlib.Path(os.environ['DATA']).read_text())"
    )
    fail_code = (
        "import pathlib, sys\n"
        "pathlib.Path('/dev/termination-log').write_text('root cause: boom')\n"
        "sys.exit(3)"
    )
    _apply(k8s, _pod("ok", ok_code, sidecar=SLEEPER))
    _apply(k8s, _pod("bad", fail_code))
    _wait_phase(k8s, node, "ok", "Succeeded", 90)
    _wait_phase(k8s, node, "bad", "Failed", 90)
    # kubectl logs: API server -> kubelet -> containerd's log file
    logs = k8s.kubectl("logs", "ok", "-c", "main").stdout
    assert "hello from ok as uid 65532" in logs and logs.rstrip().endswith("ok"), logs
    bad = _status(k8s, "bad")["containerStatuses"][0]["state"]["terminated"]
    assert (bad["exitCode"], bad["message"], bad["reason"]) == (3, "root cause: boom", "Error")
    ok = _status(k8s, "ok")
    assert ipaddress.ip_address(ok["podIP"]) in ipaddress.ip_network(node.pod_cidr)
    assert ok["hostIP"] == node.ip
    assert ok["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    # the native sidecar was stopped once the main container finished
    side = ok["initContainerStatuses"][0]
    assert "terminated" in side["state"], side
    assert (
        ok["containerStatuses"][0]["imageID"].startswith("sha256:")
        or "@sha256:" in (ok["containerStatuses"][0]["imageID"])
    )


def test_readiness_comes_from_the_probe_and_deletion_is_graceful(
    k8s: Client, node: RealNode
) -> None:
    # the sidecar answers its HTTP readiness probe only once /tmp/ready exists
    server = (
        "import http.server, os\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if os.path.exists('/tmp/ready') else 503)\n"
        "        self.end_headers()\n"
        "http.server.HTTPServer(('', 8081), H).serve_forever()\n"
    )
    probe = {"httpGet": {"path": "/", "port": 8081}, "periodSeconds": 1, "failureThreshold": 1}
    ignore_term = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    _apply(k8s, _pod("long", ignore_term, sidecar=server, grace=3, probe=probe))
    _wait_phase(k8s, node, "long", "Running", 90)
    pod = k8s.get("pod", "long")
    assert pod is not None
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert ready["Ready"] == "False", pod["status"]  # the probe says 503

    side_pids = node.container_pids(pod, "side")
    assert side_pids, "no process in the sidecar's cgroup"
    # make the probe pass from inside the container (same mount namespace as the server)
    os.system(f"nsenter -t {side_pids[0]} -m -- touch /tmp/ready")
    wait_until(
        lambda: {c["type"]: c["status"] for c in _status(k8s, "long")["conditions"]}["Ready"]
        == "True",
        30, what="Ready from the readiness probe",
    )  # fmt: skip
    pod = k8s.get("pod", "long")
    assert pod is not None
    pids = node.container_pids(pod, "main") + node.container_pids(pod, "side")
    assert len(pids) >= 2 and all(psutil.pid_exists(p) for p in pids)
    k8s.kubectl("delete", "pod", "long", "--wait=false")
    # Terminating: still there with a deletionTimestamp while the grace period runs
    terminating = k8s.get("pod", "long")
    assert terminating is not None and terminating["metadata"].get("deletionTimestamp")
    wait_until(lambda: k8s.get("pod", "long") is None, 60, what="the pod gone")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_a_node_changes_nothing_on_the_machine_and_leaves_nothing(
    k8s_cluster: ControlPlane, node: RealNode, tmp_path: Path
) -> None:
    """A second node, started and stopped: Ready through the real API server, this
    machine's kernel tunables untouched, and no process, cgroup, mount or link left."""
    before = {key: Path(f"/proc/sys/{key}").read_text() for key in KERNEL_TUNABLES}
    small = {k: v for k, v in node.images.items() if k in (PAUSE, KELASTIC)}  # not 4.4 GB
    second = RealNode(k8s_cluster, tmp_path / "n2", small, name="kelastic-node-2",
                      index=2).start()  # fmt: skip
    try:
        assert second.startup_seconds > 0
        inside = second.nsenter("cat", *(f"/proc/sys/{k}" for k in KERNEL_TUNABLES)).split()
        assert inside == list(KERNEL_TUNABLES.values())
        assert {k: Path(f"/proc/sys/{k}").read_text() for k in KERNEL_TUNABLES} == before
        init = second.init_pid
        node_pids = second.pids()
        names = {psutil.Process(p).name() for p in node_pids}
        assert {"pause", "containerd", "kubelet"} <= names, names
    finally:
        second.stop()
    assert second.leftovers() == []

    def running(pid: int) -> bool:  # a zombie is gone: this machine's init reaps it
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    wait_until(lambda: not [p for p in [init, *node_pids] if running(p)], 30,
               what="the node's processes gone")  # fmt: skip
    assert second.node() is None
    assert {k: Path(f"/proc/sys/{k}").read_text() for k in KERNEL_TUNABLES} == before


def test_a_restarted_kubelet_keeps_its_pods_running(k8s: Client, node: RealNode) -> None:
    _apply(k8s, _pod("steady", SLEEPER, sidecar=SLEEPER))
    _wait_phase(k8s, node, "steady", "Running", 90)
    pod = k8s.get("pod", "steady")
    assert pod is not None
    pids = node.container_pids(pod, "main")
    old_kubelet = node.process_pid("kubelet")
    node.restart_kubelet()
    assert node.process_pid("kubelet") != old_kubelet
    assert not psutil.pid_exists(old_kubelet) or psutil.Process(old_kubelet).status() == "zombie"
    node.wait_ready(60)
    # the containers were never touched: same processes, no restart counted
    assert all(psutil.pid_exists(p) for p in pids)
    status = _status(k8s, "steady")
    assert status["phase"] == "Running"
    assert [c["restartCount"] for c in status["containerStatuses"]] == [0]
    os.kill(pids[0], signal.SIGKILL)  # the kubelet still watches it: the Pod fails
    _wait_phase(k8s, node, "steady", "Failed", 60)
