"""``kelastic run --spares N``: the option, its help, bad input, and how the progress line
says a dead rank replaced by a spare. (The spare rung itself: tests/faults/test_spare_ranks.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kelastic_operator.cli import with_run_options
from kelastic_operator.local.inprocess_lines import inprocess_line
from kelastic_operator.model import load_manifest
from tests.localrun import run_cli, write_job

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"warm_start": None, "in_process": False, "spares": None, **kw})


def test_spares_set_spare_ranks_only_with_in_process_restart() -> None:
    job = load_manifest(DIGITS)
    assert job.spec.in_process.spare_ranks == 0  # the default
    on = with_run_options(job, _args(in_process=True, spares=2), [])
    assert (on.spec.in_process.enabled, on.spec.in_process.spare_ranks) == (True, 2)
    assert with_run_options(job, _args(in_process=True), []).spec.in_process.spare_ranks == 0
    with pytest.raises(ValueError, match="--spares needs in-process restart"):
        with_run_options(job, _args(spares=1), [])


def test_help_names_spares() -> None:
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--spares N" in text and "spec.inProcess.spareRanks" in text
    assert "without a process start" in text


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--spares", "1"), "--spares needs in-process restart"),
        (("--in-process", "--spares", "65"), "must be in 0..64"),
        (("--in-process", "--spares", "-1"), "must be in 0..64"),
        (("--in-process", "--spares", "two"), "is not an integer"),
    ],
)
def test_bad_spares_exit_2(tmp_path: Path, args: tuple[str, ...], error: str) -> None:
    job = write_job(tmp_path / "job.yaml", replicas=2)
    out = run_cli(str(job), *args)
    assert out.returncode == 2, out
    assert error in " ".join(out.stderr.split()), out.stderr


def test_the_progress_line_names_the_ranks_spares_replaced() -> None:
    last = {
        "iteration": 1, "cause": "worker_died", "rank": 1, "node": "n0", "resumed_s": 0.12,
        "message": "local rank 1 (pid 7) killed by SIGKILL; a waiting spare takes its place "
                   "(no process start)",
        "promoted": ["local rank 1 replaced by the spare of slot 2 (pid 9, no process start)"],
    }  # fmt: skip
    other = {**last, "resumed_s": 0.08}
    del other["promoted"]  # only the dead rank's node says it
    docs = [{"enabled": True, "iteration": 1, "restarts": 1, "max_restarts": 10, "last": d}
            for d in (last, other)]  # fmt: skip
    line = inprocess_line(docs, 1, waited_out=False)
    assert line == (
        "in-process restart 1/10 (iteration 1): rank 1 worker_died: local rank 1 (pid 7) killed "
        "by SIGKILL; a waiting spare takes its place (no process start); local rank 1 replaced "
        "by the spare of slot 2 (pid 9, no process start); stepping again after 0.12s"
    )
