"""``kelastic run`` end to end, the hybrid rung: the digits job with
``--in-process --fault kill:rank=2,after=4``: rank 2's process is SIGKILLed; the other
three restart in process (their pids unchanged), rank 2 alone starts again as a process
(forked from the warm-start zygote) in the same iteration, no process restart is charged,
every rank continues from the same state, and the job reaches its accuracy."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.localrun import KelasticRun

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _hashes(out: str, iteration: int) -> dict[str, str]:
    """Global rank -> its parameter hash printed on entering ``iteration``."""
    found = re.findall(rf"\[(\d)\]:? ?.*iteration {iteration}: params sha256 ([0-9a-f]{{8}})", out)
    return dict(found)


def _pids(run: KelasticRun) -> set[int]:
    """The run's live processes running ``train.py`` (workers, launchers, zygotes)."""
    return {p.pid for p in run.processes("train.py")}


@pytest.mark.slow
def test_digits_recovers_from_a_killed_worker_with_the_hybrid_rung(tmp_path: Path) -> None:
    run = KelasticRun(DIGITS, "--in-process", "--warm-start", "--fault", "kill:rank=2,after=4",
                      workdir=tmp_path / "runs")  # fmt: skip
    try:
        wait_for(lambda: len(_hashes(run.output, 0)) == 4, 300,
                 what="every rank training in iteration 0")  # fmt: skip
        before = _pids(run)
        wait_for(lambda: run.has("fault: SIGKILL rank 2"), 120, what="the fault")
        started = time.monotonic()
        wait_for(lambda: len(_hashes(run.output, 1)) == 4, 120,
                 what="every rank training in iteration 1")  # fmt: skip
        print(f"\nSIGKILL of rank 2 -> all 4 ranks in iteration 1 (hybrid rung, digits): "
              f"{time.monotonic() - started:.2f} s (output lines' time)")  # fmt: skip
        after = _pids(run)
        assert run.wait(600) == 0, run.output
    finally:
        run.interrupt()
    out = run.output
    dead = int(re.findall(r"fault: SIGKILL rank 2 after 4s \(pid (\d+)\)", out)[0])
    assert before - after == {dead}, (before, after, out)  # the survivors kept their pids
    assert len(after - before) == 1, (before, after)  # rank 2 alone is a new process
    logs = "\n".join(p.read_text() for p in (tmp_path / "runs").glob("*/pods/*/*sidecar.log"))
    assert re.search(r"in-process restart 1/\d+ \(iteration 1\): rank 2 worker_died: local rank "
                     rf"0 \(pid {dead}\) killed by SIGKILL", logs), logs  # fmt: skip
    assert "local rank 0 starts again as a process now, to enter iteration 1" in logs, logs
    assert re.search(r"in-process restart 1/\d+ \(iteration 1\): rank 2 worker_died: local rank "
                     rf"0 \(pid {dead}\) killed by SIGKILL; it alone starts again as a process",
                     out), out  # kelastic run names the rung  # fmt: skip
    assert run.restarts_charged() == 0, out  # no process restart
    assert len(set(_hashes(out, 1).values())) == 1, _hashes(out, 1)  # the same state
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert "job succeeded" in out
    assert run.strays() == []
