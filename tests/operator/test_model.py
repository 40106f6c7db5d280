"""ElasticJob manifests: valid ones load, bad ones fail with every problem named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kelastic import contract
from kelastic_operator.model import ManifestError, load_manifest, parse_job

ROOT = Path(__file__).resolve().parents[2]


def _job(**spec: object) -> dict[str, object]:
    base: dict[str, object] = {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "trainer", "command": ["python"]}]}},
    }
    base.update(spec)
    return {"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
            "metadata": {"name": "j"}, "spec": base}  # fmt: skip


def test_the_digits_example_loads() -> None:
    job = load_manifest(ROOT / "examples/digits/elasticjob.yaml")
    assert job.metadata.name == "digits"
    assert (job.spec.replicas, job.spec.nproc_per_node, job.spec.max_restarts) == (2, 2, 3)
    assert (job.spec.min_nodes, job.spec.max_nodes) == (1, 4)


def test_defaults_min_and_max_to_replicas() -> None:
    job = parse_job(_job())
    assert (job.spec.min_nodes, job.spec.max_nodes) == (2, 2)
    assert job.spec.rendezvous.lease_ttl_seconds == 10
    assert job.spec.warm_start.enabled is False
    assert job.spec.warm_start.preload == [
        "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"
    ]  # fmt: skip


def test_in_process_restart_is_off_by_default_with_the_contracts_defaults() -> None:
    spec = parse_job(_job()).spec.in_process
    assert spec.enabled is False
    assert (spec.max_restarts, spec.soft_timeout_seconds, spec.hard_timeout_seconds) == (
        contract.DEFAULT_INPROCESS_MAX_RESTARTS,
        contract.DEFAULT_INPROCESS_SOFT_TIMEOUT,
        contract.DEFAULT_INPROCESS_HARD_TIMEOUT,
    )
    on = parse_job(_job(inProcess={"enabled": True, "maxRestarts": 0, "softTimeoutSeconds": 0.5,
                                   "hardTimeoutSeconds": 2})).spec.in_process  # fmt: skip
    assert (on.enabled, on.max_restarts, on.soft_timeout_seconds, on.hard_timeout_seconds) == (
        True, 0, 0.5, 2.0)  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": 0}, "spec.replicas: Input should be greater than or equal to 1"),
        ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas (3) must be <= maxReplicas (2)"),
        ({"minReplicas": 1, "maxReplicas": 1}, "replicas (2) must be within [1, 1]"),
        ({"nprocPerNode": "two"}, "spec.nprocPerNode"),
        ({"template": {"spec": {"containers": []}}}, "containers must list the trainer"),
        ({"template": {"spec": {"containers": [{"name": "t"}]}}}, "needs a command"),
        ({"bogus": 1}, "spec.bogus: Extra inputs are not permitted"),
        ({"warmStart": {"preload": ["torch", "os;rm"]}}, "spec.warmStart.preload.1"),
        ({"warmStart": {"enabled": "maybe"}}, "spec.warmStart.enabled"),
        (
            {"inProcess": {"maxRestarts": -1}},
            "spec.inProcess.maxRestarts: Input should be greater than or equal to 0",
        ),
        (
            {"inProcess": {"softTimeoutSeconds": 0}},
            "spec.inProcess.softTimeoutSeconds: Input should be greater than 0",
        ),
        (
            {"inProcess": {"softTimeoutSeconds": 30, "hardTimeoutSeconds": 30}},
            "spec.inProcess: hardTimeoutSeconds (30) must be greater than softTimeoutSeconds (30)",
        ),
        (
            {"inProcess": {"softTimeoutSeconds": 120}},  # the default hard timeout is 90
            "hardTimeoutSeconds (90) must be greater than softTimeoutSeconds (120)",
        ),
        ({"inProcess": {"enable": True}}, "spec.inProcess.enable: Extra inputs are not permitted"),
    ],
)
def test_bad_specs_are_rejected_clearly(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_job(_job(**spec), "job.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("job.yaml: invalid ElasticJob")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(bad)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"kind": "Pod"}))
    with pytest.raises(ManifestError, match="no document with kind: ElasticJob"):
        load_manifest(other)
