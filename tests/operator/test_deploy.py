"""deploy/: every manifest validates strictly against Kubernetes 1.33 and applies with kubectl
to the real test cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml

from tests.k8s.cluster import Client, ControlPlane, wait_until
from tests.ship.tools import render

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")
EXAMPLE_PVC = ROOT / "examples/digits/checkpoints-pvc.yaml"
EXAMPLE_JOB = ROOT / "examples/digits/elasticjob.yaml"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifests_validate_strictly(path: Path) -> None:
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
    # delete: only a finished job whose ttlSecondsAfterFinished passed; never create one
    assert verbs[("kelastic.dev", "elasticjobs")] == {"get", "list", "watch", "patch", "delete"}
    assert all("*" not in v for v in verbs.values())
    assert not any(r == "secrets" for _, r in verbs)
    # Kueue: the Workloads it writes for queued jobs, read-only on flavors and priorities,
    # nothing else of Kueue's (no queues, no cluster queues, no admission checks)
    kueue = {r: v for (g, r), v in verbs.items() if g == "kueue.x-k8s.io"}
    assert kueue == {
        "workloads": {"get", "list", "watch", "create", "patch", "delete"},
        "workloads/status": {"patch"},
        "resourceflavors": {"get"},
        "workloadpriorityclasses": {"get"},
    }


def test_the_charts_kueue_rights_and_flag_follow_the_value() -> None:
    """operator.kueue (default true): deploy/'s Kueue rules and the Workload watch; false:
    no rule on kueue.x-k8s.io and ``--no-workload-watch``."""

    def kueue(*values: str) -> tuple[list[dict[str, Any]], list[str]]:
        objects = render(*values)
        (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
        (dep,) = [o for o in objects if o["kind"] == "Deployment"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        rules = [r for r in role["rules"] if "kueue.x-k8s.io" in r["apiGroups"]]
        return rules, [a for a in args if a == "--no-workload-watch"]

    docs = list(yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()))
    (deployed,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert kueue() == ([r for r in deployed["rules"] if "kueue.x-k8s.io" in r["apiGroups"]], [])
    assert kueue("operator.kueue=false") == ([], ["--no-workload-watch"])


def test_kubectl_applies_deploy(k8s_cluster: ControlPlane, k8s: Client) -> None:
    """``kubectl apply -k deploy/`` on the real cluster: every object is admitted, the
    operator's Pods pass the namespace's ``restricted`` Pod Security level (the
    ReplicaSet's Pods exist: a refused Pod would not), then the digits example's own
    claim and job apply as a user applies them, and are stored as written (the claim
    bound to a volume made for it)."""
    admin = k8s_cluster.admin
    result = admin.kubectl("apply", "-k", str(DEPLOY))
    assert "deployment.apps/kelastic-operator" in result.stdout
    assert "role.rbac.authorization.k8s.io/kelastic-operator-leader-election" in result.stdout
    assert "Warning" not in result.stderr, result.stderr
    try:
        (dep,) = k8s.objects("deployments", "kelastic-system")
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "kelastic-operator"
        wait_until(
            lambda: len(k8s.objects("pods", "kelastic-system")) >= 2,
            60,
            what="the operator's two Pods created under Pod Security 'restricted'",
        )
        # The storage's part (an admin's or a provisioner's): a volume for the example's
        # claim. The claim and the job are the example's own files, applied as the README
        # tells a user to.
        pv = _volume_for(k8s_cluster, k8s.namespace, "digits-checkpoints", "1Gi")
        applied = k8s.kubectl("apply", "-f", str(EXAMPLE_PVC), "-f", str(EXAMPLE_JOB))
        assert "persistentvolumeclaim/digits-checkpoints created" in applied.stdout
        assert "elasticjob.kelastic.dev/digits created" in applied.stdout
        wait_until(
            lambda: ((k8s.get("pvc", "digits-checkpoints") or {}).get("status") or {}).get(
                "phase") == "Bound", 30, 0.1, what="the example's claim bound",
        )  # fmt: skip
        claim = k8s.get("pvc", "digits-checkpoints")
        assert claim is not None and claim["spec"]["volumeName"] == pv
        _assert_stored(yaml.safe_load(EXAMPLE_PVC.read_text())["spec"], claim["spec"])
        assert k8s.names("elasticjobs") == ["digits"]
        job = k8s.get("elasticjobs", "digits")
        assert job is not None
        _assert_stored(yaml.safe_load(EXAMPLE_JOB.read_text())["spec"], job["spec"])
    finally:
        # the namespace, CRDs and RBAC stay: the session's other tests use them
        for ref in ("deployment/kelastic-operator", "statefulset/kelastic-etcd",
                    "service/kelastic-operator-metrics", "service/kelastic-etcd"):  # fmt: skip
            admin.kubectl("delete", "-n", "kelastic-system", ref, "--ignore-not-found",
                          "--wait=false")  # fmt: skip


def _volume_for(cluster: ControlPlane, namespace: str, claim: str, size: str) -> str:
    """A ``ReadWriteMany`` hostPath PersistentVolume of no class reserved for ``claim``
    (``claimRef``), as the cluster's storage would provide; returns its name."""
    pv = f"{namespace}-{claim}"[:63]
    folder = cluster.workdir / "volumes" / pv
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
           "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"],
                    "storageClassName": "", "hostPath": {"path": str(folder)},
                    "claimRef": {"namespace": namespace, "name": claim}}}  # fmt: skip
    cluster.admin.kubectl("apply", "-f", "-", input=json.dumps(doc))
    return pv


def _assert_stored(written: Any, stored: Any, where: str = "spec") -> None:
    """Everything the manifest wrote is stored as written (the API server may add
    defaults, but must not drop or change a field: a CRD schema that pruned one would)."""
    if isinstance(written, dict):
        assert isinstance(stored, dict), (where, stored)
        for key, value in written.items():
            assert key in stored, f"{where}.{key} was dropped"
            _assert_stored(value, stored[key], f"{where}.{key}")
    elif isinstance(written, list):
        assert isinstance(stored, list) and len(stored) == len(written), (where, stored)
        for i, (w, s) in enumerate(zip(written, stored, strict=True)):
            _assert_stored(w, s, f"{where}[{i}]")
    else:
        assert stored == written, (where, written, stored)


def test_the_operator_entry_point_parses_its_options() -> None:
    from kelastic_operator.__main__ import build_parser

    args = build_parser().parse_args(
        ["--etcd-endpoints", "a:1,b:2", "--namespace", "ml", "--standalone", "--priority", "5"]
    )
    assert (args.etcd_endpoints, args.namespace, args.standalone, args.priority) == (
        "a:1,b:2", ["ml"], True, 5)  # fmt: skip
    assert args.lease_name == "kelastic-operator"
    # the kopf-peering flag still works, naming the Lease now
    assert build_parser().parse_args(["--peering", "old"]).lease_name == "old"


def test_bad_leader_election_timings_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from kelastic_operator.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--lease-duration", "5", "--renew-deadline", "6"])
    assert exc.value.code == 2
    assert "renew deadline < lease duration" in capsys.readouterr().err


def test_no_kubernetes_credentials_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kelastic_operator.__main__ import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    empty = tmp_path / "kubeconfig"
    empty.write_text("")
    assert main(["--kubeconfig", str(empty), "--standalone", "--metrics-port=0",
                 "--health-port=0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("kelastic-operator: no Kubernetes credentials") and "Traceback" not in err
