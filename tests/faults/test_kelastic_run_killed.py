"""Fault matrix: ``kelastic run`` itself SIGKILLed mid-training.

Everything it started (etcd, sidecars, launchers, workers) dies with it, and the next
``kelastic run`` in the same folder removes the etcd data the killed one left; the run
dir of a live run is never touched.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from kelastic_operator.local.rundirs import ETCD_DATA_DIR, OWNER_FILE
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


def _run_dir(runs: Path, name: str) -> Path:
    return wait_for(lambda: next(iter(runs.glob(f"{name}-*")), None), 30, what="the run dir")


def test_sigkill_of_kelastic_run_takes_everything_down_and_the_next_run_cleans_up(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    ckpt = tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", name="killed", replicas=2, nproc=2,
        env={"STEPS_CHECKPOINT": str(ckpt)},
    )  # fmt: skip
    run = KelasticRun(job, workdir=runs)
    wait_for(lambda: run.has("step 5"), 60, what="workers stepping")
    killed_dir = _run_dir(runs, "killed")
    assert (killed_dir / ETCD_DATA_DIR).is_dir() and (killed_dir / OWNER_FILE).is_file()
    children = len(run.strays())
    assert children >= 1 + 2 + 2 + 4  # etcd, 2 sidecars, 2 launchers, 4 workers

    run.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    run.wait(30)
    wait_for(lambda: run.strays() == [], 20, interval=0.1, what="every child of the run to die")
    gone_in = time.monotonic() - killed_at
    print(f"\nFAULT kelastic-run-killed: {children} children gone {gone_in:.2f}s after SIGKILL")
    assert gone_in < 15
    step = int(ckpt.read_text())
    time.sleep(0.5)  # nothing trains on: the checkpoint stays where the kill left it
    assert int(ckpt.read_text()) == step > 0
    assert (killed_dir / ETCD_DATA_DIR).is_dir()  # left behind by the kill

    # The next run removes the killed run's etcd data (its logs stay)...
    live = KelasticRun(
        write_job(tmp_path / "live.yaml", name="live", replicas=1, min_replicas=1),
        workdir=runs,
    )
    try:
        wait_for(lambda: live.has("step 3"), 60, what="the live run stepping")
        assert live.has(f"of etcd data left by a killed run in {killed_dir}"), live.output
        assert not (killed_dir / ETCD_DATA_DIR).exists()
        assert (killed_dir / "pods").is_dir()
        # ...and a run never touches the dir of a live one, only its own.
        live_dir = _run_dir(runs, "live")
        nxt = KelasticRun(
            write_job(tmp_path / "next.yaml", name="next", replicas=1, env={"STEPS_MAX": "3"}),
            workdir=runs,
        )
        assert nxt.wait(120) == 0, nxt.output
        assert not nxt.has("left by a killed run"), nxt.output
        assert (live_dir / ETCD_DATA_DIR).is_dir()
        assert not (_run_dir(runs, "next") / ETCD_DATA_DIR).exists()
        assert nxt.strays() == []
    finally:
        live.proc.send_signal(signal.SIGINT)
        assert live.wait(60) == 130, live.output
    assert live.strays() == []
    assert not (live_dir / ETCD_DATA_DIR).exists()
