"""The test cluster's fixtures, defined once in ``tests/conftest.py`` from these helpers:
one control plane and one real node per test run, a fresh namespace per test.

- ``k8s_cluster`` (session): :class:`~tests.k8s.cluster.ControlPlane` with the ElasticJob CRD
  applied, the operator's namespace and RBAC of ``deploy/``.
- ``node`` (session): a :class:`~tests.k8s.node.RealNode` (kubelet, containerd, runc, the
  CNI bridge) running the images of :mod:`tests.k8s.images`.
- ``k8s`` (function): an admin :class:`~tests.k8s.cluster.Client` whose kubeconfig
  defaults to a namespace of the test's own, deleted afterwards.

A missing control plane (``scripts/build-k8s.sh`` not run) skips these tests, and fails
them under ``CI=true``.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import pytest

from .cluster import ClusterUnavailable, ControlPlane, control_plane_bin, wait_until
from .node import RealNode


def start_or_skip(workdir: Path) -> ControlPlane:
    """:func:`start_cluster`, skipping the test when the binaries are missing (failing it
    under ``CI=true``, where scripts/test-tools.sh must have built them)."""
    try:
        return start_cluster(workdir)
    except ClusterUnavailable as exc:
        if os.environ.get("CI") or "did not start" in str(exc):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "deploy" / "crds"
OPERATOR_NAMESPACE = "kelastic-system"
OPERATOR_ACCOUNT = "kelastic-operator"
startup_seconds: list[float] = []


def start_cluster(workdir: Path, audit_users: tuple[str, ...] = ()) -> ControlPlane:
    """Start the control plane and install what every test expects: the ElasticJob CRD,
    the operator's namespace, ServiceAccount and RBAC (``deploy/``).

    Raises:
        ClusterUnavailable: the binaries are not built or a component did not start.
    """
    cluster = ControlPlane(workdir, control_plane_bin(), audit_users=audit_users).start()
    startup_seconds.append(cluster.startup_seconds)
    admin = cluster.admin
    admin.kubectl("apply", "-f", str(CRDS))
    admin.kubectl("apply", "-f", str(ROOT / "deploy" / "namespace.yaml"),
                  "-f", str(ROOT / "deploy" / "rbac.yaml"))  # fmt: skip
    wait_until(lambda: admin.kubectl("get", "elasticjobs", check=False).returncode == 0, 30,
               what="the ElasticJob CRD to be served")  # fmt: skip
    wait_until(lambda: admin.get("serviceaccount", OPERATOR_ACCOUNT, OPERATOR_NAMESPACE), 30,
               what="the operator's ServiceAccount")  # fmt: skip
    return cluster


node_startup: list[str] = []


def start_node(cluster: ControlPlane, workdir: Path) -> RealNode:
    """The real node of the test run (kubelet, containerd, runc, CNI), with the images it
    runs (:func:`tests.k8s.images.build_images`, cached by content) imported.

    Fails the test (never skips) when it cannot start: it is what every e2e test runs on.
    First removes what killed runs left on disk beside this one
    (:func:`tests.k8s.leftovers.sweep_dead_runs`): their nodes' containerd roots.
    """
    from .images import build_images
    from .leftovers import sweep_dead_runs

    swept = sweep_dead_runs(workdir.parent)
    if swept:
        node_startup.append(f"removed what dead test runs left: {', '.join(map(str, swept))}")
    started = time.monotonic()
    images = build_images()
    built = time.monotonic() - started
    try:
        node = RealNode(cluster, workdir, images).start()
    except ClusterUnavailable as exc:
        pytest.fail(f"the test node did not start: {exc}")
    node_startup.append(
        f"test node {node.name}: images {built:.1f} s, ready in {node.startup_seconds:.1f} s "
        f"(image import {node.image_import_seconds:.1f} s)"
    )
    return node


def namespace_for(nodeid: str) -> str:
    """A valid, unique namespace name (<= 63 chars) for a test id."""
    name = re.sub(r"[^a-z0-9]+", "-", nodeid.rsplit("::", 1)[-1].lower()).strip("-")[:40]
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:8]
    return f"t-{name}-{digest}".replace("--", "-")
