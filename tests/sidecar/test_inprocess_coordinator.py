"""In-process restarts coordinated by two sidecars' coordinators over a real etcd, with
ranks played by clients of the real unix socket."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kelastic import contract
from kelastic.inprocess_messages import Abort, Fault, GiveUp, Go, Progress
from kelastic_etcd import EtcdClient
from kelastic_sidecar.inprocess.record import (
    IterationRecord,
    advance_iteration,
    decode_iteration_record,
)
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import (
    NEVER_READY,
    Node,
    Rank,
    fault_rank_0_and_leave,
    make_node,
    rank_1_process,
    sample,
    settings,
)

AB = ("node-a", "node-b")


@pytest.fixture
def two(store: EtcdClient, job_prefix: str) -> Iterator[tuple[Node, Node]]:
    with (
        make_node("node-a", store, job_prefix, "127.0.0.1") as a,
        make_node("node-b", store, job_prefix, "127.0.0.2") as b,
    ):
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        yield a, b


def _record(store: EtcdClient, prefix: str) -> IterationRecord:
    got = store.get(contract.Keys(prefix).inprocess_iteration)
    return IterationRecord() if got is None else decode_iteration_record(got[0])


def _restart(nodes: tuple[Node, ...], iteration: int, timeout: float = 20.0) -> list[Go]:
    """Every rank expects abort(iteration), answers ready, and gets go (each within
    ``timeout`` s): the go's."""
    ranks = [r for n in nodes for r in n.ranks]
    for r in ranks:
        assert r.expect(Abort, timeout).iteration == iteration  # type: ignore[attr-defined]
    for r in ranks:
        r.ready(iteration)
    gos = [r.expect(Go, timeout) for r in ranks]
    assert all(isinstance(g, Go) and g.iteration == iteration for g in gos)
    return gos  # type: ignore[return-value]


def test_a_fault_on_one_node_restarts_both_with_one_env(
    two: tuple[Node, Node], store: EtcdClient, job_prefix: str
) -> None:
    a, b = two
    started = time.monotonic()
    b.ranks[1].fault(0, "RuntimeError: NCCL timeout")
    gos = _restart(two, 1)
    took = time.monotonic() - started
    print(f"fault -> go, 2 nodes x 2 ranks, real etcd: {took * 1000:.1f} ms")
    masters = {(g.env[contract.MASTER_ADDR], g.env[contract.MASTER_PORT]) for g in gos}
    assert len(masters) == 1
    addr, port = masters.pop()
    assert addr == "127.0.0.1" and 0 < int(port) < 65536  # group rank 0's node (a)
    assert [g.env[contract.RANK] for g in gos] == ["0", "1", "2", "3"]  # ranks unchanged
    assert {g.env[contract.ENV_INPROCESS_ITERATION] for g in gos} == {"1"}
    assert gos[3].env[contract.KELASTIC_TIMER_TOKEN] == "token-node-b-1"  # the round's env
    for node in two:  # abort -> go is downtime; productive again from the go
        assert sample(node.metrics, "kelastic_downtime_seconds_total", cause="worker_failure") > 0
        assert node.metrics.goodput.running
    record = _record(store, job_prefix)
    assert (record.iteration, record.restarts, record.node, record.rank) == (1, 1, "node-b", 3)
    assert record.cause == "exception" and record.message == "RuntimeError: NCCL timeout"
    # the restart ends when every local rank progresses in the new iteration
    for node in two:
        for r in node.ranks:
            r.progress(1)
    for node in two:
        wait_for(
            lambda n=node: sample(n.metrics, "kelastic_inprocess_restart_seconds_count") == 1,
            10, what="the restart's duration observed",
        )  # fmt: skip
        node.flush()
        status = node.coordinator.status()
        assert status is not None
        assert (status["iteration"], status["restarts"], status["phase"]) == (1, 1, "running")
        last = status["last"]
        assert (last["iteration"], last["node"], last["rank"]) == (1, "node-b", 3)
        assert 0 < last["resumed_s"] < 30
        level = {"level": "inprocess", "cause": "worker_failure"}
        assert sample(node.metrics, "kelastic_restarts_total", **level) == 1
        level = {"level": "process", "cause": "worker_failure"}
        assert sample(node.metrics, "kelastic_restarts_total", **level) == 0
    # a second fault, in iteration 1, restarts again into 2 (the ready keys of 1 go)
    a.ranks[0].fault(1)
    gos = _restart(two, 2)
    assert {g.env[contract.ENV_INPROCESS_ITERATION] for g in gos} == {"2"}
    keys = contract.Keys(job_prefix)
    wait_for(lambda: not store.get_prefix(keys.inprocess_ready_prefix(1)), 10,
             what="the ready keys of iteration 1 deleted")  # fmt: skip
    assert store.get(keys.inprocess_ready(2, "node-a")) is not None


