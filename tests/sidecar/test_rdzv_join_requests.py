"""Joining in few etcd requests: join requests applied by other writers, and writes that
return the next view (a lost compare-and-set needs no read after it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kelastic_sidecar.rendezvous.handler import EtcdRendezvousHandler, RendezvousTimeoutError
from kelastic_sidecar.rendezvous.state import (
    MAX_ADMITTED_PER_WRITE,
    RendezvousState,
    mark_closed,
)
from kelastic_sidecar.rendezvous.steps import Clock, admit_requests
from tests.conftest import wait_for
from tests.sidecar.test_rendezvous import RUN, Cluster, join_all, settings

NOW = 1000.0


@pytest.fixture
def cluster(etcd_endpoint: str, job_prefix: str) -> Iterator[Cluster]:
    c = Cluster(etcd_endpoint, job_prefix)
    yield c
    c.close()


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}


# ====================================================================== pure state machine


def test_admit_requests_joins_the_forming_round_in_name_order() -> None:
    s = settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    state = RendezvousState(RUN, participants={"job-1": 0})
    new, admitted = admit_requests(state, ["job-10", "job-2", "job-3"], Clock(NOW), settings=s)
    assert admitted == ("job-2", "job-3", "job-10")
    assert new.complete  # job-3 brought it to max_nodes
    assert set(new.participants) == {"job-1", "job-2", "job-3"}
    assert new.redundancy_list == {"job-10"}  # the round was full when its turn came


def test_admit_requests_skips_names_no_state_may_hold() -> None:
    """A forged join request (an empty or 2000-character node name) is not applied: the
    state's strict writer would refuse the state, and the join would fail."""
    from kelastic_sidecar.rendezvous.state import decode_state, encode_state

    s = settings(min_nodes=1, max_nodes=4)
    new, admitted = admit_requests(
        RendezvousState(RUN), ["", "x" * 2000, "b"], Clock(NOW), settings=s
    )
    assert admitted == ("b",) and set(new.participants) == {"b"}
    assert decode_state(encode_state(new)) == new


def test_admit_requests_starts_the_last_call_at_min_nodes() -> None:
    s = settings(min_nodes=2, max_nodes=4, last_call_timeout=30)
    new, admitted = admit_requests(RendezvousState(RUN), ["b", "a"], Clock(NOW), settings=s)
    assert admitted == ("a", "b")
    assert not new.complete and new.deadline == NOW + 30


def test_admit_requests_puts_late_nodes_on_the_wait_list() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    state = RendezvousState(RUN, complete=True, participants={"a": 0})
    new, admitted = admit_requests(state, ["b"], Clock(NOW), settings=s)
    assert admitted == ("b",) and new.wait_list == {"b"} and new.participants == {"a": 0}


def test_admit_requests_applies_at_most_limit_requests() -> None:
    """etcd refuses a transaction of more than --max-txn-ops (128) compares or operations,
    and each admitted request costs the write one of each."""
    s = settings(min_nodes=1, max_nodes=300, last_call_timeout=30)
    requesters = [f"job-{i}" for i in range(250)]
    new, admitted = admit_requests(RendezvousState(RUN), requesters, Clock(NOW), settings=s)
    assert len(admitted) == MAX_ADMITTED_PER_WRITE <= 128 - 8
    assert admitted == tuple(f"job-{i}" for i in range(MAX_ADMITTED_PER_WRITE))  # name order
    assert set(new.participants) == set(admitted)
    _, three = admit_requests(RendezvousState(RUN), requesters, Clock(NOW), settings=s, limit=3)
    assert three == ("job-0", "job-1", "job-2")


def test_admit_requests_skips_listed_nodes_and_a_closed_rendezvous() -> None:
    s = settings(min_nodes=3, max_nodes=3)
    state = RendezvousState(RUN, participants={"a": 0}, redundancy_list=frozenset({"r"}))
    state = dataclasses.replace(state, wait_list=frozenset({"w"}))
    new, admitted = admit_requests(state, ["a", "r", "w"], Clock(NOW), settings=s)
    assert admitted == () and new == state
    closed = mark_closed(RendezvousState(RUN), {"why": "test"})
    assert admit_requests(closed, ["a"], Clock(NOW), settings=s) == (closed, ())


# =========================================================================== on etcd


def _joining(c: Cluster) -> set[str]:
    prefix = c.keys.joining_prefix
    return {k[len(prefix) :] for k in c.admin.get_prefix(prefix)}


