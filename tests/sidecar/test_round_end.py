"""kelastic_sidecar.round_end: how a round ended, as tables of inputs (no processes)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from kelastic import contract
from kelastic.control_messages import Exited
from kelastic_sidecar.assignment import build_assign
from kelastic_sidecar.failure import (
    CAUSE_HANG,
    CAUSE_NODE_LOST,
    CAUSE_OOM,
    CAUSE_PEER,
    CAUSE_SCALE,
    CAUSE_START_FAILURE,
    CAUSE_WORKER_FAILURE,
    Failure,
)
from kelastic_sidecar.rendezvous.state import RoundCheck
from kelastic_sidecar.round_end import (
    LiveStates,
    RoundEnd,
    RoundEndKind,
    RoundOf,
    blame_lost_peer,
    classify_check,
    classify_exit,
    closed_outcome,
    explain_worker_failure,
    lost_peer,
    stopped_failure,
)
from kelastic_sidecar.timer import ReapEvent

NODE = "job-1"
ROUND = RoundOf(node=NODE, round=7, group_rank=1, nproc=2)

K = RoundEndKind
LOST_LIVENESS = "its liveness key is gone (lease expired or node removed)"

CHECKS = [
    # (id, check, expected kind, expected reason, expected failure node, failure message)
    ("healthy", RoundCheck(True, ""), None, "", None, None),
    ("closed", RoundCheck(False, "closed"), K.CLOSED, "", None, None),
    (
        "we-left-scale-down",
        RoundCheck(False, "participant_left", (NODE,), ((NODE, "scale_down"),)),
        K.REMOVED, "scale_down", None, None,
    ),
    (
        "we-were-lost",
        RoundCheck(False, "participant_lost", ("job-0", NODE)),
        K.REMOVED, "", None, None,
    ),
    (
        "peer-lost",
        RoundCheck(False, "participant_lost", ("job-0", "job-2")),
        K.FAILED, "", "job-0, job-2", LOST_LIVENESS,
    ),
    (
        "peer-left-unplanned",
        RoundCheck(False, "participant_left", ("job-2", "job-0"), (("job-2", "shutdown"),)),
        K.FAILED, "", "job-0, job-2", "left the round: job-0 (?), job-2 (shutdown)",
    ),
    (
        "peer-scaled-down",
        RoundCheck(False, "participant_left", ("job-2",), (("job-2", "scale_down"),)),
        K.RESTART, CAUSE_SCALE, None, None,
    ),
    (
        "peer-rejoins",
        RoundCheck(False, "participant_left", ("job-2",), (("job-2", "rejoin"),)),
        K.RESTART, CAUSE_SCALE, None, None,
    ),
    (
        "peer-disrupted",  # drained or preempted: the operator's notice, nothing charged
        RoundCheck(False, "participant_left", ("job-2",), (("job-2", "disruption"),)),
        K.RESTART, CAUSE_SCALE, None, None,
    ),
    (
        "we-were-disrupted",
        RoundCheck(False, "participant_left", (NODE,), ((NODE, "disruption"),)),
        K.REMOVED, "disruption", None, None,
    ),
    ("nodes-waiting", RoundCheck(False, "nodes_waiting", ("job-3",)), K.RESTART, CAUSE_SCALE,
     None, None),
    ("round-advanced", RoundCheck(False, "round_advanced"), K.RESTART, CAUSE_PEER, None, None),
    ("lease-lost", RoundCheck(False, "lease_lost"), K.RESTART, CAUSE_PEER, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("check", "kind", "reason", "node", "message"),
    [pytest.param(*row[1:], id=row[0]) for row in CHECKS],
)
def test_classify_check(
    check: RoundCheck,
    kind: RoundEndKind | None,
    reason: str,
    node: str | None,
    message: str | None,
) -> None:
    end = classify_check(check, NODE, 7)
    if kind is None:
        assert end is None
        return
    assert end is not None and end.kind is kind and end.reason == reason
    if node is None:
        assert end.failure is None
    else:
        f = end.failure
        assert f is not None
        assert (f.cause, f.node, f.round, f.message) == (CAUSE_NODE_LOST, node, 7, message)


def _reap(pid: int, state: str = "S", scope: str = "step") -> ReapEvent:
    return ReapEvent(pid, scope, 9, 100.0, 101.0, state)


PIDS = {0: 100, 1: 101}

EXITS = [
    # (id, exited message, reaped, cause, rank, message, stopped)
    ("plain-failure", Exited(1, 0, 100, 1, None, {"message": "boom"}, ("a",)), {},
     CAUSE_WORKER_FAILURE, 2, "boom", False),
    ("error-not-a-message", Exited(1, 1, 101, 1, None, {}, ()), {},
     CAUSE_WORKER_FAILURE, 3, "", False),
    ("killed-by-signal", Exited(1, 1, 101, None, 9, None, ()), {},
     CAUSE_WORKER_FAILURE, 3, "", False),
    ("not-started-no-pid", Exited(1, 0, None, None, None, {"message": "exec"}, ()), {},
     CAUSE_START_FAILURE, 2, "exec", False),
    ("not-started-127", Exited(1, 0, 100, 127, None, None, ()), {},
     CAUSE_START_FAILURE, 2, "", False),
    ("hang", Exited(1, 0, 100, None, 9, None, ()), {100: _reap(100)},
     CAUSE_HANG, 2, "timer 'step' expired; reaped by the timer server", False),
    ("hang-127-is-still-a-hang", Exited(1, 0, 100, 127, None, None, ()), {100: _reap(100)},
     CAUSE_HANG, 2, "timer 'step' expired; reaped by the timer server", False),
    ("hang-blames-the-stopped-peer", Exited(1, 0, 100, None, 9, None, ()),
     {100: _reap(100), 101: _reap(101, "T", "fwd")}, CAUSE_HANG, 3,
     "timer 'fwd' expired; reaped by the timer server (it was stopped, not waiting on a peer)",
     True),
    ("oom-killed", Exited(1, 1, 101, None, 9, {"message": "killed by the OOM killer: its "
     "container's memory limit is 200 MiB"}, (), True), {},
     CAUSE_OOM, 3, "killed by the OOM killer: its container's memory limit is 200 MiB", False),
    ("a-reap-is-a-hang-even-if-oom-counted", Exited(1, 0, 100, None, 9, None, (), True),
     {100: _reap(100)}, CAUSE_HANG, 2, "timer 'step' expired; reaped by the timer server",
     False),
    ("stopped-peer-ignored-without-own-reap", Exited(1, 0, 100, 1, None, None, ()),
     {101: _reap(101, "t")}, CAUSE_WORKER_FAILURE, 2, "", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("msg", "reaped", "cause", "rank", "message", "stopped"),
    [pytest.param(*row[1:], id=row[0]) for row in EXITS],
)
def test_classify_exit(
    msg: Exited,
    reaped: dict[int, ReapEvent],
    cause: str,
    rank: int,
    message: str,
    stopped: bool,
) -> None:
    failure = classify_exit(ROUND, msg, PIDS, reaped)
    assert (failure.cause, failure.rank, failure.message, failure.stopped) == (
        cause, rank, message, stopped,
    )  # fmt: skip
    assert failure.node == NODE and failure.round == 7
    if not stopped:
        assert failure.exitcode == msg.exitcode and failure.tail == msg.tail


def test_a_hang_blames_a_stopped_peer_that_held_no_timer() -> None:
    """A worker SIGSTOPped between two timers holds none, so the timer server never reaps
    it; its peers' timers expire while they wait for it in a collective. Its live process
    state (``T``, read by the caller before the workers are stopped) names it."""
    msg = Exited(1, 0, 100, None, 9, None, ())
    live = LiveStates({100: "S", 101: "T"}, {101: "main thread at /w/t.py:9 in f"})
    got = classify_exit(ROUND, msg, PIDS, {100: _reap(100)}, live)
    assert got.stopped and got.cause == CAUSE_HANG and (got.rank, got.local_rank) == (3, 1)
    assert got.signal is None and got.exitcode is None  # not killed (yet): stopped
    assert got.message == (
        "stopped (process state T) outside any timer; main thread at /w/t.py:9 in f; its "
        "peers' timers expired waiting on it: timer 'step' expired; reaped by the timer "
        "server (it was stopped, not waiting on a peer)"
    )
    # a worker stopped by a tracer (py-spy reading stacks, a debugger) is not named live
    assert not classify_exit(ROUND, msg, PIDS, {100: _reap(100)}, LiveStates({101: "t"})).stopped
    # a plain failure (no reap) never looks for stopped peers
    crash = Exited(1, 0, 100, 1, None, None, ())
    assert not classify_exit(ROUND, crash, PIDS, {}, LiveStates({101: "T"})).stopped
    # a peer reaped while stopped still comes first (it has its timer's words)
    reaped = {100: _reap(100), 101: _reap(101, "T", "fwd")}
    got = classify_exit(ROUND, msg, PIDS, reaped, LiveStates({100: "T"}))
    assert got.local_rank == 1 and got.signal == 9 and "timer 'fwd' expired" in got.message


def test_stopped_failure_names_a_live_stopped_worker_without_any_reap() -> None:
    """A peer node restarted the round first: a worker of ours stopped then is named."""
    got = stopped_failure(ROUND, PIDS, {}, LiveStates({100: "R", 101: "T"}))
    assert got is not None and got.stopped and got.local_rank == 1 and got.signal is None
    assert got.message == (
        "stopped (process state T) outside any timer; the round ended "
        "(it was stopped, not waiting on a peer)"
    )
    assert stopped_failure(ROUND, PIDS, {}, LiveStates({100: "S", 101: "D"})) is None
    assert stopped_failure(ROUND, PIDS, {}) is None


def test_later_readings_never_replace_a_live_one_with_a_dead_one() -> None:
    """The attempt keeps what it read of its workers while they lived: a stopped worker
    killed afterwards (the stop of its group) stays the stopped one it was, with its
    stacks; a live reading replaces an earlier one, and a dead one fills a gap."""
    seen = LiveStates({100: "S", 101: "T"}, {101: "main thread at /w/t.py:9 in f"})
    later = seen.then(LiveStates({100: "R", 101: "Z", 102: ""}, {101: "stacks unavailable"}))
    assert later.states == {100: "R", 101: "T", 102: ""}
    assert later.evidence == {101: "main thread at /w/t.py:9 in f"}
    for dead in ("", "Z", "X", "x"):
        assert seen.then(LiveStates({101: dead})).states[101] == "T"
    # stopped again elsewhere: the newer live reading and its stacks win
    again = later.then(LiveStates({101: "T"}, {101: "main thread at /w/t.py:12 in g"}))
    assert again.evidence[101].endswith("in g")
    # dead both times: the newer one stands
    assert LiveStates({7: "Z"}).then(LiveStates({7: ""})).states == {7: ""}
    assert seen.then(LiveStates()) == seen


def test_stopped_failure_takes_the_lowest_stopped_local_rank() -> None:
    reaped = {100: _reap(100, "t", "a"), 101: _reap(101, "T", "b")}
    got = stopped_failure(ROUND, PIDS, reaped)
    assert got is not None and got.local_rank == 0 and got.rank == 2 and got.signal == 9
    assert stopped_failure(ROUND, PIDS, {100: _reap(100, "D")}) is None


LOST = Failure(cause=CAUSE_NODE_LOST, node="job-0", round=7, message="gone")
MINE = Failure(cause=CAUSE_WORKER_FAILURE, node=NODE, round=7, rank=2, exitcode=1)


@pytest.mark.parametrize(
    ("end", "failure", "blamed"),
    [
        pytest.param(None, MINE, False, id="no-check"),
        pytest.param(RoundEnd(K.RESTART, reason=CAUSE_SCALE), MINE, False, id="restart"),
        pytest.param(RoundEnd(K.FAILED, LOST), MINE, True, id="peer-lost"),
        pytest.param(
            RoundEnd(K.FAILED, Failure(cause=CAUSE_HANG, node="x", round=7)), MINE, False,
            id="failed-not-lost",
        ),
        pytest.param(
            RoundEnd(K.FAILED, LOST), Failure(cause=CAUSE_HANG, node=NODE, round=7), False,
            id="a-hang-is-ours",
        ),
    ],
)  # fmt: skip
def test_blame_lost_peer(end: RoundEnd | None, failure: Failure, blamed: bool) -> None:
    got = blame_lost_peer(failure, lost_peer(end))
    if blamed:
        assert got.cause == CAUSE_NODE_LOST and got.node == "job-0"
        assert got.message == f"gone; then {failure.summary()}"
    else:
        assert got is failure


def test_a_restart_names_the_peers_that_left_on_purpose_and_only_them() -> None:
    left = classify_check(
        RoundCheck(False, "participant_left", ("job-2", "job-0"),
                   (("job-2", "disruption"), ("job-0", "scale_down"))), NODE, 3,
    )  # fmt: skip
    assert left == RoundEnd(K.RESTART, reason=CAUSE_SCALE, departed=("job-0", "job-2"))
    waiting = classify_check(RoundCheck(False, "nodes_waiting", ("job-3",)), NODE, 3)
    assert waiting is not None and waiting.departed == ()  # a joiner breaks no collective


MINE_FAILED = Failure(cause=CAUSE_WORKER_FAILURE, node=NODE, round=7, message="rank 3 exited 1")


@pytest.mark.parametrize(
    ("failure", "check_end", "kind", "cause"),
    [
        pytest.param(MINE_FAILED, None, K.FAILED, CAUSE_WORKER_FAILURE, id="no-check"),
        pytest.param(MINE_FAILED, RoundEnd(K.RESTART, reason=CAUSE_SCALE, departed=("job-2",)),
                     K.RESTART, CAUSE_SCALE, id="a-peer-left-on-purpose"),
        pytest.param(MINE_FAILED, RoundEnd(K.RESTART, reason=CAUSE_SCALE), K.FAILED,
                     CAUSE_WORKER_FAILURE, id="nodes-waiting-explain-nothing"),
        pytest.param(MINE_FAILED, RoundEnd(K.FAILED, LOST), K.FAILED, CAUSE_NODE_LOST,
                     id="a-peer-lost"),
        pytest.param(Failure(cause=CAUSE_HANG, node=NODE, round=7),
                     RoundEnd(K.RESTART, reason=CAUSE_SCALE, departed=("job-2",)), K.FAILED,
                     CAUSE_HANG, id="a-hang-stays-ours"),
    ],
)  # fmt: skip
def test_explain_worker_failure(
    failure: Failure, check_end: RoundEnd | None, kind: RoundEndKind, cause: str
) -> None:
    """A worker failure right after a peer left on purpose (a drain, a scale-down) is the
    peer's leaving (its ranks closed the collectives): a restart at no charge."""
    got = explain_worker_failure(failure, check_end)
    assert got.kind is kind
    if kind is K.RESTART:
        assert got.reason == cause and got.failure is None and got.departed == ("job-2",)
    else:
        assert got.failure is not None and got.failure.cause == cause


