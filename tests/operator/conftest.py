"""Fixtures of the operator tests on the real test cluster (see tests/k8s/fixtures.py).

``operator``: the kopf handlers of :mod:`kelastic_operator.handlers` in a thread, logged in
as the ``kelastic-operator`` ServiceAccount with exactly ``deploy/rbac.yaml``'s rights (a
missing verb fails the test), serving the test's namespace, with a real etcd.
(``manual_node``, a Node whose Pods' status the tests write, is in tests/conftest.py.)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import psutil
import pytest
import yaml

from kelastic import contract
from kelastic_operator.handlers import register
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.cluster import Client, ControlPlane, pods_by_name
from tests.k8s.fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE
from tests.k8s.images import KELASTIC as KELASTIC_IMAGE
from tests.k8s.kopf_thread import KopfThread
from tests.k8s.node import RealNode
from tests.k8s.nodes import ManualNode

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples/digits/elasticjob.yaml"


def operator_client(cluster: ControlPlane, namespace: str) -> Client:
    """A client with the operator's ServiceAccount token, defaulting to ``namespace``."""
    return cluster.service_account_client(
        OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, default_namespace=namespace
    )


@contextlib.contextmanager
def running_operator(
    cluster: ControlPlane,
    k8s: Client,
    etcd_endpoint: str,
    watch_workloads: bool = False,
    **pod_settings: Any,
) -> Iterator[OperatorContext]:
    """The operator's handlers in a kopf thread serving ``k8s``'s namespace as the
    operator's ServiceAccount, with a real etcd (``etcd_endpoint``: as the Pods reach it,
    :meth:`RealNode.expose`) and the image of ``Dockerfile`` as the sidecar's;
    ``pod_settings`` add to its PodSettings; ``watch_workloads``: Kueue's Workloads
    watched too (Kueue's CRDs must be installed).
    On exit the namespace's jobs are deleted while the handlers still run their
    finalizers."""
    client = operator_client(cluster, k8s.namespace)
    api = client.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(
            sidecar_image=KELASTIC_IMAGE, etcd_endpoints=(etcd_endpoint,), **pod_settings
        ),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=3, time_retry=0.5)),
        # the operator's default, as the chart deploys it: a change in etcd reaches the
        # status by the status watch, never by a fast resync that a cluster would not have
        resync_seconds=30.0,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx, watch_workloads=watch_workloads)
    try:
        with KopfThread(client, registry):
            yield ctx
            k8s.kubectl("delete", "elasticjobs", "--all", "--wait=false", check=False)
    finally:
        ctx.status_hubs.close()
        ctx.stores.close()
        api.close()


@pytest.fixture
def operator(
    k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd
) -> Iterator[OperatorContext]:
    """The operator's handlers serving the test's namespace, as its ServiceAccount."""
    with running_operator(k8s_cluster, k8s, etcd_server.endpoint) as ctx:
        yield ctx


def job_manifest(name: str = "digits", node: ManualNode | None = None, **spec: Any) -> str:
    """The digits example as ``name`` with ``spec`` fields replaced; placed on ``node``."""
    doc = copy.deepcopy(yaml.safe_load(DIGITS.read_text()))
    doc["metadata"]["name"] = name
    doc["metadata"].pop("namespace", None)
    doc["spec"].update(spec)
    if node is not None:
        doc["spec"]["template"]["spec"]["nodeSelector"] = node.selector
    return yaml.safe_dump(doc)


@pytest.fixture
def digits_operator(
    k8s_cluster: ControlPlane, k8s: Client, node: RealNode, etcd_server: EmbeddedEtcd
) -> Iterator[OperatorContext]:
    """The operator (as its ServiceAccount) serving a restricted namespace whose Pods the
    real node runs from the images built here (the digits example's trainer image and
    ``Dockerfile``'s), with the example's checkpoint claim (the e2e training tests)."""
    k8s.kubectl("label", "namespace", k8s.namespace,
                "pod-security.kubernetes.io/enforce=restricted")  # fmt: skip
    k8s.claim("digits-checkpoints")
    etcd = node.expose(etcd_server.endpoint)
    with running_operator(k8s_cluster, k8s, etcd, stop_grace=3) as ctx:
        yield ctx


@pytest.fixture
def node_operator(
    k8s_cluster: ControlPlane, k8s: Client, node: RealNode, etcd_server: EmbeddedEtcd
) -> Iterator[OperatorContext]:
    """The operator serving the test's namespace with an etcd the real node's Pods reach."""
    with running_operator(k8s_cluster, k8s, node.expose(etcd_server.endpoint)) as ctx:
        yield ctx


def worker_procs(node: RealNode, namespace: str) -> list[tuple[str, int, int]]:
    """``(pod, global rank, pid)`` of every worker process of the namespace's Pods (the
    processes of the trainer container's cgroup whose environment has ``RANK``)."""
    out: list[tuple[str, int, int]] = []
    for name, pod in pods_by_name(node.cluster.admin, namespace).items():
        for pid in node.container_pids(pod, "trainer"):
            try:
                rank = psutil.Process(pid).environ().get(contract.RANK)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if rank is not None and rank.isdigit():
                out.append((name, int(rank), pid))
    return out


def workers(node: RealNode, namespace: str) -> dict[int, int]:
    """Global rank -> pid of every worker process of the namespace's Pods."""
    return {rank: pid for _, rank, pid in worker_procs(node, namespace)}
