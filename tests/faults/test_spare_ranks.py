"""Spare ranks with real processes: ``kelastic run --in-process
--spares 1`` of a 2 x 2 job whose wrapped function takes timed steps
(``tests/workers/wrapped_steps.py``, no torch), real etcd, sidecars, launchers. Each node
runs one spare, which waits, warm, in the Wrapper. A SIGKILLed worker: its peers restart
in process and the spare of its node becomes it (its pid from before the kill: no
process start), and a new spare starts. Spares used up: the respawn of the hybrid rung.
A spare killed while waiting: replaced, the round goes on. The job succeeding with
spares waiting: they exit, no stray process."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import wait_for
from tests.localrun import WORKERS, KelasticRun, write_job

#: ``[spare4]: pid P start iteration 0``: a spare (its placeholder rank 4+) started.
SPARE = re.compile(r"^\[spare(\d+)\]:? ?pid (\d+) start iteration (\d+)$", re.M)
START = re.compile(r"^\[(\d)\]:? ?pid (\d+) start iteration (\d+)$", re.M)
#: Any prefix: a promoted spare's first lines may still carry its spare label.
ENTER = re.compile(r"^\[(\w+)\]:? ?pid (\d+) enter iteration (\d+)$", re.M)


def _job(
    tmp: Path, env: dict[str, str] | None = None, worker: str = "wrapped_steps.py", budget: int = 10
) -> tuple[Path, Path]:
    stop = tmp / "stop"
    job = write_job(
        tmp / "job.yaml", replicas=2, nproc=2, max_restarts=3,
        command=["python", str(WORKERS / worker)],
        env={"STEPS_STOP_FILE": str(stop), **(env or {})},
    )  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["inProcess"] = {"enabled": True, "maxRestarts": budget,
                                "softTimeoutSeconds": 10, "hardTimeoutSeconds": 20}  # fmt: skip
    job.write_text(yaml.safe_dump(doc))
    return job, stop


def _spares(out: str) -> dict[int, list[int]]:
    """Spare placeholder rank -> the pids started as that spare, in order."""
    found: dict[int, list[int]] = {}
    for rank, pid, _ in SPARE.findall(out):
        found.setdefault(int(rank), []).append(int(pid))
    return found


def _entered(out: str, pid: int) -> list[int]:
    """The iterations process ``pid`` entered the function in."""
    return [int(it) for _, p, it in ENTER.findall(out) if int(p) == pid]


def _logs(runs: Path) -> str:
    """Both sidecars' logs (``kelastic run`` keeps them beside its Pods)."""
    return "\n".join(p.read_text() for p in sorted(runs.glob("*/pods/*/kelastic-sidecar.log")))


def _wait(run: KelasticRun, runs: Path, cond: Callable[[], bool], what: str) -> None:
    try:
        wait_for(cond, 120, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{run.output}\n{_logs(runs)}") from None


def test_a_killed_worker_is_replaced_by_the_waiting_spare_without_a_process_start(
    tmp_path: Path,
) -> None:
    job, stop = _job(tmp_path)
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", "--fault", "kill:rank=1,after=1",
                      workdir=runs)  # fmt: skip
    try:
        # rank 1 is on the node of group rank 0, whose spare is placeholder rank 4
        _wait(run, runs, lambda: 4 in _spares(run.output) and 5 in _spares(run.output),
              "both nodes' spares started")  # fmt: skip
        spare = _spares(run.output)[4][0]
        _wait(run, runs, lambda: 1 in _entered(run.output, spare), "the spare in iteration 1")
        _wait(run, runs, lambda: len(_spares(run.output)[4]) >= 2, "a new spare started")
        said = lambda: run.has("in-process restart 1/10 (iteration 1)")  # noqa: E731
        _wait(run, runs, said, "kelastic run naming the restart")
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out = run.output
    logs = out + _logs(runs)  # the launchers log to kelastic run's output
    assert "fault: SIGKILL rank 1 after 1s" in out, out
    # the rank's new process is the spare that waited before the kill
    killed = [int(p) for r, p, _ in START.findall(out) if r == "1"]
    assert len(killed) == 1 and killed[0] != spare, out  # no process started as rank 1
    assert _entered(out, spare) == [1], out  # the spare entered the function once, in 1
    assert re.search(rf"local rank 1 replaced by the spare of slot 2 \(pid {spare}, no process "
                     r"start\)", out), out  # fmt: skip
    assert "a waiting spare takes its place (no process start)" in out, out
    assert "local rank 1 starts again as a process" not in logs, logs
    assert "local_rank 1 (rank 1) is now pid" in out, out  # the launcher's side
    assert f"local rank(s) 1: the spare pid(s) {spare} took over (no process start)" in logs
    # the peers restarted in process: one process each, in iterations 0 and 1
    for rank in ("0", "2", "3"):
        pids = [int(p) for r, p, _ in START.findall(out) if r == rank]
        assert len(pids) == 1 and _entered(out, pids[0]) == [0, 1], (rank, out)
    new = _spares(out)[4][1]
    assert new != spare and _entered(out, new) == [], out  # replenished, waiting
    assert run.restarts_charged() == 0, out
    assert "job succeeded" in out
    assert run.strays() == []


