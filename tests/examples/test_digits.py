"""The README's first command: the digits DDP job survives a killed and a hung worker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.localrun import KelasticRun

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _readme_fault_args() -> list[str]:
    """The ``--fault`` flags of the README's first command, so test and README agree."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if "kelastic run examples/digits" in x and "pip" in x]
    return line.split("elasticjob.yaml", 1)[1].split()


@pytest.mark.slow
def test_digits_survives_a_kill_and_a_hang_and_reaches_90_percent(tmp_path: Path) -> None:
    args = _readme_fault_args()
    assert any(a.startswith("kill:") for a in args) and any(a.startswith("hang:") for a in args)
    run = KelasticRun(MANIFEST, *args, workdir=tmp_path / "runs")
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "round 0: world size 4 (2 nodes x 2)" in out
    assert "fault: SIGKILL rank 1" in out and "fault: SIGSTOP rank 2" in out
    assert re.search(
        r"restart 1/3: worker_failure: rank 1 on digits-\d \(round \d+\) killed by SIGKILL", out
    )
    # the stopped worker is named, not a peer whose timer expired while waiting for it
    assert re.search(
        r"restart 2/3: hang: rank 2 on digits-1 \(round \d+\) killed by SIGKILL: timer "
        r"'train_step' expired; reaped by the timer server \(it was stopped",
        out,
    ), out
    assert out.count("resumed from checkpoint") >= 2, out
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert "job succeeded" in out
    assert run.strays() == []


@pytest.mark.slow
def test_digits_with_warm_start_restarts_from_the_zygote(tmp_path: Path) -> None:
    """``--warm-start``: the restarted workers are forked by the zygote and training resumes."""
    args = ("--warm-start", "--fault", "kill:rank=1,after=3", "--status-interval", "1")
    run = KelasticRun(MANIFEST, *args, workdir=tmp_path / "runs")
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "warm start: workers fork from a process that preloads torch, " in out
    assert "warm start is off" not in out  # no fallback to cold start was logged
    assert re.search(r"restart 1/3: worker_failure: rank 1 on digits-\d", out), out
    assert "resumed from checkpoint" in out
    # Every worker of both attempts was forked warm (2 replicas x 2 workers per attempt).
    after_restart = out.split("restart 1/3", 1)[1]
    assert re.search(r"restarts 1/3, 4 warm-started workers", after_restart), out
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert run.strays() == []
