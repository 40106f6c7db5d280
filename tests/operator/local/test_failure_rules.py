"""spec.failurePolicy end to end in local mode: real ``kelastic run`` (embedded etcd,
sidecars, launchers) of 2 nodes running ``tests/workers/exit_code.py``, whose rank 1 fails
once with a chosen exit code or signal; each action decides what that failure costs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.localrun import WORKERS, KelasticRun, write_job

pytestmark = pytest.mark.timeout(240)


def job_with_rules(tmp_path: Path, rules: list[dict[str, Any]], *, max_restarts: int,
                   code: int = 42, signum: int | None = None,
                   pod_replacement: dict[str, Any] | None = None) -> Path:  # fmt: skip
    env = {"EXIT_CODE": str(code), "EXIT_ONCE_FILE": str(tmp_path / "failed-once"),
           "STEPS_STOP_FILE": str(tmp_path / "stop")}  # fmt: skip
    if signum is not None:
        env["EXIT_SIGNAL"] = str(signum)
    path = write_job(tmp_path / "job.yaml", name="rules", replicas=2, max_restarts=max_restarts,
                     env=env, command=[sys.executable, str(WORKERS / "exit_code.py")],
                     pod_replacement=pod_replacement)  # fmt: skip
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["failurePolicy"] = {"rules": rules}
    path.write_text(yaml.safe_dump(doc))
    return path


def exit_42(action: str) -> dict[str, Any]:
    return {"action": action, "onExitCodes": {"operator": "In", "values": [42]}}


def trains_again(run: KelasticRun, tmp_path: Path) -> None:
    """Wait until rank 1 trains in a later attempt (it failed once), then end the job."""
    wait_for(lambda: (tmp_path / "failed-once").exists(), 60, what="rank 1 failed")
    wait_for(lambda: run.has("[1]: rank=1 round=1"), 60, what=f"rank 1 again:\n{run.output}")
    run.finish(tmp_path / "stop", rank=1)


def test_fail_job_fails_the_job_at_once_naming_the_rule(tmp_path: Path) -> None:
    rules = [{"action": "Count", "onCauses": {"operator": "In", "values": ["hang"]}},
             exit_42("FailJob")]  # fmt: skip
    run = KelasticRun(job_with_rules(tmp_path, rules, max_restarts=3), workdir=tmp_path / "runs")
    assert run.wait() == 1, run.output
    out = run.output
    assert "job FAILED" in out
    assert "spec.failurePolicy rule 1 (FailJob: exit code 42) applies" in out, out
    assert "root cause: worker_failure: rank 1 on rules-" in out and "exited with code 42" in out
    assert run.restarts_charged() == 0  # the budget of 3 was not spent on it
    assert "replacing" not in out
    assert run.strays() == []


def test_fail_job_is_not_respawned_in_process_first(tmp_path: Path) -> None:
    """With in-process restart on, a worker's death was offered to the hybrid rung
    before any rule was asked: a FailJob exit code ('restarting cannot fix this') was
    respawned in process on the same host until that budget was spent. The rule is asked
    first now: FailJob fails the job at once."""
    path = job_with_rules(tmp_path, [exit_42("FailJob")], max_restarts=3)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["inProcess"] = {"enabled": True, "maxRestarts": 10}
    doc["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "EXIT_WRAPPED", "value": "1"})  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    run = KelasticRun(path, "--in-process", workdir=tmp_path / "runs")
    assert run.wait() == 1, run.output
    out = run.output
    assert "spec.failurePolicy rule 0 (FailJob: exit code 42) applies" in out, out
    assert "in-process restart" not in out.replace("in-process restart: a fault", ""), out
    assert "starts again as a process" not in "\n".join(
        p.read_text() for p in (tmp_path / "runs").glob("*/pods/*/kelastic-sidecar.log")
    )
    assert run.restarts_charged() == 0
    assert run.strays() == []


def test_ignore_restarts_without_charging_the_budget(tmp_path: Path) -> None:
    # maxRestarts 0: a charged failure would fail the job
    run = KelasticRun(job_with_rules(tmp_path, [exit_42("Ignore")], max_restarts=0),
                      workdir=tmp_path / "runs")  # fmt: skip
    trains_again(run, tmp_path)
    out = run.output
    assert "job succeeded" in out and run.restarts_charged() == 0
    assert "budget spent" not in out
    assert run.strays() == []


def test_a_rule_that_does_not_match_leaves_the_failure_counted(tmp_path: Path) -> None:
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [42]}},
             {"action": "Ignore", "onSignals": {"operator": "In", "values": [9]}},
             {"action": "Count",
              "onCauses": {"operator": "In", "values": ["worker_failure"]}}]  # fmt: skip
    run = KelasticRun(job_with_rules(tmp_path, rules, max_restarts=1), workdir=tmp_path / "runs")
    trains_again(run, tmp_path)
    out = run.output
    assert "restart 1/1: worker_failure: rank 1 on rules-" in out, out
    assert run.restarts_charged() == 1 and "job succeeded" in out
    assert run.strays() == []


def test_count_spends_the_budget_and_fails_the_job_when_it_is_spent(tmp_path: Path) -> None:
    rules = [{"action": "Count", "onSignals": {"operator": "In", "values": [15]}}]
    run = KelasticRun(job_with_rules(tmp_path, rules, max_restarts=0, signum=15),
                      workdir=tmp_path / "runs")  # fmt: skip
    assert run.wait() == 1, run.output
    out = run.output
    assert "killed by SIGTERM" in out and "budget spent" in out and "job FAILED" in out
    assert run.strays() == []


def test_restart_pod_replaces_the_pod_without_charging_the_budget(tmp_path: Path) -> None:
    job = job_with_rules(tmp_path, [exit_42("RestartPod")], max_restarts=0,
                         pod_replacement={"maxReplacements": 1, "backoffSeconds": 0})  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    wait_for(
        lambda: run.has("replaced (replacement 1)"), 90, what=f"the pod replaced:\n{run.output}"
    )
    wait_for(lambda: run.has("[1]: rank=1 round="), 60, what="rank 1 again")
    run.finish(tmp_path / "stop", rank=1)
    out = run.output
    assert run.restarts_charged() == 0 and "job succeeded" in out
    # the replaced Pod's trainer said why (its termination message, as on Kubernetes)
    (termlog,) = (tmp_path / "runs").glob("rules-*/pods/rules-*.replaced-1/trainer.termination-log")
    assert termlog.read_text().startswith(
        "pod restart asked by spec.failurePolicy rule 0 (RestartPod: exit code 42): "
        "worker_failure: rank 1 on rules-"
    ), termlog.read_text()
    assert run.strays() == []
