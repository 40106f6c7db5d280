"""The node-change rung on the coordinators (``kelastic_sidecar.inprocess.carry``), with
real etcd and ranks played by socket clients: a round ending for its membership keeps the
ranks, aborts them into the next iteration, holds them (no ``go``) until the next round
begins, and then sends the next round's env; a new node's fresh workers are counted in
the barrier at once. The pure :func:`carry_request` is table-tested."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kelastic import contract
from kelastic.inprocess_messages import Abort, GiveUp, Go
from kelastic_etcd import EtcdClient
from kelastic_sidecar.failure import (
    CAUSE_HANG,
    CAUSE_NODE_LOST,
    CAUSE_SCALE,
    CAUSE_WORKER_FAILURE,
    Failure,
)
from kelastic_sidecar.inprocess.carry import CAUSE_MEMBERSHIP, carry_request
from kelastic_sidecar.inprocess.record import (
    IterationRecord,
    decode_iteration_record,
)
from kelastic_sidecar.inprocess.round import RoundContext, restart_log_line
from kelastic_sidecar.round_end import RoundEnd, RoundEndKind
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import NEVER_READY, Node, make_node, sample, settings

AB = ("node-a", "node-b")
LOST = RoundEnd(RoundEndKind.FAILED, Failure(CAUSE_NODE_LOST, "node-b", 1, message="gone"))
SCALE = RoundEnd(RoundEndKind.RESTART, reason=CAUSE_SCALE)


@pytest.mark.parametrize(
    ("end", "want"),
    [
        (LOST, (CAUSE_NODE_LOST, "node node-b lost: gone", True)),
        (SCALE, (CAUSE_MEMBERSHIP, "the round ended (scale)", False)),
        (
            RoundEnd(RoundEndKind.RESTART),
            (CAUSE_MEMBERSHIP, "the round ended (peer_restart)", False),
        ),
        (RoundEnd(RoundEndKind.FAILED, Failure(CAUSE_WORKER_FAILURE, "node-a", 1)), None),
        (RoundEnd(RoundEndKind.FAILED, Failure(CAUSE_HANG, "node-a", 1)), None),
        (RoundEnd(RoundEndKind.FAILED), None),
        (RoundEnd(RoundEndKind.REMOVED, reason="scale_down"), None),
        (RoundEnd(RoundEndKind.SUCCEEDED), None),
        (RoundEnd(RoundEndKind.CLOSED), None),
        (RoundEnd(RoundEndKind.LAUNCHER_LOST), None),
    ],
)
def test_carry_request(end: RoundEnd, want: tuple[str, str, bool] | None) -> None:
    got = carry_request(end)
    assert (None if got is None else (got.cause, got.message, got.charge)) == want


def test_the_sidecar_log_says_a_round_change_spends_no_restart() -> None:
    """A membership carry spends no restart: its log line said ``in-process restart
    0/10`` (as if one were spent) until it used ``kelastic run``'s wording."""
    scale = IterationRecord(iteration=4, round=3, restarts=2, cause=CAUSE_MEMBERSHIP,
                            node="node-a", message="the round ended (scale)")  # fmt: skip
    assert restart_log_line(scale, 10) == (
        "in-process round change (iteration 4): the round ended (scale)")  # fmt: skip
    lost = IterationRecord(iteration=5, round=4, restarts=3, cause=CAUSE_NODE_LOST,
                           node="node-a", rank=2, message="node node-b lost: gone")  # fmt: skip
    assert restart_log_line(lost, 10) == (
        "in-process restart 3/10 (iteration 5): rank 2 node_lost: node node-b lost: gone "
        "(node node-a)")  # fmt: skip


def _record(store: EtcdClient, prefix: str) -> IterationRecord:
    got = store.get(contract.Keys(prefix).inprocess_iteration)
    return IterationRecord() if got is None else decode_iteration_record(got[0])


def _ctx(node: Node, round_: int, group_rank: int, participants: tuple[str, ...],
         port: int) -> RoundContext:  # fmt: skip
    """A round's context as ``begin_round`` makes it: the envs of the new ranks and world
    size, and the round's master (group rank 0's address, ``port``)."""
    nproc, world = 2, 2 * len(participants)
    envs = {
        lr: {
            contract.RANK: str(group_rank * nproc + lr),
            contract.LOCAL_RANK: str(lr),
            contract.WORLD_SIZE: str(world),
            contract.MASTER_ADDR: "127.0.0.1",
            contract.MASTER_PORT: str(port),
            contract.KELASTIC_TIMER_TOKEN: f"token-{node.name}-{lr}",
        }
        for lr in range(nproc)
    }
    return RoundContext(
        round=round_, group_rank=group_rank, group_world_size=len(participants), nproc=nproc,
        envs=envs, pod_ip=node.coordinator.pod_ip, participants=participants,
        master=("127.0.0.1", port),
    )  # fmt: skip