def test_two_nodes_faulting_the_same_iteration_restart_once(
    two: tuple[Node, Node], store: EtcdClient, job_prefix: str
) -> None:
    a, b = two
    a.ranks[0].fault(0)
    b.ranks[0].fault(0)
    a.ranks[1].fault(0)
    _restart(two, 1)
    record = _record(store, job_prefix)
    assert (record.iteration, record.restarts) == (1, 1)
    for node in two:
        node.flush()
        assert node.coordinator.status()["restarts"] == 1  # type: ignore[index]
        assert sample(node.metrics, "kelastic_restarts_total", level="inprocess",
                      cause="worker_failure") == 1  # fmt: skip
        for r in node.ranks:  # one abort and one go each, nothing else (streams are ordered)
            assert [type(m) for m in r.got] == [Abort, Go]


def test_a_stale_fault_is_ignored(
    two: tuple[Node, Node], store: EtcdClient, job_prefix: str
) -> None:
    a, _ = two
    a.ranks[0].fault(0)
    _restart(two, 1)
    a.ranks[1].fault(0)  # a late report of the iteration already left
    wait_for(lambda: a.coordinator.machine.stale_faults == 1, 10, what="the stale fault seen")
    assert _record(store, job_prefix).iteration == 1


def test_a_new_iteration_during_the_barrier_supersedes_it(
    two: tuple[Node, Node], store: EtcdClient, job_prefix: str
) -> None:
    a, b = two
    a.ranks[0].fault(0)
    ranks = [*a.ranks, *b.ranks]
    for r in ranks:
        assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
    for r in a.ranks:  # node a passes its termination barrier; node b's ranks not yet
        r.ready(1)
    key = contract.Keys(job_prefix).inprocess_ready(1, "node-a")
    wait_for(lambda: store.get(key), 10, what="node a's ready key")
    out = advance_iteration(  # another fault of iteration 1 lands meanwhile (a late node)
        store, contract.Keys(job_prefix).inprocess_iteration, 1, 10,
        round_=1, cause="soft_timeout", node="node-c", rank=9, message="hung", now=0.0,
    )  # fmt: skip
    assert out.record is not None and out.record.iteration == 2
    for r in ranks:
        assert r.expect(Abort).iteration == 2  # type: ignore[attr-defined]
    b.ranks[0].ready(1)  # late answers to the superseded abort count for nothing
    for r in ranks:
        r.ready(2)
    for r in ranks:
        go = r.expect(Go)
        assert go.iteration == 2  # type: ignore[attr-defined]
    for node in two:
        assert all(not (isinstance(m, Go) and m.iteration == 1) for r in node.ranks for m in r.got)
        status = node.coordinator.status()
        assert status is not None and status["last"]["cause"] == "soft_timeout"
        hang = {"level": "inprocess", "cause": "hang"}
        assert sample(node.metrics, "kelastic_restarts_total", **hang) == 1


def test_budget_spent_gives_up_to_the_faulted_rank_only(store: EtcdClient, job_prefix: str) -> None:
    with make_node("solo", store, job_prefix, cfg=settings(max_restarts=1)) as n:
        n.begin(1, 0, ("solo",))
        n.ranks[0].fault(0)
        _restart((n,), 1)
        n.ranks[1].fault(1, "the second one")
        give_up = n.ranks[1].expect(GiveUp)
        assert "budget of 1 spent" in give_up.reason  # type: ignore[attr-defined]
        record = _record(store, job_prefix)
        assert (record.iteration, record.restarts) == (1, 1)
        n.coordinator.end_round("failed")
        # rank 0's stream: abort, go, and then only the round's end (nothing in between)
        assert isinstance(n.ranks[0].expect(GiveUp), GiveUp)
        assert [type(m) for m in n.ranks[0].got] == [Abort, Go, GiveUp]
        assert n.ranks[0].closed()
        status = n.coordinator.status()
        assert status is not None and status["phase"] == "idle"


