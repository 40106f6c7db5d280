"""What a node says of its workers as a hung round ends (:mod:`kelastic_sidecar.witness`,
kept by :class:`~kelastic_sidecar.attempt_monitor.AttemptMonitor`), with real workers, a
real timer server and a real ``py-spy``.

CI caught the case these tests pin down: a worker stopped outside its timer holds its
peers up; a peer's timer reaps the peer; the node reads the stopped worker's stacks as it
classifies that exit; by the time the round's evidence was gathered, the stopped worker
was dead (a zombie, its stacks unreadable), and the culprit was published as ``state Z:
stacks unavailable``. What was read of a worker while it lived now stands, and a pid's
first reap stands against a later one that found it dead.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.contract import TORCHELASTIC_TIMER_FILE
from kelastic.control_messages import Exited
from kelastic_sidecar.attempt_monitor import AttemptMonitor
from kelastic_sidecar.control import ControlServer
from kelastic_sidecar.events import Event, RendezvousChanged, WorkerReaped
from kelastic_sidecar.hang_evidence import Evidence, Outcome, StackCollector
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.rendezvous.state import RendezvousInfo
from kelastic_sidecar.round_end import LiveStates, RoundEnd, RoundEndKind, RoundOf
from kelastic_sidecar.timer import Reaper, ReapEvent, TimerServer, TimerStats
from kelastic_sidecar.timer.report import process_state
from kelastic_sidecar.witness import observe, where_ranks_were
from tests.conftest import wait_for

#: Stops itself inside a timer of argv[1] seconds, in ``stuck_here`` (line 6).
STOPPED = """\
import os, signal, sys
from kelastic.timer import expires


def stuck_here():
    os.kill(os.getpid(), signal.SIGSTOP)


with expires(after=float(sys.argv[1]), scope="step"):
    stuck_here()
"""

#: Waits for its peer under a timer of argv[1] seconds, in ``wait_for_peer``.
WAITING = """\
import sys, time
from kelastic.timer import expires


def wait_for_peer():
    while True:
        time.sleep(0.05)


with expires(after=float(sys.argv[1]), scope="step"):
    wait_for_peer()
"""

INFO = RendezvousInfo(round=4, group_rank=0, group_world_size=1, participants=("job-0",))


@pytest.fixture
def events() -> queue.Queue[Event]:
    """The supervisor's queue: where the timer server's reaps go."""
    return queue.Queue()


@pytest.fixture
def server(
    tmp_path: Path, events: queue.Queue[Event]
) -> Iterator[tuple[TimerServer, list[ReapEvent]]]:
    reaps: list[ReapEvent] = []

    def on_reap(reap: ReapEvent) -> None:
        reaps.append(reap)
        events.put(WorkerReaped(reap))

    timer = TimerServer(
        tmp_path / "timer.fifo", on_reap=on_reap, collect=StackCollector(tmp_path / "ev"),
        release=False,
    )  # fmt: skip
    timer.start()
    yield timer, reaps
    timer.stop()


def _spawn(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], code: str, after: float, rank: int
) -> subprocess.Popen[bytes]:
    script = tmp_path / f"rank{rank}.py"
    script.write_text(code)
    env = dict(os.environ, RANK=str(rank))
    env[TORCHELASTIC_TIMER_FILE] = str(tmp_path / "timer.fifo")
    proc = subprocess.Popen([sys.executable, str(script), str(after)], env=env)
    procs.append(proc)
    return proc


def _monitor(tmp_path: Path, timer: TimerServer, events: queue.Queue[Event]) -> AttemptMonitor:
    control = ControlServer(tmp_path / "control.sock", lambda msg: None)  # never started
    monitor = AttemptMonitor(
        "job-0", 2, events, control, timer, SidecarMetrics(lambda: TimerStats()), stop_grace=1.0
    )
    monitor.new_attempt()
    return monitor


def test_a_stopped_worker_killed_before_the_evidence_is_named_as_it_was_seen(
    tmp_path: Path,
    events: queue.Queue[Event],
    server: tuple[TimerServer, list[ReapEvent]],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Its peer's exit (a reap) ended the round, reading it stopped; it died before the
    round's evidence was gathered, reaped by nobody we know of."""
    timer, reaps = server
    monitor = _monitor(tmp_path, timer, events)
    waiting = _spawn(tmp_path, procs, WAITING, 1.0, rank=0)
    stopped = _spawn(tmp_path, procs, STOPPED, 600.0, rank=1)  # its timer never expires here
    monitor.pids.update({0: waiting.pid, 1: stopped.pid})
    for pid in monitor.pids.values():
        timer.watch_pid(pid)
    wait_for(lambda: process_state(stopped.pid) == "T", timeout=60, what="rank 1 stopped")
    # its peer's timer expires: reaped by the server, its exit classified (reading rank 1)
    wait_for(lambda: reaps, timeout=60, what="the waiting rank's reap")
    [reap] = reaps
    assert reap.pid == waiting.pid and reap.state in ("S", "R")
    assert isinstance(events.get(timeout=10), WorkerReaped)
    monitor.on_reaped(reap)
    assert waiting.wait(30) == -signal.SIGKILL
    exited = Exited(attempt=monitor.attempt, local_rank=0, pid=waiting.pid, signal=signal.SIGKILL)
    end = monitor._on_exited(exited, INFO, set())
    assert end is not None and end.kind is RoundEndKind.FAILED and end.failure is not None
    assert end.failure.stopped and end.failure.local_rank == 1, end.failure
    # then rank 1 dies before the round's evidence is gathered (not waited for: a zombie)
    stopped.kill()
    wait_for(lambda: process_state(stopped.pid) == "Z", timeout=30, what="rank 1 a zombie")
    monitor.before_stop(INFO, end, lambda round_: None)
    assert monitor.where is not None
    rank0, rank1 = monitor.where.ranks
    assert (rank0.reaped, rank0.how) == (True, "reaped") and "wait_for_peer" in rank0.where
    assert (rank1.state, rank1.how, rank1.reaped) == ("T", "stopped", False)
    assert f"rank1.py:6 in stuck_here (stacks in {tmp_path / 'ev'}" in rank1.where, rank1
    # what the node reads of it now alone would have named a dead process, no stacks
    now = where_ranks_were(timer, monitor.round_of(INFO), monitor.pids, monitor.reaped)
    assert (now.ranks[1].how, now.ranks[1].where) == ("state Z", "stacks not read")


