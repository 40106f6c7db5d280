"""The hybrid rung with real processes: ``kelastic run`` of a 2 x 2 job whose
wrapped function takes timed steps (``tests/workers/wrapped_steps.py``, no torch), real
etcd, sidecars, launchers. A SIGKILLed worker: its peers restart in process (same pids)
and only it starts again, in the same iteration, no process restart charged. The
in-process budget spent, or the restarted worker dying before its hello: the process
path, as without in-process restart. No stray process either way."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.conftest import wait_for
from tests.localrun import WORKERS, KelasticRun, write_job

START = re.compile(r"^\[(\d)\]:? ?pid (\d+) start iteration (\d+)$", re.M)
ENTER = re.compile(r"^\[(\d)\]:? ?pid (\d+) enter iteration (\d+)$", re.M)


def _job(
    tmp: Path,
    budget: int,
    env: dict[str, str] | None = None,
    worker: str = "wrapped_steps.py",
    timeouts: tuple[float, float] = (10, 20),
) -> tuple[Path, Path]:
    """A 2 x 2 job of ``tests/workers/<worker>`` with in-process restart on (``budget``
    restarts, ``timeouts`` the soft and hard timeouts in seconds; the timer server's grace
    is their difference); returns the manifest and the workers' stop file."""
    stop = tmp / "stop"
    job = write_job(
        tmp / "job.yaml", replicas=2, nproc=2, max_restarts=3,
        command=["python", str(WORKERS / worker)],
        env={"STEPS_STOP_FILE": str(stop), **(env or {})},
    )  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["inProcess"] = {"enabled": True, "maxRestarts": budget,
                                "softTimeoutSeconds": timeouts[0],
                                "hardTimeoutSeconds": timeouts[1]}  # fmt: skip
    job.write_text(yaml.safe_dump(doc))
    return job, stop


def _starts(out: str) -> dict[int, list[tuple[int, int]]]:
    """Global rank -> its processes' (pid, iteration started in), in order."""
    found: dict[int, list[tuple[int, int]]] = {}
    for rank, pid, iteration in START.findall(out):
        found.setdefault(int(rank), []).append((int(pid), int(iteration)))
    return found


def _sidecar_logs(runs: Path) -> str:
    """Both sidecars' logs (``kelastic run`` keeps them beside the run's Pods)."""
    return "\n".join(p.read_text() for p in sorted(runs.glob("*/pods/*/kelastic-sidecar.log")))


