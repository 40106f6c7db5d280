"""One place for every hang: the in-process hard timeout's kill of a worker is a reap, like
the timer server's, queued on the supervisor's queue before the kill and held by its
monitor (``AttemptMonitor.reaped``); the worker's exit is then classified as a hang by
:func:`~kelastic_sidecar.round_end.classify_exit`, whoever killed it, and the hybrid rung
reads the cause from that classification (``death_cause``), not from a set of its own on
another thread."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from kelastic.control_messages import Exited
from kelastic_sidecar.failure import CAUSE_HANG
from kelastic_sidecar.inprocess.hybrid_verdicts import death_cause, death_message
from kelastic_sidecar.inprocess.record import RestartCause
from kelastic_sidecar.round_end import RoundOf, classify_exit, stopped_failure
from kelastic_sidecar.timer import Reaper, ReapEvent, hard_timeout_reap
from tests.conftest import wait_for

ROUND = RoundOf(node="n", round=3, group_rank=1, nproc=2)
WHY = "no termination barrier of iteration 2 within the hard timeout (14 s); killed by the sidecar"


def test_a_reap_says_who_killed_the_worker() -> None:
    timer = ReapEvent(100, "step", 9, 10.0, 12.0, "T", 2.0)
    assert timer.by is Reaper.TIMER_SERVER
    assert timer.why == "timer 'step' expired; reaped by the timer server"
    hard = ReapEvent(100, "", 9, 10.0, 10.0, "S", by=Reaper.HARD_TIMEOUT, note=WHY)
    assert hard.why == WHY


def test_the_hard_timeouts_reap_is_made_before_the_kill_with_the_process_state() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{child.pid}/stat")
        wait_for(lambda: stat.read_text().split(") ")[1][0] == "T", 10, what="child stopped")
        reap = hard_timeout_reap(child.pid, WHY)
        assert (reap.pid, reap.signal, reap.state) == (child.pid, signal.SIGKILL, "T")
        assert (reap.by, reap.why, reap.grace) == (Reaper.HARD_TIMEOUT, WHY, 0.0)
    finally:
        child.kill()
        child.wait()


def test_a_worker_killed_at_the_hard_timeout_exits_as_a_hang() -> None:
    reaped = {101: ReapEvent(101, "", 9, 1.0, 1.0, "S", by=Reaper.HARD_TIMEOUT, note=WHY)}
    exited = Exited(1, 1, 101, None, 9, None, ())
    failure = classify_exit(ROUND, exited, {0: 100, 1: 101}, reaped)
    assert (failure.cause, failure.rank, failure.message) == (CAUSE_HANG, 3, WHY)
    # the hybrid rung takes the cause from there: a hang, named as the sidecar's kill
    assert death_cause(failure) is RestartCause.HANG
    assert death_message(failure, 101) == f"local rank 1 (pid 101) killed by SIGKILL: {WHY}"


def test_a_stopped_worker_killed_at_the_hard_timeout_is_the_rounds_culprit() -> None:
    """Its peers' timers were reaped while it was stopped: it is named, as for a stopped
    worker the timer server reaped, with the hard timeout's words."""
    reaped = {
        100: ReapEvent(100, "step", 9, 1.0, 2.0, "S"),
        101: ReapEvent(101, "", 9, 3.0, 3.0, "T", by=Reaper.HARD_TIMEOUT, note=WHY),
    }
    culprit = stopped_failure(ROUND, {0: 100, 1: 101}, reaped)
    assert culprit is not None and culprit.local_rank == 1 and culprit.stopped
    assert culprit.message == f"{WHY} (it was stopped, not waiting on a peer)"
    exited = Exited(1, 0, 100, None, 9, None, ())
    got = classify_exit(ROUND, exited, {0: 100, 1: 101}, reaped)
    assert (got.local_rank, got.cause, got.message) == (1, CAUSE_HANG, culprit.message)
