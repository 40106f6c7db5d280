"""The stopped-worker watch (``kelastic_sidecar.stopped_watch``): on the process path a
worker stopped past its timeout, holding no timer and waited on by nobody, is killed as
hung (before, the job hung with nothing said). Real stopped processes, the test's clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from kelastic import contract
from kelastic_sidecar.config import ConfigError, SidecarConfig
from kelastic_sidecar.hang_evidence import Evidence, Outcome
from kelastic_sidecar.stopped_watch import StoppedWatch
from kelastic_sidecar.timer import Reaper, ReapEvent, process_stat
from tests.conftest import wait_for

from .test_sidecar_config import GOOD


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Source:
    """Stands for the timer server's collector (py-spy itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def evidence(self, pids: Sequence[int]) -> dict[int, Evidence]:
        self.asked.extend(pids)
        return {p: Evidence(p, Outcome.COLLECTED, "main thread at /w/t.py:7 in f") for p in pids}


@pytest.fixture
def stopped() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: (process_stat(proc.pid) or ("",))[0] == "T", 10, what="the child stopped")
    yield proc
    proc.kill()
    proc.wait()


def test_a_worker_stopped_past_the_timeout_is_reported_then_killed(
    stopped: subprocess.Popen[bytes],
) -> None:
    clock, source, order = Clock(), Source(), []
    reports: list[ReapEvent] = []

    def report(reap: ReapEvent) -> None:
        order.append("report")
        reports.append(reap)

    def kill(pid: int, sig: int) -> None:
        order.append("kill")
        stopped.send_signal(sig)

    watch = StoppedWatch(30.0, source, report, kill=kill, clock=clock)
    assert watch.poll({0: stopped.pid}) == []  # first seen stopped now
    clock.now += 29.9
    assert watch.poll({0: stopped.pid}) == [] and order == []
    clock.now += 0.2
    assert watch.poll({0: stopped.pid}) == [stopped.pid]
    assert order == ["report", "kill"] and source.asked == [stopped.pid]
    assert stopped.wait(10) == -signal.SIGKILL
    reap = reports[0]
    assert (reap.pid, reap.state, reap.signal, reap.by) == (
        stopped.pid, "T", signal.SIGKILL, Reaper.STOPPED_WATCH,
    )  # fmt: skip
    assert reap.why == (
        "stopped (process state T) for 30 s outside any timer (timeout 30 s); killed by the "
        "sidecar; main thread at /w/t.py:7 in f"
    )


def test_a_worker_that_runs_again_is_forgotten(stopped: subprocess.Popen[bytes]) -> None:
    clock, kills = Clock(), []
    watch = StoppedWatch(30.0, Source(), lambda r: None, kill=lambda p, s: kills.append(p),
                         clock=clock)  # fmt: skip
    watch.poll({0: stopped.pid})
    clock.now += 20
    stopped.send_signal(signal.SIGCONT)
    wait_for(lambda: (process_stat(stopped.pid) or ("",))[0] != "T", 10, what="the child runs")
    watch.poll({0: stopped.pid})  # running: forgotten
    stopped.send_signal(signal.SIGSTOP)
    wait_for(lambda: (process_stat(stopped.pid) or ("",))[0] == "T", 10, what="stopped again")
    clock.now += 20
    assert watch.poll({0: stopped.pid}) == []  # stopped 0 s, not 40
    clock.now += 29
    assert watch.poll({0: stopped.pid}) == [] and kills == []


@pytest.mark.parametrize(
    "stats",
    [
        pytest.param([("T", 100), ("T", 200), ("T", 200)], id="a-reused-pid-starts-afresh"),
        pytest.param([("t", 100)] * 3, id="a-tracer-stop-is-never-acted-on"),
        pytest.param([None] * 3, id="gone"),
        pytest.param([("T", 100), ("T", 100), ("R", 100)], id="resumed-while-stacks-read"),
    ],
)
def test_what_is_not_killed(stats: list[tuple[str, int] | None]) -> None:
    clock, kills, reports = Clock(), [], []
    seq = iter(stats + [stats[-1]] * 5)
    watch = StoppedWatch(30.0, Source(), reports.append, kill=lambda p, s: kills.append(p),
                         stat=lambda pid: next(seq), clock=clock)  # fmt: skip
    watch.poll({0: 4242})
    clock.now += 31
    assert watch.poll({0: 4242}) == [] and kills == [] and reports == []


def test_a_timeout_of_zero_is_off_and_a_failing_report_does_not_spare_the_worker() -> None:
    clock, kills = Clock(), []
    off = StoppedWatch(0.0, Source(), lambda r: None, kill=lambda p, s: kills.append(p),
                       stat=lambda pid: ("T", 1), clock=clock)  # fmt: skip
    off.poll({0: 4242})
    clock.now += 1e9
    assert off.poll({0: 4242}) == [] and kills == []

    def broken(reap: ReapEvent) -> None:
        raise RuntimeError("the queue is gone")

    watch = StoppedWatch(1.0, Source(), broken, kill=lambda p, s: kills.append(p),
                         stat=lambda pid: ("T", 1), clock=clock)  # fmt: skip
    watch.poll({0: 4242})
    clock.now += 2
    assert watch.poll({0: 4242}) == [4242] and kills == [4242]


def test_process_stat_reads_state_and_start_time_and_never_raises() -> None:
    mine = process_stat(os.getpid())
    assert mine is not None and mine[0] in "RS" and mine[1] > 0
    assert process_stat(2**22 + 12345) is None  # beyond pid_max: gone


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "86401", "1e999", "soon"])
def test_a_hostile_stopped_timeout_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        SidecarConfig.from_env(GOOD | {contract.ENV_STOPPED_TIMEOUT: value})
    assert contract.ENV_STOPPED_TIMEOUT in str(err.value), str(err.value)


def test_the_stopped_timeout_defaults_to_a_minute() -> None:
    assert SidecarConfig.from_env(GOOD).stopped_timeout == 60.0
    assert SidecarConfig.from_env(GOOD | {contract.ENV_STOPPED_TIMEOUT: "0"}).stopped_timeout == 0
