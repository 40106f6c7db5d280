"""The hybrid rung of in-process restart: a worker process dies -> its peers
restart in process and only it starts again. Pure decisions by tables; then two nodes'
coordinators on a real etcd with ranks played by clients of the real unix socket."""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from kelastic import contract
from kelastic.inprocess_messages import Abort, GiveUp, Go
from kelastic_etcd import EtcdClient
from kelastic_sidecar.failure import CAUSE_HANG, CAUSE_WORKER_FAILURE, Failure
from kelastic_sidecar.inprocess.hybrid_verdicts import (
    CAUSE_WORKER_DIED,
    Absorb,
    absorb_verdict,
    death_cause,
    death_message,
)
from kelastic_sidecar.inprocess.record import IterationRecord, decode_iteration_record
from kelastic_sidecar.inprocess.round import cause_label
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import Node, Rank, make_node, sample, settings

AB = ("node-a", "node-b")

# ----------------------------------------------------------------------- pure: tables


@pytest.mark.parametrize(
    ("phase", "local_rank", "connected", "pending", "starting", "kind", "why"),
    [
        ("running", 1, {0, 1}, set(), set(), Absorb.ADVANCE, ""),
        ("running", 1, {0}, set(), set(), Absorb.ADVANCE, ""),  # its close seen first
        ("aborting", 0, {1}, set(), set(), Absorb.JOIN, ""),  # e.g. the hard-timeout kill
        ("barrier", 0, {0, 1}, set(), set(), Absorb.JOIN, ""),
        ("aborting", 1, set(), {0}, set(), Absorb.JOIN, ""),  # a second death, both wait
        ("running", 1, {0}, set(), {1}, Absorb.REFUSE, "respawn failed"),  # died again
        ("running", 0, {0}, set(), set(), Absorb.REFUSE, "never said hello"),  # 1 unwrapped
        ("running", 1, {0}, set(), {0}, Absorb.ADVANCE, ""),  # 0 is starting: not silent
        ("idle", 0, {0, 1}, set(), set(), Absorb.REFUSE, "no round"),
        ("failed", 0, {0, 1}, set(), set(), Absorb.REFUSE, "failed"),
        ("running", 2, {0, 1}, set(), set(), Absorb.REFUSE, "not in 0..1"),
    ],
)
def test_absorb_verdict(
    phase: str,
    local_rank: int,
    connected: set[int],
    pending: set[int],
    starting: set[int],
    kind: Absorb,
    why: str,
) -> None:
    verdict = absorb_verdict(
        phase=phase, nproc=0 if phase == "idle" else 2, local_rank=local_rank,
        connected=connected, pending=pending, starting=starting,
    )  # fmt: skip
    assert verdict.kind is kind
    assert why in verdict.reason and (kind is Absorb.REFUSE) == bool(verdict.reason)


def _failure(cause: str = CAUSE_WORKER_FAILURE, **kw: object) -> Failure:
    fields: dict[str, object] = {"node": "n", "round": 1, "rank": 3, "local_rank": 1, **kw}
    return Failure(cause=cause, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failure", "cause", "label", "message"),
    [
        (_failure(signal=signal.SIGKILL), CAUSE_WORKER_DIED, CAUSE_WORKER_FAILURE,
         "local rank 1 (pid 42) killed by SIGKILL"),
        (_failure(exitcode=1, message="ValueError: x"), CAUSE_WORKER_DIED,
         CAUSE_WORKER_FAILURE, "local rank 1 (pid 42) exited with code 1: ValueError: x"),
        (_failure(CAUSE_HANG, signal=signal.SIGKILL, message="timer 'step' expired; reaped "
                  "by the timer server"), CAUSE_HANG, CAUSE_HANG,
         "local rank 1 (pid 42) killed by SIGKILL: timer 'step' expired; reaped by the timer"),
        # the hard timeout's kill: a reap the monitor held, classified as a hang like the
        # timer server's (one place for every hang)
        (_failure(CAUSE_HANG, signal=signal.SIGKILL, message="no termination barrier of "
                  "iteration 1 within the hard timeout (14 s); killed by the sidecar"),
         CAUSE_HANG, CAUSE_HANG, "local rank 1 (pid 42) killed by SIGKILL: no termination "
         "barrier of iteration 1 within the hard timeout (14 s); killed by the sidecar"),
    ],
)  # fmt: skip
def test_death_cause_and_message(failure: Failure, cause: str, label: str, message: str) -> None:
    assert death_cause(failure) == cause
    assert cause_label(cause) == label  # the dashboards' cause set: worker_failure, hang
    assert death_message(failure, 42).startswith(message)


