"""Step times per local rank and the straggler verdict (kelastic_sidecar.steptime), fed
as the timer table feeds them, with an injected clock: windows, medians, episodes, and
hostile input (a clock going backwards, a reused pid, floods of acquires and scopes)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kelastic_sidecar.config import ConfigError, SidecarConfig
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.steptime import (
    ENV_STRAGGLER_FACTOR,
    ENV_STRAGGLER_MIN_STEPS,
    MAX_SCOPES,
    VERDICT_EVERY,
    WINDOW,
    StepTimes,
    Straggler,
    StragglerSettings,
    stragglers,
)
from kelastic_sidecar.timer import TimerServer, TimerStats
from kelastic_sidecar.timer.table import TimerTable
from tests.sidecar.test_sidecar_config import GOOD


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_of(times: StepTimes, clock: Clock, pid: int, seconds: float, n: int = 1) -> None:
    """``n`` steps of ``seconds`` each by ``pid`` in scope ``step``."""
    for _ in range(n):
        times.observe(pid, "step", release=False)
        clock.now += seconds
        times.observe(pid, "step", release=True)


def node(
    settings: StragglerSettings | None = None,
) -> tuple[StepTimes, Clock, list[float], list[Straggler]]:
    clock = Clock()
    seen: list[float] = []
    episodes: list[Straggler] = []
    times = StepTimes(settings, on_step=seen.append, on_straggler=episodes.append, clock=clock)
    for rank in range(4):
        times.bind(100 + rank, rank)
    return times, clock, seen, episodes


def test_a_step_is_an_acquire_to_its_release_and_the_window_keeps_the_last_steps() -> None:
    times, clock, seen, _ = node(StragglerSettings(min_steps=3))
    steps_of(times, clock, 100, 0.5, n=2)
    clock.now += 7.0  # between steps: not part of any step
    steps_of(times, clock, 100, 0.25)
    assert seen == [0.5, 0.5, 0.25]
    # a renewal (a second acquire) inside a step keeps its start
    times.observe(100, "step", release=False)
    clock.now += 1.0
    times.observe(100, "step", release=False)
    clock.now += 1.0
    times.observe(100, "step", release=True)
    assert seen[-1] == 2.0
    # a release without an acquire is no step
    times.observe(100, "step", release=True)
    assert len(seen) == 4
    steps_of(times, clock, 100, 3.0, n=WINDOW)  # the window holds the last WINDOW steps
    rank0 = times.status()["ranks"][0]
    assert rank0 == {"local_rank": 0, "scope": "step", "median_s": 3.0, "steps": WINDOW}


def test_a_slow_rank_is_a_straggler_once_per_episode_and_named_in_the_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    times, clock, _, episodes = node(StragglerSettings(factor=1.5, min_steps=20))
    for _ in range(19):  # below min_steps: nobody is judged yet
        for pid in (100, 101, 102):
            steps_of(times, clock, pid, 0.1)
        steps_of(times, clock, 103, 0.3)
    assert times.judge() == [] and times.status()["slowest"] is None
    caplog.set_level(logging.INFO, logger="kelastic_sidecar.steptime")
    for _ in range(10):
        for pid in (100, 101, 102):
            steps_of(times, clock, pid, 0.1)
        steps_of(times, clock, 103, 0.3)
        times.judge()
    assert [(s.local_rank, s.scope) for s in episodes] == [(3, "step")]
    assert episodes[0].ratio == pytest.approx(3.0)
    warnings = [r for r in caplog.records if "straggler: local rank 3" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # once per episode, not per verdict
    status = times.status()
    assert status["slowest"] == pytest.approx(
        {"local_rank": 3, "scope": "step", "median_s": 0.3, "node_median_s": 0.1,
         "ratio_to_node_median": 3.0}
    )  # fmt: skip
    assert [s["local_rank"] for s in status["stragglers"]] == [3]
    json.dumps(status, allow_nan=False)  # the /status document stays valid JSON
    # it catches up: the episode ends (logged once); slowing again is a new episode
    steps_of(times, clock, 103, 0.1, n=WINDOW)
    assert times.judge() == []
    assert sum("no longer a straggler" in r.getMessage() for r in caplog.records) == 1
    steps_of(times, clock, 103, 0.5, n=WINDOW)
    times.judge()
    assert len(episodes) == 2


def test_the_verdict_compares_with_the_other_ranks_median() -> None:
    # two ranks: 2x slower is a straggler at 1.5 (against the node's median, the mean
    # of the two, it would be only 1.33x)
    assert [s.local_rank for s in stragglers({0: 1.0, 1: 2.0}, "step", 1.5)] == [1]
    assert stragglers({0: 1.0}, "step", 1.5) == []  # nobody to compare with
    assert stragglers({0: 0.0, 1: 5.0}, "step", 1.5) == []  # others at 0 s: no ratio
    assert stragglers({0: 1.0, 1: 1.4, 2: 1.2}, "step", 1.5) == []
    # scopes are judged apart: a slow "io" scope on rank 0 does not make it slow at "step"
    times, clock, _, _ = node(StragglerSettings(min_steps=1))
    for pid in (100, 101):
        steps_of(times, clock, pid, 1.0)
        times.observe(pid, "io", release=False)
        clock.now += 5.0 if pid == 100 else 1.0
        times.observe(pid, "io", release=True)
    assert [(s.local_rank, s.scope) for s in times.judge()] == [(0, "io")]


def test_a_clock_going_backwards_drops_the_step_and_keeps_the_verdict_going() -> None:
    times, clock, seen, episodes = node(StragglerSettings(min_steps=1))
    times.observe(100, "step", release=False)
    clock.now -= 50.0
    times.observe(100, "step", release=True)
    assert seen == [] and times.status()["steps_dropped_backwards"] == 1  # status judged
    clock.now -= 50.0  # back again, behind the last verdict
    # the verdicts go on (no wait for the clock to catch up)
    steps_of(times, clock, 100, 0.125)
    steps_of(times, clock, 101, 2.0)
    times.judge_if_due()
    assert seen == [0.125, 2.0]
    assert [(s.local_rank, s.ratio) for s in episodes] == [(1, 16.0)]


def test_a_reused_pid_never_ends_a_step_its_predecessor_began() -> None:
    times, clock, seen, _ = node()
    times.observe(100, "step", release=False)
    times.unbind(100)  # the worker exited
    clock.now += 30.0
    times.observe(100, "step", release=True)  # unbound: ignored
    times.bind(100, 2)  # the pid comes back as another rank's worker
    times.observe(100, "step", release=True)  # its predecessor's step is gone
    assert seen == []
    times.bind(100, 2)
    times.observe(100, "step", release=False)
    times.bind(100, 1)  # re-bound while a step is open: the step is dropped
    times.observe(100, "step", release=True)
    assert seen == []
    times.observe(999, "step", release=False)  # never bound: ignored
    times.observe(999, "step", release=True)
    assert seen == []


def test_a_flood_of_acquires_and_scopes_keeps_memory_bounded() -> None:
    times, clock, seen, _ = node()
    for i in range(20000):
        times.observe(100, "step", release=False)  # acquires without releases
        times.observe(101, f"scope-{i}", release=False)  # a new scope each time
        times.observe(102, f"scope-{i}", release=False)
        times.observe(102, f"scope-{i}", release=True)
        clock.now += 0.001
    assert len(times._open) <= 2 * MAX_SCOPES + 1  # bound pids x scopes
    assert len(times._windows) <= len(times._ranks) * MAX_SCOPES
    assert all(len(w) <= WINDOW for w in times._windows.values())
    assert times.status()["scopes_ignored"] > 0
    assert len(seen) == MAX_SCOPES  # rank 2's first scopes only
    times.clear()
    assert not times._open and not times._windows and not times._ranks


def test_the_nodes_histogram_counts_every_step_and_survives_a_new_attempt() -> None:
    times, clock, _, _ = node()
    steps_of(times, clock, 100, 0.125, n=3)  # bucket le=0.25
    steps_of(times, clock, 101, 0.25)  # a bound belongs to its bucket
    steps_of(times, clock, 102, 1000.0)  # above every bound: +Inf only
    times.clear()  # a new attempt: the windows go, the histogram (a counter) stays
    metrics = SidecarMetrics(lambda: TimerStats(), times.histogram)
    text = generate_latest(metrics.registry).decode()
    got = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kelastic_step_seconds"
        for s in f.samples
    }
    assert got[("kelastic_step_seconds_bucket", "0.1")] == 0
    assert got[("kelastic_step_seconds_bucket", "0.25")] == 4
    assert got[("kelastic_step_seconds_bucket", "300.0")] == 4
    assert got[("kelastic_step_seconds_bucket", "+Inf")] == 5
    assert got[("kelastic_step_seconds_count", None)] == 5
    assert got[("kelastic_step_seconds_sum", None)] == pytest.approx(1000.625)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (ENV_STRAGGLER_FACTOR, "nan", "must be a number above 1"),
        (ENV_STRAGGLER_FACTOR, "inf", "must be a number above 1"),
        (ENV_STRAGGLER_FACTOR, "-2", "must be a number above 1"),
        (ENV_STRAGGLER_FACTOR, "1", "must be a number above 1"),
        (ENV_STRAGGLER_FACTOR, "1e308", "must be a number above 1"),
        (ENV_STRAGGLER_FACTOR, "slow", "is not a valid float"),
        (ENV_STRAGGLER_MIN_STEPS, "0", f"must be in 1..{WINDOW}"),
        (ENV_STRAGGLER_MIN_STEPS, "-5", f"must be in 1..{WINDOW}"),
        (ENV_STRAGGLER_MIN_STEPS, "99999999999999999999", f"must be in 1..{WINDOW}"),
        (ENV_STRAGGLER_MIN_STEPS, "2.5", "is not a valid int"),
        (ENV_STRAGGLER_MIN_STEPS, "nan", "is not a valid int"),
    ],
)
def test_hostile_straggler_settings_are_refused_naming_the_variable(
    name: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        SidecarConfig.from_env(GOOD | {name: value})
    assert name in str(err.value) and message in str(err.value), str(err.value)


def test_straggler_settings_load_from_env_with_defaults() -> None:
    assert SidecarConfig.from_env(GOOD).stragglers == StragglerSettings(1.5, 20)
    cfg = SidecarConfig.from_env(
        GOOD | {ENV_STRAGGLER_FACTOR: "2.25", ENV_STRAGGLER_MIN_STEPS: str(WINDOW)}
    )
    assert cfg.stragglers == StragglerSettings(2.25, WINDOW)
    assert not math.isnan(cfg.stragglers.factor)


def test_the_timer_table_feeds_only_admitted_requests_of_watched_pids() -> None:
    seen: list[tuple[int, str, bool]] = []
    table = TimerTable(16, 16, kill=lambda pid, sig: None, observe=lambda *a: seen.append(a))

    def send(pid: int, scope: str, expiration: float, token: str | None = None) -> None:
        req = {"version": 1, "pid": pid, "scope_id": scope, "expiration_time": expiration,
               "signal": 9} | ({"token": token} if token else {})  # fmt: skip
        with table.lock:
            table.handle_line(json.dumps(req).encode(), oversized=False)

    table.watch(4242, "secret")
    send(4242, "step", 1e12, "secret")
    send(4242, "step", -1, "secret")
    send(4242, "step", 1e12, "forged")  # refused: not observed
    send(5555, "step", 1e12)  # unwatched: not observed
    assert seen == [(4242, "step", False), (4242, "step", True)]


def test_the_verdict_is_taken_apart_from_observe_at_most_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``observe`` runs under the timer table's lock, which every reap waits on: it only
    records. The verdict is ``judge_if_due``'s, which the timer server calls outside it:
    after a new step, and at most once per ``VERDICT_EVERY`` seconds."""
    times, clock, _, episodes = node(StragglerSettings(min_steps=1))
    verdicts: list[float] = []
    judge = times.judge
    monkeypatch.setattr(times, "judge", lambda: verdicts.append(clock.now) or judge())
    steps_of(times, clock, 100, 0.001)
    steps_of(times, clock, 101, 0.01)
    assert episodes == [] and verdicts == []  # observe never judges
    times.judge_if_due()
    assert [s.local_rank for s in episodes] == [1] and len(verdicts) == 1
    steps_of(times, clock, 101, 0.001, n=WINDOW)  # it catches up, within the second
    times.judge_if_due()
    assert len(verdicts) == 1  # not due yet
    clock.now += VERDICT_EVERY
    times.judge_if_due()
    assert len(verdicts) == 2 and times.status()["stragglers"] == []
    clock.now += VERDICT_EVERY
    times.judge_if_due()
    assert len(verdicts) == 3  # status took one (the 3rd); no step since: none now
    clock.now -= 10 * VERDICT_EVERY  # the clock stepped back: a verdict after a step
    steps_of(times, clock, 100, 0.001)
    times.judge_if_due()
    assert len(verdicts) == 4


