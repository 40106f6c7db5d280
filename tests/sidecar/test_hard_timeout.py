"""The in-process hard timeout's kill (``kelastic_sidecar.inprocess.hard_timeout``): the
kill is reported before the signal, and ranks killed together are reported together (the
report reads the worker's stacks within a budget of seconds: one after another on the
coordinator's loop, 8 ranks stuck after an abort held it for 8 budgets)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

from kelastic_sidecar.inprocess.hard_timeout import HardTimeouts
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer import TimerStats
from tests.conftest import wait_for


@dataclass
class FakeHello:
    local_rank: int
    pid: int


@dataclass
class FakeSession:
    hello: FakeHello
    peer_pid: int
    peer_known: bool = True


def test_ranks_killed_together_are_reported_together_each_before_its_signal() -> None:
    order: list[tuple[str, int]] = []
    both = threading.Barrier(2, timeout=10)  # each report waits for the other's to start

    def on_kill(pid: int, why: str) -> None:
        order.append(("report", pid))
        both.wait()  # sequential reports would never get past this

    def kill(pid: int, sig: int) -> None:
        assert sig == signal.SIGKILL
        order.append(("kill", pid))

    metrics = SidecarMetrics(lambda: TimerStats())
    hard = HardTimeouts(14.0, lambda: 0.0, kill, metrics, on_kill)
    for lr, pid in ((0, 90001), (1, 90002)):
        got = hard.kill(FakeSession(FakeHello(lr, pid), pid), 3)  # type: ignore[arg-type]
        assert got == pid  # returns at once: the coordinator's loop does not wait
    wait_for(lambda: len(order) == 4, 10, what=f"both reported and killed: {order}")
    for pid in (90001, 90002):
        assert order.index(("report", pid)) < order.index(("kill", pid))
    assert {x for x in order[:2]} == {("report", 90001), ("report", 90002)}


def test_a_failing_report_does_not_spare_the_rank() -> None:
    killed: list[int] = []

    def on_kill(pid: int, why: str) -> None:
        raise RuntimeError("the supervisor's queue is gone")

    hard = HardTimeouts(14.0, lambda: 0.0, lambda pid, sig: killed.append(pid),
                        SidecarMetrics(lambda: TimerStats()), on_kill)  # fmt: skip
    hard.kill(FakeSession(FakeHello(0, 90003), 90003), 1)  # type: ignore[arg-type]
    wait_for(lambda: killed == [90003], 10, what="the kill despite the failed report")


def test_a_second_kill_of_a_pid_in_flight_starts_no_thread() -> None:
    """A rank killed again while its first kill still reads its stacks (up to the
    collector's budget) gets no second report or thread: kill threads never outnumber
    the node's workers."""
    reports: list[int] = []
    killed: list[int] = []
    release = threading.Event()

    def on_kill(pid: int, why: str) -> None:
        reports.append(pid)
        assert release.wait(10)

    metrics = SidecarMetrics(lambda: TimerStats())
    hard = HardTimeouts(14.0, lambda: 0.0, lambda pid, sig: killed.append(pid), metrics, on_kill)
    session = FakeSession(FakeHello(0, 90001), 90001)
    threads = threading.active_count()
    for _ in range(50):
        assert hard.kill(session, 3) == 90001  # type: ignore[arg-type]
    assert threading.active_count() <= threads + 1
    release.set()
    wait_for(lambda: threading.active_count() <= threads, 10, what="the kill thread ended")
    assert killed == [90001] and reports == [90001]
    hard.kill(session, 4)  # type: ignore[arg-type]  # done: a later kill goes ahead
    wait_for(lambda: killed == [90001, 90001], 10, what=f"the second kill: {killed}")
