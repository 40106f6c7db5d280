"""charts/kelastic rendered by the real helm: lint, strict validation, deploy/ agreement, kubectl.

deploy/ and the chart cannot drift: the chart's ``crds`` is a link to ``deploy/crds`` (the
generated ElasticJob CRD and kopf's peering CRDs), and the default values must render the
same objects as deploy/ (Helm's bookkeeping labels aside) plus the monitoring objects.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.k8s.harness import K8sApi

from .tools import CHART, DEPLOY, NAMESPACE, ToolMissing, apply_chart, helm, helm_binary, render

pytestmark = pytest.mark.timeout(180)

HELM_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
)
MONITORING = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
EXTERNAL = (
    "etcd.bundled=false",
    "etcd.external.endpoints={etcd-a.example:2379,etcd-b.example:2379}",
    "etcd.external.tlsSecret=kelastic-etcd-tls",
)
VARIANTS = {
    "default": (),
    "external-etcd": EXTERNAL,
    "etcd-3-members-no-persistence": ("etcd.replicas=3", "etcd.persistence.enabled=false"),
    "namespaced-and-tuned": (
        "operator.namespaces={ml,research}",
        "sidecar.httpPort=9500",
        "operator.priority=10",
        "operator.logLevel=DEBUG",
        "etcd.persistence.storageClass=fast",
    ),
}

# Minimal schemas of the Prometheus Operator's custom resources (their CRDs are not vendored
# here): the fields the chart sets and Prometheus Operator requires.
_META = {"type": "object", "required": ["name", "namespace"]}
CR_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "namespaceSelector": {"type": "object"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string"},
                                "honorLabels": {"type": "boolean"},
                                "relabelings": {"type": "array"},
                            },
                        },
                    },
                },
            },
        },
    },
    "PodMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object"},
                    "namespaceSelector": {"type": "object"},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string"},
                                "relabelings": {"type": "array"},
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["groups"],
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "properties": {
                                            "alert": {"type": "string"},
                                            "expr": {"type": "string"},
                                            "for": {"type": "string"},
                                            "labels": {"type": "object"},
                                            "annotations": {"type": "object"},
                                        },
                                    },
                                }
                            },
                        },
                    }
                },
            },
        },
    },
}


@pytest.fixture(scope="module", autouse=True)
def _helm_available() -> None:
    try:
        helm_binary()
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def _deploy_objects() -> list[dict[str, Any]]:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    return [d for p in listed for d in yaml.safe_load_all((DEPLOY / p).read_text()) if d]


def _crd_schemas() -> dict[str, dict[str, Any]]:
    """kind -> openAPIV3Schema of the CRDs in deploy/crds."""
    out = {}
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if crd:
                (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
                out[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return out


def _strip_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    labels = obj["metadata"].get("labels") or {}
    for key in HELM_LABELS:
        labels.pop(key, None)
    if not labels:
        obj["metadata"].pop("labels", None)
    return obj


def test_helm_lint_is_clean() -> None:
    for values in ((), EXTERNAL):
        args = ["lint", str(CHART), "--strict"] + [a for v in values for a in ("--set", v)]
        out = helm(*args).stdout
        assert "1 chart(s) linted, 0 chart(s) failed" in out, out
        assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_the_chart_crds_are_deploy_crds() -> None:
    assert (CHART / "crds").is_symlink()
    assert (CHART / "crds").resolve() == (DEPLOY / "crds").resolve()
    rendered = [o for o in render(crds=True) if o["kind"] == "CustomResourceDefinition"]
    expected = [
        d
        for p in sorted((DEPLOY / "crds").glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]
    key = lambda o: o["metadata"]["name"]  # noqa: E731
    assert sorted(rendered, key=key) == sorted(expected, key=key)
    names = {o["metadata"]["name"] for o in rendered}
    assert {"elasticjobs.kelastic.dev", "clusterkopfpeerings.kopf.dev"} <= names


def test_default_values_render_deploy() -> None:
    """deploy/ (namespace and CRDs aside) == the chart's default render, plus monitoring."""
    deploy = {
        (o["kind"], o["metadata"]["name"]): o
        for o in _deploy_objects()
        if o["kind"] not in ("Namespace", "CustomResourceDefinition")
    }
    chart = {(o["kind"], o["metadata"]["name"]): _strip_helm_labels(o) for o in render()}
    extra = {k for k in chart if k not in deploy}
    assert {kind for kind, _ in extra} == MONITORING | {"ConfigMap"}, extra
    assert set(deploy) <= set(chart), set(deploy) - set(chart)
    for key, obj in deploy.items():
        assert chart[key] == obj, f"{key}: chart and deploy/ differ"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_validates_strictly(variant: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    crds = _crd_schemas()
    objects = render(*VARIANTS[variant], crds=True)
    assert objects
    for obj in objects:
        kind = obj["kind"]
        if kind in CR_SCHEMAS:
            jsonschema.validate(obj, CR_SCHEMAS[kind])
        elif kind in crds:
            jsonschema.validate(obj, crds[kind])
        else:
            kv.validate(obj, "1.33.0", strict=True)


def test_external_etcd_values() -> None:
    objects = render(*EXTERNAL)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not any(k == "StatefulSet" for k, _ in kinds)
    assert ("Service", "kelastic-etcd") not in kinds
    (dep,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "--etcd-endpoints=etcd-a.example:2379,etcd-b.example:2379" in c["args"]
    assert {"name": "KELASTIC_ETCD_TLS_DIR", "value": "/etc/kelastic/etcd-tls"} in c["env"]
    assert pod["volumes"] == [
        {"name": "etcd-tls", "secret": {"secretName": "kelastic-etcd-tls", "defaultMode": 0o400}}
    ]
    assert c["volumeMounts"][0]["readOnly"] is True


def test_a_three_member_etcd_forms_one_cluster() -> None:
    objects = render("etcd.replicas=3", "etcd.persistence.enabled=false")
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "kelastic-etcd-peer"
    assert "volumeClaimTemplates" not in sts["spec"]
    cmd = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    (cluster,) = [a for a in cmd if a.startswith("--initial-cluster=")]
    assert cluster.count("=http://") == 3 and "kelastic-etcd-2=http://kelastic-etcd-2." in cluster
    peer = [
        o
        for o in objects
        if o["kind"] == "Service" and o["metadata"]["name"] == "kelastic-etcd-peer"
    ]
    assert peer and peer[0]["spec"]["clusterIP"] == "None"


def test_the_schema_rejects_bad_values() -> None:
    for bad in (
        "etcd.replicas=2",
        "operator.replicas=0",
        "image.pullPolicy=Sometimes",
        "etcd.bundled=false",
        "nope=1",
        "operator.logLevel=LOUD",
    ):
        result = helm("template", "kelastic", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, f"{bad} was accepted"
        assert "schema" in result.stderr.lower() or "values don't meet" in result.stderr, (
            result.stderr
        )


def test_the_dashboard_and_rules_ship_in_the_chart() -> None:
    objects = render()
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["kelastic.json"])
    assert shipped == json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "kelastic.rules.yaml").read_text())
    disabled = render(
        "monitoring.serviceMonitor.enabled=false",
        "monitoring.podMonitor.enabled=false",
        "monitoring.prometheusRule.enabled=false",
        "monitoring.dashboard.enabled=false",
    )
    assert not {o["kind"] for o in disabled} & (MONITORING | {"ConfigMap"})


