"""The test cluster itself: a real API server that refuses what a real one refuses, RBAC,
the garbage collector. (The real node running Pods: tests/k8s/test_node.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .cluster import Client, ControlPlane, wait_until

pytestmark = pytest.mark.timeout(180)


def _apply(k8s: Client, doc: dict[str, Any]) -> None:
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))


def test_the_control_plane_is_real(k8s_cluster: ControlPlane, k8s: Client) -> None:
    assert k8s_cluster.startup_seconds > 0
    version = json.loads(k8s.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"].startswith("v1.")
    # built-in kinds are validated: a Pod without containers is refused
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad"}, "spec": {}}
    result = k8s.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode and "spec.containers: Required value" in result.stderr
    # metadata.name rules hold
    upper = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Not_Valid"}}
    result = k8s.kubectl("apply", "-f", "-", input=json.dumps(upper), check=False)
    assert result.returncode and "a lowercase RFC 1123 subdomain" in result.stderr
    # field selectors are checked per resource
    result = k8s.kubectl("get", "pods", "--field-selector", "spec.nope=x", check=False)
    assert result.returncode and "field label not supported" in result.stderr


def test_rbac_is_enforced_for_service_accounts(k8s_cluster: ControlPlane, k8s: Client) -> None:
    k8s.kubectl("create", "serviceaccount", "nobody")
    nobody = k8s_cluster.service_account_client(k8s.namespace, "nobody")
    result = nobody.kubectl("get", "pods", check=False)
    assert result.returncode and "Forbidden" in result.stderr
    # the operator's account has exactly deploy/rbac.yaml's rights
    operator = k8s_cluster.service_account_client("kelastic-system", "kelastic-operator",
                                                  default_namespace=k8s.namespace)  # fmt: skip
    assert operator.kubectl("get", "pods").returncode == 0
    for verb, allowed in (("delete", "yes"), ("create", "no"), ("deletecollection", "no")):
        # delete: a finished job's ttlSecondsAfterFinished; never create or delete many
        got = operator.kubectl("auth", "can-i", verb, "elasticjobs", check=False)
        assert got.stdout.strip() == allowed, verb
    can = operator.kubectl("auth", "can-i", "update", "elasticjobs", "--subresource=finalizers")
    assert can.stdout.strip() == "yes"
    result = operator.kubectl("get", "secrets", check=False)
    assert result.returncode and "Forbidden" in result.stderr


def test_owner_references_are_garbage_collected(k8s: Client) -> None:
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
    _apply(k8s, owner)
    uid = k8s.get("configmap", "owner")["metadata"]["uid"]  # type: ignore[index]
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child",
             "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                  "uid": uid}]}}  # fmt: skip
    _apply(k8s, child)
    k8s.kubectl("delete", "configmap", "owner")
    wait_until(lambda: k8s.get("configmap", "child") is None, 30, what="the child collected")
