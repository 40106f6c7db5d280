"""The ElasticJob CRD: generated from the model, served by the real API server (the test
cluster) with the real kubectl: apply, validation with clear messages, printer columns, the
scale subresource, kubectl explain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kelastic_operator import crd
from kelastic_operator.model import parse_job
from tests.k8s.cluster import Client

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / crd.CRD_FILE
DIGITS = ROOT / "examples/digits/elasticjob.yaml"
pytestmark = pytest.mark.timeout(120)


def test_the_crd_file_is_generated_from_the_model() -> None:
    assert CRD_PATH.read_text() == crd.render(), (
        f"{crd.CRD_FILE} drifted from kelastic_operator.model; regenerate it with "
        f"`python -m kelastic_operator.crd > {crd.CRD_FILE}`"
    )


def test_the_schema_is_structural() -> None:
    """Every node has a type (or preserves unknown fields); no refs, unions or titles."""
    schema = crd.openapi_schema()

    def walk(node: dict[str, object], where: str) -> None:
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), where
        for bad in ("$ref", "anyOf", "title", "additionalProperties", "$defs"):
            assert bad not in node, f"{where}: {bad}"
        if isinstance(node.get("exclusiveMinimum"), bool):
            assert "minimum" in node, where
        for name, sub in (node.get("properties") or {}).items():  # type: ignore[attr-defined]
            walk(sub, f"{where}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")  # type: ignore[arg-type]

    walk(schema, "")
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["replicas", "template"]
    assert spec["properties"]["pendingTimeoutSeconds"]["exclusiveMinimum"] is True
    assert spec["properties"]["template"]["x-kubernetes-preserve-unknown-fields"] is True
    assert schema["properties"]["status"]["properties"]["kopf"][
        "x-kubernetes-preserve-unknown-fields"
    ]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("self.replicas <= self.maxReplicas" in r for r in rules)


def test_structural_rejects_unions() -> None:
    with pytest.raises(ValueError, match="union"):
        crd.structural({"anyOf": [{"type": "string"}, {"type": "integer"}]})
    with pytest.raises(ValueError, match="unknown schema reference"):
        crd.structural({"$ref": "#/$defs/Nope"}, {})


def apply_digits(k8s: Client) -> str:
    """kubectl apply of the digits example into the test's namespace (the CRD is installed
    once per test run by the ``k8s_cluster`` fixture, from the same generated file)."""
    return str(k8s.kubectl("apply", "-f", str(DIGITS)).stdout)


def test_kubectl_applies_the_crd_and_the_digits_example(k8s: Client) -> None:
    out = apply_digits(k8s)
    assert "elasticjob.kelastic.dev/digits created" in out
    stored = json.loads(k8s.kubectl("get", "ej", "digits", "-o", "json").stdout)
    # API-server defaults come from the model's defaults
    assert stored["spec"]["podReplacement"] == {
        "maxReplacements": 10,
        "backoffSeconds": 10.0,
        "maxBackoffSeconds": 300.0,
    }
    assert stored["spec"]["rendezvous"]["joinTimeoutSeconds"] == 600.0
    assert stored["spec"]["cleanupPolicy"] == "Running"
    assert stored["spec"]["inProcess"] == {  # the example's timeouts, the rest defaulted
        "enabled": False,
        "maxRestarts": 10,
        "softTimeoutSeconds": 10,
        "hardTimeoutSeconds": 20,
        "spareRanks": 0,
    }
    # what the server stored is still a valid ElasticJob for the model
    job = parse_job(stored)
    assert job.spec.rendezvous.lease_ttl_seconds == 5
    header = k8s.kubectl("get", "ej").stdout.splitlines()[0].split()
    assert header == [
        "NAME",
        "PHASE",
        "REPLICAS",
        "READY",
        "WORLD",
        "SIZE",
        "RESTARTS",
        "REASON",
        "AGE",
    ]
    wide = k8s.kubectl("get", "elasticjobs.kelastic.dev", "digits", "--no-headers").stdout
    assert wide.split()[:2] == ["digits", "2"]  # no phase yet: columns shift left


def test_printer_columns_show_status(k8s: Client) -> None:
    apply_digits(k8s)
    status = {"phase": "Running", "replicas": 2, "readyReplicas": 2, "worldSize": 4,
              "restartsSpent": 1}  # fmt: skip
    k8s.kubectl(
        "patch", "ej", "digits", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    row = k8s.kubectl("get", "ej", "digits", "--no-headers").stdout.split()
    assert row[:6] == ["digits", "Running", "2", "2", "4", "1"]
    k8s.kubectl("patch", "ej", "digits", "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"inProcessRestarts": 7}}))  # fmt: skip
    wide = k8s.kubectl("get", "ej", "digits", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[:7] == ["NAME", "PHASE", "REPLICAS", "READY", "WORLD", "SIZE",
                                   "RESTARTS"]  # fmt: skip
    assert wide[0].split()[7] == "IN-PROCESS" and wide[1].split()[:7] == [
        "digits", "Running", "2", "2", "4", "1", "7"]  # fmt: skip


def doc_with(**spec: object) -> str:
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": 5}, "replicas must be <= maxReplicas"),
        ({"minReplicas": 3}, "replicas must be >= minReplicas"),
        ({"minReplicas": 5, "maxReplicas": 4, "replicas": 4},
         "minReplicas must be <= maxReplicas"),
        ({"replicas": 0}, "spec.replicas"),
        ({"nprocPerNode": 0}, "spec.nprocPerNode"),
        ({"pendingTimeoutSeconds": 0}, "spec.pendingTimeoutSeconds"),
        ({"cleanupPolicy": "Sometimes"}, "spec.cleanupPolicy"),
        ({"rendezvous": {"leaseTTLSeconds": 301}}, "spec.rendezvous.leaseTTLSeconds"),
        ({"template": {"spec": {"containers": []}}}, "spec.template.spec.containers"),
        ({"template": {"spec": {"containers": [{"name": "a", "command": ["x"]},
                                               {"name": "b", "command": ["run"]}]}}},
         "name the training one 'trainer'"),
        ({"template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}}},
         "the trainer container needs a command (a list of strings)"),
        ({"template": {"spec": {"containers": [{"name": "trainer", "command": []},
                                               {"name": "side", "command": ["run"]}]}}},
         "the trainer container needs a command"),
        ({"inProcess": {"maxRestarts": -1}}, "spec.inProcess.maxRestarts"),
        ({"inProcess": {"softTimeoutSeconds": 0}}, "spec.inProcess.softTimeoutSeconds"),
        # the server's defaults come first: soft 120 > the default hard 90
        ({"inProcess": {"enabled": True, "softTimeoutSeconds": 120}},
         "hardTimeoutSeconds must be greater than softTimeoutSeconds"),
        ({"checkpoint": {"memory": "1.5Gi"}}, "spec.checkpoint.memory"),
        ({"checkpoint": {"memory": "0"}}, "spec.checkpoint.memory"),
        ({"checkpoint": {"persist": {"volume": "data"}}},
         "checkpoint.persist needs checkpoint.memory"),
        ({"checkpoint": {"memory": "64Mi", "persist": {"volume": "data", "path": "../up"}}},
         "spec.checkpoint.persist.path"),
        ({"checkpoint": {"memory": "64Mi", "persist": {"volume": "data", "keep": 0}}},
         "spec.checkpoint.persist.keep"),
        ({"preflight": {"timeoutSeconds": 5}},
         "spec.preflight needs a command, a network check, or both"),
        ({"preflight": {"network": {"minBandwidthMBps": 0}}},
         "spec.preflight.network.minBandwidthMBps"),
        ({"preflight": {"network": {"sizeMiB": 257}}}, "spec.preflight.network.sizeMiB"),
        ({"preflight": {"network": {"timeoutSeconds": 601}}},
         "spec.preflight.network.timeoutSeconds"),
        ({"bogus": 1}, "bogus"),
    ],
)  # fmt: skip
def test_invalid_specs_are_rejected_with_a_clear_message(
    k8s: Client, spec: dict[str, object], message: str
) -> None:
    result = k8s.kubectl("apply", "-f", "-", input=doc_with(**spec), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert not k8s.objects("elasticjobs")


@pytest.mark.parametrize(
    "containers",
    [
        [{"name": "only", "command": ["python", "t.py"]}],
        [{"name": "trainer", "command": ["python"]}, {"name": "side", "image": "x"}],
    ],
)
def test_templates_the_model_accepts_the_api_accepts(
    k8s: Client, containers: list[dict[str, object]]
) -> None:
    # the example's checkpoint volume stays: spec.checkpoint.persist names it
    volumes = [{"name": "checkpoints", "emptyDir": {}}]
    doc = doc_with(template={"spec": {"containers": containers, "volumes": volumes}})
    parse_job(yaml.safe_load(doc))
    k8s.kubectl("apply", "-f", "-", input=doc)


def test_kubectl_scale_respects_max_replicas(k8s: Client) -> None:
    apply_digits(k8s)
    k8s.kubectl("scale", "ej/digits", "--replicas=3")
    assert k8s.objects("elasticjobs")[0]["spec"]["replicas"] == 3
    result = k8s.kubectl("scale", "ej/digits", "--replicas=9", check=False)
    assert result.returncode != 0
    assert "replicas must be <= maxReplicas" in result.stderr


def test_kubectl_explain_shows_the_models_descriptions(k8s: Client) -> None:
    out = " ".join(k8s.kubectl("explain", "ej.spec.pendingTimeoutSeconds").stdout.split())
    assert "before the operator shrinks the job towards minReplicas" in out
    assert "``" not in out and "`" not in out  # plain text, no reStructuredText
    out = " ".join(k8s.kubectl("explain", "ej.spec.inProcess.hardTimeoutSeconds").stdout.split())
    assert "must be greater than softTimeoutSeconds" in out and "`" not in out
    out = k8s.kubectl("explain", "elasticjobs.status.lastFailure").stdout
    assert "exitCode" in out and "the most recent failure" in out


def test_python_m_kelastic_operator_crd_prints_the_file() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(ROOT / d) for d in ("operator", "worker_lib"))}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "kelastic_operator.crd"], env=env,
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    assert out.stdout == CRD_PATH.read_text()
