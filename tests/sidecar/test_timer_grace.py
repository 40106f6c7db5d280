"""The timer server's grace (in-process restart on: ``hard_timeout - soft_timeout``): an
expired timer of a watched pid is reaped only after it, unless the worker releases or
acquires the timer again meanwhile. The table with an injected clock and kill; then the
server with real FIFOs, child processes and signals."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kelastic_sidecar.config import InProcessSettings
from kelastic_sidecar.timer import TimerServer
from kelastic_sidecar.timer.table import TimerTable
from kelastic_sidecar.timer.wire import _Request
from tests.conftest import wait_for
from tests.sidecar.test_timer_server import HUNG, Recorder, finish, spawn

PID = 4242


def _table(grace: float) -> tuple[TimerTable, list[tuple[int, int]]]:
    kills: list[tuple[int, int]] = []
    table = TimerTable(100, 100, kill=lambda pid, sig: kills.append((pid, sig)), grace=grace)
    table.watch(PID, None)
    return table, kills


def test_without_a_grace_the_pid_is_reaped_at_expiry() -> None:
    table, kills = _table(0.0)
    table.apply(_Request(PID, "step", 100.0, signal.SIGKILL))
    [event] = table.expire(100.0)
    assert kills == [(PID, signal.SIGKILL)] and event.grace == 0.0
    stats = table.snapshot()
    assert (stats.expired, stats.reaped, stats.reaped_after_grace, stats.overdue) == (1, 1, 0, 0)


def test_an_expired_timer_is_reaped_only_after_the_grace() -> None:
    table, kills = _table(4.0)
    table.apply(_Request(PID, "step", 100.0, signal.SIGKILL))
    assert table.expire(100.0) == [] and kills == []
    stats = table.snapshot()
    assert (stats.expired, stats.overdue, stats.active, stats.grace) == (1, 1, 1, 4.0)
    assert table.next_deadline() == 104.0  # the server sleeps until the grace is over
    assert table.expire(103.9) == [] and kills == []
    [event] = table.expire(104.0)
    assert kills == [(PID, signal.SIGKILL)]
    assert (event.scope_id, event.expiration_time, event.grace) == ("step", 100.0, 4.0)
    stats = table.snapshot()
    assert (stats.expired, stats.reaped, stats.reaped_after_grace) == (1, 1, 1)
    assert (stats.overdue, stats.active, stats.spared) == (0, 0, 0)


@pytest.mark.parametrize("again", [False, True], ids=["released", "acquired_again"])
def test_a_release_or_a_new_acquire_within_the_grace_spares_the_worker(again: bool) -> None:
    table, kills = _table(4.0)
    table.apply(_Request(PID, "step", 100.0, signal.SIGKILL))
    table.expire(101.0)
    table.apply(_Request(PID, "step", 110.0 if again else -1, signal.SIGKILL if again else 0))
    assert table.expire(105.0) == [] and kills == []
    stats = table.snapshot()
    assert (stats.spared, stats.overdue, stats.expired, stats.reaped) == (1, 0, 1, 0)
    assert stats.active == (1 if again else 0)
    if again:  # the new timer has its own deadline (and grace)
        assert table.expire(110.0) == [] and table.expire(114.0) != []
        assert kills == [(PID, signal.SIGKILL)]


def test_the_grace_spares_nothing_that_is_not_reaped_anyway() -> None:
    """Timers of unwatched pids and signal-0 timers expire at their deadline, as without
    a grace: nothing would be signalled for them."""
    table, kills = _table(4.0)
    table.apply(_Request(PID + 1, "unwatched", 100.0, signal.SIGKILL))
    table.apply(_Request(PID, "quiet", 100.0, 0))
    assert table.expire(100.0) == [] and kills == []
    stats = table.snapshot()
    assert (stats.expired, stats.unknown_pid, stats.overdue, stats.active) == (2, 1, 0, 0)


def test_forget_during_the_grace_prevents_the_reap() -> None:
    table, kills = _table(4.0)
    table.apply(_Request(PID, "step", 100.0, signal.SIGKILL))
    table.expire(100.0)
    table.forget(PID)
    assert table.expire(200.0) == [] and kills == []


def test_a_negative_or_infinite_grace_is_refused() -> None:
    for grace in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="grace"):
            TimerTable(1, 1, grace=grace)


def test_the_grace_is_hard_minus_soft_timeout_with_in_process_restart_only() -> None:
    assert InProcessSettings(enabled=True, soft_timeout=10, hard_timeout=14).timer_grace == 4
    assert InProcessSettings(enabled=False, soft_timeout=10, hard_timeout=14).timer_grace == 0


RELEASES_ON_SIGUSR1 = """
    import signal, sys, time
    from kelastic.timer import expires
    class Left(Exception):
        pass
    def leave(*_):
        raise Left
    signal.signal(signal.SIGUSR1, leave)
    try:
        with expires(after=0.3, scope="blocked"):
            print("in", flush=True)
            time.sleep(120)
    except Left:
        print("left", flush=True)
    sys.stdin.read()
"""


def test_real_workers_a_blocked_one_leaves_within_the_grace_a_stopped_one_is_reaped(
    tmp_path: Path,
) -> None:
    """Two real workers' timers expire: the one that leaves its block within the grace (a
    rank leaving its collective by the in-process abort) lives; the stopped one is
    reaped the grace after its deadline."""
    rec, fifo, grace = Recorder(), tmp_path / "timer.fifo", 1.5
    server = TimerServer(fifo, on_reap=rec.on_reap, kill=rec.kill, grace=grace)
    server.start()
    blocked = spawn(fifo, RELEASES_ON_SIGUSR1)
    stopped = spawn(fifo, HUNG.format(scope="stopped").replace(
        "time.sleep(120)", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"))  # fmt: skip
    try:
        for proc in (blocked, stopped):
            server.watch_pid(proc.pid)
        assert blocked.stdout is not None and blocked.stdout.readline() == "in\n"
        wait_for(lambda: server.stats().overdue == 2, timeout=10, what="both timers overdue")
        assert rec.kills == []
        blocked.send_signal(signal.SIGUSR1)  # it leaves the block: releases its timer
        assert blocked.stdout.readline() == "left\n"
        assert stopped.wait(timeout=30) == -signal.SIGKILL
        wait_for(rec.has_events(1), timeout=10, what="the reap")
        [event] = rec.events
        assert (event.pid, event.scope_id, event.grace, event.state) == (
            stopped.pid, "stopped", grace, "T",
        )  # fmt: skip
        assert event.reaped_at - event.expiration_time >= grace
        assert blocked.poll() is None and rec.kills == [(stopped.pid, signal.SIGKILL)]
        stats = server.stats()
        assert (stats.spared, stats.reaped_after_grace, stats.overdue) == (1, 1, 0)
    finally:
        server.stop()
        finish(blocked)
        finish(stopped)