def test_helm_template_applies_with_kubectl(k8s_api: K8sApi, tmp_path: Path) -> None:
    """``helm template | kubectl apply`` against the emulator yields the operator's objects
    (monitoring off: the emulator serves no Prometheus Operator CRDs)."""
    out = apply_chart(k8s_api, tmp_path)
    for line in (
        "serviceaccount/kelastic-operator created",
        "clusterrole.rbac.authorization.k8s.io/kelastic-operator created",
        "clusterrolebinding.rbac.authorization.k8s.io/kelastic-operator created",
        "deployment.apps/kelastic-operator created",
        "service/kelastic-operator-metrics created",
        "service/kelastic-etcd created",
        "statefulset.apps/kelastic-etcd created",
        "clusterkopfpeering.kopf.dev/kelastic created",
        "configmap/kelastic-dashboard created",
    ):
        assert line in out, out
    (dep,) = k8s_api.objects("Deployment", NAMESPACE)
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "kelastic-operator"
    assert "--peering=kelastic" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert k8s_api.names("ClusterKopfPeering") == ["kelastic"]
    assert k8s_api.names("StatefulSet", NAMESPACE) == ["kelastic-etcd"]


def test_notes_render_for_bundled_and_external_etcd(tmp_path: Path) -> None:
    """``helm install --dry-run=client`` renders NOTES.txt without a cluster."""
    env_kubeconfig = str(tmp_path / "none")
    for values, expected in (
        ((), "Rendezvous etcd: bundled, 1 member(s) at kelastic-etcd.kelastic-system.svc:2379"),
        (EXTERNAL, 'copy of the TLS Secret "kelastic-etcd-tls"'),
    ):
        args = ["install", "kelastic", str(CHART), "-n", NAMESPACE, "--dry-run=client"]
        args += [a for v in values for a in ("--set", v)]
        out = helm(*args, "--kubeconfig", env_kubeconfig).stdout
        notes = out[out.index("NOTES:") :]
        assert expected in notes, notes
        assert 'grafana_dashboard="1"' in notes


def test_the_packaged_chart_holds_the_crds_and_not_the_alert_tests(tmp_path: Path) -> None:
    import tarfile

    helm("package", str(CHART), "-d", str(tmp_path))
    (tgz,) = tmp_path.glob("kelastic-*.tgz")
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
        crd = tar.extractfile("kelastic/crds/elasticjobs.kelastic.dev.yaml")
        assert crd is not None
        assert crd.read() == (DEPLOY / "crds/elasticjobs.kelastic.dev.yaml").read_bytes()
    assert "kelastic/dashboards/kelastic.json" in names
    assert not any(n.startswith("kelastic/tests/") for n in names)


def test_the_dashboard_is_well_formed() -> None:
    """Grafana's current schema: unique ids, a 24-column grid without overlaps, the data
    source and the namespace/job variables on every query, the issue's sections."""
    dash = json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    assert dash["schemaVersion"] >= 39 and dash["uid"] == "kelastic"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "job"}
    assert variables["datasource"]["type"] == "datasource"
    assert "$namespace" in variables["job"]["query"]["query"]
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Job overview",
        "Rendezvous",
        "Timers and hangs",
        "Failures by cause",
        "Operator health",
    ]
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["refId"]
            sidecar = "kelastic_operator" not in t["expr"] and "up{" not in t["expr"]
            if sidecar:  # the sidecars' series: filtered by both variables
                assert 'namespace="$namespace", elasticjob="$job"' in t["expr"], t["expr"]