def test_a_rank_missing_the_hard_timeout_is_killed(store: EtcdClient, job_prefix: str) -> None:
    with make_node("solo", store, job_prefix, cfg=settings(soft=0.2, hard=0.5)) as n:
        n.begin(1, 0, ("solo",), connect=False)
        with rank_1_process(n, NEVER_READY) as hung:
            fault_rank_0_and_leave(n)
            assert hung.wait(timeout=20) == -9  # SIGKILL, by pid, after the hard timeout
            assert n.killed == [(hung.pid, 9)]
            # told to the supervisor as a reap before the kill (its monitor holds every
            # hang; the worker's exit, which follows the kill, finds it there)
            why = "no termination barrier of iteration 1 within the hard timeout (0.5 s)"
            assert n.told == [("reap", hung.pid, f"{why}; killed by the sidecar"),
                              ("kill", hung.pid, 9)]  # fmt: skip
            assert sample(n.metrics, "kelastic_inprocess_workers_killed_total") == 1


def test_bad_connections_are_dropped_and_the_others_unaffected(
    store: EtcdClient, job_prefix: str
) -> None:
    from kelastic.inprocess_messages import MAX_LINE
    from kelastic_sidecar.inprocess.server import MAX_PENDING

    with make_node("solo", store, job_prefix) as n:
        n.begin(1, 0, ("solo",))
        coord = n.coordinator

        def raw_client(payload: bytes) -> Rank:
            r = Rank(n.socket_path, 1, 1)  # sends a valid hello first
            r.sock.sendall(payload)
            return r

        garbage = raw_client(b"not json at all\n")
        assert garbage.closed()
        huge = raw_client(b"x" * (MAX_LINE + 10))
        assert huge.closed()
        again = raw_client(b'{"type": "hello", "pid": 1, "local_rank": 1, "rank": 1, '
                           b'"iteration": 0}\n')  # fmt: skip
        assert again.closed()
        typed = raw_client(b'{"type": "fault", "iteration": -1, "local_rank": 0}\n')
        assert typed.closed()
        # a flood: the loop is held up while one client sends more than MAX_PENDING lines
        hold = threading.Event()
        coord._events.put(hold.wait)
        flood = raw_client(b"".join(
            b'{"type": "progress", "iteration": 0, "local_rank": 1}\n'
            for _ in range(MAX_PENDING + 50)
        ))  # fmt: skip
        assert flood.closed()
        hold.set()
        dropped = coord.server.dropped
        assert dropped["malformed"] == 3 and dropped["oversized"] == 1
        assert dropped["flood"] == 1
        for reason, count in (("malformed", 3), ("oversized", 1), ("flood", 1)):
            value = sample(n.metrics, "kelastic_inprocess_sessions_dropped_total", reason=reason)
            assert value == count
        # a connection that never says hello first is dropped too
        import socket

        from kelastic.sockaddr import unix_address

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            with unix_address(n.socket_path) as address:
                s.connect(address)
            s.sendall(b'{"type": "ready", "iteration": 0, "local_rank": 0}\n')
            s.settimeout(10)
            assert s.recv(10) == b""
        assert coord.server.dropped["no_hello"] == 1
        # the well-behaved ranks never noticed: a fault still restarts them
        n.ranks[1] = n.connect(1)
        n.ranks[0].fault(0)
        _restart((n,), 1)