def _abort_and_hold(node: Node, iteration: int) -> None:
    """Each rank gets ``abort(iteration)`` and answers ready; no ``go`` comes (held)."""
    for r in node.ranks:
        assert r.expect(Abort).iteration == iteration  # type: ignore[attr-defined]
        r.ready(iteration)
    node.flush()
    for r in node.ranks:
        assert r.inbox.empty(), r.inbox.queue
    status = node.coordinator.status()
    assert status is not None and status["held"] and status["phase"] == "aborting"


def test_a_lost_node_carries_the_survivors_into_the_next_round(
    store: EtcdClient, job_prefix: str
) -> None:
    with make_node("node-a", store, job_prefix) as a, make_node("node-b", store, job_prefix) as b:
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        for r in b.ranks:  # node-b's Pod is gone
            r.close()
        assert a.coordinator.carry(LOST)
        _abort_and_hold(a, 1)
        record = _record(store, job_prefix)
        assert (record.iteration, record.restarts, record.cause) == (1, 1, CAUSE_NODE_LOST)
        assert record.message == "node node-b lost: gone"
        level = {"level": "inprocess", "cause": CAUSE_NODE_LOST}
        assert sample(a.metrics, "kelastic_restarts_total", **level) == 1
        # the next round: node-a alone, world size 2, the round's master port
        assert a.coordinator.begin(_ctx(a, 2, 0, ("node-a",), 41234)) == 1
        gos = [r.expect(Go) for r in a.ranks]
        for lr, go in enumerate(gos):
            assert go.iteration == 1  # type: ignore[attr-defined]
            env = go.env  # type: ignore[attr-defined]
            assert (env[contract.RANK], env[contract.WORLD_SIZE]) == (str(lr), "2")
            assert (env[contract.MASTER_ADDR], env[contract.MASTER_PORT]) == ("127.0.0.1", "41234")
            assert env[contract.ENV_INPROCESS_ITERATION] == "1"
        status = a.coordinator.status()
        assert status is not None
        assert (status["held"], status["carried"], status["phase"]) == (False, 1, "running")


