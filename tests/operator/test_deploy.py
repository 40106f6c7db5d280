"""deploy/: every manifest validates strictly against Kubernetes 1.33 and applies with kubectl."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s.harness import K8sApi, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifests_validate_strictly(path: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("kopf.dev/"):
            continue  # a custom resource: no built-in schema
        kv.validate(doc, "1.33.0", strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(DEPLOY / p for p in listed) == MANIFESTS


def test_the_operator_is_least_privileged() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert verbs[("", "pods")] == {"get", "list", "watch", "create", "delete"}
    assert "delete" not in verbs[("kelastic.dev", "elasticjobs")]
    assert all("*" not in v for v in verbs.values())
    assert not any(r == "secrets" for _, r in verbs)


def test_kubectl_applies_deploy(k8s_api: K8sApi) -> None:
    k8s_api.kubectl("apply", "-f", str(DEPLOY / "crds"))
    wait_until(
        lambda: k8s_api.kubectl("get", "clusterkopfpeerings", check=False).returncode == 0,
        what="the peering CRD to be served",
    )
    out = k8s_api.kubectl("apply", "-k", str(DEPLOY)).stdout
    assert "deployment.apps/kelastic-operator created" in out
    assert "clusterkopfpeering.kopf.dev/kelastic created" in out
    (dep,) = k8s_api.objects("Deployment", "kelastic-system")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "kelastic-operator"
    k8s_api.kubectl("apply", "-f", str(ROOT / "examples/digits/elasticjob.yaml"))
    assert k8s_api.names("ElasticJob", "default") == ["digits"]


def test_the_operator_entry_point_parses_its_options() -> None:
    from kelastic_operator.__main__ import build_parser

    args = build_parser().parse_args(
        ["--etcd-endpoints", "a:1,b:2", "--namespace", "ml", "--standalone", "--priority", "5"]
    )
    assert (args.etcd_endpoints, args.namespace, args.standalone, args.priority) == (
        "a:1,b:2", ["ml"], True, 5)  # fmt: skip
    assert args.peering == "kelastic"
