"""The emulator's pure parts: CEL subset, selectors, patches, structural schemas, the store."""

from __future__ import annotations

from typing import Any

import pytest

from . import cel, schema
from .errors import ApiError
from .harness import SAMPLE_CRD, load_manifests
from .patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from .selection import field_selector, label_selector
from .store import Store


@pytest.mark.parametrize(
    ("rule", "value", "expected"),
    [
        ("self.minReplicas <= self.replicas", {"minReplicas": 1, "replicas": 2}, True),
        ("self.minReplicas <= self.replicas", {"minReplicas": 3, "replicas": 2}, False),
        ("!has(self.max) || self.max >= 1", {}, True),
        ("has(self.max) && self.max >= 1", {"max": 0}, False),
        ("size(self.name) <= 5 && self.name.startsWith('ab')", {"name": "abc"}, True),
        ("self.items.all(i, i > 0) && self.items.exists(i, i == 2)", {"items": [1, 2]}, True),
        ("self.items.map(i, i * 2)[1] == 4", {"items": [1, 2]}, True),
        ("self.mode in ['a', 'b'] ? self.n % 2 == 0 : true", {"mode": "a", "n": 4}, True),
        ("-self.n + 10 / 3 == -1 && 2.5 > 2", {"n": 4}, True),
        ("self.x == oldSelf.x", {"x": 1}, True),
    ],
)
def test_cel_subset(rule: str, value: Any, expected: bool) -> None:
    assert cel.compile_rule(rule).evaluate(value, value) is expected


def test_cel_errors() -> None:
    with pytest.raises(cel.CelEvalError, match="no such key: b"):
        cel.compile_rule("self.b > 1").evaluate({"a": 1})
    # && and || absorb errors when the other side decides.
    assert cel.compile_rule("false && self.b > 1").evaluate({}) is False
    assert cel.compile_rule("self.b > 1 || true").evaluate({}) is True
    with pytest.raises(cel.CelSyntaxError):
        cel.compile_rule("self.quantity().isGreaterThan(1)")
    with pytest.raises(cel.CelSyntaxError):
        cel.compile_rule("self.a <=")


def test_selectors() -> None:
    obj = {
        "metadata": {"name": "n", "labels": {"app": "x", "tier": "web"}},
        "status": {"phase": "Running"},
    }
    assert label_selector("app=x,tier in (web, db),!gone,tier")(obj)
    assert not label_selector("app notin (x)")(obj)
    assert label_selector("")(obj)
    assert field_selector("metadata.name=n,status.phase!=Failed")(obj)
    assert not field_selector("spec.nodeName=node1")(obj)
    with pytest.raises(ApiError):
        label_selector("app in (x")


def test_patches() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None}, "l": [2]}) == {
        "a": {"c": 2},
        "l": [2],
    }
    pod = {
        "metadata": {"finalizers": ["a"]},
        "spec": {
            "containers": [{"name": "m", "image": "1", "ports": [{"containerPort": 80}]}],
            "tolerations": [1],
        },
    }
    patch = {
        "metadata": {"finalizers": ["b"]},
        "spec": {
            "$setElementOrder/containers": [{"name": "m"}],
            "containers": [
                {"name": "m", "image": "2", "ports": [{"containerPort": 81}]},
                {"name": "s"},
            ],
            "tolerations": [2],
        },
    }
    assert strategic_merge_patch(pod, patch) == {
        "metadata": {"finalizers": ["a", "b"]},
        "spec": {
            "containers": [
                {
                    "name": "m",
                    "image": "2",
                    "ports": [{"containerPort": 80}, {"containerPort": 81}],
                },
                {"name": "s"},
            ],
            "tolerations": [2],
        },
    }
    deleted = strategic_merge_patch(
        pod, {"spec": {"containers": [{"name": "m", "$patch": "delete"}]}}
    )
    assert deleted["spec"]["containers"] == []
    doc = {"a": [1, 2], "b": {"c": 1}}
    assert json_patch(
        doc,
        [{"op": "add", "path": "/a/-", "value": 3}, {"op": "move", "from": "/b/c", "path": "/d"}],
    ) == {
        "a": [1, 2, 3],
        "b": {},
        "d": 1,
    }
    with pytest.raises(PatchError, match="testing value /a/0 failed"):
        json_patch(doc, [{"op": "test", "path": "/a/0", "value": 9}])
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])


def test_schema_prune_default_validate() -> None:
    (crd,) = load_manifests(SAMPLE_CRD)
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    obj = {
        "apiVersion": "x/v1",
        "kind": "K",
        "metadata": {"name": "n"},
        "spec": {"image": "i", "replicas": 2, "junk": 1},
    }
    pruned, dropped = schema.prune(obj, spec_schema)
    assert dropped == ["spec.junk"] and pruned["metadata"] == {"name": "n"}
    defaulted = schema.apply_defaults(pruned, spec_schema)
    assert (
        defaulted["spec"]["minReplicas"] == 1 and defaulted["spec"]["restartPolicy"] == "OnFailure"
    )
    assert schema.validate(defaulted, spec_schema, None) == []
    defaulted["spec"]["replicas"] = 9
    (problem,) = schema.validate(defaulted, spec_schema, None)
    assert problem.text() == 'spec: Invalid value: "object": replicas must not exceed maxReplicas'
    broken = {"type": "object", "x-kubernetes-validations": [{"rule": "self.x.frobnicate()"}]}
    assert "compilation failed" in schema.check_schema(broken)[0].detail


def test_store_gc_foreground_and_crd_cleanup() -> None:
    store = Store()
    cms = store.type("", "v1", "configmaps")
    owner = store.create(cms, "default", {"metadata": {"name": "owner"}})
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    store.create(
        cms, "default", {"metadata": {"name": "dep", "ownerReferences": [ref], "finalizers": ["f"]}}
    )
    store.delete(cms, "default", "owner", {"propagationPolicy": "Foreground"})
    store.collect_garbage()
    # The owner waits for its dependent, which waits for its own finalizer.
    assert store.get(cms, "default", "owner")["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert store.get(cms, "default", "dep")["metadata"]["deletionTimestamp"]
    store.patch(cms, "default", "dep", "merge", {"metadata": {"finalizers": None}})
    store.collect_garbage()
    assert store.list_objects(cms, "default") == []

    crds = store.type("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    (crd,) = load_manifests(SAMPLE_CRD)
    store.create(crds, "", crd)
    jobs = store.type("emulator.kelastic.dev", "v1", "samplejobs")
    store.create(
        jobs, "default", {"metadata": {"name": "j"}, "spec": {"image": "i", "replicas": 1}}
    )
    store.delete(crds, "", crd["metadata"]["name"])
    store.collect_garbage()
    assert store.list_objects(crds, None) == []
    with pytest.raises(ApiError) as gone:
        store.type("emulator.kelastic.dev", "v1", "samplejobs")
    assert gone.value.code == 404


def test_store_no_op_update_keeps_resource_version() -> None:
    store = Store()
    cms = store.type("", "v1", "configmaps")
    created = store.create(cms, "default", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    same = store.patch(cms, "default", "c", "merge", {"data": {"a": "1"}})
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
