"""Hang evidence end to end: ``kelastic run`` of a 2 x 1 steps job (real etcd, sidecars,
launchers, ``tests/workers/steps.py``) whose rank 1 is stopped (``--fault hang``). Its
sidecar reads its stacks with py-spy before the timer server reaps it: the run's output
and the job's root cause name where it was stopped (``steps.py:<line> in main``, the
innermost frame of the user's code, kelastic's own timer frames skipped) and the stack
file is in the run dir. No restart allowed, so the hang is the job's root cause."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.localrun import WORKERS, KelasticRun, write_job


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy (the sidecar extra) missing")
def test_a_hung_ranks_stacks_name_where_it_was_stopped(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1, max_restarts=0,
        env={"STEPS_MAX": "2000", "STEPS_TIMEOUT": "1"},
    )  # fmt: skip
    run = KelasticRun(job, "--fault", "hang:rank=1,after=1", workdir=tmp_path / "runs")
    assert run.wait() == 1, run.output
    out = run.output
    assert "fault: SIGSTOP rank 1" in out
    steps = re.escape(str(WORKERS / "steps.py"))
    where = rf"main thread at {steps}:\d+ in main \(stacks in (\S+/rank-1-pid-\d+\.txt)\)"
    restart = re.search(rf"hang: rank 1 on steps-\d \(round 0\).*{where}", out)
    assert restart is not None, out
    assert re.search(rf"root cause: hang: rank 1 .*{where}", out), out
    stacks = Path(restart.group(1))
    assert stacks.is_file() and stacks.is_relative_to(tmp_path / "runs"), stacks
    assert '"MainThread"' in stacks.read_text()
    assert run.strays() == []