def test_the_same_rank_killed_twice_is_replaced_by_a_spare_twice(tmp_path: Path) -> None:
    """The second fault finds rank 1's process, the first spare, by its sidecar's
    ``inprocess.spares.pids`` (its process env still says it is a spare); the spare
    started in the freed slot meanwhile takes the place again."""
    job, stop = _job(tmp_path)
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", "--fault", "kill:rank=1,after=1",
                      "--fault", "kill:rank=1,after=1", workdir=runs)  # fmt: skip
    try:
        _wait(run, runs, lambda: len(_spares(run.output).get(4, [])) >= 2, "a second spare")
        first, second = _spares(run.output)[4][:2]
        _wait(run, runs, lambda: 2 in _entered(run.output, second), "the second spare in 2")
        _wait(run, runs, lambda: len(_spares(run.output)[4]) >= 3, "a third spare started")
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out = run.output
    assert f"fault: SIGKILL rank 1 after 1s (pid {first})" in out, out
    assert _entered(out, first) == [1] and _entered(out, second) == [2], out
    assert len(re.findall(r"local rank 1 replaced by the spare of slot 2", out)) == 2, out
    assert len([p for r, p, _ in START.findall(out) if r == "1"]) == 1, out  # no new process
    assert run.restarts_charged() == 0 and "job succeeded" in out, out
    assert run.strays() == []


def test_spares_used_up_fall_back_to_the_respawn(tmp_path: Path) -> None:
    """The node's first spare replaces rank 1; its replacements die before their hello
    (``STEPS_SPARE_ONCE``) until the slot is left empty; rank 0 killed then starts again
    as a process (the hybrid rung's respawn)."""
    job, stop = _job(tmp_path, env={"STEPS_SPARE_ONCE": str(tmp_path / "spare")})
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", "--fault", "kill:rank=1,after=1",
                      "--fault", "kill:rank=0,after=3", workdir=runs)  # fmt: skip
    try:
        _wait(run, runs, lambda: run.has("in-process restart 2/10 (iteration 2)"),
              "the second in-process restart")  # fmt: skip
        run.finish(stop, rank=2, more=10)
    finally:
        run.interrupt()
    out = run.output
    logs = out + _logs(runs)  # the launchers log to kelastic run's output
    assert "local rank 1 replaced by the spare of slot 2" in out, out
    assert "slot left empty" in logs, logs
    assert "local rank 0 starts again as a process now, to enter iteration 2" in logs, logs
    zero = [(int(p), int(it)) for r, p, it in START.findall(out) if r == "0"]
    assert len(zero) == 2 and zero[1][1] == 2, out  # a new process for rank 0, in 2
    assert run.restarts_charged() == 0, out
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_spare_killed_while_waiting_is_replaced_and_the_round_goes_on(
    tmp_path: Path,
) -> None:
    job, stop = _job(tmp_path)
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", workdir=runs)
    try:
        _wait(run, runs, lambda: 5 in _spares(run.output) and run.has("step 3"),
              "training, spares waiting")  # fmt: skip
        spare = _spares(run.output)[5][0]
        os.kill(spare, signal.SIGKILL)
        _wait(run, runs, lambda: len(_spares(run.output)[5]) >= 2, "a new spare")
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out = run.output
    logs = out + _logs(runs)  # the launchers log to kelastic run's output
    assert re.search(rf"spare 0 \(pid {spare}\) killed by signal 9 while waiting \(no failure "
                     r"of the attempt\); starting a new one", logs), logs  # fmt: skip
    assert f"the spare in slot 2 (pid {spare}) went away while waiting" in logs, logs
    assert "in-process restart 1/" not in out and run.restarts_charged() == 0, out
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_process_restart_restarts_the_spares_too(tmp_path: Path) -> None:
    """In-process budget 0: a kill takes the process path on its node; that node's new
    attempt has new workers and a new spare (the old one stopped with the old workers).
    The other node's spare goes the way of its workers: restarted with them, or carried
    into the next round with them (the node-change rung, when it takes the round change)."""
    job, stop = _job(tmp_path, budget=0)
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", "--fault", "kill:rank=1,after=1",
                      workdir=runs)  # fmt: skip
    try:
        _wait(run, runs, lambda: run.has("restart 1/3:"), "a process restart")
        again = lambda: len(_spares(run.output).get(4, [])) >= 2  # noqa: E731
        _wait(run, runs, again, "node 0's spare started again")
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out = run.output
    spares = _spares(out)
    assert len(spares[4]) == 2 and spares[4][0] != spares[4][1], out  # one per attempt
    assert not psutil.pid_exists(spares[4][0])
    two = [int(p) for r, p, _ in START.findall(out) if r == "2"]
    assert len(spares[5]) == len(two) and len(two) in (1, 2), out  # with its workers
    assert len(spares[5]) == 1 or not psutil.pid_exists(spares[5][0])
    assert "replaced by the spare" not in out, out
    assert run.restarts_charged() == 1 and "job succeeded" in out, out
    assert run.strays() == []


