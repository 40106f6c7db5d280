"""charts/kelastic with the real helm: lint, strict validation, deploy/ agreement, and
``helm install`` / ``upgrade`` / ``uninstall`` into the real test cluster (tests/k8s).

deploy/ and the chart cannot drift: the chart's ``crds`` is a link to ``deploy/crds`` (the
generated ElasticJob CRD), and the default values must render the same objects as deploy/
(Helm's bookkeeping labels aside, the leader-election Lease's Role and RoleBinding
included) plus the Grafana dashboard, and the Prometheus Operator's objects where the
cluster serves their API: the chart installs on a cluster without the Prometheus Operator.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

from tests.k8s.cluster import Client, ControlPlane, wait_until

from .tools import (
    CHART,
    DEPLOY,
    MONITORING_APIS,
    NAMESPACE,
    Release,
    ToolMissing,
    helm,
    helm_binary,
    release_name,
    render,
)

pytestmark = pytest.mark.timeout(180)

#: The scrape jobs the ServiceMonitor and the PodMonitor name (Prometheus' `job` label).
SCRAPE_JOBS = {"kelastic-operator", "kelastic-sidecar"}
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
EXTERNAL_AUTH = (*EXTERNAL, "etcd.external.authSecret=kelastic-etcd-auth")
VARIANTS = {
    "default": (),
    "external-etcd": EXTERNAL,
    "external-etcd-auth": EXTERNAL_AUTH,
    "etcd-3-members-no-persistence": ("etcd.replicas=3", "etcd.persistence.enabled=false"),
    "namespaced-and-tuned": (
        "operator.namespaces={ml,research}",
        "sidecar.httpPort=9500",
        "operator.leaderElection.leaseName=kelastic-ml",
        "operator.leaderElection.leaseDurationSeconds=15",
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
    assert [o["metadata"]["name"] for o in rendered] == ["elasticjobs.kelastic.dev"]


@pytest.mark.parametrize("served", [(), MONITORING_APIS], ids=["bare", "prometheus-operator"])
def test_default_values_render_deploy(served: tuple[str, ...]) -> None:
    """deploy/ (namespace and CRDs aside) == the chart's default render, plus the dashboard
    and, where the cluster serves their API, the Prometheus Operator's objects."""
    deploy = {
        (o["kind"], o["metadata"]["name"]): o
        for o in _deploy_objects()
        if o["kind"] not in ("Namespace", "CustomResourceDefinition")
    }
    assert ("Role", "kelastic-operator-leader-election") in deploy
    assert ("RoleBinding", "kelastic-operator-leader-election") in deploy
    chart = {
        (o["kind"], o["metadata"]["name"]): _strip_helm_labels(o)
        for o in render(api_versions=served)
    }
    extra = {k for k in chart if k not in deploy}
    assert {kind for kind, _ in extra} == (MONITORING if served else set()) | {"ConfigMap"}, extra
    assert set(deploy) <= set(chart), set(deploy) - set(chart)
    for key, obj in deploy.items():
        assert chart[key] == obj, f"{key}: chart and deploy/ differ"


def test_monitoring_objects_render_only_where_their_api_is_served() -> None:
    """Each Prometheus Operator kind needs both its API (``.Capabilities``) and its flag."""
    kinds = lambda objs: {o["kind"] for o in objs} & MONITORING  # noqa: E731
    assert kinds(render()) == set()
    assert kinds(render(api_versions=MONITORING_APIS)) == MONITORING
    for api in MONITORING_APIS:
        assert kinds(render(api_versions=[api])) == {api.rsplit("/", 1)[1]}, api
    flags = {"ServiceMonitor": "serviceMonitor", "PodMonitor": "podMonitor",
             "PrometheusRule": "prometheusRule"}  # fmt: skip
    for kind, flag in flags.items():
        off = render(f"monitoring.{flag}.enabled=false", api_versions=MONITORING_APIS)
        assert kinds(off) == MONITORING - {kind}, kind


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_validates_strictly(variant: str) -> None:
    crds = _crd_schemas()
    objects = render(*VARIANTS[variant], crds=True, api_versions=MONITORING_APIS)
    assert {o["kind"] for o in objects} >= MONITORING
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