def test_the_timer_server_calls_after_turn_outside_its_tables_lock(tmp_path: Path) -> None:
    """The straggler verdict (``after_turn``) runs on the server's thread, in every loop
    turn, but never under the table's lock, which the reaps and the supervisor's
    watch/forget wait on."""
    free: list[bool] = []

    def after_turn() -> None:
        lock = server._table.lock  # the lock under test
        got = lock.acquire(blocking=False)
        if got:
            lock.release()
        free.append(got)

    server = TimerServer(tmp_path / "timer.fifo", after_turn=after_turn, access="owner")
    server.start()
    try:
        fd = os.open(tmp_path / "timer.fifo", os.O_WRONLY | os.O_NONBLOCK)
        deadline = time.monotonic() + 10
        while len(free) < 3 and time.monotonic() < deadline:  # each line wakes a turn
            line = {"version": 1, "pid": 4242, "scope_id": "step",
                    "expiration_time": time.time() + 60, "signal": 9}  # fmt: skip
            os.write(fd, json.dumps(line).encode() + b"\n")
            time.sleep(0.01)  # pacing the writes, not waiting for a result
        os.close(fd)
    finally:
        server.stop()
    assert len(free) >= 3 and all(free), free


def test_each_change_of_the_episodes_is_reported_with_a_growing_generation() -> None:
    """``on_change`` (the operator's report): once when an episode begins, once when it
    ends, once when a new attempt ends it; a verdict that changes nothing reports nothing."""
    clock = Clock()
    changes: list[tuple[int, list[int]]] = []
    times = StepTimes(
        StragglerSettings(min_steps=5),
        on_change=lambda gen, found: changes.append((gen, [s.local_rank for s in found])),
        clock=clock,
    )
    for rank in range(3):
        times.bind(100 + rank, rank)
    for pid, seconds in ((100, 0.1), (101, 0.1), (102, 0.5)):
        steps_of(times, clock, pid, seconds, n=5)
    times.judge()
    times.judge()  # the same verdict: no report
    assert changes == [(1, [2])]
    steps_of(times, clock, 102, 0.1, n=WINDOW)
    times.judge()
    assert changes[-1] == (2, [])
    steps_of(times, clock, 102, 0.5, n=WINDOW)
    times.judge()
    times.clear()  # a new attempt: every episode ends
    times.clear()  # nothing left to end: no report
    assert changes == [(1, [2]), (2, []), (3, [2]), (4, [])]