def test_a_lone_join_takes_four_requests(cluster: Cluster) -> None:
    node = cluster.node("a", settings(min_nodes=1, max_nodes=1))
    store = node.state.store
    before = store.request_counts()
    info = node.next_rendezvous()
    assert info.group_world_size == 1
    # lease, alive key + join request + read, the write (its view says: complete)
    assert _spent(before, store.request_counts()) == {"grant_lease": 1, "put_read": 1, "cas": 1}
    assert _joining(cluster) == set()  # the request went with the write


def test_a_lost_write_returns_the_winners_view_without_a_read(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=3)
    a, b = cluster.node("a", s), cluster.node("b", s)
    a.state.ensure_alive()
    b.state.ensure_alive()
    view = a.state.read()
    view_b = b.state.read()
    ok, winner = b.state.write(view_b, dataclasses.replace(view_b.state, participants={"b": 0}))
    assert ok
    store = a.state.store
    before = store.request_counts()
    ok, after = a.state.write(view, dataclasses.replace(view.state, participants={"a": 0}))
    assert not ok
    assert after.state == winner.state and after.token == winner.token
    assert after.alive == {"a", "b"}
    assert _spent(before, store.request_counts()) == {"cas": 1, "cas_failed": 1}


def test_a_writer_admits_pending_join_requests(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2)
    a, b, ghost = cluster.node("a", s), cluster.node("b", s), cluster.node("ghost", s)
    b.state.ensure_alive(request_join=True)  # b asked to join (its join op is not running)
    ghost.state.ensure_alive(request_join=True)
    ghost.shutdown()  # its request went with its lease
    assert _joining(cluster) == {"b"}
    info = a.next_rendezvous()  # a's own write admits b: the round is complete at once
    assert info.participants == ("a", "b")
    assert cluster.state().complete
    assert _joining(cluster) == set()  # b's request was consumed by the write


def test_a_withdrawn_request_is_not_admitted(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=3)
    a, b = cluster.node("a", s), cluster.node("b", s)
    a.state.ensure_alive()
    b.state.ensure_alive(request_join=True)
    view = a.state.read()
    assert set(view.joining) == {"b"}
    b.state.withdraw_join_request()  # b timed out between a's read and a's write
    new = dataclasses.replace(view.state, participants={"a": 0, "b": 0})
    ok, after = a.state.write(view, new, admitted=("b",))
    assert not ok  # b's request is not the one a saw any more
    assert "b" not in after.state.participants


def test_many_nodes_join_with_few_writes(cluster: Cluster) -> None:
    s = settings(min_nodes=8, max_nodes=8, last_call_timeout=30)
    nodes = [cluster.node(f"job-{i}", s) for i in range(8)]
    infos = join_all(nodes)
    assert {i.participants for i in infos} == {tuple(f"job-{i}" for i in range(8))}
    assert sorted(i.group_rank for i in infos) == list(range(8))
    assert _joining(cluster) == set()
    writes = sum(
        n.request_counts().get("cas", 0) - n.request_counts().get("cas_failed", 0)
        for n in (h.state.store for h in nodes)
    )
    assert 1 <= writes <= 8  # one state write per node at most, often fewer


def test_a_timed_out_join_withdraws_its_request(cluster: Cluster) -> None:
    lonely = cluster.node("lonely", settings(min_nodes=2, max_nodes=2, join_timeout=0.5))
    with pytest.raises(RendezvousTimeoutError):
        lonely.next_rendezvous()
    assert _joining(cluster) == set()
    late = cluster.node("late", settings(min_nodes=1, max_nodes=1))
    info = late.next_rendezvous()
    assert info.participants == ("late",)  # the withdrawn node was not admitted
    wait_for(lambda: "lonely" not in cluster.state().participants, what="lonely gone")


def test_a_pending_request_is_withdrawn_once_at_the_timeout(cluster: Cluster) -> None:
    import functools
    import threading

    from kelastic_sidecar.rendezvous.steps import join_step

    s = settings(min_nodes=2, max_nodes=2)
    node = cluster.node("slow", s)
    node.state.ensure_alive(request_join=True)  # the request is pending, nobody listed us
    assert _joining(cluster) == {"slow"}
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            step = functools.partial(join_step, node="slow", settings=s)
            node.executor.run("join", step, 0.0, need_alive=True, request_join=True, admit=True)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)  # a deadline for a hang, not a timing check
    assert not thread.is_alive(), "the timed-out join did not end"
    assert len(outcome) == 1 and isinstance(outcome[0], RendezvousTimeoutError)
    assert _joining(cluster) == set()  # withdrawn, and not written again