def test_external_etcd_auth_reaches_the_operator_as_env_from_its_secret() -> None:
    """``etcd.external.authSecret``: the operator's etcd user and password come from the
    Secret's ``username``/``password`` as the env the operator reads (never its args), the
    same keys a job's ``spec.rendezvous.authSecret`` gives its sidecar."""
    from kelastic import contract
    from kelastic_operator.model import ElasticJob
    from kelastic_operator.pods import PodSettings, sidecar_env

    def operator_container(*values: str) -> dict[str, Any]:
        (dep,) = [o for o in render(*values) if o["kind"] == "Deployment"]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        return c

    c = operator_container(*EXTERNAL_AUTH)
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {
        contract.ENV_ETCD_USER: {"name": "kelastic-etcd-auth", "key": "username"},
        contract.ENV_ETCD_PASSWORD: {"name": "kelastic-etcd-auth", "key": "password"},
    }
    assert not any("auth" in a or "password" in a for a in c["args"]), c["args"]
    # the TLS mount is independent of it
    assert {"name": contract.ENV_ETCD_TLS_DIR, "value": "/etc/kelastic/etcd-tls"} in c["env"]
    no_tls = [v for v in EXTERNAL_AUTH if not v.startswith("etcd.external.tlsSecret")]
    c = operator_container(*no_tls)
    names = {e["name"] for e in c["env"]}
    assert {contract.ENV_ETCD_USER, contract.ENV_ETCD_PASSWORD} <= names
    assert contract.ENV_ETCD_TLS_DIR not in names and "volumeMounts" not in c
    # bundled etcd (no auth) or no Secret: no such env
    for values in (("etcd.external.authSecret=kelastic-etcd-auth",), EXTERNAL):
        names = {e["name"] for e in operator_container(*values)["env"]}
        assert not names & {contract.ENV_ETCD_USER, contract.ENV_ETCD_PASSWORD}, values
    # a job's authSecret gives its sidecar the same env from the same keys
    trainer = {"name": "t", "image": "i", "command": ["x"]}
    job = ElasticJob.model_validate({
        "apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
        "metadata": {"name": "j", "namespace": "ml"},
        "spec": {"replicas": 1, "rendezvous": {"authSecret": "kelastic-etcd-auth"},
                 "template": {"spec": {"containers": [trainer]}}},
    })  # fmt: skip
    job_refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in sidecar_env("j", "uid", job.spec, PodSettings(etcd_endpoints=("e:2379",)))
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert job_refs == refs


#: The labels the Prometheus Operator gives a ServiceMonitor's targets (beside ``instance``).
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint"}


def test_honor_labels_stays_for_the_operators_namespace_label_only() -> None:
    """The ServiceMonitor keeps ``honorLabels: true`` for one reason: the operator's
    ``kelastic_operator_job_phase{namespace,elasticjob,phase}`` names the ElasticJob's own
    namespace, which the alerts aggregate by (without it Prometheus would rename it
    ``exported_namespace`` and put the operator's there). It is not there for the job's
    name (``elasticjob``, no clash) nor for ``job`` (the operator exposes none: the scrape
    job stays ``kelastic-operator``), and nothing else of the operator's clashes with a
    target label. The sidecars' PodMonitor honors no label (it sets ``elasticjob``, ``namespace``
    and ``pod`` from the Pod)."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.parser import text_string_to_metric_families

    from kelastic_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    exposed = {n for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)
               for n in v._labelnames}  # fmt: skip
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        exposed |= {label for sample in family.samples for label in sample.labels}
    assert "elasticjob" in exposed
    assert exposed & TARGET_LABELS == {"namespace"}, exposed & TARGET_LABELS

    objects = render(api_versions=MONITORING_APIS)
    (sm,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "job", "replacement": "kelastic-operator"}
    ]
    (pm,) = [o for o in objects if o["kind"] == "PodMonitor"]
    assert not any("honorLabels" in e for e in pm["spec"]["podMetricsEndpoints"])
    rules = yaml.safe_load((CHART / "rules" / "kelastic.rules.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert not any("label_replace" in e or "exported_" in e for e in exprs)
    phase_rules = [e for e in exprs if "kelastic_operator_job_phase" in e]
    assert phase_rules and all("by (namespace, elasticjob)" in e for e in phase_rules)
    for text in (CHART / "templates" / "monitoring.yaml", CHART / "README.md"):
        assert "honorLabels" in text.read_text() and "namespace" in text.read_text(), text


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
        "operator.peering=kelastic",  # kopf peering's values are gone: leaderElection
        "operator.leaderElection.renewDeadlineSeconds=0",
    ):
        result = helm("template", "kelastic", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, f"{bad} was accepted"
        assert "schema" in result.stderr.lower() or "values don't meet" in result.stderr, (
            result.stderr
        )
    # what the schema cannot say: the operator's leader-election timing must be ordered
    late = "operator.leaderElection.renewDeadlineSeconds=12"  # > the lease duration (10)
    result = helm("template", "kelastic", str(CHART), "--set", late, check=False)
    assert result.returncode != 0, result.stdout[-500:]
    assert "retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds" in result.stderr


def test_the_dashboard_and_rules_ship_in_the_chart() -> None:
    objects = render(api_versions=MONITORING_APIS)
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
        api_versions=MONITORING_APIS,
    )
    assert not {o["kind"] for o in disabled} & (MONITORING | {"ConfigMap"})


def _monitoring_crd(kind: str) -> dict[str, Any]:
    """A minimal CRD serving the Prometheus Operator's ``kind`` as monitoring.coreos.com/v1
    (what the chart's ``.Capabilities`` look for; the spec is kept, not checked)."""
    plural = kind.lower() + "s"
    spec = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                      "listKind": f"{kind}List"},
            "versions": [{"name": "v1", "served": True, "storage": True,
                          "schema": {"openAPIV3Schema": {"type": "object",
                                                         "properties": {"spec": spec}}}}],
        },
    }  # fmt: skip


