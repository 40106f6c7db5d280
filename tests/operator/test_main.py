"""``python -m kelastic_operator`` as a process against the emulator: it logs in with the
kubeconfig, creates the Pods of a job, and serves /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kelastic_operator import crd
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from tests.k8s.harness import K8sApi, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def test_the_operator_process(k8s_api: K8sApi, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    port = free_port()
    env = {**k8s_api.env(), "PYTHONPATH": os.pathsep.join(
        str(ROOT / d) for d in ("operator", "worker_lib", "sidecar"))}  # fmt: skip
    log = (tmp_path / "operator.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kelastic_operator", "--standalone",
         "--etcd-endpoints", etcd_server.endpoint, "--sidecar-image", "kelastic:e2e",
         "--metrics-port", str(port), "--resync-seconds", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
        wait_until(lambda: len(k8s_api.names("Pod", "default")) == 2, 30, what="the pods")
        pod = k8s_api.objects("Pod", "default")[0]
        assert pod["spec"]["initContainers"][-1]["image"] == "kelastic:e2e"
        phase = 'kelastic_operator_job_phase{job="digits",namespace="default",phase="Pending"} 1.0'
        wait_until(
            lambda: (m := metrics(port)) and "kelastic_operator_pods_created_total 2.0" in m
            and phase in m,
            30, what="/metrics with the pods created and the job's phase",
        )  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        log.close()
    assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]
