"""The local kubelet runs the emulator's Pods as real processes and reports their status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from .harness import K8sApi, wait_until
from .kubelet import LocalKubelet

SIDECAR_LOOP = "import time\nwhile True: time.sleep(0.05)"


def _pod(name: str, main: str, *, sidecar: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": "main", "image": "local/test", "command": ["python", "-c", main],
            "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "DATA", "value": "/data/out.txt"}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }],
        "volumes": [{"name": "data", "emptyDir": {}}],
    }  # fmt: skip
    if sidecar:
        spec["initContainers"] = [
            {"name": "side", "image": "local/test", "restartPolicy": "Always",
             "command": ["python", "-c", SIDECAR_LOOP]}
        ]  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


def _status(api: K8sApi, name: str) -> dict[str, Any]:
    for pod in api.objects("Pod", "default"):
        if pod["metadata"]["name"] == name:
            return pod.get("status") or {}
    return {}


def test_pods_run_and_report_exit_codes_and_termination_messages(
    k8s_api: K8sApi, tmp_path: Path
) -> None:
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
    with LocalKubelet(k8s_api, tmp_path / "kubelet", {"local/test": tmp_path}) as kubelet:
        k8s_api.create(_pod("ok", ok_code, sidecar=True))
        k8s_api.create(_pod("bad", fail_code))
        wait_until(lambda: _status(k8s_api, "ok").get("phase") == "Succeeded", 30, what="ok")
        wait_until(lambda: _status(k8s_api, "bad").get("phase") == "Failed", 30, what="bad")
        assert "hello from ok" in kubelet.log("default", "ok", "main")
        (out,) = (tmp_path / "kubelet").glob("default/ok/volumes/data/out.txt")
        assert out.read_text() == "ok"
        bad = _status(k8s_api, "bad")["containerStatuses"][0]["state"]["terminated"]
        assert (bad["exitCode"], bad["message"]) == (3, "root cause: boom")
        ok = _status(k8s_api, "ok")
        assert ok["podIP"] == "127.0.0.1"
        assert ok["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        # The native sidecar was stopped once the main container finished.
        side = kubelet.pods[("default", "ok")].pod.containers[0]
        assert side.sidecar and side.proc.poll() is not None
        assert kubelet.warnings == []


def test_deleting_a_pod_kills_its_processes(k8s_api: K8sApi, tmp_path: Path) -> None:
    with LocalKubelet(k8s_api, tmp_path / "kubelet", stop_grace=2) as kubelet:
        k8s_api.create(_pod("long", SIDECAR_LOOP, sidecar=True))
        wait_until(lambda: _status(k8s_api, "long").get("phase") == "Running", 30, what="run")
        pids = [c.proc.pid for c in kubelet.pods[("default", "long")].pod.containers]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        code, _ = k8s_api.request("DELETE", "/api/v1/namespaces/default/pods/long")
        assert code == 200
        wait_until(lambda: ("default", "long") not in kubelet.pods, 30, what="pod stopped")
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in pids)  # fmt: skip
