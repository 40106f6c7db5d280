"""Spare ranks of in-process restart: a waiting spare takes a dead
rank's place at the ``go`` (no process start). Pure decisions by tables; then two nodes'
coordinators on a real etcd with ranks and spares played by clients of the real unix
socket (the launcher's side: tests/worker_lib/test_launch_spares.py; everything together
with real processes: tests/faults/test_spare_ranks.py)."""

from __future__ import annotations

import dataclasses
import queue
import signal
import socket

import pytest

from kelastic import contract
from kelastic.inprocess_messages import Abort, GiveUp, Go, Hello, WorkerMessage
from kelastic.sockaddr import unix_address
from kelastic_etcd import EtcdClient
from kelastic_sidecar.failure import CAUSE_WORKER_FAILURE, Failure
from kelastic_sidecar.inprocess.record import decode_iteration_record
from kelastic_sidecar.inprocess.spares import SpareHello, pair_spares, spare_hello_verdict
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import Node, Rank, make_node, sample, settings

AB = ("node-a", "node-b")

# ----------------------------------------------------------------------- pure: tables


@pytest.mark.parametrize(
    ("phase", "nproc", "spares", "slot", "kind", "why"),
    [
        ("running", 2, 1, 2, SpareHello.WAIT, ""),
        ("aborting", 2, 2, 3, SpareHello.WAIT, ""),  # may be the one this restart needs
        ("barrier", 4, 1, 4, SpareHello.WAIT, ""),
        ("running", 2, 1, 3, SpareHello.DROP, "not in 2..2"),
        ("running", 2, 1, 1, SpareHello.DROP, "not in 2..2"),  # a worker's local rank
        ("running", 2, 0, 2, SpareHello.DROP, "runs no spare ranks"),
        ("running", 2, 1, 2, SpareHello.DROP, "pid 0 not in"),  # a promote could not name it
        ("idle", 0, 1, 2, SpareHello.GIVE_UP, "no round"),
        ("failed", 2, 1, 2, SpareHello.GIVE_UP, "failed"),
    ],
)
def test_spare_hello_verdict(
    phase: str, nproc: int, spares: int, slot: int, kind: SpareHello, why: str
) -> None:
    pid = 0 if "pid 0" in why else 77
    verdict = spare_hello_verdict(phase=phase, nproc=nproc, spares=spares, slot=slot, pid=pid)
    assert verdict.kind is kind
    assert why in verdict.reason and (verdict.reason == "") == (kind is SpareHello.WAIT)


@pytest.mark.parametrize(
    ("dead", "waiting", "pairs"),
    [
        ({1}, {2}, {1: 2}),
        ({1, 0}, {3, 2}, {0: 2, 1: 3}),  # lowest with lowest
        ({0, 1}, {2}, {0: 2}),  # rank 1 is left for the respawn
        ({1}, {2, 3}, {1: 2}),  # slot 3 keeps waiting
        ({1}, set(), {}),
        (set(), {2}, {}),
    ],
)
def test_pair_spares(dead: set[int], waiting: set[int], pairs: dict[int, int]) -> None:
    assert pair_spares(dead, waiting) == pairs


# ------------------------------------------------------- two coordinators, real etcd


class Spare(Rank):
    """A spare worker: its ``hello`` says ``spare`` (``local_rank`` is its slot)."""

    def send(self, msg: WorkerMessage) -> None:
        if isinstance(msg, Hello):
            msg = dataclasses.replace(msg, spare=True)
        super().send(msg)