def _pods(k8s: Client, app: str) -> list[dict[str, Any]]:
    return [
        p
        for p in k8s.objects("pods")
        if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == app
    ]


def _args(pod_or_template: dict[str, Any]) -> list[str]:
    return list(pod_or_template["spec"]["containers"][0]["args"])


def test_helm_install_upgrade_and_uninstall_on_a_real_cluster(
    k8s_cluster: ControlPlane, k8s: Client
) -> None:
    """The chart installs on a cluster without the Prometheus Operator (into a namespace
    enforcing Pod Security ``restricted``), its controllers' Pods are admitted, its operator
    account has the chart's RBAC; ``helm upgrade`` changes the Deployment and, once the
    cluster serves monitoring.coreos.com/v1, adds the monitoring objects; ``helm
    uninstall`` leaves nothing of the release."""
    ns = k8s.namespace
    k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                "pod-security.kubernetes.io/warn=restricted")  # fmt: skip
    assert "monitoring.coreos.com/v1" not in k8s.kubectl("api-versions").stdout.split()
    release = Release(k8s, release_name(ns))
    op, etcd = f"{release.prefix}-operator", f"{release.prefix}-etcd"
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    monitoring_crds = [_monitoring_crd(kind) for kind in sorted(MONITORING)]
    try:
        with release:
            started = time.monotonic()
            out = release.install()
            install_seconds = time.monotonic() - started
            assert "STATUS: deployed" in out.stdout, out.stdout
            assert "Not installed: ServiceMonitor, PodMonitor, PrometheusRule" in out.stdout
            assert "PodSecurity" not in out.stderr, out.stderr  # warn=restricted is quiet
            manifest = release.manifest()
            expected = render(*release.values(), namespace=ns, release=release.name)
            assert sorted(map(key, manifest)) == sorted(map(key, expected))
            assert not {o["kind"] for o in manifest} & MONITORING
            for obj in manifest:  # every object is in the cluster, owned by the release
                live = k8s.get(obj["kind"], obj["metadata"]["name"])
                assert live is not None, key(obj)
                assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
            # The controllers act on them; Pod Security (restricted) admits their Pods.
            pods = wait_until(lambda: len(p := _pods(k8s, op)) == 2 and p, 60, 0.2,
                              what="the operator Deployment's 2 Pods")  # fmt: skip
            assert {p["spec"]["serviceAccountName"] for p in pods} == {op}
            wait_until(lambda: _pods(k8s, etcd), 60, 0.2, what="the etcd StatefulSet's Pod")
            # The operator's account has exactly the chart's RBAC.
            sa = k8s_cluster.service_account_client(ns, op)

            def can(*args: str) -> str:
                return sa.kubectl("auth", "can-i", *args, check=False).stdout.strip()

            assert can("create", "pods", "-n", "default") == "yes"  # a ClusterRole
            assert can("patch", "elasticjobs", "--subresource=status", "-n", "default") == "yes"
            assert can("update", "elasticjobs", "--subresource=finalizers") == "yes"
            assert can("delete", "elasticjobs") == "yes"  # ttlSecondsAfterFinished
            assert can("create", "elasticjobs") == "no"
            assert can("deletecollection", "elasticjobs") == "no"
            assert can("update", "leases", "-n", ns) == "yes"  # the leader-election Role
            assert can("create", "leases", "-n", "default") == "no"
            assert can("get", "secrets") == "no"

            # helm upgrade: a changed value reaches the Deployment and its new Pods.
            out = release.upgrade("operator.replicas=3", "operator.logLevel=DEBUG")
            assert "REVISION: 2" in out.stdout, out.stdout
            dep = k8s.get("deployment", op)
            assert dep is not None and dep["spec"]["replicas"] == 3
            assert "--log-level=DEBUG" in _args(dep["spec"]["template"])
            wait_until(lambda: any("--log-level=DEBUG" in _args(p) for p in _pods(k8s, op)),
                       60, 0.2, what="a Pod of the upgraded Deployment")  # fmt: skip

            # The Prometheus Operator's API appears: the next upgrade installs its objects.
            k8s.kubectl("apply", "-f", "-", input=json.dumps(
                {"apiVersion": "v1", "kind": "List", "items": monitoring_crds}))  # fmt: skip
            wait_until(
                lambda: all(k8s.kubectl("get", k, check=False).returncode == 0 for k in MONITORING),
                30, 0.2, what="the monitoring kinds to be served",
            )  # fmt: skip
            out = release.upgrade()
            assert "Not installed" not in out.stdout, out.stdout
            assert f"Alerts: PrometheusRule {release.prefix}" in out.stdout, out.stdout
            live = {kind: k8s.names(kind) for kind in MONITORING}
            assert live == {"ServiceMonitor": [op], "PodMonitor": [f"{release.prefix}-sidecars"],
                            "PrometheusRule": [release.prefix]}  # fmt: skip
            rule = k8s.get("PrometheusRule", release.prefix)
            assert rule is not None
            assert rule["spec"] == yaml.safe_load((CHART / "rules/kelastic.rules.yaml").read_text())
        # helm uninstall (leaving the with): nothing of the release is left.
        for kind, name in [("ClusterRole", op), ("ClusterRoleBinding", op),
                           ("Deployment", op), ("StatefulSet", etcd), ("ServiceAccount", op),
                           ("Role", f"{op}-leader-election"), ("PrometheusRule", release.prefix),
                           ("ConfigMap", f"{release.prefix}-dashboard")]:  # fmt: skip
            assert k8s.get(kind, name) is None, (kind, name)
        wait_until(lambda: not _pods(k8s, op), 60, 0.2, what="the operator's Pods gone")
        listed = release.helm("list", "-q").stdout.split()
        assert release.name not in listed
    finally:
        names = [c["metadata"]["name"] for c in monitoring_crds]
        k8s.kubectl("delete", "crd", *names, "--ignore-not-found", "--wait=false")
    print(f"helm install: {install_seconds:.1f} s")


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
    source and the namespace/elasticjob variables on every query, its sections."""
    dash = json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    assert dash["schemaVersion"] >= 39 and dash["uid"] == "kelastic"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "elasticjob"}
    assert variables["datasource"]["type"] == "datasource"
    assert "$namespace" in variables["elasticjob"]["query"]["query"]
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Job overview",
        "Rendezvous",
        "Timers and hangs",
        "Failures by cause",
        "Restart ladder",
        "Checkpoints",
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
            # Grafana's legend template is {{label}}: a doubled brace (an f-string's
            # escape written out) shows the braces instead of the label's value
            assert "{{{" not in t.get("legendFormat", ""), (p["title"], t["legendFormat"])
            for label in re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")):
                # a label the query keeps (named in its by (...) or its selector)
                assert re.search(rf"\b{label}\b", t["expr"]), (p["title"], label, t["expr"])
            sidecar = "kelastic_operator" not in t["expr"] and "up{" not in t["expr"]
            # `job` is Prometheus' target label only (the scrape job), never the ElasticJob
            assert set(re.findall(r'\bjob="([^"]*)"', t["expr"])) <= SCRAPE_JOBS, t["expr"]
            if sidecar or "kelastic_operator_job_phase" in t["expr"]:  # by both variables
                assert 'namespace="$namespace", elasticjob="$elasticjob"' in t["expr"], t["expr"]


def test_the_node_rights_and_flags_follow_the_values() -> None:
    """Nodes: list/watch while the operator watches them (the default; lost nodes),
    get/patch only with ``operator.taintQuarantinedNodes``, none with neither."""

    def nodes(*values: str) -> tuple[list[list[str]], list[str]]:
        objects = render(*values)
        (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
        (dep,) = [o for o in objects if o["kind"] == "Deployment"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        flags = [a for a in args if a in ("--no-node-watch", "--taint-quarantined-nodes")]
        return [r["verbs"] for r in role["rules"] if "nodes" in r["resources"]], flags

    assert nodes() == ([["list", "watch"]], [])
    assert nodes("operator.taintQuarantinedNodes=true") == (
        [["list", "watch"], ["get", "patch"]], ["--taint-quarantined-nodes"])  # fmt: skip
    assert nodes("operator.watchNodes=false") == ([], ["--no-node-watch"])