# ------------------------------------------------------- two coordinators, real etcd


class Respawns:
    """Records the coordinator's ``on_respawn`` calls (the supervisor's RespawnDue)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[int, int, dict[str, str]]] = queue.Queue()

    def __call__(self, round_: int, local_rank: int, env: dict[str, str]) -> None:
        self.calls.put((round_, local_rank, env))

    def next(self, timeout: float = 20.0) -> tuple[int, int, dict[str, str]]:
        try:
            return self.calls.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no respawn within {timeout}s") from None


def _nodes(store: EtcdClient, prefix: str, max_restarts: int = 10, hard: float = 60.0):  # type: ignore[no-untyped-def]
    cfg = settings(max_restarts=max_restarts, soft=min(30.0, hard / 2), hard=hard)
    return make_node("node-a", store, prefix, "127.0.0.1", cfg), make_node(
        "node-b", store, prefix, "127.0.0.2", cfg
    )


#: Starts node-a and node-b's coordinators (a budget, a hard timeout), records the
#: respawns of one of them and begins round 1 on both; returns (node a, node b, respawns).
StartPair = Callable[..., tuple[Node, Node, "Respawns"]]


@pytest.fixture
def two_nodes(store: EtcdClient, job_prefix: str) -> Iterator[StartPair]:
    """The two-node set-up of the tests below: ``start(respawns_on, max_restarts=10,
    hard=60.0)``; both nodes stop (b first) when the test ends."""
    with contextlib.ExitStack() as stack:

        def start(
            respawns_on: str, max_restarts: int = 10, hard: float = 60.0
        ) -> tuple[Node, Node, Respawns]:
            a_cm, b_cm = _nodes(store, job_prefix, max_restarts=max_restarts, hard=hard)
            a = stack.enter_context(a_cm)
            b = stack.enter_context(b_cm)
            respawned = Respawns()
            {"a": a, "b": b}[respawns_on].coordinator.machine.on_respawn = respawned
            a.begin(1, 0, AB)
            b.begin(1, 1, AB)
            return a, b, respawned

        yield start


def _record(store: EtcdClient, prefix: str) -> IterationRecord:
    got = store.get(contract.Keys(prefix).inprocess_iteration)
    return IterationRecord() if got is None else decode_iteration_record(got[0])


def _kill(node: Node, local_rank: int, pid: int = 4242) -> bool:
    """Rank ``local_rank`` of ``node`` dies of SIGKILL: its connection ends, and the
    supervisor offers its exit to the coordinator; what ``absorb_exit`` answered."""
    assert node.ctx is not None
    node.ranks[local_rank].close()
    rank = node.ctx.group_rank * node.ctx.nproc + local_rank
    failure = Failure(cause=CAUSE_WORKER_FAILURE, node=node.name, round=node.ctx.round,
                      rank=rank, local_rank=local_rank, signal=signal.SIGKILL)  # fmt: skip
    return node.coordinator.absorb_exit(local_rank, pid, failure)


def test_a_dead_worker_restarts_its_peers_in_process_and_alone_as_a_process(
    store: EtcdClient, job_prefix: str, two_nodes: StartPair
) -> None:
    a, b, respawned = two_nodes("b")
    started = time.monotonic()
    assert _kill(b, 1)  # global rank 3
    # started again at once (the early respawn), before any peer is ready: it waits in
    # the barrier of iteration 1 for the go that names the iteration's store
    round_, local_rank, env = respawned.next()
    assert (round_, local_rank) == (1, 1)
    assert env[contract.ENV_INPROCESS_AWAIT_GO] == "1"
    assert env[contract.ENV_INPROCESS_ITERATION] == "1" and env[contract.RANK] == "3"
    assert env[contract.KELASTIC_TIMER_TOKEN] == "token-node-b-1"
    survivors = [*a.ranks, b.ranks[0]]
    for r in survivors:
        assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
    new = Rank(b.socket_path, 1, 3, iteration=1)  # its Wrapper: hello(1), then ready(1)
    b.ranks[1] = new
    new.ready(1)
    for r in survivors:
        r.ready(1)  # the dead rank counts as ready: the barrier needs no more
    gos = [r.expect(Go) for r in [*survivors, new]]
    took = time.monotonic() - started
    print(f"\ndeath -> respawn and go, 2 nodes x 2 ranks, real etcd: {took * 1000:.1f} ms")
    # the respawned rank enters iteration 1 with what its peers got with the go
    go_env, its = gos[0].env, gos[3].env  # type: ignore[attr-defined]
    assert its[contract.MASTER_ADDR] == go_env[contract.MASTER_ADDR] == "127.0.0.1"
    assert its[contract.MASTER_PORT] == go_env[contract.MASTER_PORT]
    assert its[contract.RANK] == "3" and gos[3].iteration == 1  # type: ignore[attr-defined]
    assert respawned.calls.empty()  # once: not again at the go
    record = _record(store, job_prefix)
    assert (record.iteration, record.restarts, record.cause, record.rank) == (
        1, 1, CAUSE_WORKER_DIED, 3,
    )  # fmt: skip
    assert record.message == (
        "local rank 1 (pid 4242) killed by SIGKILL; it alone starts again as a process"
    )
    for r in [*survivors, new]:
        r.progress(1)
    for node in (a, b):
        wait_for(
            lambda n=node: sample(n.metrics, "kelastic_inprocess_restart_seconds_count"),
            10, what=f"{node.name}: every local rank progressed in iteration 1",
        )  # fmt: skip
        node.flush()
        status = node.coordinator.status()
        assert status is not None and status["phase"] == "running"
        assert (status["iteration"], status["restarts"]) == (1, 1)
        assert status["last"]["cause"] == CAUSE_WORKER_DIED
        labels = {"level": "inprocess", "cause": "worker_failure"}
        assert sample(node.metrics, "kelastic_restarts_total", **labels) == 1
    status = b.coordinator.status()
    assert status is not None and status["respawns"] == 1
    assert status["last"]["signal"] == "SIGKILL"
    assert status["last"]["died"] == ["local rank 1 (pid 4242) killed by SIGKILL"]
    assert [type(m) for m in new.got] == [Go]  # no abort for the newcomer: only its go
    # a raise afterwards restarts all four, the respawned one included
    a.ranks[0].fault(1)
    for r in [*survivors, new]:
        assert r.expect(Abort).iteration == 2  # type: ignore[attr-defined]


def test_an_early_respawn_slower_than_the_barrier_gets_the_go_at_its_hello(
    store: EtcdClient, job_prefix: str, two_nodes: StartPair
) -> None:
    """The dead rank's new process connects after its peers' go (a cold start): it is
    sent that go at its hello, once; with a newer restart meanwhile it is aborted into
    that one instead, never sent the older go."""
    a, b, respawned = two_nodes("b")
    assert _kill(b, 1)
    assert respawned.next()[1] == 1
    survivors = [*a.ranks, b.ranks[0]]
    for r in survivors:
        r.expect(Abort)
        r.ready(1)
    gos = [r.expect(Go) for r in survivors]
    new = Rank(b.socket_path, 1, 3, iteration=1)  # late: the go went out before its hello
    b.ranks[1] = new
    go = new.expect(Go)
    assert go.iteration == 1  # type: ignore[attr-defined]
    assert go.env[contract.MASTER_PORT] == gos[0].env[contract.MASTER_PORT]  # type: ignore[attr-defined]
    new.ready(1)  # what its Wrapper sends before the go it awaits: ignored when running
    b.flush()
    assert [type(m) for m in new.got] == [Go] and respawned.calls.empty()
    # again, but a raise restarts the others before the late process connects
    assert _kill(b, 1, pid=4343)
    assert respawned.next()[1] == 1
    for r in survivors:
        r.expect(Abort)
        r.ready(2)
    for r in survivors:
        r.expect(Go)
    a.ranks[0].fault(2)
    for r in survivors:
        assert r.expect(Abort).iteration == 3  # type: ignore[attr-defined]
    late = Rank(b.socket_path, 1, 3, iteration=2)
    b.ranks[1] = late
    assert late.expect(Abort).iteration == 3  # type: ignore[attr-defined]
    for r in [*survivors, late]:
        r.ready(3)
    for r in [*survivors, late]:
        assert r.expect(Go).iteration == 3  # type: ignore[attr-defined]
    assert [type(m) for m in late.got] == [Abort, Go]  # never the go of iteration 2


def test_an_early_respawn_dying_before_the_go_takes_the_process_path(
    store: EtcdClient, job_prefix: str, two_nodes: StartPair
) -> None:
    """A process started again at the death that dies before its go (after its hello,
    too) is not started once more: that would repeat without end and spend nothing."""
    _, b, respawned = two_nodes("b")
    assert _kill(b, 1)
    respawned.next()
    b.ranks[1] = Rank(b.socket_path, 1, 3, iteration=1)
    b.flush()
    assert not _kill(b, 1, pid=4343)  # refused: the round ends on the process path
    assert respawned.calls.empty()


def test_deaths_during_a_restart_join_it_and_all_start_again(
    store: EtcdClient, job_prefix: str, two_nodes: StartPair
) -> None:
    a, b, respawned = two_nodes("a")
    b.ranks[0].fault(0)  # a raise on node b
    for r in (*a.ranks, *b.ranks):
        assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
    a.ranks[1].ready(1)
    assert _kill(a, 0)  # dies while aborting: joins the restart, no restart spent
    for r in b.ranks:
        r.ready(1)
    for r in (a.ranks[1], *b.ranks):
        r.expect(Go)
    _, local_rank, env = respawned.next()
    assert local_rank == 0 and env[contract.ENV_INPROCESS_ITERATION] == "1"
    assert _record(store, job_prefix).restarts == 1
    a.flush()
    status = a.coordinator.status()
    assert status is not None and status["last"]["cause"] == "exception"  # the raise won
    assert status["last"]["died"] == ["local rank 0 (pid 4242) killed by SIGKILL"]


def test_process_path_when_the_budget_is_spent_or_the_respawn_fails(
    store: EtcdClient, job_prefix: str, two_nodes: StartPair
) -> None:
    a, b, respawned = two_nodes("b", max_restarts=1)
    assert _kill(b, 1, pid=100)
    survivors = [*a.ranks, b.ranks[0]]
    for r in survivors:
        r.expect(Abort)
        r.ready(1)
    for r in survivors:
        r.expect(Go)
    respawned.next()
    # the respawned process dies before its hello: not again (the process path)
    assert not _kill(b, 1, pid=101)
    # a respawned rank that did say hello may die again; but the budget of 1 is spent
    b.ranks[1] = b.connect(1, iteration=1)
    assert not _kill(b, 1, pid=102)
    assert _record(store, job_prefix).restarts == 1
    # the refusals gave nobody up: the round's end (the process path) does
    b.coordinator.end_round("failed")
    assert isinstance(b.ranks[0].expect(GiveUp), GiveUp)


def test_a_respawned_rank_without_hello_in_time_gives_the_round_up(
    two_nodes: StartPair,
) -> None:
    a, b, respawned = two_nodes("b", hard=1.0)
    assert _kill(b, 0)
    for r in (*a.ranks, b.ranks[1]):
        r.expect(Abort)
        r.ready(1)
    for r in (*a.ranks, b.ranks[1]):
        r.expect(Go)
    respawned.next()
    # no hello from the new process within the hard timeout (1 s): give up
    assert isinstance(b.ranks[1].expect(GiveUp, timeout=10), GiveUp)
    b.flush()
    status = b.coordinator.status()
    assert status is not None and status["phase"] == "failed"


def test_disabled_or_no_round_refuses(store: EtcdClient, job_prefix: str) -> None:
    a_cm, _ = _nodes(store, job_prefix)
    with a_cm as a:
        failure = Failure(cause=CAUSE_WORKER_FAILURE, node="node-a", round=1, local_rank=0)
        assert not a.coordinator.absorb_exit(0, 1234, failure)  # no round begun


def test_a_respawn_that_cannot_start_is_a_worker_failure_not_a_job_failure() -> None:
    from kelastic_sidecar.failure import CAUSE_START_FAILURE
    from kelastic_sidecar.inprocess.hybrid_verdicts import respawn_failure

    failed = _failure(CAUSE_START_FAILURE, exitcode=127, message="fork: out of memory")
    again = respawn_failure(failed)
    assert again.cause == CAUSE_WORKER_FAILURE  # the process path restarts the group
    assert again.message == "could not be started again after its death: fork: out of memory"
    died = _failure(signal=signal.SIGKILL)
    assert respawn_failure(died) is died
