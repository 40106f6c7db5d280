"""``kelastic run`` end to end with real etcd, sidecars, launchers, signals and workers.

The workers here are ``tests/workers/steps.py`` (no torch), so each test takes seconds;
the torch DDP digits job runs in ``test_digits.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2)
    suspended = tmp_path / "suspended.yaml"
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["suspend"] = True
    suspended.write_text(yaml.safe_dump(doc))
    cases = [
        ([str(suspended)], "spec.suspend is true: kelastic run cannot suspend or resume a job"),
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
    from kelastic_etcd import EtcdClient

    etcd_endpoint = etcd_server.endpoint
    job = write_job(tmp_path / "job.yaml", name="ext", replicas=2, env={"STEPS_MAX": "5"})
    run = KelasticRun(job, "--etcd", etcd_endpoint, workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    assert f"etcd {etcd_endpoint}," in run.output
    with EtcdClient([etcd_endpoint]) as store:
        keys = store.get_prefix("/kelastic/default/ext/")
    reports = {k.rsplit("/", 1)[1]: json.loads(v) for k, (v, _) in keys.items() if "/reports/" in k}
    assert sorted(reports) == ["ext-0", "ext-1"]
    assert {r["outcome"] for r in reports.values()} == {"succeeded"}
    assert any(k.endswith("/rdzv/state") for k in keys)
    assert run.strays() == []
    # the etcd we were given is not ours to stop (its /health may be slow on a loaded machine)
    wait_for(etcd_server.healthy, 30, what="the given etcd to stay up")


def test_root_cause_prefers_the_stopped_worker_of_the_latest_round() -> None:
    from kelastic_operator.local.restart_lines import root_cause

    peer = {"round": 3, "time": 10.0, "summary": "hang: rank 1 on j-0", "stopped": False}
    hung = {"round": 3, "time": 10.2, "summary": "hang: rank 2 on j-1", "stopped": True}
    old = {"round": 2, "time": 1.0, "summary": "worker_failure: rank 0 on j-0"}
    assert root_cause([peer, hung, old]) == "hang: rank 2 on j-1"
    assert root_cause([peer, old]) == "hang: rank 1 on j-0"  # else the earliest
    later = {**peer, "time": 11.0, "summary": "hang: rank 3 on j-1"}
    assert root_cause([later, peer]) == "hang: rank 1 on j-0"
    assert root_cause([]) == "see the sidecar logs"
