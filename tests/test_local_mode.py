"""``kelastic run`` end to end with real etcd, sidecars, launchers, signals and workers.

The workers here are ``tests/workers/steps.py`` (no torch), so each test takes seconds;
the torch DDP digits job runs in ``test_digits.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.local.runner import LocalOptions, LocalRunner
from kelastic_operator.model import load_manifest
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


def test_a_new_node_joins_at_the_next_round(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    job = load_manifest(write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=2, max_replicas=3, nproc=1,
        env={"STEPS_STOP_FILE": str(stop)},
    ))  # fmt: skip
    lines: list[str] = []
    runner = LocalRunner(
        job, tmp_path, LocalOptions(workdir=tmp_path / "runs", stop_grace=2, status_interval=2),
        say=lambda line: lines.append(f"[kelastic] {line}"),
        echo=lambda line, _err: lines.append(line),
    )  # fmt: skip
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: any("world=2 round=0" in x for x in lines), 60, what="round 0")
        assert runner.add_replica() == "steps-2"
        wait_for(lambda: any("world=3" in x for x in lines), 60, what="a round of 3 nodes")
        wait_for(
            lambda: any("world size 3 (3 nodes x 1), restarts 0/3" in x for x in lines),
            30, what="the runner's progress line for the round of 3",
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="maxReplicas"):
            runner.add_replica()
        # Each sidecar serves its probes, metrics and status on one port.
        for pod in runner.pods:
            base = f"http://127.0.0.1:{pod.http_port}"
            assert _get(base + "/healthz") == (200, "ok\n")
            wait_for(lambda b=base: _get(b + "/readyz")[0] == 200, 30, what="ready")
            code, metrics = _get(base + "/metrics")
            assert code == 200 and "kelastic_world_size 3.0" in metrics
            rounds = 1 if pod.name == "steps-2" else 2  # the new node joined in round 1
            assert f"kelastic_rendezvous_rounds_total {rounds}.0" in metrics
            assert "kelastic_rendezvous_duration_seconds_count" in metrics
            status = json.loads(_get(base + "/status")[1])
            assert status["group_world_size"] == 3 and status["phase"] == "running"
            assert _get(base + "/nope")[0] == 404
        stop.touch()
        thread.join(60)
        assert result == [0], "\n".join(lines)
    finally:
        runner.interrupt()
        thread.join(30)
    # Scale-up cost no restart.
    assert not any("restart 1/" in x for x in lines)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2)
    cases = [
        ([str(tmp_path / "nope.yaml")], "cannot read"),
        ([str(job), "--fault", "explode:rank=1"], "expected kill:rank=R,after=S"),
        ([str(job), "--replicas", "5"], "--replicas 5 is outside [minReplicas, maxReplicas]"),
        ([str(job), "--fault", "kill:rank=9,after=1"], "fault rank 9 >= world size 2"),
    ]
    for args, message in cases:
        out = subprocess.run(
            [sys.executable, "-m", "kelastic_operator.cli", "run", *args],
            capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert out.returncode == 2, out
        assert message in out.stderr, out.stderr


def test_help_explains_run_and_faults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kelastic_operator.cli", "run", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "kill:rank=R,after=S" in out.stdout and "--etcd ENDPOINTS" in out.stdout


def test_an_existing_etcd_is_used_and_keeps_the_job_record(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    from kelastic_sidecar.etcd_store import EtcdStore

    etcd_endpoint = etcd_server.endpoint
    job = write_job(tmp_path / "job.yaml", name="ext", replicas=2, env={"STEPS_MAX": "5"})
    run = KelasticRun(job, "--etcd", etcd_endpoint, workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    assert f"etcd {etcd_endpoint}," in run.output
    with EtcdStore([etcd_endpoint]) as store:
        keys = store.get_prefix("/kelastic/default/ext/")
    reports = {k.rsplit("/", 1)[1]: json.loads(v) for k, (v, _) in keys.items() if "/reports/" in k}
    assert sorted(reports) == ["ext-0", "ext-1"]
    assert {r["outcome"] for r in reports.values()} == {"succeeded"}
    assert any(k.endswith("/rdzv/state") for k in keys)
    assert run.strays() == []
    # the etcd we were given is not ours to stop (its /health may be slow on a loaded machine)
    wait_for(etcd_server.healthy, 30, what="the given etcd to stay up")


def test_root_cause_prefers_the_stopped_worker_of_the_latest_round() -> None:
    from kelastic_operator.local.runner import root_cause

    peer = {"round": 3, "time": 10.0, "summary": "hang: rank 1 on j-0", "stopped": False}
    hung = {"round": 3, "time": 10.2, "summary": "hang: rank 2 on j-1", "stopped": True}
    old = {"round": 2, "time": 1.0, "summary": "worker_failure: rank 0 on j-0"}
    assert root_cause([peer, hung, old]) == "hang: rank 2 on j-1"
    assert root_cause([peer, old]) == "hang: rank 1 on j-0"  # else the earliest
    later = {**peer, "time": 11.0, "summary": "hang: rank 3 on j-1"}
    assert root_cause([later, peer]) == "hang: rank 1 on j-0"
    assert root_cause([]) == "see the sidecar logs"
