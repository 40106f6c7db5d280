"""Fault matrix: a job that cannot start.

A worker command that does not exist fails the job at once with that cause (a restart
would run the same command again), and an etcd that cannot be reached is reported
within seconds, naming the endpoint, while the sidecars keep retrying.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kelastic_operator.local.etcd import free_port
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


@pytest.mark.parametrize(
    ("command", "how"),
    [
        (["no-such-command-kelastic", "--epochs", "3"], "FileNotFoundError"),  # exec fails
        (["sh", "-c", "exec no-such-command-kelastic"], "exited with code 127"),  # via a shell
    ],
)
def test_a_command_that_does_not_exist_fails_the_job_at_once(
    tmp_path: Path, command: list[str], how: str
) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2, nproc=2, max_restarts=3, command=command)
    run = KelasticRun(job, workdir=tmp_path / "runs")
    started = time.monotonic()
    assert run.wait(120) == 1, run.output
    took = time.monotonic() - started
    print(f"\nFAULT start-failure ({how}): job failed in {took:.1f}s, 0 restarts")
    out = run.output
    assert "job FAILED" in out
    assert "a worker could not be started (not retried)" in out, out
    assert "start_failure: rank" in out and how in out, out
    assert run.restarts_charged() == 0, out  # no "restart 1/3": the budget is not spent
    assert run.strays() == []


def test_an_unreachable_etcd_is_reported_within_seconds_naming_the_endpoint(
    tmp_path: Path,
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    job = write_job(tmp_path / "job.yaml", replicas=1, min_replicas=1)
    run = KelasticRun(job, "--etcd", endpoint, workdir=tmp_path / "runs")
    try:
        started = time.monotonic()
        wait_for(lambda: run.has("etcd unreachable"), 30, interval=0.1, what="the report")
        took = time.monotonic() - started
        print(f"\nFAULT etcd-unreachable: reported after {took:.1f}s")
        line = next(x for x in run.lines if "etcd unreachable" in x)
        assert f"etcd at {endpoint}" in line and "keep retrying" in line, run.output
        # Still retrying: the sidecar is up and says so in its status line.
        wait_for(lambda: run.has("etcd unreachable") and run.has(", etcd unreachable"), 30,
                 what="a status line naming the outage")  # fmt: skip
        assert run.proc.poll() is None
    finally:
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(60) == 130, run.output
    assert run.strays() == []
