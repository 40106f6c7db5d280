"""Fault matrix: a 3-member etcd loses its leader, then (the leader back) a follower.

The sidecars fail over between the members they were given (``--etcd a,b,c``); with a
quorum left, nothing about the job changes: no restart, no new round.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kelastic_operator.local.etcd import etcd_binary, free_port
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


@dataclass
class Member:
    """One member of the test cluster."""

    name: str
    client: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def status(self) -> dict[str, object] | None:
        """etcd's maintenance status (``header.member_id``, ``leader``), None if down."""
        req = urllib.request.Request(
            f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=1) as resp:
                doc = json.loads(resp.read())
                return doc if isinstance(doc, dict) else None
        except (OSError, ValueError):
            return None

    def is_leader(self) -> bool:
        doc = self.status()
        return bool(doc) and doc["header"]["member_id"] == doc.get("leader")  # type: ignore[index]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[Member]]:
    """Three etcd members on loopback with the fast test flags."""
    peers = {f"m{i}": free_port() for i in range(3)}
    initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in peers.items())
    members = []
    for name, peer in peers.items():
        client = free_port()
        args = [
            str(etcd_binary()), "--name", name, "--data-dir", str(tmp_path / name),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--heartbeat-interval", "10", "--election-timeout", "100",
            "--log-level", "error",
        ]  # fmt: skip
        members.append(Member(name, client, args))
    for m in members:
        m.start()
    try:
        wait_for(lambda: sum(m.is_leader() for m in members) == 1, 60, interval=0.1,
                 what="a leader of three members")  # fmt: skip
        yield members
    finally:
        for m in members:
            if m.proc is not None and m.proc.poll() is None:
                m.kill()


def _lose_and_restore(members: list[Member], victim: Member, ttl: float) -> float:
    """Kill ``victim``; return the seconds until the others have a leader; restart it once
    a lease TTL and more has passed."""
    victim.kill()
    lost_at = time.monotonic()
    others = [m for m in members if m is not victim]
    wait_for(lambda: any(m.is_leader() for m in others), 30, interval=0.01, what="a leader")
    elected = time.monotonic() - lost_at
    wait_for(lambda: time.monotonic() - lost_at > ttl + 2, ttl + 10, interval=0.2,
             what="a lease TTL without the member")  # fmt: skip
    victim.start()
    wait_for(lambda: victim.status() is not None, 30, interval=0.1, what="the member back")
    return elected


def test_losing_the_leader_then_a_follower_costs_nothing(
    tmp_path: Path, cluster: list[Member]
) -> None:
    stop, ckpt = tmp_path / "stop", tmp_path / "ckpt"
    ttl = 3
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1, lease_ttl=ttl,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_CHECKPOINT": str(ckpt)},
    )  # fmt: skip
    endpoints = ",".join(m.endpoint for m in cluster)
    run = KelasticRun(job, "--etcd", endpoints, workdir=tmp_path / "runs")
    try:
        wait_for(lambda: run.has("[1]: step 10"), 60, what="both nodes training")
        leader = next(m for m in cluster if m.is_leader())
        elected = _lose_and_restore(cluster, leader, ttl)
        follower = next(m for m in cluster if m.status() is not None and not m.is_leader())
        _lose_and_restore(cluster, follower, ttl)
        run.finish(stop)
    finally:
        run.interrupt()
    out = run.output
    assert run.restarts_charged() == 0, out
    assert not re.search(r"round [1-9]\d*: world size", out), out
    assert len(re.findall(r"from_step=", out)) == 2, out  # the workers never restarted
    lost = run.time_lost()
    print(f"\nFAULT etcd-3-members: new leader in {elected:.2f}s, time lost {lost:.2f}s, "
          "0 restarts")  # fmt: skip
    assert lost < 3.0, out
    assert run.strays() == []