def test_a_corrupt_record_is_counted_once_and_replaced_by_the_next_fault(
    store: EtcdClient, job_prefix: str
) -> None:
    """A corrupt record once made every fault a process restart until the next
    round; now the fault replaces it (compare-and-set on its revision, the restarts this
    node knew of kept) and restarts in process. A corrupt record at a round's start is
    replaced too, past every iteration this node knew of."""
    keys = contract.Keys(job_prefix)
    with make_node("solo", store, job_prefix) as n:
        n.begin(1, 0, ("solo",))
        store.put(keys.inprocess_iteration, b'{"iteration": ' + b"9" * 5000 + b"}")
        source = {"source": "inprocess_record"}
        wait_for(lambda: sample(n.metrics, "kelastic_corrupt_values_total", **source) == 1,
                 10, what="the corrupt record counted")  # fmt: skip
        n.ranks[0].fault(0)
        _restart((n,), 1)
        got = _record(store, job_prefix)
        assert (got.iteration, got.restarts, got.cause) == (1, 1, "exception")
        assert sample(n.metrics, "kelastic_corrupt_values_total", **source) == 1  # the same one
        corrupt = (n.coordinator.status() or {})["corrupt"]
        assert corrupt["replaced_by"] == 1 and "integer of 5000" in corrupt["error"], corrupt
        n.coordinator.end_round("failed")
        store.put(keys.inprocess_iteration, b"\xff not json")
        assert n.begin(2, 0, ("solo",), connect=False) == 2
        assert _record(store, job_prefix).iteration == 2
        assert _record(store, job_prefix).restarts == 1  # not refilled
        wait_for(lambda: sample(n.metrics, "kelastic_corrupt_values_total", **source) == 2,
                 10, what="the second corrupt record counted")  # fmt: skip
        n.ranks = [n.connect(0, 2), n.connect(1, 0)]  # hello 0 is taken as the round's 2
        n.ranks[1].fault(0)  # its own count: iteration 0, the round's 2
        _restart((n,), 3)


def test_end_round_gives_up_and_a_late_rank_is_aborted(
    two: tuple[Node, Node], store: EtcdClient, job_prefix: str
) -> None:
    a, b = two
    b.ranks[1].close()  # b's rank 1 is restarting (its process): it connects late
    wait_for(lambda: b.coordinator._call(lambda: not b.coordinator.machine.has_session(1)), 10)
    a.ranks[0].fault(0)
    for r in (*a.ranks, b.ranks[0]):
        assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
    late = b.connect(1, 0)
    assert late.expect(Abort).iteration == 1  # type: ignore[attr-defined]
    b.ranks[1] = late
    for node in two:
        node.coordinator.end_round("restart")
    for r in (*a.ranks, *b.ranks):
        assert r.expect(GiveUp).reason == "round ended: restart"  # type: ignore[attr-defined]
        assert r.closed()
    # after the round, a fault cannot restart in-process
    orphan = Rank(a.socket_path, 0, 0, 1)
    orphan.fault(1)
    assert isinstance(orphan.expect(GiveUp), GiveUp)
    orphan.close()


def test_progress_before_any_restart_is_not_a_restart(two: tuple[Node, Node]) -> None:
    a, _ = two
    a.ranks[0].send(Progress(0, 0))
    a.flush()
    assert sample(a.metrics, "kelastic_inprocess_restart_seconds_count") == 0


def test_a_rank_failing_to_leave_gets_give_up_and_the_others_wait(
    store: EtcdClient, job_prefix: str
) -> None:
    with make_node("solo", store, job_prefix) as n:
        n.begin(1, 0, ("solo",))
        n.ranks[0].fault(0)
        for r in n.ranks:
            assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
        # rank 1's health check fails after the abort: it reports a fault of iteration 1
        n.ranks[1].send(Fault(1, 1, "health_check", "RuntimeError: unhealthy device"))
        give_up = n.ranks[1].expect(GiveUp)
        assert "health_check" in give_up.reason  # type: ignore[attr-defined]
        n.flush()
        assert n.coordinator.machine.stale_faults == 0
        assert _record(store, job_prefix).iteration == 1  # no second restart for it
        status = n.coordinator.status()
        assert status is not None and status["phase"] == "aborting"


