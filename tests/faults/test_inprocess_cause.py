"""Fault matrix: the restart names the first fault, not its consequences in peers.

A rank's exception aborts its process group, and its peers' collectives then fail with
gloo's "Connection closed by peer"; with in-process restart on, each of those reaches its
own node's sidecar as a fault of the same iteration. Normally the first one's sidecar
records the restart first. With etcd stalled when the exception is raised, every sidecar's
compare-and-set waits, and when etcd answers, a peer's node (a later fault) may win: the
node whose fault came first then renames the restart to its fault, keeping the iteration
and the restart spent (``kelastic_sidecar.inprocess.record.advance_iteration``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.conftest import wait_for
from tests.faults.test_hybrid_rung import _job, _sidecar_logs
from tests.localrun import KelasticRun

RESTART = re.compile(r"in-process restart 1/10 \(iteration 1\): (.*)$", re.M)


def test_an_exception_raised_while_etcd_is_stalled_names_the_restart(tmp_path: Path) -> None:
    """A 2 x 2 gloo DDP job (``wrapped_ddp.py``), etcd stopped (SIGSTOP) while it trains;
    rank 1 raises 8 s into training; etcd answers again 2 s later, once its peers' gloo
    errors have reached their sidecars too. The restart's line names rank 1's exception;
    one restart spent, in process, and the job succeeds."""
    job, stop = _job(tmp_path, budget=10, worker="wrapped_ddp.py", timeouts=(10, 14))
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--fault", "raise:rank=1,after=8", workdir=runs)
    try:
        wait_for(lambda: len(re.findall(r"^\[\d\]:? ?pid \d+ enter iteration 0", run.output,
                                        re.M)) == 4, 120, what="every rank training")  # fmt: skip
        (etcd,) = run.processes("etcd", "--name kelastic-local")
        etcd.suspend()
        try:
            wait_for(lambda: "fault: SIGUSR1 rank 1" in run.output, 60, what="the raise")
            # the peers' "Connection closed by peer" reach their sidecars meanwhile
            time.sleep(2.0)  # the fault's condition: etcd stalled this long after the raise
        finally:
            etcd.resume()
        try:
            wait_for(lambda: RESTART.search(run.output), 120, what="the restart's line")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{run.output}\n{_sidecar_logs(runs)}") from None
        stop.touch()
        assert run.wait() == 0, run.output
    finally:
        run.interrupt()
    out = run.output
    found = RESTART.search(out)
    assert found is not None
    line = found.group(1)
    print(f"\netcd stalled at the raise -> {line}")
    assert line.startswith("rank 1 exception: InjectedFault"), (line, _sidecar_logs(runs))
    assert "process restart" not in out.replace("in-process restart", ""), out
    assert run.restarts_charged() == 0, out
    assert len(RESTART.findall(out)) == 1, out  # said once
    assert run.strays() == []
