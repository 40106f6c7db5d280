"""The official ``kubernetes`` client against the emulator."""
# The typed `kubernetes` models want model objects and Optional checks; these tests pass plain
# dicts (which the client accepts) and read back fields they have just written.
# mypy: disable-error-code="arg-type,index,union-attr,return-value,no-untyped-call"

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ProtocolError

from .harness import SAMPLE_CRD, K8sApi, load_manifests, wait_until

GROUP, VERSION, PLURAL = "emulator.kelastic.dev", "v1", "samplejobs"


@pytest.fixture
def api_client(k8s_api: K8sApi) -> Iterator[client.ApiClient]:
    with k8s_api.api_client() as api:
        yield api


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def custom(api_client: client.ApiClient) -> client.CustomObjectsApi:
    (crd,) = load_manifests(SAMPLE_CRD)
    client.ApiextensionsV1Api(api_client).create_custom_resource_definition(crd)
    return client.CustomObjectsApi(api_client)


def pod(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, **meta},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }


def job(name: str, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SampleJob",
        "metadata": {"name": name},
        "spec": {"image": "busybox", "replicas": replicas, **spec},
    }


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    assert body["kind"] == "Status" and body["code"] == exc.status
    return body


def test_crud_with_metadata_and_errors(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_config_map(
        "default", {"metadata": {"name": "cfg"}, "data": {"a": "1"}}
    )
    meta = created.metadata
    assert meta.uid and meta.resource_version and meta.creation_timestamp
    assert meta.generation is None  # only workloads and custom resources track a generation

    with pytest.raises(ApiException) as exists:
        core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}})
    assert exists.value.status == 409 and status_of(exists.value)["reason"] == "AlreadyExists"

    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("nope", "default")
    assert missing.value.status == 404
    assert status_of(missing.value)["message"] == 'configmaps "nope" not found'

    created.data["a"] = "2"
    replaced = core.replace_namespaced_config_map("cfg", "default", created)
    assert int(replaced.metadata.resource_version) > int(meta.resource_version)
    assert replaced.metadata.uid == meta.uid

    created.data["a"] = "3"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as stale:
        core.replace_namespaced_config_map("cfg", "default", created)
    assert stale.value.status == 409 and status_of(stale.value)["reason"] == "Conflict"

    listed = core.list_namespaced_config_map("default")
    assert [c.metadata.name for c in listed.items] == ["cfg"]
    assert int(listed.metadata.resource_version) >= int(replaced.metadata.resource_version)

    generated = core.create_namespaced_config_map("default", {"metadata": {"generateName": "gen-"}})
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9

    with pytest.raises(ApiException) as no_ns:
        core.create_namespaced_config_map("absent", {"metadata": {"name": "x"}})
    assert no_ns.value.status == 404

    core.delete_namespaced_config_map("cfg", "default")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("cfg", "default")
    assert gone.value.status == 404