def _wait(run: KelasticRun, runs: Path, cond: Callable[[], bool], what: str) -> None:
    """Wait for ``cond`` (120 s at most); fail naming ``what``, with the run's output and
    the sidecars' logs under ``runs``."""
    try:
        wait_for(cond, 120, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{run.output}\n{_sidecar_logs(runs)}") from None


def _entered(run: KelasticRun, iteration: int, ranks: int = 4) -> bool:
    return {int(r) for r, _, it in ENTER.findall(run.output) if int(it) == iteration} >= set(
        range(ranks)
    )


def test_a_killed_worker_alone_starts_again_its_peers_restart_in_process(
    tmp_path: Path,
) -> None:
    job, stop = _job(tmp_path, budget=10)
    run = KelasticRun(job, "--in-process", "--fault", "kill:rank=1,after=1",
                      workdir=tmp_path / "runs")  # fmt: skip
    try:
        _wait(run, tmp_path / "runs", lambda: _entered(run, 1), "every rank in iteration 1")
        said = lambda: run.has("in-process restart 1/10 (iteration 1)")  # noqa: E731
        _wait(run, tmp_path / "runs", said, "kelastic run naming the restart")
        run.finish(stop, rank=1, more=10)
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(tmp_path / "runs")
    assert "fault: SIGKILL rank 1 after 1s" in out, out
    assert re.search(r"in-process restart 1/10 \(iteration 1\): rank 1 worker_died: local rank "
                     r"1 \(pid \d+\) killed by SIGKILL", logs), logs  # fmt: skip
    assert "local rank 1 starts again as a process now, to enter iteration 1" in logs, logs
    # what kelastic run says of it: the rung, the dead worker and its signal
    assert re.search(r"in-process restart 1/10 \(iteration 1\): rank 1 worker_died: local rank "
                     r"1 \(pid \d+\) killed by SIGKILL; it alone starts again as a process; "
                     r"stepping again after \d", out), out  # fmt: skip
    took = re.findall(r"every local rank progressed (\d+\.\d+)s after the abort", logs)
    print(f"\nSIGKILL of rank 1 -> every local rank stepping again (hybrid rung): {took} s")
    starts = _starts(out)
    for rank in (0, 2, 3):  # the survivors: one process each, entering iterations 0 and 1
        assert len(starts[rank]) == 1, (rank, starts)
        pid = starts[rank][0][0]
        assert {(int(p), int(i)) for r, p, i in ENTER.findall(out) if int(r) == rank} == {
            (pid, 0), (pid, 1),
        }  # fmt: skip
    (old, it0), (new, it1) = starts[1]
    assert (it0, it1) == (0, 1) and old != new  # only rank 1 is a new process, in iteration 1
    assert run.restarts_charged() == 0, out  # the job's process-restart budget untouched
    assert "job succeeded" in out
    assert run.strays() == []


def test_the_budget_spent_or_a_respawn_failing_takes_the_process_path(
    tmp_path: Path,
) -> None:
    """Budget 1: the first kill is taken in process; the second restarts the processes.
    Then a restarted worker that dies before its hello: the process path too."""
    job, stop = _job(tmp_path, budget=1)
    run = KelasticRun(job, "--in-process", "--fault", "kill:rank=1,after=1", "--fault",
                      "kill:rank=2,after=1", workdir=tmp_path / "runs")  # fmt: skip
    try:
        _wait(run, tmp_path / "runs", lambda: run.has("restart 1/3:"), "a process restart")
        # the budget spent, every node restarts its processes: the killed rank's, and
        # the other one, whose workers the node-change rung does not carry then
        _wait(
            run,
            tmp_path / "runs",
            lambda: all(len(_starts(run.output).get(r, [])) == 2 for r in (0, 2)),
            "ranks 0 and 2 started again",
        )
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(tmp_path / "runs")
    assert "local rank 1 starts again as a process now, to enter iteration 1" in logs, logs
    assert "in-process restart budget of 1 spent" in logs, logs
    assert "restart 1/3: worker_failure: rank 2" in out, out
    assert run.restarts_charged() == 1
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_restarted_worker_dying_before_its_hello_takes_the_process_path(
    tmp_path: Path,
) -> None:
    die = tmp_path / "died"
    job, stop = _job(tmp_path, budget=10, env={"STEPS_DIE_FILE": str(die), "STEPS_DIE_RANK": "1"})
    run = KelasticRun(job, "--in-process", "--fault", "kill:rank=1,after=1",
                      workdir=tmp_path / "runs")  # fmt: skip
    try:
        _wait(run, tmp_path / "runs", lambda: run.has("restart 1/3:"), "a process restart")
        _wait(
            run,
            tmp_path / "runs",
            lambda: len(_starts(run.output).get(0, [])) == 2,
            "rank 0 started again",
        )
        run.finish(stop, rank=0, more=10)
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(tmp_path / "runs")
    assert die.exists() and "dying before the hello" in out, out
    assert "it died again before its hello (respawn failed)" in logs, logs
    assert "restart 1/3: worker_failure: rank 1" in out and "exited with code 3" in out, out
    assert run.restarts_charged() == 1
    assert "job succeeded" in out
    assert run.strays() == []


#: Where rank 2 of the no-collective job stops itself (``wrapped_steps.py``'s
#: ``STEPS_HANG_*``), and how kelastic knows: inside its step timer, the timer server
#: reaps it after the grace; between steps it holds no timer and its peers do not wait on
#: it: its sidecar sees its beats stop for the soft timeout, faults it on its behalf, and
#: the hard timeout kills it, which cannot answer the abort.
STOPPED = {
    "in-step": (r"rank 2 hang: local rank 0 \(pid {pid}\) killed by SIGKILL: timer 'step' "
                r"expired", r"reaped pid {pid} .*\(after the grace of 2 s\)"),
    "between-steps": (r"rank 2 soft_timeout: local rank 0 \(pid {pid}\) silent for 1\d\.\d s "
                      r"\(soft timeout 15 s\): its process is stopped or its interpreter does "
                      r"not run", r"local rank 0 \(pid {pid}\): no termination barrier of "
                      r"iteration 1 within the hard timeout \(17 s\); killing it"),
}  # fmt: skip


def _rank_2_alone_again(tmp_path: Path, job: Path, stop: Path, *args: str) -> tuple[str, str]:
    """Run ``job`` (``kelastic run --in-process`` and ``args``) until every rank is in
    iteration 1, finish it, and assert the hybrid rung took rank 2 alone: its process
    started again, its peers' not, nothing charged, success, no stray; return the
    output and the sidecars' logs."""
    run = KelasticRun(job, "--in-process", *args, workdir=tmp_path / "runs")
    try:
        _wait(run, tmp_path / "runs", lambda: _entered(run, 1), "every rank in iteration 1")
        run.finish(stop, rank=2, more=10)
    finally:
        run.interrupt()
    out = run.output
    assert [len(_starts(out).get(r, [])) for r in range(4)] == [1, 1, 2, 1], out
    assert run.restarts_charged() == 0, out
    assert "job succeeded" in out
    assert run.strays() == []
    return out, _sidecar_logs(tmp_path / "runs")


@pytest.mark.parametrize("where", list(STOPPED))
def test_a_stopped_worker_nobody_waits_on_is_killed_alone_and_starts_again(
    tmp_path: Path, where: str
) -> None:
    """SIGSTOP of a worker whose peers do not wait on it (no collective), at its 20th
    step: inside its step's timer (5 s), the timer server reaps it once the grace (hard -
    soft timeout: 2 s) is over; between steps, holding no timer, its sidecar sees its
    beats stop for the soft timeout (15 s) and faults it (a stopped process cannot report
    its own soft timeout; before, nothing ended this hang). Either way the hybrid rung:
    it alone starts again, its peers keep their pids, nothing charged."""
    env = {"STEPS_HANG_RANK": "2", "STEPS_HANG_STEP": "20",
           "STEPS_HANG_BETWEEN": "1" if where == "between-steps" else "0"}  # fmt: skip
    job, stop = _job(tmp_path, budget=10, timeouts=(15, 17), env=env)
    out, logs = _rank_2_alone_again(tmp_path, job, stop)
    said = "between steps" if where == "between-steps" else "in step"
    hung = re.search(rf"^\[2\]:? ?pid (\d+) hangs {said} 20$", out, re.M)
    assert hung is not None, out
    cause, killed = (x.format(pid=hung[1]) for x in STOPPED[where])
    assert re.search(r"in-process restart 1/10 \(iteration 1\): " + cause, logs), logs
    assert re.search(killed, logs), logs
    starts = _starts(out)
    assert str(starts[2][0][0]) == hung[1] and starts[2][1][1] == 1, starts


def test_kelastic_run_fault_hang_of_a_worker_nobody_waits_on_restarts_it_alone(
    tmp_path: Path,
) -> None:
    """``kelastic run --fault hang`` (SIGSTOP from outside, at whatever moment: inside the
    step's timer or between steps) of a worker nobody waits on: it is named and alone
    starts again (reaped by its timer, or faulted for its silence; see above)."""
    job, stop = _job(tmp_path, budget=10, timeouts=(10, 12))
    out, logs = _rank_2_alone_again(tmp_path, job, stop, "--fault", "hang:rank=2,after=1")
    assert "fault: SIGSTOP rank 2" in out, out
    named = r"in-process restart 1/10 \(iteration 1\): rank 2 (hang|soft_timeout): local rank 0"
    assert re.search(named, logs), logs


STEPPED = re.compile(r"^\[(\d)\]:? ?pid (\d+) stepped iteration (\d+)$", re.M)


@pytest.mark.slow
def test_ddp_survivors_of_killed_workers_leave_their_iteration_at_once(tmp_path: Path) -> None:
    # The survivors of a SIGKILLed peer were in DDP's backward with bucket all-reduces in
    # flight. Releasing the aborted iteration's frames (its DDP reducer) after its process
    # group was destroyed deadlocked them in the reducer's destructor until the hard
    # timeout killed them (2 of 6 kills, 30 s each): the frames go first now.
    job, stop = _job(tmp_path, budget=10, worker="wrapped_ddp.py", timeouts=(30, 60))
    kills = [a for _ in range(6) for a in ("--fault", "kill:rank=1,after=1")]
    run = KelasticRun(job, "--in-process", "--warm-start", *kills, workdir=tmp_path / "runs")
    try:

        def stepped(iteration: int) -> Callable[[], bool]:
            return lambda: {int(r) for r, _, it in STEPPED.findall(run.output)
                            if int(it) == iteration} >= {0, 1, 2, 3}  # fmt: skip

        for iteration in range(1, 7):
            _wait(run, tmp_path / "runs", stepped(iteration), f"all ranks stepping in {iteration}")
        stop.touch()
        assert run.wait() == 0, run.output
    finally:
        run.interrupt()
    logs = _sidecar_logs(tmp_path / "runs")
    assert "within the hard timeout" not in logs, logs
    assert run.has("in-process restart 6/10 (iteration 6)"), run.output
    assert "process restart" not in run.output.replace("in-process restart", ""), run.output


@pytest.mark.slow
def test_a_hung_ddp_rank_alone_is_killed_its_blocked_peers_restart_in_process(
    tmp_path: Path,
) -> None:
    """A hang: SIGSTOP of rank 3 of a DDP job whose steps are in ``expires(3)``.
    Its peers block in DDP's all-reduce on it, so their step timers expire too: each
    one's wrapper reports its expired timer as a soft timeout at once and leaves in
    process, while the timer server's grace (hard - soft timeout: 4 s) keeps it from
    reaping them. Only the stopped rank, which cannot leave, is killed (reaped after the
    grace, or the coordinator's hard-timeout kill) and started again (the hybrid rung);
    the others keep their pids. Without the grace, or without the wrapper's timer check,
    all four were reaped."""
    job, stop = _job(tmp_path, budget=10, worker="wrapped_ddp.py", timeouts=(10, 14),
                     env={"STEPS_TIMER_AFTER": "3"})  # fmt: skip
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", "--fault", "hang:rank=3,after=2", workdir=runs)
    try:

        def stepped(iteration: int) -> Callable[[], bool]:
            return lambda: {int(r) for r, _, it in STEPPED.findall(run.output)
                            if int(it) == iteration} >= {0, 1, 2, 3}  # fmt: skip

        _wait(run, runs, stepped(1), "every rank stepping in iteration 1")
        stop.touch()
        assert run.wait() == 0, run.output
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(runs)
    assert "fault: SIGSTOP rank 3" in out, out
    starts = _starts(out)
    assert [len(starts.get(r, [])) for r in range(4)] == [1, 1, 1, 2], (starts, out)
    for rank in (0, 1, 2):  # the blocked peers: the same process in iterations 0 and 1
        pid = starts[rank][0][0]
        assert {(int(p), int(i)) for r, p, i in ENTER.findall(out) if int(r) == rank} == {
            (pid, 0), (pid, 1),
        }, (rank, out)  # fmt: skip
    (old, it0), (new, it1) = starts[3]
    assert (it0, it1) == (0, 1) and old != new, starts  # rank 3 alone is a new process
    # the peers' step timers expired first, but the restart names the stopped rank: its
    # sidecar saw its beats stop before their timeouts (before: "rank [0-2] soft_timeout:
    # timer 'step' expired", a rank waiting on it)
    assert re.search(rf"in-process restart 1/10 \(iteration 1\): rank 3 soft_timeout: local "
                     rf"rank 1 \(pid {old}\) silent since", out), out  # fmt: skip
    assert "within the grace of 4 s: not reaped" in logs, logs  # a peer's timer spared
    # rank 3 alone was killed: reaped after the grace when it stopped inside its step,
    # else by the coordinator's hard-timeout kill
    assert set(re.findall(r"timer server: reaped pid (\d+)", logs)) <= {str(old)}, logs
    assert re.search(rf"local rank 1 \(pid {old}\) killed by (SIGKILL|the sidecar)", logs), logs
    assert "local rank 1 starts again as a process now, to enter iteration 1" in logs, logs
    took = re.findall(r"stepping again after (\d+\.\d+)s", out)
    print(f"\nSIGSTOP of rank 3 of DDP -> every rank stepping again: {took} s")
    assert "process restart" not in out.replace("in-process restart", ""), out
    assert run.restarts_charged() == 0, out
    assert run.strays() == []


#: Where rank 1 stops itself (``wrapped_ddp.py``'s ``STEPS_HANG_*``), and who kills it then:
#: inside its step timer, the timer server after the grace; between steps (no timer),
#: the in-process hard timeout.
HUNG = {
    "in-step": ("in step", "timer 'step' expired; reaped by the timer server"),
    "between-steps": ("between steps", "no termination barrier of iteration 1 within the "
                      "hard timeout (14 s); killed by the sidecar"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("where", list(HUNG))
def test_a_hung_rank_alone_is_killed_its_peers_abort_in_process_one_record_of_the_hang(
    tmp_path: Path, where: str
) -> None:
    """Rank 1 of a 2 x 2 DDP job stops itself (SIGSTOP) at its 5th step: inside its step's
    ``expires(3)`` (holding its timer), or between steps (holding none). Its peers block
    on it in DDP's all-reduce, so their step timers expire; they leave in process (their
    wrappers' soft timeout), the grace (hard - soft timeout: 4 s) spares them, and only
    rank 1 is killed: by the timer server after the grace, or by the in-process hard
    timeout (14 s after the abort). The hybrid rung starts it alone again. The hang is
    recorded in one place, the supervisor's monitor, whoever killed it (the hard
    timeout's kill is a reap on its queue): the monitor's log, the record's ``died`` and
    ``kelastic run`` say who killed rank 1 and that it alone started again."""
    said, why = HUNG[where]
    env = {"STEPS_TIMER_AFTER": "3", "STEPS_HANG_RANK": "1", "STEPS_HANG_STEP": "5",
           "STEPS_HANG_BETWEEN": "1" if where == "between-steps" else "0"}  # fmt: skip
    job, stop = _job(tmp_path, budget=10, worker="wrapped_ddp.py", timeouts=(10, 14), env=env)
    runs = tmp_path / "runs"
    # warm start: rank 1's new process is forked from the zygote; a cold one imports torch
    # after the go, which took 10.2 s on a loaded 2-core host, past the peers' soft
    # timeout (10 s) while they wait for it in init_process_group: a second restart
    run = KelasticRun(job, "--in-process", "--warm-start", workdir=runs)
    try:

        def stepped(iteration: int) -> Callable[[], bool]:
            return lambda: {int(r) for r, _, it in STEPPED.findall(run.output)
                            if int(it) == iteration} >= {0, 1, 2, 3}  # fmt: skip

        _wait(run, runs, stepped(1), "every rank stepping in iteration 1")
        told = re.compile(r"\(started again as a process\); (every rank )?stepping again after")
        _wait(run, runs, lambda: bool(told.search(run.output)), "kelastic run naming rank 1")
        stop.touch()
        assert run.wait() == 0, run.output
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(runs)
    hung = re.search(rf"^\[1\]:? ?pid (\d+) hangs {said} 5$", out, re.M)
    assert hung is not None, out
    starts = _starts(out)
    assert [len(starts.get(r, [])) for r in range(4)] == [1, 2, 1, 1], (starts, out)
    for rank in (0, 2, 3):  # the blocked peers: the same process in iterations 0 and 1
        pid = starts[rank][0][0]
        assert {(int(p), int(i)) for r, p, i in ENTER.findall(out) if int(r) == rank} == {
            (pid, 0), (pid, 1),
        }, (rank, out)  # fmt: skip
    (old, it0), (new, it1) = starts[1]
    assert (it0, it1) == (0, 1) and old != new and str(old) == hung[1], starts
    # rank 1 alone was killed, by the one its hang calls for
    reaps = set(re.findall(r"timer server: reaped pid (\d+)", logs))
    killed = "within the hard timeout" in logs
    if where == "in-step":
        assert reaps == {str(old)} and "after the grace of 4 s" in logs and not killed, logs
    else:
        assert not reaps and killed, logs
    # one record of the hang: the supervisor's monitor holds it (the hard timeout's kill
    # too), and the rung's cause and words come from its classification
    assert re.search(rf"worker pid {old} hung: {re.escape(why)}", logs), logs
    died = rf"local rank 1 \(pid {old}\) killed by SIGKILL: {re.escape(why)}"
    assert re.search(died, logs), logs
    assert "local rank 1 starts again as a process now, to enter iteration 1" in logs, logs
    # what kelastic run says: one restart, named after the stopped rank (its silence
    # began before its peers' timers expired), its kill and its start (on that line when
    # every rank stepped again before it was said, else on a follow-up), and the time to
    # every rank stepping
    assert re.search(rf"in-process restart 1/10 \(iteration 1\): rank 1 soft_timeout: local "
                     rf"rank 1 \(pid {old}\) silent since", out), out  # fmt: skip
    line = (rf"in-process restart (1/10 )?\(iteration 1\): .*local rank 1 \(pid {old}\) killed "
            rf"by SIGKILL: {re.escape(why[:20])}.*\(started again as a process\); "
            r"(every rank )?stepping again after \d+\.\d+s")  # fmt: skip
    assert re.search(line, out), out
    assert "it alone starts again" not in out, out  # a peer's fault made the restart
    took = re.findall(r"stepping again after (\d+\.\d+)s", out)
    print(f"\nrank 1 hung {said} (DDP) -> every rank stepping again: {took} s")
    assert "process restart" not in out.replace("in-process restart", ""), out
    assert not re.search(r"restart \d+/3:", out), out
    assert run.restarts_charged() == 0, out
    assert run.strays() == []
