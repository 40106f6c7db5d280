"""spec.checkpoint.memory: the model's bounds, the Pod's memory-backed volume in both
containers, the sidecar's env, the spec digest, and the sidecar's check at its start."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml
from pydantic import ValidationError

from kelastic import contract
from kelastic_operator.model import CheckpointSpec, ElasticJobSpec, load_manifest, parse_job
from kelastic_operator.pods import PodSettings, build_pod, pod_spec_hash
from kelastic_sidecar.checkpoint_volume import prepare_volume
from tests.k8s.cluster import Client, ControlPlane
from tests.k8s.nodes import ManualNode

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd.kelastic:2379",))
UID = "0b7c6a3e-0000-4000-8000-000000000001"


def _spec(memory: str | None) -> ElasticJobSpec:
    spec = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    return spec.model_copy(update={"checkpoint": CheckpointSpec(memory=memory)})


def _as_pinned(spec: ElasticJobSpec) -> ElasticJobSpec:
    """``spec`` with the example's trainer as it was when the digests were pinned: the
    example has since turned torch's flight recorder on (an input of the digest, not the
    operator's doing); the pin is of the operator's Pod for one fixed input."""
    template = copy.deepcopy(spec.template)
    trainer = template["spec"]["containers"][0]
    trainer["env"] = [e for e in trainer["env"] if e["name"] != "TORCH_FR_BUFFER_SIZE"]
    return spec.model_copy(update={"template": template})


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}


@pytest.mark.parametrize(("memory", "size"), [("512Mi", 512 << 20), ("2G", 2 * 10**9),
                                              ("1Ti", 1 << 40), ("4096", 4096)])  # fmt: skip
def test_the_memory_quantity_is_read_in_bytes(memory: str, size: int) -> None:
    assert CheckpointSpec(memory=memory).memory_bytes == size


@pytest.mark.parametrize("memory", ["0", "0Mi", "1.5Gi", "512MB", "1e9", "-1Gi", "", "Mi"])
def test_a_bad_memory_quantity_is_refused_with_the_pattern(memory: str) -> None:
    with pytest.raises(ValidationError, match="pattern"):
        CheckpointSpec.model_validate({"memory": memory})


def test_the_volume_is_memory_backed_and_mounted_in_both_containers() -> None:
    pod = build_pod("digits", "ml", UID, _spec("256Mi"), 0, SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[contract.CHECKPOINT_VOLUME_NAME] == {
        "name": contract.CHECKPOINT_VOLUME_NAME,
        "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"},
    }
    for name, c in _containers(pod).items():
        if name not in ("trainer", "kelastic-sidecar"):
            continue
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts[contract.CHECKPOINT_VOLUME_NAME] == contract.DEFAULT_CHECKPOINT_DIR, name
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[contract.ENV_CHECKPOINT_DIR] == contract.DEFAULT_CHECKPOINT_DIR, name
    sidecar_env = {e["name"]: e.get("value") for e in _containers(pod)["kelastic-sidecar"]["env"]}
    assert sidecar_env[contract.ENV_CHECKPOINT_MEMORY] == str(256 << 20)
    kv.validate(pod, "1.33.0", strict=True)


@pytest.mark.parametrize(
    ("limits", "memory", "want"),
    [({"memory": "256Mi"}, "512Mi", {"memory": "768Mi"}),  # the volume's bytes on top
     ({"memory": "256Mi"}, "2G", {"memory": str((256 << 20) + 2 * 10**9)}),
     ({"memory": "256Mi"}, None, {"memory": "256Mi"}),  # no volume: as configured
     ({"cpu": "1"}, "512Mi", {"cpu": "1"}),  # no memory limit: none added
     ({"memory": "0.5Gi"}, "512Mi", {"memory": "0.5Gi"})],  # a form we do not read: kept
)  # fmt: skip
def test_the_sidecars_memory_limit_grows_by_the_volume_it_writes_at_start(
    limits: dict[str, str], memory: str | None, want: dict[str, str]
) -> None:
    """tmpfs pages are charged to the process that writes them: the sidecar writes the
    whole volume once at its start (and frees it), which under its own 256Mi limit got it
    OOM-killed at every start for a 512Mi volume. Its request stays as it is."""
    resources = {"requests": {"memory": "64Mi"}, "limits": limits}
    settings = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd:2379",),
                           sidecar_resources=resources)  # fmt: skip
    pod = build_pod("digits", "ml", UID, _spec(memory), 0, settings)
    got = _containers(pod)["kelastic-sidecar"]["resources"]
    assert got == {"requests": {"memory": "64Mi"}, "limits": want}
    assert settings.sidecar_resources["limits"] == limits  # the settings untouched
    kv.validate(pod, "1.33.0", strict=True)


def test_without_memory_the_pod_has_no_volume_and_its_digest_is_unchanged() -> None:
    pod = build_pod("digits", "ml", UID, _spec(None), 0, SETTINGS)
    assert contract.CHECKPOINT_VOLUME_NAME not in {v["name"] for v in pod["spec"]["volumes"]}
    for c in _containers(pod).values():
        names = {e["name"] for e in c.get("env") or []}
        assert not names & {contract.ENV_CHECKPOINT_MEMORY, contract.ENV_CHECKPOINT_DIR}
    doc = yaml.safe_load((ROOT / "examples/digits/elasticjob.yaml").read_text())
    del doc["spec"]["checkpoint"]  # a job written before the field existed
    plain = parse_job(doc).spec
    assert pod_spec_hash(_spec(None)) == pod_spec_hash(plain)  # running Pods are kept
    assert pod_spec_hash(_spec("1Gi")) != pod_spec_hash(plain)
    assert pod_spec_hash(_spec("1Gi")) != pod_spec_hash(_spec("2Gi"))


def test_the_sidecar_allocates_the_volume_at_start_or_names_the_size(tmp_path: Path) -> None:
    env = {contract.ENV_CHECKPOINT_DIR: str(tmp_path)}
    assert prepare_volume(env) == 0  # no volume: nothing to do
    assert prepare_volume({**env, contract.ENV_CHECKPOINT_MEMORY: str(3 << 20)}) == 3 << 20
    assert list(tmp_path.iterdir()) == []  # the check's file is gone
    huge = 1 << 50  # 1 PiB
    with pytest.raises(ValueError, match=rf"\({huge} bytes, spec.checkpoint.memory\).*"
                                         rf"{huge} more bytes"):  # fmt: skip
        prepare_volume({**env, contract.ENV_CHECKPOINT_MEMORY: str(huge)})
    with pytest.raises(ValueError, match="does not exist"):
        prepare_volume({contract.ENV_CHECKPOINT_DIR: str(tmp_path / "x"),
                        contract.ENV_CHECKPOINT_MEMORY: "4096"})  # fmt: skip
    for bad in ("-1", "1Gi", "0", "x"):
        with pytest.raises(ValueError, match="is not a size in bytes"):
            prepare_volume({**env, contract.ENV_CHECKPOINT_MEMORY: bad})


# ------------------------------------------------------------------- spec.checkpoint.persist


def _persisting(**persist: Any) -> ElasticJobSpec:
    spec = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["checkpoint"] = {"memory": "64Mi", "persist": {"volume": "checkpoints", **persist}}
    return ElasticJobSpec.model_validate(doc)


def test_persist_mounts_the_shared_volume_in_the_sidecar_and_sets_its_env() -> None:
    spec = _persisting(path="runs/digits", everySteps=50, onStop=False, keep=5)
    pod = build_pod("digits", "ml", UID, spec, 0, SETTINGS)
    sidecar = _containers(pod)["kelastic-sidecar"]
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["checkpoints"] == contract.PERSIST_MOUNT
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_CHECKPOINT_PERSIST_DIR] == f"{contract.PERSIST_MOUNT}/runs/digits"
    assert env[contract.ENV_CHECKPOINT_PERSIST_EVERY] == "50"
    assert env[contract.ENV_CHECKPOINT_PERSIST_ON_STOP] == "0"
    assert env[contract.ENV_CHECKPOINT_PERSIST_KEEP] == "5"
    # the sidecar reads exactly what the operator wrote
    from kelastic_sidecar.config import PersistSettings, SidecarConfig

    downward = {contract.ENV_POD_NAME: "digits-0", contract.ENV_NAMESPACE: "ml"}
    cfg = SidecarConfig.from_env({k: v for k, v in env.items() if v is not None} | downward)
    assert cfg.persist == PersistSettings(
        Path(contract.PERSIST_MOUNT) / "runs/digits", 50, False, 5
    )
    # the trainer's own mount of the volume is untouched; its saves mark the due steps;
    # it sees the folder read only at the sidecar's path (a step restored from disk)
    trainer = _containers(pod)["trainer"]
    trainer_env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert trainer_env[contract.ENV_CHECKPOINT_PERSIST_EVERY] == "50"
    assert (
        trainer_env[contract.ENV_CHECKPOINT_PERSIST_DIR] == env[contract.ENV_CHECKPOINT_PERSIST_DIR]
    )
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in trainer["volumeMounts"]
    assert {"name": "checkpoints", "mountPath": contract.PERSIST_MOUNT,
            "readOnly": True} in trainer["volumeMounts"]  # fmt: skip
    kv.validate(pod, "1.33", strict=True)


def test_the_trainers_mount_at_the_persistence_path_is_kelastics() -> None:
    """A user's own mount at kelastic's path (and their own env entry of the folder) is
    replaced: two mounts at one path would be refused; without ``everySteps`` the
    trainer still gets the folder (a stop persists, a later round restores from it)."""
    spec = _persisting()
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    trainer = doc["template"]["spec"]["containers"][0]
    trainer["volumeMounts"].append({"name": "checkpoints", "mountPath": contract.PERSIST_MOUNT})
    trainer.setdefault("env", []).append(
        {"name": contract.ENV_CHECKPOINT_PERSIST_DIR, "value": "/elsewhere"})  # fmt: skip
    pod = build_pod("digits", "ml", UID, ElasticJobSpec.model_validate(doc), 0, SETTINGS)
    built = _containers(pod)["trainer"]
    at_path = [m for m in built["volumeMounts"] if m["mountPath"] == contract.PERSIST_MOUNT]
    assert at_path == [{"name": "checkpoints", "mountPath": contract.PERSIST_MOUNT,
                        "readOnly": True}]  # fmt: skip
    env = [e for e in built["env"] if e["name"] == contract.ENV_CHECKPOINT_PERSIST_DIR]
    assert env == [{"name": contract.ENV_CHECKPOINT_PERSIST_DIR,
                    "value": f"{contract.PERSIST_MOUNT}/kelastic-checkpoints"}]  # fmt: skip
    assert not any(e["name"] == contract.ENV_CHECKPOINT_PERSIST_EVERY for e in built["env"])
    kv.validate(pod, "1.33", strict=True)


def test_persist_defaults_and_the_digest_of_jobs_without_it() -> None:
    spec = _persisting()
    persist = spec.checkpoint.persist
    assert persist is not None
    assert (persist.path, persist.every_steps, persist.on_stop, persist.keep) == (
        "kelastic-checkpoints", 0, True, contract.DEFAULT_PERSIST_KEEP)  # fmt: skip
    # a job with memory and no persist keeps the digest it had before persist existed (as
    # computed by the commit before it, 64ae9eb): its running Pods are not replaced
    assert pod_spec_hash(_as_pinned(_spec("64Mi"))) == "0be377ee2335514c"
    assert pod_spec_hash(_as_pinned(_spec(None))) == "d5f8f11bc12031ee"
    without = _spec("64Mi")
    assert pod_spec_hash(without) != pod_spec_hash(spec)
    assert pod_spec_hash(_persisting(everySteps=1)) != pod_spec_hash(spec)


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"persist": {"volume": "checkpoints"}}, "checkpoint.persist needs checkpoint.memory"),
        ({"memory": "64Mi", "persist": {"volume": "nope"}}, "'nope' is not a volume of"),
        ({"memory": "64Mi", "persist": {"volume": "Bad_Name"}}, "pattern"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "path": "../up"}}, "pattern"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "path": "/abs"}}, "pattern"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "path": "a/./b"}}, "pattern"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "path": "a" * 256}}, "at most"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "everySteps": -1}}, "greater"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "everySteps": 10**10}}, "less"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "keep": 0}}, "greater"),
        ({"memory": "64Mi", "persist": {"volume": "checkpoints", "extra": 1}}, "Extra inputs"),
        ({"memory": "64Mi", "persist": {}}, "volume"),
        ({"memory": "64Mi", "persist": {"volume": "kelastic-checkpoints"}}, "kelastic makes"),
        ({"memory": "64Mi", "persist": {"volume": "kelastic-run"}}, "kelastic makes"),
    ],
    ids=[
        "no-memory",
        "unknown-volume",
        "bad-volume-name",
        "dotdot",
        "absolute",
        "dot",
        "long",
        "negative-every",
        "huge-every",
        "keep-zero",
        "unknown-field",
        "no-volume",
        "our-checkpoint-volume",
        "our-run-volume",
    ],
)
def test_a_bad_persist_spec_is_refused_clearly(checkpoint: dict[str, Any], message: str) -> None:
    spec = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["checkpoint"] = checkpoint
    with pytest.raises(ValidationError, match=message):
        ElasticJobSpec.model_validate(doc)


def _replicating(**checkpoint: Any) -> ElasticJobSpec:
    spec = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["checkpoint"] = {"memory": "64Mi", "replicas": 1, **checkpoint}
    return ElasticJobSpec.model_validate(doc)


def test_replicas_give_the_sidecar_its_port_and_env_and_the_sidecar_reads_them() -> None:
    spec = _replicating(replicationRate="100Mi", replicateEverySteps=25)
    pod = build_pod("digits", "ml", UID, spec, 0, SETTINGS)
    sidecar = _containers(pod)["kelastic-sidecar"]
    assert {"name": contract.REPLICA_PORT_NAME, "containerPort": contract.DEFAULT_REPLICA_PORT,
            "protocol": "TCP"} in sidecar["ports"]  # fmt: skip
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_CHECKPOINT_REPLICAS] == "1"
    assert env[contract.ENV_CHECKPOINT_REPLICATION_RATE] == str(100 << 20)
    assert env[contract.ENV_REPLICA_PORT] == str(contract.DEFAULT_REPLICA_PORT)
    assert env[contract.ENV_CHECKPOINT_REPLICATE_EVERY] == "25"
    zone = {e["name"]: e.get("valueFrom") for e in sidecar["env"]}[contract.ENV_FAILURE_DOMAIN]
    assert zone == {
        "fieldRef": {
            "apiVersion": "v1",
            "fieldPath": "metadata.labels['topology.kubernetes.io/zone']",
        }
    }
    from kelastic_sidecar.config import ReplicationSettings, SidecarConfig

    downward = {contract.ENV_POD_NAME: "digits-0", contract.ENV_NAMESPACE: "ml"}
    cfg = SidecarConfig.from_env({k: v for k, v in env.items() if v is not None} | downward)
    assert cfg.replication == ReplicationSettings(
        replicas=1, every=25, rate=100 << 20, port=contract.DEFAULT_REPLICA_PORT,
        max_slot_bytes=64 << 20)  # fmt: skip
    kv.validate(pod, "1.33", strict=True)
    # the default rate; and no replicas: no port, no env, no replication in the sidecar
    default = build_pod("digits", "ml", UID, _replicating(), 0, SETTINGS)
    env = {e["name"]: e.get("value") for e in _containers(default)["kelastic-sidecar"]["env"]}
    assert env[contract.ENV_CHECKPOINT_REPLICATION_RATE] == str(contract.DEFAULT_REPLICATION_RATE)
    assert env[contract.ENV_CHECKPOINT_REPLICATE_EVERY] == str(contract.DEFAULT_REPLICATE_EVERY)
    plain = _containers(build_pod("digits", "ml", UID, _spec("64Mi"), 0, SETTINGS))
    assert [p["name"] for p in plain["kelastic-sidecar"]["ports"]] == ["kelastic-http"]
    names = {e["name"] for e in plain["kelastic-sidecar"]["env"]}
    assert not names & {contract.ENV_CHECKPOINT_REPLICAS, contract.ENV_REPLICA_PORT,
                        contract.ENV_FAILURE_DOMAIN}  # fmt: skip
    # a job without replicas keeps its digest (its running Pods are not replaced)
    assert pod_spec_hash(_as_pinned(_spec("64Mi"))) == "0be377ee2335514c"
    assert pod_spec_hash(_replicating()) != pod_spec_hash(_spec("64Mi"))


def test_a_replicated_state_serves_the_slots_and_says_its_layout() -> None:
    spec = _replicating(replicas=0, stateLayout="Replicated")
    pod = build_pod("digits", "ml", UID, spec, 0, SETTINGS)
    sidecar = _containers(pod)["kelastic-sidecar"]
    assert contract.REPLICA_PORT_NAME in [p["name"] for p in sidecar["ports"]]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_CHECKPOINT_LAYOUT] == "replicated"
    assert env[contract.ENV_REPLICA_PORT] == str(contract.DEFAULT_REPLICA_PORT)
    assert contract.ENV_CHECKPOINT_REPLICAS not in env  # served, not sent
    from kelastic_sidecar.config import SidecarConfig

    downward = {contract.ENV_POD_NAME: "digits-0", contract.ENV_NAMESPACE: "ml"}
    cfg = SidecarConfig.from_env({k: v for k, v in env.items() if v is not None} | downward)
    assert cfg.layout is contract.StateLayout.REPLICATED
    assert cfg.replication is not None and cfg.replication.replicas == 0
    kv.validate(pod, "1.33", strict=True)
    # with replicas too: one port, one variable each
    both = _containers(build_pod("digits", "ml", UID, _replicating(stateLayout="Replicated"),
                                 0, SETTINGS))["kelastic-sidecar"]  # fmt: skip
    assert [p["name"] for p in both["ports"]].count(contract.REPLICA_PORT_NAME) == 1
    assert [e["name"] for e in both["env"]].count(contract.ENV_REPLICA_PORT) == 1
    # Sharded, the default, leaves the Pod and its digest as they were; Replicated is a
    # new Pod (its sidecar serves)
    sharded = _replicating(replicas=0, stateLayout="Sharded")
    assert pod_spec_hash(sharded) == pod_spec_hash(_spec("64Mi"))
    assert pod_spec_hash(_as_pinned(sharded)) == "0be377ee2335514c"
    assert pod_spec_hash(spec) != pod_spec_hash(sharded)


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"memory": "64Mi", "stateLayout": "replicated"}, "'Sharded' or 'Replicated'"),
        ({"replicas": 1}, "checkpoint.replicas needs checkpoint.memory"),
        ({"memory": "64Mi", "replicas": 2}, "less than or equal to 1"),
        ({"memory": "64Mi", "replicas": -1}, "greater than or equal to 0"),
        ({"memory": "64Mi", "replicas": 1, "replicationRate": "1.5Gi"}, "pattern"),
        ({"memory": "64Mi", "replicas": 1, "replicationRate": "0"}, "pattern"),
        ({"memory": "64Mi", "replicas": 1, "replicateEverySteps": 0}, "greater than or equal"),
    ],
    ids=["bad-layout", "no-memory", "two", "negative", "bad-rate", "zero-rate", "every-zero"],
)
def test_a_bad_replicas_spec_is_refused_clearly(checkpoint: dict[str, Any], message: str) -> None:
    spec = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["checkpoint"] = checkpoint
    with pytest.raises(ValidationError, match=message):
        ElasticJobSpec.model_validate(doc)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({contract.ENV_CHECKPOINT_REPLICAS: "2"}, "REPLICAS must be 0..1"),
        ({contract.ENV_CHECKPOINT_REPLICAS: "x"}, "not a valid int"),
        (
            {contract.ENV_CHECKPOINT_REPLICAS: "1", contract.ENV_REPLICA_PORT: "70000"},
            "REPLICA_PORT must be 0..65535",
        ),
        (
            {contract.ENV_CHECKPOINT_REPLICAS: "1", contract.ENV_CHECKPOINT_REPLICATION_RATE: "-5"},
            "RATE must be 0..2\\*\\*40",
        ),
        (
            {contract.ENV_CHECKPOINT_REPLICAS: "1", contract.ENV_CHECKPOINT_REPLICATE_EVERY: "0"},
            "REPLICATE_EVERY must be 1..",
        ),
    ],
)
def test_the_sidecar_refuses_bad_replication_settings(env: dict[str, str], message: str) -> None:
    from kelastic_sidecar.config import ConfigError, SidecarConfig

    base = {contract.ENV_POD_NAME: "digits-0", contract.ENV_JOB_NAME: "digits",
            contract.ENV_JOB_UID: "u", contract.ENV_ETCD_ENDPOINTS: "127.0.0.1:2379",
            contract.ENV_MIN_NODES: "1", contract.ENV_MAX_NODES: "2"}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        SidecarConfig.from_env(base | env)
    assert SidecarConfig.from_env(base).replication is None


def test_the_api_server_takes_the_layouts_and_refuses_another(k8s: Client) -> None:
    doc = yaml.safe_load((ROOT / "examples/digits/elasticjob.yaml").read_text())
    doc["spec"]["checkpoint"] = {"memory": "64Mi", "stateLayout": "DDP"}
    result = k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert 'spec.checkpoint.stateLayout: Unsupported value: "DDP"' in result.stderr, result.stderr
    assert not k8s.objects("elasticjobs")
    doc["spec"]["checkpoint"] = {"memory": "64Mi"}
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    stored = k8s.get("elasticjob", doc["metadata"]["name"])
    assert stored is not None and stored["spec"]["checkpoint"]["stateLayout"] == "Sharded"
    doc["spec"]["checkpoint"]["stateLayout"] = "Replicated"
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    stored = k8s.get("elasticjob", doc["metadata"]["name"])
    assert stored is not None and parse_job(stored).spec.checkpoint.replicated


def test_a_pod_bound_to_a_node_carries_its_zone_for_the_sidecar(
    k8s_cluster: ControlPlane, k8s: Client
) -> None:
    """The sidecar's failure domain comes from the Pod's zone label, which the API server
    copies from the Node at binding (PodTopologyLabels, on by default since 1.35): a Pod
    of a job with replicas, placed on a Node of zone ``z-1``, carries the label its
    sidecar's ``fieldRef`` reads."""
    spec = _replicating()
    pod = build_pod("digits", k8s.namespace, UID, spec, 0, SETTINGS)
    with ManualNode(k8s_cluster, "zoned", labels={contract.ZONE_LABEL: "z-1"}) as node:
        pod["spec"]["nodeName"] = node.name  # bound at creation, as the scheduler binds it
        pod["metadata"].pop("ownerReferences", None)
        k8s.kubectl("create", "-f", "-", input=yaml.safe_dump(pod))
        stored = k8s.get("pod", pod["metadata"]["name"])
        assert stored is not None
        assert stored["metadata"]["labels"].get(contract.ZONE_LABEL) == "z-1", stored["metadata"]
        k8s.kubectl("delete", "pod", pod["metadata"]["name"], "--grace-period=0", "--force")