def test_an_open_session_spends_no_grant_or_stream_per_round(cluster: Cluster) -> None:
    """``open()`` grants the lease and creates the watch once; rounds and waits reuse them."""
    import threading

    s = settings(min_nodes=2, max_nodes=2, last_call_timeout=30)
    a, b = cluster.node("a", s), cluster.node("b", s)
    store = a.state.store
    a.open()
    a.open()  # idempotent
    assert _spent({}, store.request_counts()) == {"grant_lease": 1, "watch": 1}
    before = store.request_counts()
    infos: list[object] = []
    joining = threading.Thread(target=lambda: infos.append(a.next_rendezvous()), daemon=True)
    joining.start()  # a waits for b on its watch
    state_key = cluster.keys.rdzv_state
    wait_for(lambda: cluster.admin.get(state_key), what="a to join and wait")
    assert "a" in cluster.state().participants
    info_b = b.next_rendezvous()
    joining.join(30)
    assert len(infos) == 1 and info_b.participants == ("a", "b")
    # a announced itself and wrote its join; b's write completed the round, and a
    # learnt it from the watch event: no read
    assert _spent(before, store.request_counts()) == {"put_read": 1, "cas": 1}
    for _ in range(3):  # the supervisor's watch loop
        assert a.check_round(info_b).healthy
        a.wait_for_change(0.05)
    spent = _spent(before, store.request_counts())
    assert "grant_lease" not in spent and "watch" not in spent and "wait_change" not in spent
    b.shutdown()  # b's lease goes: a's waiting watch hears the alive key deleted
    wait_for(lambda: a.wait_for_change(1.0), 10, what="a to see b's lease gone")
    assert not a.check_round(info_b).healthy


def test_a_waiting_node_follows_state_writes_without_reads(cluster: Cluster) -> None:
    """Each peer's join wakes the waiting node; the state comes with the watch event, so
    it goes on waiting, and finishes, without reading."""
    import threading

    s = settings(min_nodes=3, max_nodes=3, last_call_timeout=30)
    a, b, c = (cluster.node(n, s) for n in "abc")
    for node in (a, b, c):
        node.open()
    store = a.state.store
    before = store.request_counts()
    infos: list[object] = []
    joining = threading.Thread(target=lambda: infos.append(a.next_rendezvous()), daemon=True)
    joining.start()
    state_key = cluster.keys.rdzv_state
    wait_for(lambda: cluster.admin.get(state_key), what="a to join and wait")
    b_joins = threading.Thread(target=b.next_rendezvous, daemon=True)
    b_joins.start()  # b's write wakes a: still 2 of 3, a keeps waiting
    wait_for(lambda: len(cluster.state().participants) == 2, what="b to join")
    info_c = c.next_rendezvous()
    joining.join(30)
    b_joins.join(30)
    assert len(infos) == 1 and info_c.participants == ("a", "b", "c")
    assert _spent(before, store.request_counts()) == {"put_read": 1, "cas": 1}


def test_a_write_never_exceeds_etcds_transaction_limit(cluster: Cluster) -> None:
    """129 pending join requests: the writer applies MAX_ADMITTED_PER_WRITE of them (etcd
    refuses more than 128 compares or operations in one transaction), the rest join by
    their own writes; no etcd call fails."""
    import functools
    import threading

    from kelastic_sidecar.rendezvous.steps import join_step

    n = 130
    s = settings(min_nodes=n, max_nodes=n, last_call_timeout=30, join_timeout=60)
    nodes = [cluster.node(f"job-{i:03d}", s) for i in range(n)]
    for node in nodes[1:]:  # each has asked to join and finished its exit step
        node.state.ensure_alive(request_join=True)
    views: dict[str, object] = {}

    def join(node: EtcdRendezvousHandler) -> None:  # next_rendezvous's join op
        step = functools.partial(join_step, node=node.node, settings=s)
        view = node.executor.run("join", step, 60, need_alive=True, request_join=True, admit=True)
        views[node.node] = view.state

    first = threading.Thread(target=join, args=(nodes[0],), daemon=True)
    first.start()
    wait_for(lambda: cluster.admin.get(cluster.keys.rdzv_state), what="the first write")
    assert len(cluster.state().participants) == 1 + MAX_ADMITTED_PER_WRITE
    rest = [threading.Thread(target=join, args=(node,), daemon=True) for node in nodes[1:]]
    for thread in rest:
        thread.start()
    for thread in (first, *rest):
        thread.join(60)
    final = cluster.state()
    assert final.complete and len(final.participants) == n
    assert len(views) == n
    assert sum(node.state.store.request_counts().get("errors", 0) for node in nodes) == 0