@dataclass(frozen=True)
class _Reap:
    scope_id: str
    signal: int
    state: str
    why: str = "timer 's' expired; reaped by the timer server"


def test_inputs_are_structural() -> None:
    """Any object with the fields read will do (no timer server needed)."""
    got = stopped_failure(ROUND, {0: 5}, {5: _Reap("s", 15, "T")})
    assert got is not None and got.signal == 15


@pytest.mark.parametrize(
    ("reason", "starts"),
    [
        pytest.param(None, "job failed: the rendezvous was closed", id="no-reason"),
        pytest.param({"x": 1}, "job failed: the rendezvous was closed ({'x': 1})", id="other"),
        pytest.param(
            {**MINE.as_dict(), "not_retried": True},
            "job failed: a worker could not be started (not retried); root cause: ",
            id="not-started",
        ),
        pytest.param(
            {**MINE.as_dict(), "max_restarts": 3},
            "job failed after 3 restarts (budget spent); root cause: ",
            id="budget-spent",
        ),
    ],
)
def test_closed_outcome(reason: dict[str, object] | None, starts: str) -> None:
    failure, text = closed_outcome(reason, 3)
    assert text.startswith(starts.replace("job failed", contract.JOB_FAILED_PREFIX)), text
    assert (failure is None) == (reason is None or "x" in reason)
    if failure is not None:
        assert failure.cause == CAUSE_WORKER_FAILURE and failure.details() in text


