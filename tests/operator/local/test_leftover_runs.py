"""The test harness stops a ``kelastic run`` a test left running (a test interrupted by
pytest-timeout inside ``wait`` has no cleanup of its own): one left for an hour loaded
the machine under the tests that followed, restarting its workers all along."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import wait_for
from tests.localrun import KelasticRun, stop_leftovers, write_job


def test_a_run_left_running_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    stop_leftovers()  # none of an earlier test's
    job = write_job(tmp_path / "job.yaml", replicas=1, nproc=1, env={"STEPS_MAX": "100000"})
    run = KelasticRun(job, workdir=tmp_path / "runs")
    wait_for(lambda: run.has("step 3"), 120, what=f"training:\n{run.output}")
    assert stop_leftovers() == [str(job)]
    assert run.proc.poll() is not None
    assert run.strays() == []
    assert stop_leftovers() == []  # once
