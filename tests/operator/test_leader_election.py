"""The shipped operator Deployment's HA, as processes on the real cluster: two replicas of
``python -m kelastic_operator`` with deploy/operator.yaml's arguments, each logged in as the
operator's ServiceAccount. Exactly one acts; SIGKILL it and the other takes over within
15 s without creating any Pod twice; SIGTERM releases the Lease for an immediate handover.
Plus the Lease elector's rules, step by step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kelastic_operator.leader import LeaderElectionError, LeaseElector, LeaseSettings
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.fixtures import OPERATOR_NAMESPACE
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest, operator_client

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)
TAKEOVER_LIMIT = 15.0  # seconds to a new leader after a SIGKILL (the Lease expires after 10 s)


def deployment_args() -> list[str]:
    """The operator container's command and args in deploy/operator.yaml."""
    docs = yaml.safe_load_all((ROOT / "deploy/operator.yaml").read_text())
    (dep,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert dep["spec"]["replicas"] == 2
    return list(container["command"]) + list(container["args"])


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def sample(port: int, name: str) -> float:
    for line in metrics(port).splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Replica:
    """One operator process with the Deployment's arguments (test overrides appended)."""

    def __init__(self, name: str, client: Client, etcd: str, lease: str, workdir: Path) -> None:
        self.name = name
        self.port, self.health_port = free_port(), free_port()
        argv = deployment_args()
        assert argv[:3] == ["python", "-m", "kelastic_operator"]
        args = [a for a in argv[3:] if not a.startswith(("--etcd-endpoints", "--metrics-port"))]
        args += [f"--etcd-endpoints={etcd}", f"--metrics-port={self.port}",
                 f"--health-port={self.health_port}",
                 f"--namespace={client.namespace}", f"--lease-name={lease}"]  # fmt: skip
        env = {**client.env(), "POD_ID": name, "POD_NAMESPACE": OPERATOR_NAMESPACE,
               "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in
                                             ("operator", "worker_lib", "sidecar"))}  # fmt: skip
        self.log = workdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kelastic_operator", *args], env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop:\n{self.tail()}") from None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for r in started:
        with contextlib.suppress(AssertionError):
            r.stop(signal.SIGKILL)


def holder(k8s_cluster: ControlPlane, lease: str) -> str:
    found = k8s_cluster.admin.get("lease", lease, OPERATOR_NAMESPACE)
    return str(((found or {}).get("spec") or {}).get("holderIdentity") or "")


def test_two_replicas_one_acts_and_the_other_takes_over_within_15_s(
    k8s_cluster: ControlPlane,
    k8s: Client,
    etcd_server: EmbeddedEtcd,
    manual_node: ManualNode,
    replicas: list[Replica],
    tmp_path: Path,
) -> None:
    client = operator_client(k8s_cluster, k8s.namespace)
    lease = f"ha-{k8s.namespace}"[:63]
    a = Replica("operator-a", client, etcd_server.endpoint, lease, tmp_path)
    replicas.append(a)
    wait_until(lambda: holder(k8s_cluster, lease).startswith("operator-a_"), 30,
               what="operator-a to lead")  # fmt: skip
    b = Replica("operator-b", client, etcd_server.endpoint, lease, tmp_path)
    replicas.append(b)
    wait_until(lambda: metrics(b.port), 30, what="operator-b serving /metrics")
    for replica in (a, b):  # the leader's event loop turns; the follower campaigns
        url = f"http://127.0.0.1:{replica.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200

    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(node=manual_node))
    wait_until(lambda: len(pods_by_name(k8s)) == 2, 30, what="the leader creating the pods")
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
    wait_until(lambda: sample(a.port, "kelastic_operator_pods_created_total") == 2, 30,
               what="the leader's count")  # fmt: skip
    assert sample(b.port, "kelastic_operator_pods_created_total") == 0
    assert holder(k8s_cluster, lease).startswith("operator-a_")

    killed = time.monotonic()
    a.stop(signal.SIGKILL)
    wait_until(lambda: holder(k8s_cluster, lease).startswith("operator-b_"), 30,
               what="operator-b to take the lease")  # fmt: skip
    takeover = time.monotonic() - killed
    assert takeover <= TAKEOVER_LIMIT, f"takeover took {takeover:.1f} s"
    # the new leader acts: a deleted Pod is replaced ...
    k8s.kubectl("delete", "pod", "digits-1", "--wait=false")

    def replaced() -> bool:
        pod = pods_by_name(k8s).get("digits-1")
        return pod is not None and pod["metadata"]["uid"] != uids["digits-1"]

    wait_until(replaced, 30, what="operator-b replacing digits-1")
    # ... and nothing was created twice: digits-0 is the first leader's Pod
    assert pods_by_name(k8s)["digits-0"]["metadata"]["uid"] == uids["digits-0"]
    assert sample(b.port, "kelastic_operator_pods_created_total") == 1

    # a clean stop releases the lease at once
    assert b.stop(signal.SIGTERM) == 0, b.tail()
    assert holder(k8s_cluster, lease) == ""
    print(f"leader takeover after SIGKILL: {takeover:.1f} s")