def test_build_assign_ranks_and_env() -> None:
    msg = build_assign(
        attempt=4, round_=7, group_rank=1, group_world_size=3, nproc=2,
        master=("10.0.0.1", 29500), run_id="uid", restart_count=1, max_restarts=5,
        tokens={0: "t0", 1: "t1"},
    )  # fmt: skip
    assert (msg.attempt, msg.round, [w.local_rank for w in msg.workers]) == (4, 7, [0, 1])
    env = msg.workers[1].env
    assert env[contract.RANK] == "3" and env[contract.WORLD_SIZE] == "6"
    assert env[contract.LOCAL_WORLD_SIZE] == "2" and env[contract.GROUP_RANK] == "1"
    assert env[contract.MASTER_ADDR] == "10.0.0.1" and env[contract.MASTER_PORT] == "29500"
    assert env[contract.KELASTIC_TIMER_TOKEN] == "t1" and env[contract.KELASTIC_ROUND] == "7"
    assert env[contract.TORCHELASTIC_RESTART_COUNT] == "1"
    assert all(isinstance(v, str) for w in msg.workers for v in w.env.values())


def test_a_failure_is_timed_when_its_fault_was_raised() -> None:
    """etcd stopped, rank 1 raised: its in-process restart could not be agreed, and it
    exited only after its sidecar gave up; its peer's collective, failed on rank 1's
    closed connection, exited first. Each failure carries the time its exception was
    raised (the error file's ``fault_time``), so the raise, not the consequence, is the
    earliest (``kelastic run`` and the operator name the earliest of a round)."""
    now = time.time()
    raised = Exited(1, 1, 101, 1, None, {"message": "InjectedFault: injected",
                                         "fault_time": now - 2.0}, ())  # fmt: skip
    consequence = Exited(1, 0, 100, 1, None, {"message": "RuntimeError: Connection closed by "
                                              "peer", "fault_time": now - 1.5}, ())  # fmt: skip
    first = classify_exit(ROUND, raised, PIDS, {})
    second = classify_exit(ROUND, consequence, PIDS, {})
    assert first.time == now - 2.0 and second.time == now - 1.5
    assert min((first, second), key=lambda f: f.time).rank == ROUND.rank(1)
    # a fault time no worker could have stamped (later than its exit is seen, not a
    # number) is not believed: the failure is timed when it was observed
    for bad in (now + 3600, "soon", float("nan"), True, -1.0):
        exited = Exited(1, 1, 101, 1, None, {"message": "x", "fault_time": bad}, ())
        assert now <= classify_exit(ROUND, exited, PIDS, {}).time <= time.time()
