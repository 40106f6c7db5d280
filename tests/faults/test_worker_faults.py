"""Fault matrix: a worker crashes, a worker hangs, the restart budget runs out.

Real ``kelastic run`` processes: embedded etcd, sidecars, launchers and
``tests/workers/steps.py`` workers (no torch), each step inside ``expires(...)`` and
checkpointed by rank 0 (``STEPS_CHECKPOINT``), so a restart must resume where the last
step left it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kelastic import contract
from kelastic.last_status import LAST_STATUS_NAME, read_last_status
from tests.localrun import KelasticRun, write_job


def _resumed_steps(out: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"from_step=(\d+)", out)]


def test_a_crashed_worker_restarts_the_group_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = write_job(tmp_path / "job.yaml", replicas=2, nproc=2,
                    env={"STEPS_MAX": "80", "STEPS_CHECKPOINT": str(ckpt)})  # fmt: skip
    run = KelasticRun(job, "--fault", "kill:rank=1,after=0.5", workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    out = run.output
    assert "fault: SIGKILL rank 1 after 0.5s" in out
    assert "restart 1/3: worker_failure: rank 1 on steps-0 (round 0) killed by SIGKILL" in out
    assert "round 1: world size 4" in out
    assert "[1]: rank=1 world=4 round=1 restart=1" in out
    assert run.restarts_charged() == 1
    assert min(_resumed_steps(out)[4:]) > 0 and int(ckpt.read_text()) == 80  # nothing lost
    lost = run.time_lost(rank=1)
    print(f"\nFAULT worker-crash: time lost {lost:.2f}s, 1 restart charged (worker_failure)")
    assert lost < 30
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_hung_worker_is_reaped_by_its_timer_and_the_group_restarts(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1,
        env={"STEPS_MAX": "60", "STEPS_TIMEOUT": "1", "STEPS_CHECKPOINT": str(ckpt)},
    )  # fmt: skip
    run = KelasticRun(job, "--fault", "hang:rank=0,after=0.5", workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    out = run.output
    assert "fault: SIGSTOP rank 0" in out
    assert "restart 1/3: hang: rank 0 on steps-0 (round 0) killed by SIGKILL" in out
    assert "timer 'step' expired" in out
    # the other node's sidecar read where its worker was as the round hung (the restart
    # record's cause), before stopping it
    assert re.search(
        r"hang in round 0 on steps-1: rank 1 \(state [RS]\): main thread at \S+steps\.py:\d+ "
        r"in (main|_wait_for_peers) \(stacks in \S+rank-1-pid-\d+\.txt\)",
        out,
    ), out
    assert run.restarts_charged() == 1
    assert min(_resumed_steps(out)[2:]) > 0 and int(ckpt.read_text()) == 60
    lost = run.time_lost(rank=0)
    print(f"\nFAULT worker-hang: time lost {lost:.2f}s (timer 1 s), 1 restart charged (hang)")
    assert lost < 30
    assert "job succeeded" in out
    assert run.strays() == []


@pytest.mark.parametrize(
    ("replicas", "nproc", "node", "ended"),
    [
        # its node-mate's timer expires: its own sidecar names it as it classifies the reap
        pytest.param(1, 2, "steps-0", r"its peers' timers expired waiting on it: timer 'step' "
                     r"expired; reaped by the timer server.*", id="peer-on-its-node"),
        # the peer is on another node, whose restart ends the round: named before the stop
        pytest.param(2, 1, "steps-1", r"the round ended", id="peer-on-another-node"),
    ],
)  # fmt: skip
def test_a_worker_stopped_between_its_timers_is_named_not_the_peer_waiting_on_it(
    tmp_path: Path, replicas: int, nproc: int, node: str, ended: str
) -> None:
    """Rank 1 stops itself between two steps: it holds no timer, so the timer server never
    reaps it; rank 0 waits on it (a collective, here files) until its own timer expires.
    The restart is named after the stopped rank, read from its process state, with where
    it stopped (its stacks, read by py-spy: a dependency of the sidecar's extra)."""
    job = write_job(
        tmp_path / "job.yaml", replicas=replicas, nproc=nproc,
        env={"STEPS_MAX": "8", "STEPS_TIMEOUT": "2", "STEPS_LOCKSTEP": str(tmp_path / "steps"),
             "STEPS_STOP_RANK": "1", "STEPS_STOP_AT": "3"},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    out = run.output
    assert re.search(
        rf"restart 1/3: hang: rank 1 on {node} \(round 0\): stopped \(process state T\) "
        rf"outside any timer; main thread at \S+steps\.py:\d+ in main \(stacks in \S+\); "
        rf"{ended} \(it was stopped, not waiting on a peer\)",
        out,
    ), out
    # where every rank was, on every node: the stopped one, and the one waiting for it
    stacks = r"main thread at \S+steps\.py:\d+ in {} \(stacks in \S+\)"
    assert re.search(rf"hang in round 0 on {node}: .*rank 1 \(stopped\): " + stacks.format("main"),
                     out), out  # fmt: skip
    # waiting on its peer's file: py-spy names the innermost frame, which may be the read
    # that _wait_for_peers makes (CI caught it there once)
    assert re.search(r"hang in round 0 on steps-0: rank 0 \(reaped\): "
                     + stacks.format("(_wait_for_peers|_read_step)"), out), out  # fmt: skip
    verdict = (rf"hang in round 0 \(2 nodes reported\): culprit: rank 1 on {node} "
               r"\(stopped\): main thread at \S+steps\.py:\d+ in main")  # fmt: skip
    if replicas > 1:  # every node said it: the verdict across nodes names the stopped rank
        assert re.search(verdict, out), out
    assert run.restarts_charged() == 1
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_worker_stopped_outside_its_timers_with_nobody_waiting_is_killed_at_its_timeout(
    tmp_path: Path,
) -> None:
    """One worker stops itself between two steps: no timer of its own expires, no peer
    waits for it. Before the stopped-worker watch the job hung with nothing said; now its
    sidecar kills it at ``$KELASTIC_STOPPED_TIMEOUT`` and the restart names it, with
    where it was."""
    job = write_job(
        tmp_path / "job.yaml", replicas=1, nproc=1,
        env={"STEPS_MAX": "8", "STEPS_TIMEOUT": "2", "STEPS_STOP_RANK": "0",
             "STEPS_STOP_AT": "3"},
    )  # fmt: skip
    env = {**os.environ, contract.ENV_STOPPED_TIMEOUT: "2"}
    run = KelasticRun(job, workdir=tmp_path / "runs", env=env)
    assert run.wait(120) == 0, run.output
    out = run.output
    assert re.search(
        r"restart 1/3: hang: rank 0 on steps-0 \(round 0\) killed by SIGKILL: stopped "
        r"\(process state T\) for \d+ s outside any timer \(timeout 2 s\); killed by the "
        r"sidecar; main thread at \S+steps\.py:\d+ in main \(stacks in \S+\) \(it was "
        r"stopped, not waiting on a peer\)",
        out,
    ), out
    assert "hang in round 0 on steps-0: rank 0 (stopped): main thread at" in out
    assert run.restarts_charged() == 1 and "job succeeded" in out
    assert run.strays() == []


def test_an_exhausted_budget_fails_the_job_with_the_root_cause(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=2, max_restarts=1,
        env={"STEPS_FAIL_RANK": "3", "STEPS_FAIL_AT": "3", "STEPS_MAX": "400"},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    assert run.wait() == 1, run.output
    out = run.output
    assert "round 0: world size 4 (2 nodes x 2)" in out
    # every restart is said, each with its own cause (CI saw the first never said: the
    # second round, a warm start, failed before the next poll)
    restarts = [line for line in out.splitlines() if "process restart" in line]
    assert len(restarts) == 2, out
    assert re.search(
        r"process restart 1/1: worker_failure: rank 3 on steps-\d \(round 0\) "
        r"exited with code 1: ValueError: bad batch at step 3",
        restarts[0],
    ), out
    assert re.search(r"process restart budget \(1\) spent: worker_failure: rank 3 on "
                     r"steps-\d \(round 1\)", restarts[1]), out  # fmt: skip
    # the sidecars said the budget record's charges, each with its count and round (the
    # one that charged round 1 knows it; the other read the record as round 1 began)
    kept = sorted(
        (tmp_path / "runs").glob("*/pods/steps-*/volumes/kelastic-run/" + LAST_STATUS_NAME)
    )
    assert len(kept) == 2, kept
    said = [[(c["count"], c["round"]) for c in read_last_status(k.parent)["charges"]] for k in kept]
    assert [(1, 0), (2, 1)] in said and all(s in ([(1, 0)], [(1, 0), (2, 1)]) for s in said), said
    assert "job FAILED" in out
    assert "budget spent" in out and "root cause: worker_failure: rank 3" in out
    assert "replacing" not in out  # the job failed: no Pod is replaced
    # The root cause is also the trainer container's termination message.
    termlogs = list((tmp_path / "runs").glob("steps-*/pods/steps-*/trainer.termination-log"))
    assert len(termlogs) == 2
    assert all("ValueError: bad batch at step 3" in t.read_text() for t in termlogs)
    assert run.strays() == []


def test_a_node_failing_after_its_peer_finished_the_training_trains_nothing_again(
    tmp_path: Path,
) -> None:
    """Rank 0's node finishes its steps first (every worker exited 0: the training is
    done, the rendezvous closed as finished); rank 1, slower, is then killed. Its node
    charges the restart but forms no round to train again alone: it ends with nothing
    left to train, and the job succeeds (found on two real nodes: a node back from a
    partition just after its peer finished trained the last epochs again)."""
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1, min_replicas=1,
        env={"STEPS_MAX": "40", "STEPS_SLOW_RANK": "1", "STEPS_SLOW_SECONDS": "0.3"},
    )  # fmt: skip
    run = KelasticRun(job, "--fault", "kill:rank=1,after=6", workdir=tmp_path / "runs")
    assert run.wait(180) == 0, run.output
    out = run.output
    assert "fault: SIGKILL rank 1 after 6" in out, out
    assert re.search(r"process restart 1/3: worker_failure: rank 1 on steps-\d \(round 0\) "
                     r"killed by SIGKILL", out), out  # fmt: skip
    assert "round 1:" not in out and "restart=1" not in out, out  # no round trained again
    assert "job succeeded" in out
    reports = list((tmp_path / "runs").glob("steps-*/pods/steps-*/trainer.termination-log"))
    texts = sorted(t.read_text() for t in reports)
    assert len(texts) == 2 and any("nothing left to train" in t for t in texts), texts
    assert run.strays() == []
