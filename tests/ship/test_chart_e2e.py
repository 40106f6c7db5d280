"""The chart's operator runs the digits job: ``helm template | kubectl apply`` into the
Kubernetes API emulator, then the operator Deployment's own command, args and env run as a
process (leader election through the chart's ClusterKopfPeering; only its etcd endpoint is
swapped for a local etcd, since the bundled etcd's Service name resolves in a cluster only),
and the local kubelet runs the job's Pods (sidecar + trainer with real torch DDP)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from tests.k8s.harness import K8sApi, wait_until
from tests.k8s.kubelet import LocalKubelet

from .tools import NAMESPACE, ROOT, ToolMissing, apply_chart, helm_binary

DIGITS = ROOT / "examples/digits/elasticjob.yaml"
IMAGE = "ghcr.io/kelastic/digits-example:0.1.0"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _status(api: K8sApi) -> dict[str, Any]:
    out = api.kubectl("get", "ej", "digits", "-o", "json", check=False)
    return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}


def test_the_charts_operator_runs_the_digits_job(
    k8s_api: K8sApi, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    try:
        helm_binary()
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    apply_chart(k8s_api, tmp_path / "chart")
    (dep,) = k8s_api.objects("Deployment", NAMESPACE)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = [a for a in c["args"] if not a.startswith(("--etcd-endpoints=", "--metrics-port="))]
    port = free_port()
    args += [f"--etcd-endpoints={etcd_server.endpoint}", f"--metrics-port={port}"]
    assert "--peering=kelastic" in args and c["command"][:2] == ["python", "-m"]
    sidecar_image = next(a.split("=", 1)[1] for a in args if a.startswith("--sidecar-image="))
    env = {
        **k8s_api.env(),
        "POD_ID": "kelastic-operator-0",  # the Deployment's fieldRef: metadata.name
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("operator", "worker_lib", "sidecar")),
    }
    log_path = tmp_path / "operator.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, *c["command"][1:], *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kubelet = LocalKubelet(k8s_api, tmp_path / "kubelet", {IMAGE: DIGITS.parent}, stop_grace=5)
    try:
        with kubelet:
            k8s_api.kubectl("apply", "-f", str(DIGITS))
            wait_until(
                lambda: _status(k8s_api).get("worldSize") == 4,
                180,
                what="world size 4\n" + log_path.read_text(errors="replace")[-3000:],
            )
            pod = k8s_api.objects("Pod", "default")[0]
            assert pod["spec"]["initContainers"][-1]["image"] == sidecar_image
            wait_until(
                lambda: _status(k8s_api).get("phase") in ("Succeeded", "Failed"),
                400,
                what="the job to finish",
            )
            assert _status(k8s_api)["phase"] == "Succeeded", _status(k8s_api)
            logs = "\n".join(kubelet.log(ns, name, "trainer") for (ns, name) in list(kubelet.pods))
            accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)", logs)]
            assert accuracies and accuracies[-1] >= 0.90, logs[-3000:]
            assert kubelet.warnings == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