def test_ready_and_go_keys_are_bound_to_the_nodes_lease(store: EtcdClient, job_prefix: str) -> None:
    lease = store.grant_lease(30)
    keys = contract.Keys(job_prefix)
    try:
        with make_node("solo", store, job_prefix) as n:
            n.begin(1, 0, ("solo",), connect=False)
            assert n.ctx is not None
            n.ctx = replace(n.ctx, lease_id=lambda: lease.id)
            n.coordinator.begin(n.ctx)
            n.ranks = [n.connect(0), n.connect(1)]
            n.ranks[0].fault(0)
            _restart((n,), 1)
            assert store.get(keys.inprocess_ready(1, "solo")) is not None
            assert store.get(keys.inprocess_go(1)) is not None  # group rank 0's go
            lease.revoke()  # the node is gone: so are its ready key and its go
            assert store.get(keys.inprocess_ready(1, "solo")) is None
            assert store.get(keys.inprocess_go(1)) is None
    finally:
        lease.revoke()


def test_etcd_unreachable_falls_back_to_the_process_path(job_prefix: str) -> None:
    from kelastic_operator.local.etcd import free_port

    dead = EtcdClient([f"127.0.0.1:{free_port()}"], timeout=0.5)  # nothing listens there
    try:
        with make_node("solo", dead, job_prefix) as n:
            assert n.begin(1, 0, ("solo",)) == 0  # the record cannot be read: iteration 0
            n.ranks[0].fault(0)
            give_up = n.ranks[0].expect(GiveUp)
            assert "cannot record the in-process restart" in give_up.reason  # type: ignore[attr-defined]
            n.coordinator.end_round("failed")
            assert isinstance(n.ranks[1].expect(GiveUp), GiveUp)  # nothing before the end
    finally:
        dead.close()


def _events_sent(endpoint: str) -> float:
    """etcd's count of the watch events it sent (``etcd_debugging_mvcc_events_total``)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("etcd_debugging_mvcc_events_total "):
            return float(line.split()[1])
    raise AssertionError("etcd_debugging_mvcc_events_total not in etcd's metrics")


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[str]:
    """An etcd of this module's own: etcd counts the events it sends to every watcher,
    and another test's watch on the whole key space (an operator's) would add to them."""
    from kelastic_operator.local.etcd import EmbeddedEtcd

    with EmbeddedEtcd(die_with_parent=True) as server:
        yield server.endpoint


@pytest.mark.parametrize("n", [6, 64, 256])
def test_a_restart_costs_o_n_requests_and_watch_events(
    own_etcd: str, job_prefix: str, n: int
) -> None:
    """A restart of N nodes costs etcd O(N) requests and O(N) watch events: each node
    writes its ready key, group rank 0's node alone watches them and writes one ``go``,
    which every node watches. (When every node watched every ready key, the events were
    N^2: 256 nodes did not pass the barrier within its 90 s here, their threads waiting
    on 65,536 events through Python gRPC in one process, and at N = 64 each restart sent
    etcd over 4,096.) Threads of this process, one etcd; the events counted by etcd."""
    names = tuple(f"node-{i}" for i in range(n))
    store = EtcdClient([own_etcd])  # the nodes' requests, counted together
    try:
        with contextlib.ExitStack() as stack:
            nodes = [stack.enter_context(make_node(x, store, job_prefix)) for x in names]
            for i, node in enumerate(nodes):
                node.begin(1, i, names, nproc=1)
            before, events = dict(store.request_counts()), _events_sent(own_etcd)
            started = time.monotonic()
            nodes[3].ranks[0].fault(0)
            _restart(tuple(nodes), 1, timeout=max(20.0, n))  # N nodes' threads, 2 cores
            took = time.monotonic() - started
            after, events = store.request_counts(), _events_sent(own_etcd) - events
    finally:
        store.close()
    spent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    reads = {k: v for k, v in spent.items() if k in ("read", "get", "get_prefix", "range")}
    print(f"\n{n} nodes, one restart (fault -> go on every rank, {took:.2f} s): etcd "
          f"requests {spent}, watch events {events:.0f}")  # fmt: skip
    assert sum(reads.values()) <= 1, reads  # the faulting node's record read, at most
    assert sum(spent.values()) <= 3 * n + 10, spent  # O(N) requests in all
    # the record to N, the ready keys to 1, the go to N (no deletion: a first restart)
    assert events <= 3 * n + 10, events