PARAMS = re.compile(r"^\[\w+\]:? ?rank (\d) params ([0-9a-f]+)$", re.M)
STEPPED = re.compile(r"^\[\w+\]:? ?pid (\d+) stepped iteration (\d+)$", re.M)


@pytest.mark.slow
def test_a_spare_takes_a_killed_ddp_rank_and_all_ranks_end_with_the_same_parameters(
    tmp_path: Path,
) -> None:
    """gloo DDP, warm start: the spare (its model initialised apart, imports done) becomes
    rank 1 in iteration 1; DDP's broadcast makes its parameters its peers'; every rank
    ends with the same parameter hash (the ranks stop together: tests/workers/spare_ddp.py)."""
    job, stop = _job(tmp_path, worker="spare_ddp.py")
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--warm-start", "--spares", "1", "--fault",
                      "kill:rank=1,after=2", workdir=runs)  # fmt: skip
    try:
        _wait(run, runs, lambda: 4 in _spares(run.output), "the spare of node 0 started")
        spare = _spares(run.output)[4][0]
        stepped = lambda: (str(spare), "1") in STEPPED.findall(run.output)  # noqa: E731
        _wait(run, runs, stepped, "the spare stepping as rank 1 in iteration 1")
        _wait(run, runs, lambda: len(_spares(run.output)[4]) >= 2, "a new spare forked")
        for rank in ("0", "2", "3"):
            pid = next(p for r, p, _ in START.findall(run.output) if r == rank)
            _wait(run, runs, lambda p=pid: (p, "1") in STEPPED.findall(run.output),
                  f"rank {rank} stepping in iteration 1")  # fmt: skip
        stop.touch()
        assert run.wait(120) == 0, run.output
    finally:
        run.interrupt()
    out = run.output
    params = dict(PARAMS.findall(out))
    assert set(params) == {"0", "1", "2", "3"}, out
    assert len(set(params.values())) == 1, params  # the spare's parameters are its peers'
    assert "replaced by the spare of slot 2" in out and run.restarts_charged() == 0, out
    assert run.strays() == []


def test_a_spare_dying_right_after_its_go_is_that_ranks_death(tmp_path: Path) -> None:
    """The spare promoted in place of killed rank 1 dies as it enters the function (its
    go sent, the launcher's promote before or after): its exit is rank 1's death, which
    the hybrid rung takes at once (another in-process restart; rank 1 starts again), not
    a rank missing until the termination barrier's timeout."""
    job, stop = _job(tmp_path, env={"STEPS_PROMOTED_DIES": str(tmp_path / "died")})
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--spares", "1", "--fault", "kill:rank=1,after=1",
                      workdir=runs)  # fmt: skip
    try:
        _wait(run, runs, lambda: run.has("in-process restart 2/10 (iteration 2)"),
              "the promoted spare's death restarting in process")  # fmt: skip
        _wait(run, runs, lambda: any(2 in _entered(run.output, int(p))
                                     for r, p, _ in ENTER.findall(run.output) if r == "1"),
              "rank 1 in iteration 2")  # fmt: skip
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out, logs = run.output, run.output + _logs(runs)
    assert "promoted spare dying at once" in out, out
    assert "in-process restart 2/10 (iteration 2): rank 1 worker_died" in out, out
    assert "not passed within" not in logs, logs  # no barrier timeout
    assert run.restarts_charged() == 0 and "job succeeded" in out, out
    assert run.strays() == []
