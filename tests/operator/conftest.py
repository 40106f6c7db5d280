"""Fixtures of the operator tests on the real test cluster (see tests/k8s/fixtures.py).

``operator``: the kopf handlers of :mod:`kelastic_operator.handlers` in a thread, logged in
as the ``kelastic-operator`` ServiceAccount with exactly ``deploy/rbac.yaml``'s rights (a
missing verb fails the test), serving the test's namespace, with a real etcd.
(``manual_node``, a Node whose Pods' status the tests write, is in tests/conftest.py.)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.cluster import Client, ControlPlane
from tests.k8s.fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE
from tests.k8s.kopf_thread import KopfThread
from tests.k8s.nodes import ManualNode

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples/digits/elasticjob.yaml"


def operator_client(cluster: ControlPlane, namespace: str) -> Client:
    """A client with the operator's ServiceAccount token, defaulting to ``namespace``."""
    return cluster.service_account_client(
        OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, default_namespace=namespace
    )


@pytest.fixture
def operator(
    k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd
) -> Iterator[OperatorContext]:
    """The operator's handlers serving the test's namespace, as its ServiceAccount."""
    client = operator_client(k8s_cluster, k8s.namespace)
    api = client.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(
            sidecar_image="kelastic:test", etcd_endpoints=(etcd_server.endpoint,)
        ),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=3, time_retry=0.5)),
        resync_seconds=0.5,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    with KopfThread(client, registry):
        yield ctx
        # delete the namespace's jobs while the operator still runs their finalizers
        k8s.kubectl("delete", "elasticjobs", "--all", "--wait=false", check=False)
    ctx.stores.close()
    api.close()


def job_manifest(name: str = "digits", node: ManualNode | None = None, **spec: Any) -> str:
    """The digits example as ``name`` with ``spec`` fields replaced; placed on ``node``."""
    doc = copy.deepcopy(yaml.safe_load(DIGITS.read_text()))
    doc["metadata"]["name"] = name
    doc["metadata"].pop("namespace", None)
    doc["spec"].update(spec)
    if node is not None:
        doc["spec"]["template"]["spec"]["nodeSelector"] = node.selector
    return yaml.safe_dump(doc)