def test_label_and_field_selectors(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod("a", {"app": "x", "tier": "web"}))
    core.create_namespaced_pod("default", pod("b", {"app": "y", "tier": "db"}))
    core.create_namespaced_pod("default", pod("c", {"tier": "web"}))

    def names(**kw: str) -> list[str | None]:
        return [p.metadata.name for p in core.list_namespaced_pod("default", **kw).items]

    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app!=x") == ["b", "c"]
    assert names(label_selector="app in (x, y)") == ["a", "b"]
    assert names(label_selector="tier notin (db),app") == ["a"]
    assert names(label_selector="!app") == ["c"]
    assert names(label_selector="tier=web,app=x") == ["a"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.namespace=default,metadata.name!=b") == ["a", "c"]

    core.patch_namespaced_pod_status("b", "default", {"status": {"phase": "Running"}})
    assert names(field_selector="status.phase=Running") == ["b"]
    assert names(field_selector="status.phase=Pending") == ["a", "c"]
    all_ns = core.list_pod_for_all_namespaces(label_selector="tier=web")
    assert [p.metadata.name for p in all_ns.items] == ["a", "c"]

    with pytest.raises(ApiException) as bad:
        core.list_namespaced_pod("default", label_selector="a in (b")
    assert bad.value.status == 400


def test_watch_events_resume_and_gone(k8s_api: K8sApi, core: client.CoreV1Api) -> None:
    events: list[tuple[str, str, str]] = []
    watcher = watch.Watch()

    def consume() -> None:
        stream = watcher.stream(
            core.list_namespaced_pod, "default", label_selector="app=x", timeout_seconds=20
        )
        with contextlib.suppress(ProtocolError):  # Watch.stop() shuts the socket down
            for event in stream:
                obj = event["object"]
                events.append((event["type"], obj.metadata.name, obj.status.phase or ""))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(
        lambda: any("watch=true" in path for _, path, _ in k8s_api.requests), what="watch request"
    )

    first = core.create_namespaced_pod("default", pod("w", {"app": "x"}))
    core.create_namespaced_pod("default", pod("other", {"app": "y"}))  # filtered out
    core.patch_namespaced_pod_status("w", "default", {"status": {"phase": "Running"}})
    core.patch_namespaced_pod(
        "w", "default", {"metadata": {"labels": {"app": "z"}}}
    )  # leaves the selection
    core.patch_namespaced_pod(
        "w", "default", {"metadata": {"labels": {"app": "x"}}}
    )  # enters again
    core.delete_namespaced_pod("w", "default")
    wait_until(lambda: len(events) >= 5, what="5 watch events")
    watcher.stop()
    assert events == [
        ("ADDED", "w", "Pending"),
        ("MODIFIED", "w", "Running"),
        ("DELETED", "w", "Running"),
        ("ADDED", "w", "Running"),
        ("DELETED", "w", "Running"),
    ]

    # Resuming from a resourceVersion replays what happened after it.
    resumed = watch.Watch().stream(
        core.list_namespaced_pod,
        "default",
        resource_version=first.metadata.resource_version,
        timeout_seconds=1,
    )
    replayed = [(e["type"], e["object"].metadata.name) for e in resumed]
    assert replayed[:2] == [("ADDED", "other"), ("MODIFIED", "w")]
    assert replayed[-1] == ("DELETED", "w")

    # After compaction, an old resourceVersion is 410 Gone (the client raises it).
    k8s_api.call(k8s_api.store.compact)
    with pytest.raises(ApiException) as gone:
        list(
            watch.Watch().stream(
                core.list_namespaced_pod,
                "default",
                resource_version=first.metadata.resource_version,
                timeout_seconds=1,
            )
        )
    assert gone.value.status == 410


def test_custom_resources_schema_status_and_scale(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("j1"))
    assert created["spec"] == {
        "image": "busybox",
        "replicas": 2,
        "minReplicas": 1,  # defaults from the schema
        "maxReplicas": 8,
        "restartPolicy": "OnFailure",
    }
    assert created["metadata"]["generation"] == 1

    for bad_spec, message in [
        ({"replicas": 100}, "spec.replicas in body should be less than or equal to 64"),
        ({"replicas": "two"}, "spec.replicas in body must be of type integer"),
        ({"minReplicas": 3}, "minReplicas must not exceed replicas"),
        ({"replicas": 9}, "replicas must not exceed maxReplicas"),
        ({"restartPolicy": "Always"}, 'supported values: "Never", "OnFailure"'),
    ]:
        with pytest.raises(ApiException) as invalid:
            custom.create_namespaced_custom_object(
                GROUP, VERSION, "default", PLURAL, job("bad", **bad_spec)
            )
        assert invalid.value.status == 422
        status = status_of(invalid.value)
        assert status["reason"] == "Invalid" and message in status["message"], status
    with pytest.raises(ApiException) as no_image:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, {**job("bad"), "spec": {"replicas": 1}}
        )
    assert "spec.image: Required value" in status_of(no_image.value)["message"]

    # The status subresource: status writes do not bump the generation; spec writes do.
    patched = custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        "j1",
        {"status": {"phase": "Running", "replicas": 2, "selector": "job=j1"}},
    )
    assert patched["status"]["phase"] == "Running" and patched["metadata"]["generation"] == 1
    ignored = custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        "j1",
        {"spec": {"replicas": 3}, "status": {"phase": "Hacked"}},
    )
    assert ignored["status"]["phase"] == "Running" and ignored["metadata"]["generation"] == 2

    # The scale subresource maps onto specReplicasPath/statusReplicasPath/labelSelectorPath.
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "j1")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 2, "selector": "job=j1"}
    scaled = custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, "j1", {"spec": {"replicas": 5}}
    )
    assert scaled["spec"]["replicas"] == 5
    assert (
        custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "j1")["spec"][
            "replicas"
        ]
        == 5
    )
    with pytest.raises(ApiException) as too_many:  # the CEL rule still applies through /scale
        custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, "default", PLURAL, "j1", {"spec": {"replicas": 9}}
        )
    assert too_many.value.status == 422

    # Unknown fields are pruned (the client does not ask for strict validation).
    pruned = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "j1", {"spec": {"bogus": 1}}
    )
    assert "bogus" not in pruned["spec"]


