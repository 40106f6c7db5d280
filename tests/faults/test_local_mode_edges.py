"""Local-mode edges: the interpreter the workers run, bad numbers on
the command line, Ctrl-C at any moment, and a quiet sidecar shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


def test_python_in_the_trainer_command_is_the_interpreter_running_kelastic(
    tmp_path: Path,
) -> None:
    # A virtualenv used without activating it: `python` on PATH is another interpreter
    # that lacks the job's packages (here: one that cannot run anything).
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text("#!/bin/sh\necho 'not the interpreter of kelastic' >&2\nexit 3\n")
        (fake / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    job = write_job(tmp_path / "job.yaml", replicas=1, env={"STEPS_MAX": "3"}, max_restarts=0)
    run = KelasticRun(job, workdir=tmp_path / "runs", env=env)
    assert run.wait(120) == 0, run.output
    assert run.has("[0]: step 3") and not run.has("not the interpreter")
    assert run.strays() == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--stop-grace", "-1", "must be a finite number >= 0"),
        ("--stop-grace", "nan", "must be a finite number >= 0"),
        ("--status-interval", "0", "must be a finite number > 0"),
        ("--status-interval", "-3", "must be a finite number > 0"),
        ("--status-interval", "soon", "is not a number of seconds"),
    ],
)
def test_bad_seconds_are_refused_as_bad_input(
    tmp_path: Path, option: str, value: str, message: str
) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=1)
    out = subprocess.run(
        [sys.executable, "-m", "kelastic_operator.cli", "run", str(job), f"{option}={value}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.7, 1.0])
def test_ctrl_c_in_the_first_second_prints_no_traceback(tmp_path: Path, delay: float) -> None:
    """A Ctrl-C ``delay`` seconds after ``kelastic run`` was started exits 130, one line,
    no traceback. It is started with SIGINT blocked, as a supervisor does: a SIGINT sent
    before it installed its handler (at delay 0 always; later ones too on a loaded
    machine) stays pending until it has. Before ``kelastic run`` unblocked SIGINT there,
    delay 0 never saw its Ctrl-C (the job ran on past the 60 s); and when the test instead
    waited for "Python's start-up" by the clock, a slow start let the SIGINT land before
    the interpreter had any handler: killed by the signal's default action, exit -2."""
    job = write_job(tmp_path / "job.yaml", replicas=1, min_replicas=1)
    run = KelasticRun(job, workdir=tmp_path / "runs", sigint_blocked=True)
    time.sleep(delay)  # the moment of the Ctrl-C is what this test varies
    run.proc.send_signal(signal.SIGINT)
    code = run.wait(60)
    assert code == 130, run.output
    assert "interrupted" in run.output, run.output
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output, run.output
    wait_for(lambda: run.strays() == [], 20, interval=0.1, what="no stray process")


@pytest.mark.parametrize("plain", [True, False], ids=["pythons_handler", "kelastic_run"])
def test_ctrl_c_inside_a_string_exec_of_the_start_up_exits_130(tmp_path: Path, plain: bool) -> None:
    """The intermittent exit -2 of the test above, made deterministic: a Ctrl-C whose
    KeyboardInterrupt ends a string ``exec`` (rich's and pydantic's imports run thousands:
    dataclasses, namedtuples) made ``python -m`` exit by SIGINT although ``main`` caught
    it and returned 130 (CPython takes such an interrupt as unhandled). With Python's own
    handler (the control) it still does; with ``kelastic run``'s start-up handler, 130."""
    job = write_job(tmp_path / "job.yaml", replicas=1, min_replicas=1)
    env = dict(os.environ, CTRL_C_PLAIN="1" if plain else "0")
    out = subprocess.run(
        [sys.executable, "-m", "tests.workers.ctrl_c_in_exec", "run", str(job),
         "--workdir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert "kelastic: interrupted" in out.stderr, out
    assert out.returncode == (-signal.SIGINT if plain else 130), out
    assert "Traceback" not in out.stderr, out.stderr


def test_ctrl_c_stops_everything_quietly_and_leaves_no_stray_process(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2, nproc=2, env={"STEPS_IGNORE_TERM": "1"})
    run = KelasticRun(job, workdir=tmp_path / "runs")
    wait_for(lambda: run.has("step 5"), timeout=60, what="workers stepping")
    pids = [p.split(":")[0] for p in run.strays()]
    assert len(pids) >= 1 + 2 * 2 + 2 * 2  # etcd, 2 sidecars + 2 launchers, 4 workers
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(60) == 130, run.output
    assert "SIGINT: stopping the job" in run.output
    assert "job interrupted" in run.output
    assert run.strays() == []
    # Each sidecar stopped once, in order: no traceback (a second SIGTERM used to raise
    # SidecarShutdown inside the handling of the first).
    logs = list((tmp_path / "runs").glob("steps-*/pods/steps-*/kelastic-sidecar.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and "SidecarShutdown" not in text, text


def test_a_second_sigterm_while_the_sidecar_stops_logs_no_second_traceback(
    tmp_path: Path,
) -> None:
    # Workers that ignore SIGTERM keep the sidecar in its orderly stop for --stop-grace
    # seconds: a second SIGTERM lands in the middle of it.
    job = write_job(tmp_path / "job.yaml", replicas=1, min_replicas=1,
                    env={"STEPS_IGNORE_TERM": "1"})  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        wait_for(lambda: run.has("step 3"), 60, what="workers stepping")
        (sidecar,) = run.processes("kelastic_sidecar")
        sidecar.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping workers" in _sidecar_log(tmp_path), 20, what="the stop")
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(30)  # not our child: psutil cannot tell its exit code
    finally:
        run.proc.send_signal(signal.SIGINT)
        run.wait(60)
    text = _sidecar_log(tmp_path)
    assert "already stopping" in text
    assert "Traceback" not in text, text
    assert run.strays() == []


def _sidecar_log(tmp_path: Path) -> str:
    logs = list((tmp_path / "runs").glob("steps-*/pods/steps-0/kelastic-sidecar.log"))
    return logs[0].read_text() if logs else ""
