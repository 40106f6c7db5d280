"""A tiny kopf operator (in a thread) against the emulator."""
# The typed `kubernetes` models want model objects and Optional checks; these tests pass plain
# dicts (which the client accepts) and read back fields they have just written.
# mypy: disable-error-code="arg-type,index,union-attr,return-value,no-untyped-call"

from __future__ import annotations

import threading
from typing import Any

import kopf
import pytest
from kubernetes import client

from .harness import (
    KOPF_PEERING_CRDS,
    SAMPLE_CRD,
    K8sApi,
    KopfThread,
    fast_kopf_settings,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
GROUP, VERSION, PLURAL = "emulator.kelastic.dev", "v1", "samplejobs"


def sample_operator(k8s_api: K8sApi) -> tuple[kopf.OperatorRegistry, list[tuple[str, Any]]]:
    """Handlers: create -> a Pod owned by the job; update -> record; delete -> record."""
    registry = kopf.OperatorRegistry()
    seen: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def record(what: str, value: Any) -> None:
        with lock:
            seen.append((what, value))

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    def created(body: kopf.Body, name: str, namespace: str, spec: kopf.Spec, **_: Any) -> None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-0", "labels": {"job": name}},
            "spec": {"containers": [{"name": "main", "image": spec["image"]}]},
        }
        kopf.adopt(pod, owner=body)
        with k8s_api.api_client() as api:
            client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
        kopf.info(body, reason="PodCreated", message=f"created {pod['metadata']['name']}")
        record("create", name)

    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def updated(name: str, diff: kopf.Diff, **_: Any) -> None:
        record("update", [(op, path, new) for op, path, _old, new in diff])

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def deleted(name: str, **_: Any) -> None:
        record("delete", name)

    return registry, seen


def apply_all(k8s_api: K8sApi, *manifests: Any) -> None:
    for path in manifests:
        k8s_api.kubectl("apply", "-f", str(path))


def new_job(custom: client.CustomObjectsApi, name: str) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SampleJob",
        "metadata": {"name": name},
        "spec": {"image": "busybox", "replicas": 1},
    }
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)


def test_kopf_create_update_delete_with_finalizer_and_gc(k8s_api: K8sApi) -> None:
    apply_all(k8s_api, SAMPLE_CRD)
    registry, seen = sample_operator(k8s_api)
    with k8s_api.api_client() as api, KopfThread(k8s_api, registry):
        custom = client.CustomObjectsApi(api)
        new_job(custom, "j1")

        pod = wait_until(lambda: k8s_api.objects("Pod", "default"), what="the operator's pod")[0]
        job = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "j1")
        assert pod["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        assert pod["metadata"]["ownerReferences"][0]["controller"] is True

        # kopf blocks deletion with its finalizer and keeps its state in annotations.
        def handled() -> dict[str, Any] | None:
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "j1")
            annotations = obj["metadata"].get("annotations", {})
            done = "kopf.zalando.org/last-handled-configuration" in annotations
            return obj if done and obj["metadata"].get("finalizers") else None

        job = wait_until(handled, what="kopf's finalizer and last-handled state")
        assert job["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]

        custom.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, "j1", {"spec": {"replicas": 2}}
        )
        wait_until(
            lambda: ("update", [("change", ("spec", "replicas"), 2)]) in seen,
            what="the update handler",
        )

        custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "j1")
        wait_until(lambda: ("delete", "j1") in seen, what="the delete handler")
        wait_until(lambda: not k8s_api.objects("SampleJob", "default"), what="the job to go")
        wait_until(lambda: not k8s_api.objects("Pod", "default"), what="owner GC of the pod")

        def posted() -> list[tuple[str, str]]:  # kopf.info() posts a core/v1 Event
            return [
                (e["reason"], e["involvedObject"]["name"])
                for e in k8s_api.objects("Event", "default")
            ]

        wait_until(lambda: ("PodCreated", "j1") in posted(), what="kopf's event")
    assert seen[0] == ("create", "j1")


def test_kopf_with_clusterwide_peering_and_initial_streaming(k8s_api: K8sApi) -> None:
    apply_all(k8s_api, SAMPLE_CRD, KOPF_PEERING_CRDS)
    peering = "apiVersion: kopf.dev/v1\nkind: ClusterKopfPeering\nmetadata: {name: default}\n"
    k8s_api.kubectl("apply", "-f", "-", input=peering)
    registry, seen = sample_operator(k8s_api)
    settings = fast_kopf_settings()
    settings.watching.initial_streaming = True  # watch-list: sendInitialEvents, then a BOOKMARK
    operator = KopfThread(
        k8s_api, registry, settings=settings, standalone=False, peering_name="default"
    )
    with k8s_api.api_client() as api, operator:

        def peers() -> dict[str, Any]:
            (peering,) = load_peering(k8s_api)
            return dict(peering.get("status") or {})

        status = wait_until(peers, what="kopf to announce itself in the peering object")
        (identity,) = status
        assert {"priority", "lastseen", "lifetime"} <= set(status[identity])
        new_job(client.CustomObjectsApi(api), "j2")
        wait_until(lambda: ("create", "j2") in seen, what="the create handler with peering on")
        assert any("sendInitialEvents=true" in path for _, path, _ in k8s_api.requests)
    wait_until(lambda: not peers_left(k8s_api), what="kopf to leave the peering on exit")


def load_peering(k8s_api: K8sApi) -> list[dict[str, Any]]:
    return k8s_api.objects("ClusterKopfPeering")


def peers_left(k8s_api: K8sApi) -> dict[str, Any]:
    (peering,) = load_peering(k8s_api)
    return {k: v for k, v in (peering.get("status") or {}).items() if v}