def test_the_elector_follows_client_go_rules(k8s_cluster: ControlPlane, k8s: Client) -> None:
    """Step by step on a fake clock: a live holder keeps the lease; a silent one loses it
    after lease_duration as *observed* by the candidate; terms count transitions; a leader
    that cannot renew stops counting itself leader after renew_deadline."""
    client = operator_client(k8s_cluster, k8s.namespace)
    api = client.api_client()
    now = [1000.0]
    lease = f"unit-{k8s.namespace}"[:63]
    settings = LeaseSettings(lease_duration=10, renew_deadline=7, retry_period=2)

    def elector(identity: str) -> LeaseElector:
        return LeaseElector(api, OPERATOR_NAMESPACE, lease, identity, settings, lambda: now[0])

    a, b = elector("a"), elector("b")
    assert a.try_acquire_or_renew() and a.is_leader() and a.term == 0
    assert not b.try_acquire_or_renew()  # first sight of a's record
    now[0] += 9
    assert a.try_acquire_or_renew()  # a renews: the record changes
    assert not b.try_acquire_or_renew()
    now[0] += 9.9
    assert not b.try_acquire_or_renew()  # 9.9 s since b saw a change: not expired yet
    assert not a.is_leader()  # a has not renewed for 9.9 s > renew deadline: it stops acting
    now[0] += 0.2
    assert b.try_acquire_or_renew() and b.is_leader() and b.term == 1
    assert not a.try_acquire_or_renew() and not a.is_leader()  # a sees b's fresh record
    b.release()
    assert holder(k8s_cluster, lease) == "" and not b.is_leader()
    assert a.try_acquire_or_renew() and a.term == 2  # a released lease is taken at once
    with pytest.raises(LeaderElectionError, match="renew deadline < lease duration"):
        LeaseSettings(lease_duration=5, renew_deadline=5, retry_period=1)
    api.close()


def test_healthz_follows_the_event_loop_or_the_election() -> None:
    """The liveness verdict: a follower is alive while it campaigns; a leader while its
    event loop ticks; served on its own port."""
    import urllib.error

    from kelastic_operator.health import Health, serve

    now = [0.0]
    campaigning = [True]
    health = Health(lambda: campaigning[0], stale_after=30, clock=lambda: now[0])
    server = serve(health, 0, "127.0.0.1")
    port = server.server_address[1]

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        assert get() == (200, "waiting to lead\n")
        campaigning[0] = False
        assert get()[0] == 503
        health.tick()  # leading: kopf's loop ticks
        now[0] = 29.0
        assert get() == (200, "leading; the event loop turns\n")
        now[0] = 31.5
        assert get() == (503, "the event loop has not turned for 32 s\n")
    finally:
        server.shutdown()
