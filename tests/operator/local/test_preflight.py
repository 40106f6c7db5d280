"""spec.preflight with real processes (``kelastic run``): the launcher runs the user's
check in the trainer container before its ``hello``; a node that fails it never joins a
round, its Pod fails naming the check, and its replacement (which passes) joins; nothing
is charged to maxRestarts. The check's failure modes: an exit code, a timeout (its
processes killed), a program that does not exist."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job

#: Fails once, for whichever node claims the flag first (a rename: one winner), saying so
#: on stderr; every later run passes.
FAIL_ONCE = (
    "import os, sys, time\n"
    "flag = sys.argv[1]\n"
    "try:\n"
    "    os.rename(flag, flag + '.claimed')\n"
    "except FileNotFoundError:\n"
    "    sys.exit(0)\n"
    "print('GPU 1: 2 uncorrectable ECC errors', file=sys.stderr, flush=True)\n"
    "if sys.argv[2] == 'hang':\n"
    "    os.fork() or time.sleep(600)  # a child in its session, killed with it\n"
    "    time.sleep(600)\n"
    "sys.exit(3)\n"
)


def job_with_preflight(tmp_path: Path, how: str, timeout: int = 60) -> Path:
    flag = tmp_path / "bad-node"
    flag.touch()
    script = tmp_path / "check.py"
    script.write_text(FAIL_ONCE)
    path = write_job(tmp_path / "job.yaml", replicas=2, max_restarts=0,
                     env={"STEPS_STOP_FILE": str(tmp_path / "stop")},
                     pod_replacement={"maxReplacements": 2, "backoffSeconds": 0})  # fmt: skip
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["spec"]["preflight"] = {
        "command": [sys.executable, str(script), str(flag), how],
        "timeoutSeconds": timeout,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("how", "timeout", "reason"),
    [
        ("exit", 60, "exited with code 3: GPU 1: 2 uncorrectable ECC errors"),
        ("hang", 2, "timed out after 2 s: GPU 1: 2 uncorrectable ECC errors"),
    ],
)
def test_a_node_failing_its_preflight_never_joins_and_its_replacement_does(
    tmp_path: Path, how: str, timeout: int, reason: str
) -> None:
    run = KelasticRun(job_with_preflight(tmp_path, how, timeout), workdir=tmp_path / "runs")
    wait_for(lambda: run.has("replaced (replacement 1)"), 90, what=f"replaced:\n{run.output}")
    wait_for(lambda: run.has("[1]: rank=1 world=2 round=0"), 60, what=f"rank 1:\n{run.output}")
    run.finish(tmp_path / "stop", rank=1)
    out = run.output
    assert "job succeeded" in out and run.restarts_charged() == 0, out
    assert "round 0: world size 2" in out and "round 0: world size 1" not in out, out
    # the failed Pod's trainer said why (its termination message, as on Kubernetes)
    (termlog,) = (tmp_path / "runs").glob("steps-*/pods/steps-*.replaced-1/trainer.termination-log")
    text = termlog.read_text()
    assert text.startswith("preflight failed on steps-") and reason in text, text
    assert run.strays() == []


def test_a_check_that_does_not_exist_fails_every_node_and_the_job(tmp_path: Path) -> None:
    path = job_with_preflight(tmp_path, "exit")
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["preflight"]["command"] = ["/no/such/check"]
    path.write_text(yaml.safe_dump(doc))
    run = KelasticRun(path, workdir=tmp_path / "runs")
    assert run.wait(180) != 0, run.output
    out = run.output
    assert "could not start '/no/such/check'" in out, out
    assert "]: rank=" not in out and run.restarts_charged() == 0, out
    assert run.strays() == []