def test_patch_flavours(k8s_api: K8sApi, core: client.CoreV1Api) -> None:
    spec = pod("p")
    spec["spec"]["containers"] = [
        {"name": "main", "image": "busybox", "env": [{"name": "A", "value": "1"}]},
        {"name": "side", "image": "busybox"},
    ]
    core.create_namespaced_pod("default", spec)

    # Strategic merge (the client's default for dicts): containers and env merge by name.
    strategic = {"spec": {"containers": [{"name": "main", "env": [{"name": "B", "value": "2"}]}]}}
    merged = core.patch_namespaced_pod("p", "default", strategic)
    main = merged.spec.containers[0]
    assert [c.name for c in merged.spec.containers] == ["main", "side"]
    assert [(e.name, e.value) for e in main.env] == [
        ("A", "1"),
        ("B", "2"),
    ] and main.image == "busybox"

    # JSON patch, with a failing "test" -> 422 (kopf relies on this).
    rv = merged.metadata.resource_version
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/labels", "value": {"k": "v"}},
    ]
    assert core.patch_namespaced_pod("p", "default", ops).metadata.labels == {"k": "v"}
    with pytest.raises(ApiException) as failed:
        core.patch_namespaced_pod("p", "default", ops)
    assert failed.value.status == 422

    # Merge patch (raw HTTP): lists are replaced, null deletes.
    patch = {
        "metadata": {"labels": {"k": None}},
        "spec": {"containers": [{"name": "only", "image": "x"}]},
    }
    code, body = k8s_api.request(
        "PATCH", "/api/v1/namespaces/default/pods/p", patch, "application/merge-patch+json"
    )
    assert code == 200 and "labels" not in body["metadata"]
    assert body["spec"]["containers"] == [{"name": "only", "image": "x"}]

    # Strategic merge is not for custom resources, and unknown patch types are refused: 415.
    code, body = k8s_api.request(
        "PATCH", "/api/v1/namespaces/default/pods/p", {}, "application/x-unknown"
    )
    assert code == 415 and body["reason"] == "UnsupportedMediaType"


def test_finalizers_owner_gc_and_namespace_cleanup(k8s_api: K8sApi, core: client.CoreV1Api) -> None:
    # Finalizers: DELETE only marks; removing the last finalizer deletes.
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "held", "finalizers": ["x/y"]}}
    )
    core.delete_namespaced_config_map("held", "default")
    held = core.read_namespaced_config_map("held", "default")
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as new_finalizer:
        core.patch_namespaced_config_map(
            "held", "default", {"metadata": {"finalizers": ["x/y", "z/w"]}}
        )
    assert new_finalizer.value.status == 422
    core.patch_namespaced_config_map(
        "held", "default", [{"op": "remove", "path": "/metadata/finalizers"}]
    )
    assert "held" not in k8s_api.names("ConfigMap", "default")

    # Owner references: deleting the owner deletes dependents in the background...
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_pod("default", pod("child", ownerReferences=[ref]))
    child_uid = core.read_namespaced_pod("child", "default").metadata.uid
    child_ref = {"apiVersion": "v1", "kind": "Pod", "name": "child", "uid": child_uid}
    core.create_namespaced_pod("default", pod("grandchild", ownerReferences=[child_ref]))
    core.delete_namespaced_config_map("owner", "default")
    wait_until(lambda: not k8s_api.names("Pod", "default"), what="dependents collected")

    # ...unless orphaned.
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner2"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner2", "uid": owner.metadata.uid}
    core.create_namespaced_pod("default", pod("orphan", ownerReferences=[ref]))
    core.delete_namespaced_config_map("owner2", "default", propagation_policy="Orphan")
    orphan = core.read_namespaced_pod("orphan", "default")
    assert not orphan.metadata.owner_references

    # Deleting a namespace deletes what is in it, then the namespace.
    core.create_namespace({"metadata": {"name": "doomed"}})
    core.create_namespaced_pod("doomed", pod("p"))
    core.delete_namespace("doomed")
    wait_until(lambda: "doomed" not in k8s_api.names("Namespace"), what="namespace deleted")
    assert not k8s_api.objects("Pod", "doomed")


def test_events_leases_and_rbac_are_stored(api_client: client.ApiClient) -> None:
    core = client.CoreV1Api(api_client)
    involved = {"kind": "Pod", "name": "p"}
    event = {
        "metadata": {"name": "e1"},
        "involvedObject": involved,
        "reason": "Test",
        "message": "hi",
    }
    core.create_namespaced_event("default", event)
    assert core.list_namespaced_event("default").items[0].reason == "Test"
    events = client.EventsV1Api(api_client)
    new_event = {
        "metadata": {"name": "e2"},
        "eventTime": "2024-01-01T00:00:00.000000Z",
        "reportingController": "test",
        "reportingInstance": "test",
        "action": "Test",
        "reason": "Testing",
    }
    events.create_namespaced_event("default", new_event)
    assert [e.metadata.name for e in events.list_namespaced_event("default").items] == ["e2"]
    leases = client.CoordinationV1Api(api_client)
    leases.create_namespaced_lease(
        "default", {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "me"}}
    )
    assert leases.read_namespaced_lease("leader", "default").spec.holder_identity == "me"
    rbac = client.RbacAuthorizationV1Api(api_client)
    rbac.create_cluster_role({"metadata": {"name": "system:reader"}, "rules": []})
    assert rbac.read_cluster_role("system:reader").metadata.name == "system:reader"


def test_protobuf_is_refused_clearly(k8s_api: K8sApi) -> None:
    code, body = k8s_api.request(
        "POST", "/api/v1/namespaces", b"\x6b\x38\x73\x00", "application/vnd.kubernetes.protobuf"
    )
    assert code == 415 and body["kind"] == "Status" and "protobuf" in body["message"]
