"""``kelastic run --in-process`` and ``--fault raise:...``: options, help, bad input, and
(slow) the digits job recovering from an exception without restarting its processes."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic import contract
from kelastic_operator.cli import with_run_options
from kelastic_operator.local.faults import Fault
from kelastic_operator.model import load_manifest, trainer_container
from tests.localrun import KelasticRun, write_job

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _env(job_template: dict[str, object]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in trainer_container(job_template).get("env") or []}


def test_in_process_and_raise_change_only_what_they_name() -> None:
    job = load_manifest(DIGITS)
    plain = with_run_options(job, argparse.Namespace(warm_start=None, in_process=False), [])
    assert plain.spec == job.spec
    args = argparse.Namespace(warm_start=None, in_process=True)
    on = with_run_options(job, args, [Fault("raise", 1, 4.0)])
    assert on.spec.in_process.enabled is True
    assert on.spec.in_process.max_restarts == job.spec.in_process.max_restarts
    assert _env(on.spec.template)[contract.ENV_INJECT_RAISE] == "1"
    assert job.spec.in_process.enabled is False  # the manifest's model is left alone
    assert contract.ENV_INJECT_RAISE not in _env(job.spec.template)
    # a raise fault without --in-process still arms the Wrapper (the process rung recovers)
    off = with_run_options(job, argparse.Namespace(warm_start=True, in_process=False),
                           [Fault("raise", 0, 1.0)])  # fmt: skip
    assert (off.spec.in_process.enabled, off.spec.warm_start.enabled) == (False, True)
    assert _env(off.spec.template)[contract.ENV_INJECT_RAISE] == "1"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kelastic_operator.cli", "run", *args],
        capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )  # fmt: skip


def test_help_explains_in_process_and_the_raise_fault() -> None:
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--in-process" in text and "spec.inProcess.enabled" in text
    assert "raise:rank=R,after=S SIGUSR1" in text and "kelastic.inprocess.Wrapper" in text
    assert "in-process restart" in text and "then process restart" in text


def test_a_bad_raise_fault_exits_2_listing_every_kind(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2)
    out = _cli(str(job), "--in-process", "--fault", "raise:rank=one")
    assert out.returncode == 2, out
    assert "expected kill:rank=R,after=S, hang:rank=R,after=S or raise:rank=R,after=S" in " ".join(
        out.stderr.split()
    )
    out = _cli(str(job), "--fault", "raise:rank=7,after=1")
    assert out.returncode == 2 and "fault rank 7 >= world size 2" in out.stderr, out


@pytest.mark.slow
def test_digits_recovers_in_process_from_an_exception(tmp_path: Path) -> None:
    """rank 1 raises 4 s into training: every rank leaves the wrapped function and enters
    it again in the same processes (no process restart charged), continues from rank 0's
    state (equal parameter hashes on every rank), and the job reaches its accuracy."""
    run = KelasticRun(DIGITS, "--in-process", "--fault", "raise:rank=1,after=4",
                      "--status-interval", "2", workdir=tmp_path / "runs")  # fmt: skip
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "fault: SIGUSR1 rank 1 after 4s" in out, out
    assert re.search(
        r"in-process restart 1/10 \(iteration 1\): rank 1 exception: .*InjectedFault", out
    ), out
    assert not re.search(r"process restart \d+/", out.replace("in-process restart", "")), out
    # every rank printed iteration 1 with the same parameter hash
    hashes = re.findall(r"\[(\d)\]:? ?.*iteration 1: params sha256 ([0-9a-f]{8})", out)
    assert {rank for rank, _ in hashes} == {"0", "1", "2", "3"}, out
    assert len({h for _, h in hashes}) == 1, hashes
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert "job succeeded" in out
    assert run.strays() == []
