"""The pod builder: the user's template plus the kelastic sidecar, volume, launcher and
labels; every built Pod validates with kubernetes-validate --strict against Kubernetes 1.33."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml

from kelastic import contract
from kelastic.launch import parse_args
from kelastic_operator.model import ElasticJobSpec, InProcessSpec, WarmStartSpec, load_manifest
from kelastic_operator.pods import (
    ETCD_TLS_MOUNT,
    PodBuildError,
    PodSettings,
    build_pod,
    launcher_command,
    pod_spec_hash,
)
from kelastic_sidecar.config import SidecarConfig

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples/digits/elasticjob.yaml"
SETTINGS = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd.kelastic:2379",))
UID = "0b7c6a3e-0000-4000-8000-000000000001"


def digits_spec(**changes: Any) -> ElasticJobSpec:
    spec = load_manifest(DIGITS).spec
    return spec.model_copy(update=changes) if changes else spec


def rich_spec() -> ElasticJobSpec:
    """A template using the fields users bring: they must survive untouched."""
    template = {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"note": "x"}},
        "spec": {
            "nodeSelector": {"gpu": "a100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "training",
            "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
            "containers": [
                {"name": "trainer", "image": "img", "command": ["torchrun-free", "main.py"],
                 "args": ["--lr", "0.1"], "env": [{"name": "A", "value": "1"}],
                 "resources": {"limits": {"nvidia.com/gpu": "8"}},
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                {"name": "helper", "image": "helper:1", "command": ["sleep", "inf"]},
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
        },
    }  # fmt: skip
    return ElasticJobSpec.model_validate(
        {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 3,
            "nprocPerNode": 8,
            "template": template,
            "rendezvous": {"tlsSecret": "etcd-client"},
        }
    )


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for c in spec["containers"] + spec["initContainers"]}


def resolve_env(container: dict[str, Any], pod: dict[str, Any], ip: str) -> dict[str, str]:
    """What the kubelet would hand the container (downward API resolved)."""
    fields = {"metadata.name": pod["metadata"]["name"], "metadata.uid": "pod-uid-1",
              "spec.nodeName": "gpu-node-7",
              "metadata.namespace": pod["metadata"]["namespace"], "status.podIP": ip}  # fmt: skip
    out = {}
    for item in container["env"]:
        if "value" in item:
            out[item["name"]] = item["value"]
        else:
            out[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def test_the_digits_pod() -> None:
    pod = build_pod("digits", "ml", UID, digits_spec(), 1, SETTINGS)
    meta, spec = pod["metadata"], pod["spec"]
    assert (meta["name"], meta["namespace"]) == ("digits-1", "ml")
    assert meta["labels"] == {
        "kelastic.dev/job-name": "digits",
        "kelastic.dev/replica-index": "1",
        "kelastic.dev/job-uid": UID,
    }
    assert meta["ownerReferences"] == [{"apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob", "name": "digits", "uid": UID, "controller": True,
        "blockOwnerDeletion": True}]  # fmt: skip
    assert spec["restartPolicy"] == "Never"
    assert spec["shareProcessNamespace"] is True
    assert spec["automountServiceAccountToken"] is False
    assert {"name": "kelastic-run", "emptyDir": {}} in spec["volumes"]
    run_mount = {"name": "kelastic-run", "mountPath": contract.DEFAULT_RUN_DIR}
    c = containers(pod)
    trainer, sidecar = c["trainer"], c["kelastic-sidecar"]
    user = yaml.safe_load(DIGITS.read_text())["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == [
        "python", "-m", "kelastic.launch", "--nproc-per-node", "2", "--",
        *user["command"], *user["args"],
    ]  # fmt: skip
    assert "args" not in trainer
    assert trainer["terminationMessagePath"] == contract.DEFAULT_TERMINATION_LOG
    assert trainer["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert run_mount in trainer["volumeMounts"] and run_mount in sidecar["volumeMounts"]
    assert {"name": "CHECKPOINT_DIR", "value": "/checkpoints"} in trainer["env"]
    assert trainer["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "kelastic-http"}
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"  # Ready = training
    assert sidecar["ports"][0]["containerPort"] == contract.DEFAULT_HTTP_PORT
    assert sidecar["image"] == "kelastic:test"
    assert spec["initContainers"][-1] is sidecar


def test_the_sidecar_env_is_exactly_what_the_sidecar_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = build_pod("digits", "ml", UID, digits_spec(), 0, SETTINGS)
    env = resolve_env(containers(pod)["kelastic-sidecar"], pod, "10.1.2.3")
    monkeypatch.setenv(contract.ENV_RUN_DIR, env[contract.ENV_RUN_DIR])
    cfg = SidecarConfig.from_env(env)
    assert (cfg.job_name, cfg.namespace, cfg.job_uid, cfg.node, cfg.pod_ip) == (
        "digits", "ml", UID, "digits-0", "10.1.2.3")  # fmt: skip
    assert cfg.etcd_endpoints == ("etcd.kelastic:2379",)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.max_restarts) == (1, 4, 2, 3)
    assert (cfg.last_call_timeout, cfg.join_timeout, cfg.lease_ttl) == (2.0, 600.0, 5)
    assert cfg.http_port == contract.DEFAULT_HTTP_PORT
    assert cfg.tls_dir is None
    assert str(cfg.run_dir) == contract.DEFAULT_RUN_DIR
    assert cfg.prefix == contract.job_prefix("ml", "digits", UID)
    # nothing the sidecar does not read
    known = {v for k, v in vars(contract).items() if k.startswith("ENV_")}
    assert set(env) <= known


def test_the_users_fields_are_kept() -> None:
    spec = rich_spec()
    before = copy.deepcopy(spec.template)
    pod = build_pod("big", "default", UID, spec, 2, SETTINGS)
    assert spec.template == before  # not modified in place
    p, c = pod["spec"], containers(pod)
    assert p["nodeSelector"] == {"gpu": "a100"}
    assert p["tolerations"] == before["spec"]["tolerations"]
    assert p["priorityClassName"] == "training"
    assert [i["name"] for i in p["initContainers"]] == ["fetch", "kelastic-sidecar"]
    assert [x["name"] for x in p["containers"]] == ["trainer", "helper"]
    assert c["helper"] == before["spec"]["containers"][1]
    assert c["trainer"]["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert c["trainer"]["env"][0] == {"name": "A", "value": "1"}
    assert c["trainer"]["command"][-5:] == ["--", "torchrun-free", "main.py", "--lr", "0.1"]
    assert c["trainer"]["command"][4] == "8"
    assert {"name": "data", "mountPath": "/data"} in c["trainer"]["volumeMounts"]
    assert [v["name"] for v in p["volumes"]] == ["data", "kelastic-run", "kelastic-etcd-tls"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["annotations"]["note"] == "x"
    env = {e["name"]: e.get("value") for e in c["kelastic-sidecar"]["env"]}
    assert env[contract.ENV_ETCD_TLS_DIR] == ETCD_TLS_MOUNT
    assert {"name": "kelastic-etcd-tls", "mountPath": ETCD_TLS_MOUNT, "readOnly": True} in c[
        "kelastic-sidecar"]["volumeMounts"]  # fmt: skip


def test_job_endpoints_win_and_none_at_all_is_an_error() -> None:
    spec = ElasticJobSpec.model_validate(
        {
            "replicas": 1,
            "template": rich_spec().template,
            "rendezvous": {"etcdEndpoints": ["a:1", "b:2"]},
        }
    )
    pod = build_pod("j", "default", UID, spec, 0, SETTINGS)
    env = {e["name"]: e.get("value") for e in containers(pod)["kelastic-sidecar"]["env"]}
    assert env[contract.ENV_ETCD_ENDPOINTS] == "a:1,b:2"
    with pytest.raises(PodBuildError, match="no etcd endpoint"):
        build_pod("j", "default", UID, digits_spec(), 0, PodSettings())


def test_launcher_command_needs_a_command() -> None:
    with pytest.raises(PodBuildError, match="needs a command"):
        launcher_command({"name": "t"}, 1)


def test_warm_start_flags_reach_the_launcher() -> None:
    spec = digits_spec().model_copy(
        update={"warm_start": WarmStartSpec(enabled=True, preload=["torch", "mylib.model"])}
    )
    command = containers(build_pod("digits", "default", UID, spec, 0, SETTINGS))["trainer"][
        "command"
    ]
    split = command.index("--")
    assert command[:split][-3:] == ["--warm-start", "--preload", "torch,mylib.model"]
    # the launcher's own parser takes them as such
    _, config = parse_args(command[command.index("kelastic.launch") + 1 :])
    assert (config.warm_start, config.preload) == (True, ("torch", "mylib.model"))
    assert config.cmd == command[split + 1 :]
    # disabled (the default): no flag at all
    cold = containers(build_pod("digits", "default", UID, digits_spec(), 0, SETTINGS))["trainer"]
    assert "--warm-start" not in cold["command"]


def test_built_pods_validate_strictly_against_kubernetes_1_33(tmp_path: Path) -> None:
    docs = [build_pod("digits", "default", UID, digits_spec(), i, SETTINGS) for i in range(2)]
    docs.append(build_pod("big", "default", UID, rich_spec(), 0, SETTINGS))
    for doc in docs:
        kv.validate(doc, "1.33.0", strict=True)  # raises ValidationError
    # the validator is strict indeed: an unknown field fails
    bad = copy.deepcopy(docs[0])
    bad["spec"]["initContainers"][-1]["restartPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.33.0", strict=True)
    # and the command line agrees (what CI runs on rendered manifests)
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.33.0", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource pod/") == 3, result.stdout


@pytest.mark.parametrize(
    ("pod_sc", "trainer_sc", "expected"),
    [
        # the trainer's user is known: the sidecar runs as it, no capability
        ({}, {"runAsUser": 1000, "runAsGroup": 1000},
         {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
          "capabilities": {"drop": ["ALL"]}}),
        ({"runAsUser": 1001}, {}, {"runAsUser": 1001, "runAsNonRoot": True,
                                   "capabilities": {"drop": ["ALL"]}}),
        ({"runAsUser": 1001}, {"runAsUser": 7}, {"runAsUser": 7, "runAsNonRoot": True,
                                                 "capabilities": {"drop": ["ALL"]}}),
        # root trainer: root sidecar that may only kill
        ({}, {"runAsUser": 0}, {"runAsUser": 0, "runAsNonRoot": False,
                                "capabilities": {"drop": ["ALL"], "add": ["KILL"]}}),
        # unknown (the image's user): root with CAP_KILL can signal any user
        ({}, {}, {"runAsUser": 0, "runAsNonRoot": False,
                  "capabilities": {"drop": ["ALL"], "add": ["KILL"]}}),
        # unknown but non-root required: the sidecar keeps its image's user
        ({"runAsNonRoot": True}, {}, {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}),
    ],
)  # fmt: skip
def test_sidecar_can_signal_the_trainers_workers(
    pod_sc: dict[str, Any], trainer_sc: dict[str, Any], expected: dict[str, Any]
) -> None:
    spec = digits_spec()
    template = copy.deepcopy(spec.template)
    template["spec"]["securityContext"] = pod_sc
    template["spec"]["containers"][0]["securityContext"] = trainer_sc
    spec = spec.model_copy(update={"template": template})
    pod = build_pod("digits", "default", UID, spec, 0, SETTINGS)
    sidecar = containers(pod)["kelastic-sidecar"]
    runtime_default = {"seccompProfile": {"type": "RuntimeDefault"}}
    assert sidecar["securityContext"] == {"allowPrivilegeEscalation": False, **runtime_default,
                                          **expected}  # fmt: skip
    # a Pod that names its seccomp profile keeps it for the sidecar too
    template["spec"]["securityContext"] = {**pod_sc, "seccompProfile": {"type": "Localhost",
                                           "localhostProfile": "p.json"}}  # fmt: skip
    spec = spec.model_copy(update={"template": template})
    pod = build_pod("digits", "default", UID, spec, 0, SETTINGS)
    assert "seccompProfile" not in containers(pod)["kelastic-sidecar"]["securityContext"]


def test_pods_carry_the_spec_hash_which_ignores_scaling() -> None:
    spec = digits_spec()
    pod = build_pod("digits", "default", UID, spec, 1, SETTINGS)
    digest = pod["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"]
    assert digest == pod_spec_hash(spec) and len(digest) == 16
    assert pod_spec_hash(spec.model_copy(update={"replicas": 9})) == digest
    changed = copy.deepcopy(spec.template)
    changed["spec"]["containers"][0]["image"] = "other:2"
    assert pod_spec_hash(spec.model_copy(update={"template": changed})) != digest


def _in_process(**fields: Any) -> ElasticJobSpec:
    return digits_spec(in_process=InProcessSpec.model_validate(fields))


INPROCESS_VARS = {
    contract.ENV_INPROCESS,
    contract.ENV_INPROCESS_MAX_RESTARTS,
    contract.ENV_INPROCESS_SOFT_TIMEOUT,
    contract.ENV_INPROCESS_HARD_TIMEOUT,
    contract.ENV_INPROCESS_SPARES,
}


def test_in_process_settings_reach_both_the_sidecar_and_the_trainer() -> None:
    spec = _in_process(enabled=True, maxRestarts=4, softTimeoutSeconds=2.5, hardTimeoutSeconds=7,
                       spareRanks=2)  # fmt: skip
    pod = build_pod("digits", "ml", UID, spec, 0, SETTINGS)
    want = {
        contract.ENV_INPROCESS: "1",
        contract.ENV_INPROCESS_MAX_RESTARTS: "4",
        contract.ENV_INPROCESS_SOFT_TIMEOUT: "2.5",
        contract.ENV_INPROCESS_HARD_TIMEOUT: "7",
        contract.ENV_INPROCESS_SPARES: "2",
    }
    for name in ("kelastic-sidecar", "trainer"):
        env = resolve_env(containers(pod)[name], pod, "10.1.2.3")
        assert {k: env[k] for k in INPROCESS_VARS} == want, name
    # the sidecar still reads its own config from the same env
    sidecar_env = resolve_env(containers(pod)["kelastic-sidecar"], pod, "10.1.2.3")
    assert SidecarConfig.from_env(sidecar_env).max_restarts == 3
    assert SidecarConfig.from_env(sidecar_env).inprocess.spare_ranks == 2
    # the user's other env is kept
    assert {"name": "CHECKPOINT_DIR", "value": "/checkpoints"} in containers(pod)["trainer"]["env"]


def test_disabled_in_process_puts_nothing_in_the_pod() -> None:
    for spec in (digits_spec(), _in_process(enabled=False, maxRestarts=2)):
        pod = build_pod("digits", "ml", UID, spec, 0, SETTINGS)
        for name in ("kelastic-sidecar", "trainer"):
            names = {e["name"] for e in containers(pod)[name]["env"]}
            assert not names & INPROCESS_VARS, name


def test_the_specs_in_process_settings_win_over_the_users_env() -> None:
    """Sidecar and workers must agree: a trainer env entry of the same name is replaced."""
    spec = _in_process(enabled=True, maxRestarts=4)
    template = copy.deepcopy(spec.template)
    template["spec"]["containers"][0]["env"].append(
        {"name": contract.ENV_INPROCESS_MAX_RESTARTS, "value": "99"}
    )
    spec = spec.model_copy(update={"template": template})
    trainer = containers(build_pod("digits", "ml", UID, spec, 0, SETTINGS))["trainer"]
    values = [
        e["value"] for e in trainer["env"] if e["name"] == contract.ENV_INPROCESS_MAX_RESTARTS
    ]
    assert values == ["4"]


def test_in_process_is_in_the_spec_hash_only_when_enabled() -> None:
    """Enabling it (or changing it while enabled) changes both containers' env: new Pods.
    While disabled it shapes nothing, so the field's arrival replaces no running Pod."""
    plain = pod_spec_hash(digits_spec())
    assert pod_spec_hash(_in_process(enabled=False, maxRestarts=1)) == plain
    on = pod_spec_hash(_in_process(enabled=True))
    assert on != plain
    assert pod_spec_hash(_in_process(enabled=True, softTimeoutSeconds=5)) != on
    pod = build_pod("digits", "ml", UID, _in_process(enabled=True), 0, SETTINGS)
    assert pod["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"] == on


def test_in_process_pods_validate_strictly_against_kubernetes_1_33() -> None:
    kv.validate(build_pod("digits", "ml", UID, _in_process(enabled=True), 0, SETTINGS),
                "1.33.0", strict=True)  # fmt: skip
