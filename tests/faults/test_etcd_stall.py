"""Fault matrix: etcd stalls (SIGSTOP) shorter and longer than the lease TTL.

Training needs no etcd between rounds: when etcd comes back and the membership is
unchanged, the round goes on without stopping the workers (each node takes a new lease
and writes its alive key again); no restart is charged and no step is lost.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job

TTL = 5


@pytest.mark.parametrize("stall", [2.0, 2 * TTL], ids=["shorter-than-ttl", "longer-than-ttl"])
def test_an_etcd_stall_costs_no_restart_and_no_round(tmp_path: Path, stall: float) -> None:
    stop, ckpt = tmp_path / "stop", tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1, lease_ttl=TTL,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_CHECKPOINT": str(ckpt),
             "STEPS_TIMEOUT": "30"},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        wait_for(lambda: run.has("[1]: step 10"), 60, what="both nodes training")
        (etcd,) = run.processes("etcd", "--name kelastic-local")
        etcd.suspend()
        time.sleep(stall)  # the fault: etcd answers nothing for this long
        etcd.resume()
        resumed = time.monotonic()
        # Long enough after the stall for any lease or alive key gone to be noticed.
        wait_for(lambda: time.monotonic() - resumed > TTL + 2, TTL + 10, interval=0.2,
                 what="the sidecars to settle")  # fmt: skip
        run.finish(stop)
    finally:
        run.interrupt()
    out = run.output
    assert run.restarts_charged() == 0, out
    assert not re.search(r"round [1-9]\d*: world size", out), out  # still round 0
    assert len(re.findall(r"from_step=", out)) == 2, out  # the workers never restarted
    lost = run.time_lost()
    print(f"\nFAULT etcd-stall-{stall:g}s (TTL {TTL}s): time lost {lost:.2f}s, 0 restarts")
    assert lost < 3.0, out
    assert run.strays() == []
