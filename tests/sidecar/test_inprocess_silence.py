"""The silence watch (``kelastic_sidecar.inprocess.silence``): a rank whose worker stopped
beating in a running iteration is faulted on its behalf and killed at the hard timeout;
a worker that never beats (an older one), a finished one, or a watch that was not looking
faults nobody. The clock is the test's where the rule is arithmetic; the protocol and
the kill run over the real socket with a real SIGSTOPped process."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from kelastic.inprocess_messages import (
    Abort,
    Beat,
    Fault,
    ProtocolError,
    beat_interval,
    encode,
    parse_worker_message,
)
from kelastic_etcd import EtcdClient
from kelastic_sidecar.inprocess.phase import Phase
from kelastic_sidecar.inprocess.silence import SilenceWatch
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import NEVER_READY, make_node, sample, settings


@dataclass
class FakeHello:
    local_rank: int
    rank: int
    pid: int = 4242


@dataclass
class FakeSession:
    id: int
    heard: float
    beating: bool = True
    peer_pid: int | None = 4242
    hello: FakeHello | None = None


@dataclass
class FakeNode:
    """What the watch reads of the machine, and what it asks of it."""

    sessions: dict[int, Any]
    phase: Phase = Phase.RUNNING
    ready: set[int] = field(default_factory=set)
    ctx: object = object()
    iteration: int = 3
    advance_result: tuple[object | None, str] = (object(), "")
    advanced: list[dict[str, Any]] = field(default_factory=list)

    def advance(self, cause: object, **kw: Any) -> tuple[object | None, str]:
        self.advanced.append({"cause": cause, **kw})
        return self.advance_result


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _session(i: int, heard: float, beating: bool = True) -> FakeSession:
    return FakeSession(i, heard, beating, hello=FakeHello(local_rank=i, rank=10 + i))


def _watch_ticking(clock: Clock, watch: SilenceWatch, node: FakeNode, until: float) -> None:
    """Advance the clock to ``until`` in steps of 1 s, checking at each (the loop's wakes)."""
    while clock.now < until:
        clock.now += 1.0
        watch.check(node, lambda *a: None)  # type: ignore[arg-type]


def test_a_beating_rank_silent_for_the_soft_timeout_is_faulted_naming_it() -> None:
    clock = Clock()
    watch = SilenceWatch(10.0, clock)
    quiet, alive = _session(0, heard=1000.0), _session(1, heard=1000.0)
    node = FakeNode({0: quiet, 1: alive})
    for _ in range(15):  # rank 1 keeps beating, rank 0 went silent at 1000
        clock.now += 1.0
        alive.heard = clock.now
        watch.check(node, lambda *a: None)  # type: ignore[arg-type]
        if node.advanced:
            break
    assert len(node.advanced) == 1, node.advanced
    fault = node.advanced[0]
    assert str(fault["cause"]) == "soft_timeout" and fault["rank"] == 10
    assert clock.now - 1000.0 > 10.0  # not before the soft timeout
    assert fault["message"].startswith("local rank 0 (pid 4242) silent for 1")
    assert "(soft timeout 10 s): its process is stopped" in fault["message"]


def test_no_fault_for_a_worker_that_never_beat_a_finished_one_or_outside_running() -> None:
    clock = Clock()
    watch = SilenceWatch(10.0, clock)
    old = _session(0, heard=1000.0, beating=False)  # an older worker: sends no beats
    done = _session(1, heard=1000.0)
    node = FakeNode({0: old, 1: done})
    watch.finished(done)  # type: ignore[arg-type]
    _watch_ticking(clock, watch, node, 1100.0)
    assert node.advanced == []
    # nothing watched: a poll a quarter of the soft timeout on (a session may start
    # beating without waking the loop), never a deadline in the past (a busy loop)
    assert watch.deadlines(node) == [clock.now + 1.0]  # a beat interval on
    assert watch.deadlines(FakeNode({})) == []
    idle = FakeNode({2: _session(2, heard=clock.now)}, phase=Phase.IDLE)
    assert watch.deadlines(idle) == []
    _watch_ticking(clock, watch, idle, clock.now + 100)
    assert idle.advanced == []  # no round: nothing watched


def test_a_watch_that_was_not_looking_restarts_every_clock() -> None:
    """The sidecar stopped (SIGSTOP) or its loop starved for longer than half the soft
    timeout: its workers' beats waited in the socket; nobody is faulted on resuming,
    and a rank silent after it is, a soft timeout later."""
    clock = Clock()
    watch = SilenceWatch(10.0, clock)
    rank = _session(0, heard=1000.0)
    node = FakeNode({0: rank})
    watch.check(node, lambda *a: None)  # type: ignore[arg-type]
    clock.now += 60.0  # the sidecar was stopped for a minute
    watch.check(node, lambda *a: None)  # type: ignore[arg-type]
    assert node.advanced == []
    resumed = clock.now
    _watch_ticking(clock, watch, node, resumed + 10.0)
    assert node.advanced == []  # the silence counts from the resume
    _watch_ticking(clock, watch, node, resumed + 11.0)
    assert len(node.advanced) == 1


def test_a_silent_rank_whose_restart_cannot_be_recorded_is_killed() -> None:
    clock = Clock()
    watch = SilenceWatch(10.0, clock)
    node = FakeNode({0: _session(0, heard=1000.0)}, advance_result=(None, "budget spent"))
    killed: list[tuple[object, int, str]] = []
    while not killed and clock.now < 1100:
        clock.now += 1.0
        watch.check(node, lambda s, it, why: killed.append((s, it, why)))  # type: ignore[arg-type]
    assert len(killed) == 1
    session, iteration, why = killed[0]
    assert session is node.sessions[0] and iteration == 3
    assert why.endswith("its interpreter does not run; budget spent"), why
    assert watch.deadlines(node) == [clock.now + 1.0]  # acted on once: only the poll
    _watch_ticking(clock, watch, node, clock.now + 100)
    assert len(killed) == 1 and len(node.advanced) == 1


def test_a_restart_in_flight_is_renamed_after_the_rank_silent_since_before_it() -> None:
    """Ranks blocked on a stopped peer time out and name the restart after themselves;
    the stopped rank, silent for 3 beats without answering its abort, renames it with
    the time of its last beat (the earliest fault names a restart; nothing more charged:
    ``faulted`` is the iteration before). Ranks that answered (ready) are never named;
    each silence is acted on once."""
    import time

    clock = Clock()
    watch = SilenceWatch(10.0, clock)  # beats every 1 s: 3 missed beats = 3 s
    stopped, answered = _session(0, heard=clock.now), _session(1, heard=clock.now)
    node = FakeNode({0: stopped, 1: answered}, phase=Phase.ABORTING, ready={1})
    _watch_ticking(clock, watch, node, clock.now + 3.0)
    assert node.advanced == []  # 3 s: not yet more than 3 beats
    before = time.time()
    _watch_ticking(clock, watch, node, clock.now + 1.0)
    assert len(node.advanced) == 1, node.advanced
    renamed = node.advanced[0]
    assert renamed["faulted"] == 2 and renamed["rank"] == 10  # into iteration 3, rank 0's
    assert before - 4.5 < renamed["now"] < before - 3.5  # its last beat, 4 s ago
    assert "silent since 4.0 s" in renamed["message"]
    _watch_ticking(clock, watch, node, clock.now + 20.0)
    assert len(node.advanced) == 1  # once; rank 1 answered: never named


def test_a_rank_that_recovered_is_watched_again_and_a_ready_one_wakes_nobody() -> None:
    """A silence is acted on once, but a rank heard from after that (SIGCONT, a
    GIL-holding call that returned) is watched again: stopped again in a later iteration,
    it is faulted again (before: never again, a hang nobody ended). A rank that answered
    the abort in flight is not watched then, and its silence sets no deadline in the past
    (before: the coordinator's loop spun until the go)."""
    clock = Clock()
    watch = SilenceWatch(10.0, clock)
    rank = _session(0, heard=clock.now)
    node = FakeNode({0: rank})
    _watch_ticking(clock, watch, node, clock.now + 12.0)
    assert len(node.advanced) == 1  # faulted for its silence
    _watch_ticking(clock, watch, node, clock.now + 30.0)
    assert len(node.advanced) == 1  # still silent: once
    rank.heard = clock.now  # it recovered; iteration 4 runs
    node.iteration = 4
    _watch_ticking(clock, watch, node, clock.now + 12.0)
    assert len(node.advanced) == 2 and node.advanced[1]["rank"] == 10  # stopped again
    ready = _session(1, heard=clock.now)
    aborting = FakeNode({1: ready}, phase=Phase.ABORTING, ready={1})
    _watch_ticking(clock, watch, aborting, clock.now + 20.0)
    assert aborting.advanced == []
    assert watch.deadlines(aborting)[0] > clock.now  # the poll only, in the future


def test_the_beat_message_round_trips_and_bad_ones_are_refused() -> None:
    assert parse_worker_message(encode(Beat(local_rank=7))[:-1]) == Beat(local_rank=7)
    for bad in (b'{"type":"beat"}', b'{"type":"beat","local_rank":-1}',
                b'{"type":"beat","local_rank":1e400}', b'{"type":"beat","local_rank":4096}',
                b'{"type":"beat","local_rank":true}'):  # fmt: skip
        try:
            parse_worker_message(bad)
        except ProtocolError:
            continue
        raise AssertionError(f"accepted {bad!r}")
    assert beat_interval(60.0) == 1.0 and beat_interval(0.2) == 0.05
    assert beat_interval(0.0001) == 0.01  # never a busy loop


def test_a_sigstopped_worker_is_faulted_for_its_silence_and_killed_at_the_hard_timeout(
    store: EtcdClient, job_prefix: str
) -> None:
    """Real socket, real process, real SIGSTOP: its peer gets the abort naming it (soft
    timeout 0.5 s), it cannot answer, the hard timeout (1 s) kills it (told as a reap
    first). Before the watch, nothing happened: it held no timer and nobody waited on it."""
    with make_node("solo", store, job_prefix, cfg=settings(soft=0.5, hard=1.0)) as n:
        n.begin(1, 0, ("solo",), connect=False)
        n.ranks = [n.connect(0)]  # the peer first: a client that never beats (never watched)
        # then the worker, beating only once its hello was handled: its hello is the
        # coordinator's last event, and beats wake nothing (before: the loop then slept
        # with no deadline and never looked again; a real worker's first beat races its
        # hello)
        script = [sys.executable, "-c", NEVER_READY, str(n.socket_path), "beat"]
        worker = subprocess.Popen(script, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "connected"
            coord = n.coordinator
            wait_for(lambda: coord._call(lambda: coord.machine.has_session(1)), 10, what="hello")
            assert worker.stdin is not None
            worker.stdin.write("beat\n")
            worker.stdin.flush()
            wait_for(lambda: coord.server.sessions()[-1].beating, 10, what="the worker beating")
            worker.send_signal(signal.SIGSTOP)
            abort = n.ranks[0].expect(Abort)
            assert abort.iteration == 1  # type: ignore[attr-defined]
            reason = abort.reason  # type: ignore[attr-defined]
            assert f"rank 1: soft_timeout: local rank 1 (pid {worker.pid}) silent" in reason, reason
            assert "its process is stopped or its interpreter does not run" in reason, reason
            n.ranks[0].send(Beat(local_rank=0))  # the peer beats from now on: alive, ready
            n.ranks[0].ready(1)
            assert worker.wait(timeout=20) == -signal.SIGKILL
            assert n.killed == [(worker.pid, signal.SIGKILL)]
            assert n.told[0][0] == "reap" and "hard timeout (1 s)" in str(n.told[0][2])
            assert sample(n.metrics, "kelastic_inprocess_workers_killed_total") == 1
        finally:
            if worker.poll() is None:
                worker.send_signal(signal.SIGCONT)
                worker.kill()
                worker.wait()


def test_a_beat_flood_costs_no_queue_and_drops_nobody(store: EtcdClient, job_prefix: str) -> None:
    """Beats only stamp the session in its reader thread: 20,000 of them (far over the
    flood bound of queued messages) neither drop the session nor delay its fault."""
    with make_node("solo", store, job_prefix) as n:
        n.begin(1, 0, ("solo",))
        n.ranks[0].send(Beat(local_rank=0))
        n.ranks[0].sock.sendall(encode(Beat(local_rank=0)) * 20_000)
        n.ranks[0].send(Fault(0, 0, "exception", "ValueError: after the flood"))
        abort = n.ranks[1].expect(Abort)
        assert "ValueError: after the flood" in abort.reason  # type: ignore[attr-defined]
        assert sum(n.coordinator.server.dropped.values()) == 0