@pytest.mark.parametrize("begun", [False, True], ids=["held", "next-round-begun"])
def test_a_rank_that_cannot_leave_a_carried_iteration_is_killed_at_the_hard_timeout(
    store: EtcdClient, job_prefix: str, begun: bool
) -> None:
    """A lost node aborts the survivors into the next iteration; a survivor stuck where
    the abort cannot reach it is SIGKILLed by the sidecar at the hard timeout, whether the
    next round began meanwhile or not (its death then takes the hybrid rung)."""
    cfg = settings(soft=0.2, hard=1.0)
    with make_node("node-a", store, job_prefix, cfg=cfg) as a:
        a.begin(1, 0, AB, connect=False)
        stuck = subprocess.Popen([sys.executable, "-c", NEVER_READY, str(a.socket_path)],
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert stuck.stdout is not None and stuck.stdout.readline().strip() == "connected"
            a.ranks = [a.connect(0)]
            assert a.coordinator.carry(LOST)
            assert a.ranks[0].expect(Abort).iteration == 1  # type: ignore[attr-defined]
            a.ranks[0].ready(1)
            if begun:
                a.coordinator.begin(_ctx(a, 2, 0, ("node-a",), 41234))
            assert stuck.wait(timeout=20) == -9, "the stuck rank was not killed"
            assert a.killed == [(stuck.pid, 9)]
        finally:
            if stuck.poll() is None:
                stuck.kill()
                stuck.wait()


def test_a_joining_node_is_waited_for_and_spends_no_restart(
    store: EtcdClient, job_prefix: str
) -> None:
    with make_node("node-a", store, job_prefix) as a, make_node("node-c", store, job_prefix,
                                                                 "127.0.0.3") as c:  # fmt: skip
        a.begin(1, 0, ("node-a",))
        assert a.coordinator.carry(SCALE)
        _abort_and_hold(a, 1)
        record = _record(store, job_prefix)
        assert (record.iteration, record.restarts, record.cause) == (1, 0, CAUSE_MEMBERSHIP)
        level = {"level": "inprocess", "cause": CAUSE_SCALE}
        assert sample(a.metrics, "kelastic_restarts_total", **level) == 1
        # node-a (group rank 0) enters round 2 first: it waits for node-c's key
        ac = ("node-a", "node-c")
        assert a.coordinator.begin(_ctx(a, 2, 0, ac, 45678)) == 1
        a.flush()
        assert all(r.inbox.empty() for r in a.ranks)
        # node-c starts fresh workers in the record's iteration: its key says so at once
        c.ctx = _ctx(c, 2, 1, ac, 45678)
        assert c.coordinator.begin(c.ctx) == 1
        gos = [r.expect(Go) for r in a.ranks]
        assert [g.env[contract.RANK] for g in gos] == ["0", "1"]  # type: ignore[attr-defined]
        assert {g.env[contract.MASTER_PORT] for g in gos} == {"45678"}  # type: ignore[attr-defined]
        assert {g.env[contract.WORLD_SIZE] for g in gos} == {"4"}  # type: ignore[attr-defined]
        assert _record(store, job_prefix).restarts == 0


def test_a_restart_in_flight_is_carried_without_another(store: EtcdClient, job_prefix: str) -> None:
    """A fault (the broken collective) moved the record first and node-a passed its
    termination barrier; node-b never will (lost). The carry spends nothing more, the
    ended round's barrier never goes (node-b's key, written before it died, is of that
    round), and the next round's does."""
    with make_node("node-a", store, job_prefix) as a, make_node("node-b", store, job_prefix) as b:
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        a.ranks[0].fault(0, "RuntimeError: Connection reset by peer")
        for r in a.ranks:
            assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
            r.ready(1)
        wait_for(lambda: (a.coordinator.status() or {}).get("phase") == "barrier", 10,
                 what="node-a in the barrier")  # fmt: skip
        for r in b.ranks:
            r.close()
        assert a.coordinator.carry(LOST)
        # node-b's ready key of round 1 appears now (written just before it died)
        b.coordinator.close()
        keys = contract.Keys(job_prefix)
        from kelastic_sidecar.inprocess.record import ReadyRecord, encode_ready

        store.put(
            keys.inprocess_ready(1, "node-b"), encode_ready(ReadyRecord(1, "127.0.0.1", 9, 1))
        )
        a.flush()
        assert all(r.inbox.empty() for r in a.ranks)  # held: no go into the dead world
        assert (_record(store, job_prefix).iteration, _record(store, job_prefix).restarts) == (1, 1)
        assert a.coordinator.begin(_ctx(a, 2, 0, ("node-a",), 42000)) == 1
        gos = [r.expect(Go) for r in a.ranks]
        assert {g.env[contract.WORLD_SIZE] for g in gos} == {"2"}  # type: ignore[attr-defined]


def test_refusals_take_the_process_path(store: EtcdClient, job_prefix: str) -> None:
    # the in-process budget spent: every round change starts the workers again, even one
    # that would spend nothing (a node joining looks like a peer's process restart)
    with make_node("node-a", store, job_prefix, cfg=settings(max_restarts=0)) as a:
        a.begin(1, 0, ("node-a",))
        for end in (LOST, SCALE, RoundEnd(RoundEndKind.RESTART, reason="peer_restart")):
            assert not a.coordinator.carry(end)
        assert all(r.inbox.empty() for r in a.ranks)
        assert _record(store, job_prefix).iteration == 0
    # within the budget: held, then the job ends while held: the ranks give up
    with make_node("node-a", store, job_prefix + "a/") as a:
        a.begin(1, 0, ("node-a",))
        assert a.coordinator.carry(SCALE)
        _abort_and_hold(a, 1)
        a.coordinator.end_round("closed")  # the job ended while held: the ranks give up
        for r in a.ranks:
            r.expect(GiveUp)
    # a local rank that never said hello (not wrapped) cannot be held
    with make_node("node-d", store, job_prefix + "d/") as d:
        d.begin(1, 0, ("node-d",), connect=False)
        d.ranks = [d.connect(0)]
        assert not d.coordinator.carry(SCALE)
        assert _record(store, job_prefix + "d/").iteration == 0
    # another kind of end, or no round
    with make_node("node-e", store, job_prefix + "e/") as e:
        assert not e.coordinator.carry(SCALE)  # no round began
        e.begin(1, 0, ("node-e",))
        assert not e.coordinator.carry(RoundEnd(RoundEndKind.SUCCEEDED))


def test_a_lost_node_is_charged_even_when_its_own_sidecar_moved_the_record_first(
    store: EtcdClient, job_prefix: str
) -> None:
    """Seen on Kubernetes: the deleted Pod's sidecar sees its own lease gone (a restart
    that spends nothing) and wins the compare-and-set before SIGTERM stops it; the
    survivor's lost-node carry then charges that same restart once, with its cause, and
    its ranks are aborted once."""
    with make_node("node-a", store, job_prefix) as a, make_node("node-b", store, job_prefix) as b:
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        assert b.coordinator.carry(RoundEnd(RoundEndKind.RESTART, reason="peer_restart"))
        wait_for(lambda: _record(store, job_prefix).iteration == 1, 10, what="b's carry")
        assert _record(store, job_prefix).restarts == 0
        assert a.coordinator.carry(LOST)
        record = _record(store, job_prefix)
        assert (record.iteration, record.restarts, record.cause) == (1, 1, CAUSE_NODE_LOST)
        assert (record.node, record.message) == ("node-a", "node node-b lost: gone")
        _abort_and_hold(a, 1)  # one abort each, then nothing until the next round