def test_a_stopped_worker_reaped_dead_by_its_timer_is_named_as_it_was_seen(
    tmp_path: Path,
    server: tuple[TimerServer, list[ReapEvent]],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Its own timer expires after it died (killed by its group's stop, not yet waited
    for): the timer server's reap finds a zombie, whose stacks cannot be read; the
    reading taken while it was stopped names it."""
    timer, reaps = server
    stopped = _spawn(tmp_path, procs, STOPPED, 4.0, rank=1)
    timer.watch_pid(stopped.pid)
    wait_for(lambda: process_state(stopped.pid) == "T", timeout=60, what="stopped")
    seen = observe(timer, {1: stopped.pid}, {})
    assert seen.states == {stopped.pid: "T"} and "in stuck_here" in seen.evidence[stopped.pid]
    stopped.kill()
    wait_for(lambda: process_state(stopped.pid) == "Z", timeout=30, what="a zombie")
    wait_for(lambda: reaps, timeout=60, what="its timer's reap")
    [reap] = reaps
    # the test's precondition: the reap came after the kill (a 4 s timer; else it read T)
    assert reap.state == "Z" and reap.evidence is not None, reap
    assert reap.evidence.outcome is Outcome.UNAVAILABLE
    round_ = RoundOf("job-0", 4, 0, 2)
    got = where_ranks_were(timer, round_, {1: stopped.pid}, {stopped.pid: reap}, seen)
    [rank] = got.ranks
    assert (rank.state, rank.reaped, rank.how) == ("T", True, "stopped")
    assert rank.where == seen.evidence[stopped.pid]
    alone = where_ranks_were(timer, round_, {1: stopped.pid}, {stopped.pid: reap})
    assert alone.ranks[0].how == "reaped" and alone.ranks[0].state == "Z"


def test_a_pids_first_reap_stands(tmp_path: Path) -> None:
    """The stopped-worker watch killed a worker (state T, its stacks); its timer then
    expires on the dead process: the later reap is logged, not taken for the hang."""
    timer = TimerServer(tmp_path / "timer.fifo", release=False)  # never started
    monitor = _monitor(tmp_path, timer, queue.Queue())
    ev = Evidence(812, Outcome.COLLECTED, "main thread at /w/t.py:5 in f")
    first = ReapEvent(812, "", 9, 0.0, 100.0, "T", by=Reaper.STOPPED_WATCH, evidence=ev)
    later = ReapEvent(812, "step", 9, 101.0, 101.5, "Z")
    monitor.on_reaped(first)
    monitor.on_reaped(later)
    assert monitor.reaped == {812: first}
    monitor.new_attempt()  # a new attempt forgets the reaps and the readings
    assert monitor.reaped == {} and monitor.seen == LiveStates()
    monitor.on_reaped(later)
    assert monitor.reaped == {812: later}


def test_a_hung_round_of_a_peer_reads_each_worker_once(
    tmp_path: Path,
    events: queue.Queue[Event],
    server: tuple[TimerServer, list[ReapEvent]],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """A peer node's restart ends the round (not failed here): the stopped worker is
    read once, named stopped, and kept in the attempt's readings."""
    timer, _ = server
    monitor = _monitor(tmp_path, timer, events)
    stopped = _spawn(tmp_path, procs, STOPPED, 600.0, rank=1)
    monitor.pids[1] = stopped.pid
    timer.watch_pid(stopped.pid)
    wait_for(lambda: process_state(stopped.pid) == "T", timeout=60, what="stopped")
    found = monitor.before_stop(INFO, RoundEnd(RoundEndKind.RESTART), lambda round_: "hang")
    assert found is not None and found.stopped and found.local_rank == 1
    assert monitor.where is not None and monitor.where.ranks[0].how == "stopped"
    assert monitor.seen.states == {stopped.pid: "T"}
    dumps = list((tmp_path / "ev").iterdir())
    assert [p.name for p in dumps] == [f"rank-1-pid-{stopped.pid}.txt"]


def test_a_reap_queued_after_the_rounds_end_is_taken_into_its_evidence(
    tmp_path: Path,
    events: queue.Queue[Event],
    server: tuple[TimerServer, list[ReapEvent]],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """The stopped worker's own timer expires just after its peer's exit ended the round:
    its reap (with the stacks read before the kill) waits in the queue, behind the round's
    end; the evidence takes it, and the other events stay queued, in order."""
    timer, reaps = server
    monitor = _monitor(tmp_path, timer, events)
    waiting = _spawn(tmp_path, procs, WAITING, 1.0, rank=0)
    stopped = _spawn(tmp_path, procs, STOPPED, 3.0, rank=1)
    monitor.pids.update({0: waiting.pid, 1: stopped.pid})
    for pid in monitor.pids.values():
        timer.watch_pid(pid)
    wait_for(lambda: reaps, timeout=60, what="the waiting rank's reap")
    first = events.get(timeout=10)
    assert isinstance(first, WorkerReaped) and first.reap.pid == waiting.pid
    monitor.on_reaped(first.reap)
    end = monitor._on_exited(
        Exited(attempt=monitor.attempt, local_rank=0, pid=waiting.pid, signal=signal.SIGKILL),
        INFO, set(),
    )  # fmt: skip
    assert end is not None and end.kind is RoundEndKind.FAILED
    events.put(RendezvousChanged())
    wait_for(lambda: len(reaps) == 2, timeout=60, what="rank 1's own reap")
    events.put(RendezvousChanged())
    assert reaps[1].pid == stopped.pid and reaps[1].state == "T"
    monitor.before_stop(INFO, end, lambda round_: None)
    assert monitor.reaped[stopped.pid] is reaps[1]
    assert monitor.where is not None
    rank1 = monitor.where.ranks[1]
    assert (rank1.how, rank1.reaped) == ("stopped", True) and "in stuck_here" in rank1.where
    left = [events.get_nowait() for _ in range(events.qsize())]
    assert left == [RendezvousChanged(), RendezvousChanged()]


def test_an_exit_that_overtakes_its_reaps_event_is_still_a_hang(
    tmp_path: Path,
    events: queue.Queue[Event],
    server: tuple[TimerServer, list[ReapEvent]],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """The timer server kills first and calls ``on_reap`` after: on a loaded machine the
    launcher's report of the exit can reach the supervisor before the reap's event (a
    run named the reaped rank ``worker_died`` in its in-process restart, not ``hang``).
    The exit finds the reap at the timer server, and the late event changes nothing."""
    timer, reaps = server
    monitor = _monitor(tmp_path, timer, events)
    waiting = _spawn(tmp_path, procs, WAITING, 1.0, rank=0)
    monitor.pids.update({0: waiting.pid})
    timer.watch_pid(waiting.pid)
    wait_for(lambda: reaps, timeout=60, what="its timer's reap")
    assert waiting.wait(30) == -signal.SIGKILL
    assert timer.reap_of(waiting.pid) is reaps[0]
    exited = Exited(attempt=monitor.attempt, local_rank=0, pid=waiting.pid, signal=signal.SIGKILL)
    end = monitor._on_exited(exited, INFO, set())  # its WorkerReaped still in the queue
    assert end is not None and end.failure is not None
    assert (end.failure.cause, end.failure.rank) == ("hang", 0), end.failure
    assert "timer 'step' expired" in end.failure.message, end.failure
    late = events.get(timeout=10)
    assert isinstance(late, WorkerReaped) and late.reap is reaps[0]
    monitor.on_reaped(late.reap)  # the same reap: nothing changes
    assert monitor.reaped == {waiting.pid: reaps[0]}
    timer.forget_all()  # a new attempt: the old reaps are forgotten
    assert timer.reap_of(waiting.pid) is None