class Calls:
    """Records ``on_respawn``/``on_promote`` calls (the supervisor's RespawnDue)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[object, ...]] = queue.Queue()

    def __call__(self, *args: object) -> None:
        self.calls.put(args)

    def next(self, timeout: float = 20.0) -> tuple[object, ...]:
        try:
            return self.calls.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no call within {timeout}s") from None


def _nodes(store: EtcdClient, prefix: str, spares: int = 1):  # type: ignore[no-untyped-def]
    cfg = dataclasses.replace(settings(), spare_ranks=spares)
    return make_node("node-a", store, prefix, "127.0.0.1", cfg), make_node(
        "node-b", store, prefix, "127.0.0.2", cfg
    )


def _waiting(node: Node) -> list[int]:
    status = node.coordinator.status()
    assert status is not None
    return list(status["spares"]["waiting"])


def _spare(node: Node, slot: int = 2, rank: int = 5) -> Spare:
    spare = Spare(node.socket_path, slot, rank)
    wait_for(lambda: (node.flush(), slot in _waiting(node))[1], 10,
             what=f"{node.name}: the spare of slot {slot} waiting")  # fmt: skip
    return spare


def _kill(node: Node, local_rank: int, pid: int = 4242) -> bool:
    assert node.ctx is not None
    node.ranks[local_rank].close()
    rank = node.ctx.group_rank * node.ctx.nproc + local_rank
    failure = Failure(cause=CAUSE_WORKER_FAILURE, node=node.name, round=node.ctx.round,
                      rank=rank, local_rank=local_rank, signal=signal.SIGKILL)  # fmt: skip
    return node.coordinator.absorb_exit(local_rank, pid, failure)


def test_a_waiting_spare_takes_the_dead_ranks_place_then_the_respawn(
    store: EtcdClient, job_prefix: str
) -> None:
    a_cm, b_cm = _nodes(store, job_prefix)
    with a_cm as a, b_cm as b:
        respawned, promoted = Calls(), Calls()
        b.coordinator.machine.on_respawn = respawned
        b.coordinator.machine.on_promote = promoted
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        spare = _spare(b)
        assert sample(b.metrics, "kelastic_inprocess_spares_waiting") == 1
        assert _kill(b, 1)  # global rank 3
        survivors = [*a.ranks, b.ranks[0]]
        for r in survivors:
            assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
            r.ready(1)
        gos = [r.expect(Go) for r in survivors]
        go = spare.expect(Go)  # no abort before: it never ran an iteration
        assert promoted.next() == (1, 2, 1, 123456)  # round 1: slot 2 (pid) is rank 1 now
        assert respawned.calls.empty()
        env, peer_env = go.env, gos[0].env  # type: ignore[attr-defined]
        assert go.iteration == 1  # type: ignore[attr-defined]
        assert (env[contract.RANK], env[contract.LOCAL_RANK]) == ("3", "1")
        assert env[contract.KELASTIC_TIMER_TOKEN] == "token-node-b-1"
        assert env[contract.MASTER_PORT] == peer_env[contract.MASTER_PORT]
        assert env[contract.ENV_INPROCESS_ITERATION] == "1"
        got = store.get(contract.Keys(job_prefix).inprocess_iteration)
        assert got is not None
        assert decode_iteration_record(got[0]).message == (
            "local rank 1 (pid 4242) killed by SIGKILL; a waiting spare takes its place (no "
            "process start)"
        )
        spare.local_rank = 1  # what the Wrapper does with the go: it speaks as rank 1 now
        for r in [*survivors, spare]:
            r.progress(1)
        wait_for(lambda: sample(b.metrics, "kelastic_inprocess_restart_seconds_count"), 10,
                 what="every local rank of node-b progressed, the spare as rank 1")  # fmt: skip
        b.flush()
        status = b.coordinator.status()
        assert status is not None
        assert status["spares"] == {"configured": 1, "waiting": [], "promoted": 1,
                                    "pids": {"3": 123456}}  # fmt: skip
        assert status["respawns"] == 0
        assert status["last"]["promoted"] == [
            "local rank 1 replaced by the spare of slot 2 (pid 123456, no process start)"
        ]
        assert sample(b.metrics, "kelastic_inprocess_spares_promoted_total") == 1
        assert sample(b.metrics, "kelastic_inprocess_spares_waiting") == 0
        # the promoted spare is rank 1 now: its fault restarts everyone, itself included
        spare.fault(1)
        for r in [*survivors, spare]:
            assert r.expect(Abort).iteration == 2  # type: ignore[attr-defined]
            r.ready(2)
        for r in [*survivors, spare]:
            r.expect(Go)
        # no spare waits (the launcher's new one did not connect): the respawn
        b.ranks[1] = spare
        assert _kill(b, 0, pid=4343)
        for r in [*a.ranks, spare]:
            assert r.expect(Abort).iteration == 3  # type: ignore[attr-defined]
            r.ready(3)
        round_, local_rank, _ = respawned.next()
        assert (round_, local_rank) == (1, 0)
        assert promoted.calls.empty()


def test_a_death_a_spare_was_waiting_for_is_started_at_the_go_if_the_spare_left(
    store: EtcdClient, job_prefix: str
) -> None:
    """A spare waits at the death: the dead rank is not started early (the spare takes
    it). The spare goes away before the go: the rank is started at the go, its env
    naming the go's store and no early wait (the launcher keeps env of an earlier
    early start, so it is said)."""
    a_cm, b_cm = _nodes(store, job_prefix)
    with a_cm as a, b_cm as b:
        respawned = Calls()
        b.coordinator.machine.on_respawn = respawned
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        spare = _spare(b)
        assert _kill(b, 1)
        survivors = [*a.ranks, b.ranks[0]]
        for r in survivors:
            r.expect(Abort)
        b.flush()
        assert respawned.calls.empty()  # the spare is to take it
        spare.close()
        wait_for(lambda: (b.flush(), not _waiting(b))[1], 10, what="the spare gone")
        for r in survivors:
            r.ready(1)
        gos = [r.expect(Go) for r in survivors]
        round_, local_rank, env = respawned.next()
        assert (round_, local_rank) == (1, 1)
        assert env[contract.ENV_INPROCESS_AWAIT_GO] == "0"
        assert env[contract.MASTER_PORT] == gos[0].env[contract.MASTER_PORT]  # type: ignore[attr-defined]


def test_spares_outside_the_rules_are_dropped_or_sent_away(
    store: EtcdClient, job_prefix: str
) -> None:
    a_cm, _ = _nodes(store, job_prefix)
    with a_cm as a:
        early = Spare(a.socket_path, 2, 4)  # no round yet: not needed
        assert isinstance(early.expect(GiveUp), GiveUp)
        a.begin(1, 0, ("node-a",))
        for slot in (3, 0):  # past the node's spare slots; a worker's local rank
            wrong = Spare(a.socket_path, slot, 4)
            assert wrong.closed(), slot
        assert sample(a.metrics, "kelastic_inprocess_sessions_dropped_total",
                      reason="malformed") == 2  # fmt: skip
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # spare: "yes"
        with unix_address(a.socket_path) as address:
            raw.connect(address)
        raw.sendall(b'{"type":"hello","pid":7,"local_rank":2,"rank":4,"iteration":0,'
                    b'"spare":"yes"}\n')  # fmt: skip
        raw.settimeout(10)
        assert raw.recv(100) == b""  # dropped
        raw.close()
        dropped = "kelastic_inprocess_sessions_dropped_total"
        wait_for(lambda: sample(a.metrics, dropped, reason="malformed") == 3, 10,
                 what="the bad hello dropped")  # fmt: skip
        assert _waiting(a) == []


def test_a_node_without_spare_ranks_drops_a_spare(store: EtcdClient, job_prefix: str) -> None:
    a_cm, _ = _nodes(store, job_prefix, spares=0)
    with a_cm as a:
        a.begin(1, 0, ("node-a",))
        assert Spare(a.socket_path, 2, 4).closed()
        status = a.coordinator.status()
        assert status is not None and status["spares"]["configured"] == 0


def test_a_spare_dying_while_waiting_is_no_fault_and_the_round_end_sends_spares_away(
    store: EtcdClient, job_prefix: str
) -> None:
    a_cm, _ = _nodes(store, job_prefix)
    with a_cm as a:
        a.begin(1, 0, ("node-a",))
        first = _spare(a)
        first.close()  # SIGKILLed while waiting
        wait_for(lambda: (a.flush(), _waiting(a) == [])[1], 10, what="the dead spare forgotten")
        status = a.coordinator.status()
        assert status is not None and status["phase"] == "running" and status["restarts"] == 0
        for r in a.ranks:
            assert r.inbox.empty()  # no abort: nothing happened to the round
        second = _spare(a)  # the launcher's new one
        a.coordinator.end_round("succeeded")
        assert isinstance(second.expect(GiveUp), GiveUp)
        assert second.closed()
        assert _waiting(a) == []
        assert sample(a.metrics, "kelastic_inprocess_spares_waiting") == 0
