"""The dynamic rendezvous: the pure state machine, then nodes in threads on a real etcd."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kelastic.contract import Keys
from kelastic.etcd_values import encode_departure
from kelastic_etcd import EtcdClient, EtcdError, EtcdUnavailable
from kelastic_sidecar.rendezvous.finished import finished_in, finished_reason
from kelastic_sidecar.rendezvous.handler import (
    LEAVE_OUTAGE_TIMEOUT,
    EtcdRendezvousHandler,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from kelastic_sidecar.rendezvous.state import (
    RendezvousState,
    decode_state,
    encode_state,
    remove_participant,
    sanitize,
)
from kelastic_sidecar.rendezvous.steps import (
    Action,
    Clock,
    evaluate_round,
    exit_step,
    join_step,
    leave_step,
)
from tests.conftest import wait_for
from tests.etcd_client.test_etcd_store import OutageProxy

RUN = "run-1"


def settings(min_nodes: int = 1, max_nodes: int = 3, **kw: float) -> RendezvousSettings:
    return RendezvousSettings(RUN, min_nodes, max_nodes, **kw)  # type: ignore[arg-type]


# ====================================================================== pure state machine


def _drive(state: RendezvousState, node: str, s: RendezvousSettings, now: float) -> RendezvousState:
    """Apply join steps for ``node`` until it has to wait or is done."""
    for _ in range(10):
        step = join_step(state, Clock(now=now), node=node, settings=s)
        if step.action is not Action.WRITE:
            return state
        assert step.state is not None and step.state != state
        state = step.state
    raise AssertionError("join step did not settle")


def test_settings_validation() -> None:
    for bad in (
        dict(min_nodes=0, max_nodes=1),
        dict(min_nodes=3, max_nodes=2),
        dict(min_nodes=1, max_nodes=1, join_timeout=0),
        dict(min_nodes=1, max_nodes=1, last_call_timeout=-1),
        dict(min_nodes=1, max_nodes=1, close_timeout=0),
        dict(min_nodes=1, max_nodes=1, lease_ttl=0),
    ):
        with pytest.raises(ValueError):
            RendezvousSettings(RUN, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RendezvousSettings("", 1, 1)


def test_state_round_trips_through_json() -> None:
    state = RendezvousState(
        run_id=RUN,
        round=4,
        complete=True,
        closed=True,
        closed_reason={"cause": "budget", "n": [1, 2]},
        participants={"b": 1, "a": 0},
        wait_list=frozenset({"c"}),
        redundancy_list=frozenset({"d"}),
        departed={"e": "succeeded"},
        lost=frozenset({"f"}),
    )
    raw = encode_state(state)
    assert json.loads(raw)["version"] == 1
    assert decode_state(raw, run_id=RUN) == state
    assert encode_state(decode_state(raw)) == raw  # deterministic


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x80\x04pickle", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"version": 2}', "version 2"),
        (b'{"version": 1}', "missing fields"),
    ],
)
def test_decode_rejects_garbage(raw: bytes, message: str) -> None:
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(raw, where="/k/rdzv/state")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": 1}, "unknown fields"),
        ({"run_id": "other"}, "belongs to run 'other'"),
        ({"round": True}, "'round'"),
        ({"round": -1}, "'round'"),
        ({"complete": 1}, "'complete'"),
        ({"deadline": "soon"}, "'deadline'"),
        ({"closed_reason": "x"}, "'closed_reason'"),
        ({"participants": {"a": -1}}, "'participants'"),
        ({"participants": ["a"]}, "'participants'"),
        ({"wait_list": ["a", "a"]}, "twice"),
        ({"wait_list": [3]}, "'wait_list'"),
        ({"participants": {"a": 0}, "wait_list": ["a"]}, "both"),
        ({"complete": True, "participants": {"a": 0, "b": 0}}, "distinct"),
        ({"departed": {"a": 1}}, "'departed'"),
    ],
)
def test_decode_rejects_malformed_fields(change: dict[str, object], message: str) -> None:
    doc = json.loads(encode_state(RendezvousState(run_id=RUN)))
    doc.update(change)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(json.dumps(doc).encode(), run_id=RUN)


def test_join_min_then_last_call_then_complete() -> None:
    s = settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    state = _drive(RendezvousState(run_id=RUN), "b", s, now=100.0)
    assert state.participants == {"b": 0} and state.deadline is None and not state.complete
    state = _drive(state, "a", s, now=101.0)
    assert state.deadline == 131.0 and not state.complete
    step = join_step(state, Clock(now=120.0), node="a", settings=s)
    assert step.action is Action.WAIT and step.wake_at == 131.0
    step = join_step(state, Clock(now=131.5), node="b", settings=s)
    assert step.action is Action.WRITE and step.state is not None
    state = step.state
    assert state.complete and state.participants == {"a": 0, "b": 1} and state.deadline is None
    assert join_step(state, Clock(now=132), node="a", settings=s).action is Action.FINISH


def test_max_nodes_completes_at_once_with_sorted_ranks() -> None:
    s = settings(min_nodes=1, max_nodes=3, last_call_timeout=1000)
    state = RendezvousState(run_id=RUN)
    for node in ("node-c", "node-a", "node-b"):
        state = _drive(state, node, s, now=0.0)
    assert state.complete
    assert state.ranked() == ("node-a", "node-b", "node-c")


def test_ranks_follow_natural_name_order() -> None:
    s = settings(min_nodes=1, max_nodes=12, last_call_timeout=1)
    names = [f"job-{i}" for i in range(12)]
    state = RendezvousState(run_id=RUN)
    for node in reversed(names):
        state = _drive(state, node, s, now=0.0)
    state = _drive(state, "job-0", s, now=5.0)  # last call over
    assert state.complete
    assert state.ranked() == tuple(names)
    assert [state.participants[n] for n in names] == list(range(12))


def test_late_nodes_wait_or_are_redundant() -> None:
    s = settings(min_nodes=1, max_nodes=2)
    state = RendezvousState(run_id=RUN, complete=True, participants={"a": 0})
    state = _drive(state, "x", s, now=0)
    assert state.wait_list == {"x"}
    assert join_step(state, Clock(now=0), node="x", settings=s).action is Action.WAIT
    full = RendezvousState(run_id=RUN, complete=True, participants={"a": 0, "b": 1})
    full = _drive(full, "y", s, now=0)
    assert full.redundancy_list == {"y"} and not full.wait_list
    # redundant nodes ignore the join timeout while the round is full ...
    step = join_step(full, Clock(now=0, timed_out=True, rollback_over=True), node="y", settings=s)
    assert step.action is Action.WAIT and step.untimed
    # ... and move on (timer restarted) once a participant is gone
    shrunk = remove_participant(full, "b", s, departure=None)
    step = join_step(shrunk, Clock(now=0), node="y", settings=s)
    assert step.action is Action.WRITE and step.restart_timer
    assert step.state is not None and "y" not in step.state.redundancy_list


def test_remove_participant_epilogue() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    done = RendezvousState(run_id=RUN, round=3, complete=True, participants={"a": 0, "b": 1})
    one = remove_participant(done, "a", s, departure="succeeded")
    assert one.departed == {"a": "succeeded"} and one.complete and one.round == 3
    two = remove_participant(one, "b", s, departure=None)
    assert (two.round, two.complete, two.participants, two.departed, two.lost) == (
        4,
        False,
        {},
        {},
        frozenset(),
    )
    forming = RendezvousState(run_id=RUN, participants={"a": 0, "b": 0}, deadline=50.0)
    assert remove_participant(forming, "a", s, departure="timeout").deadline is None


def test_exit_and_leave_steps() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    done = RendezvousState(run_id=RUN, complete=True, participants={"a": 0, "b": 1})
    step = exit_step(done, Clock(now=0), node="a", settings=s)
    assert step.state is not None and step.state.departed == {"a": "rejoin"}
    assert exit_step(done, Clock(now=0), node="z", settings=s).action is Action.FINISH
    waiting = dataclasses.replace(done, wait_list=frozenset({"w"}))
    step = leave_step(waiting, Clock(now=0), node="w", settings=s, reason="scale_down")
    assert step.state is not None and not step.state.wait_list
    step = leave_step(done, Clock(now=0, timed_out=True), node="a", settings=s, reason="x")
    assert step.action is Action.ERROR_TIMEOUT


def test_join_timeout_rolls_back_then_errors() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    forming = RendezvousState(run_id=RUN, participants={"a": 0})
    late = Clock(now=0, timed_out=True)
    step = join_step(forming, late, node="a", settings=s)
    assert step.action is Action.WRITE and step.state is not None and not step.state.participants
    assert join_step(step.state, late, node="a", settings=s).action is Action.ERROR_TIMEOUT
    too_late = Clock(now=0, timed_out=True, rollback_over=True)
    assert join_step(forming, too_late, node="a", settings=s).action is Action.ERROR_TIMEOUT


def test_closed_state_refuses_joins() -> None:
    closed = RendezvousState(run_id=RUN, closed=True, closed_reason={"why": "x"})
    s = settings()
    assert join_step(closed, Clock(now=0), node="a", settings=s).action is Action.ERROR_CLOSED


def test_sanitize_removes_nodes_without_alive_key() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    state = RendezvousState(
        run_id=RUN,
        complete=True,
        participants={"a": 0, "b": 1},
        wait_list=frozenset({"w"}),
        redundancy_list=frozenset({"r"}),
    )
    clean, dead = sanitize(state, {"a", "r"}, s)
    assert dead == ("b", "w")
    assert clean.participants == {"a": 0} and clean.lost == {"b"}
    assert not clean.wait_list and clean.redundancy_list == {"r"}
    assert sanitize(clean, {"a", "r"}, s) == (clean, ())


def test_evaluate_round_reasons_in_order() -> None:
    info = RendezvousInfo(2, 0, 3, ("a", "b", "c"))
    healthy = RendezvousState(
        run_id=RUN, round=2, complete=True, participants={"a": 0, "b": 1, "c": 2}
    )
    assert evaluate_round(healthy, info, "a", lease_lost=False).healthy
    s = settings(min_nodes=1, max_nodes=4)
    waiting = dataclasses.replace(healthy, wait_list=frozenset({"d"}))
    left = remove_participant(waiting, "c", s, departure="scale_down")
    lost = remove_participant(left, "b", s, departure=None)
    cases = [
        (waiting, False, ("nodes_waiting", ("d",))),
        (left, False, ("participant_left", ("c",))),
        (lost, False, ("participant_lost", ("b",))),
        (dataclasses.replace(lost, round=3), False, ("round_advanced", ())),
        (lost, True, ("lease_lost", ("a",))),
        (dataclasses.replace(lost, closed=True), True, ("closed", ())),
    ]
    for state, lease_lost, (reason, nodes) in cases:
        check = evaluate_round(state, info, "a", lease_lost=lease_lost)
        assert (check.healthy, check.reason, check.nodes) == (False, reason, nodes)
    assert evaluate_round(lost, info, "a", lease_lost=False).departures == (("c", "scale_down"),)


def test_a_participant_that_succeeded_closes_the_rendezvous_as_finished() -> None:
    """torch's agent closes the rendezvous once its worker group succeeded: the training
    is done, and no node may form a round to train again (found on two real nodes: a
    node back from a partition just after its peer finished trained the last epochs
    again, alone, from a persisted step)."""
    s = settings(min_nodes=1, max_nodes=3)
    done = RendezvousState(run_id=RUN, round=4, complete=True, participants={"a": 0, "b": 1},
                           wait_list=frozenset({"w"}))  # fmt: skip
    step = leave_step(done, Clock(now=0), node="b", settings=s, reason="succeeded")
    assert step.state is not None and step.state.closed
    assert finished_in(step.state.closed_reason) == ("b", 4)
    assert step.state.departed == {"b": "succeeded"}
    info = RendezvousInfo(4, 0, 2, ("a", "b"))
    # the round's other participant finishes its own work (the waiter changes nothing)
    assert evaluate_round(step.state, info, "a", lease_lost=False).healthy
    assert evaluate_round(step.state, info, "a", lease_lost=True).reason == "lease_lost"
    older = RendezvousInfo(3, 0, 2, ("a", "b"))
    assert evaluate_round(step.state, older, "a", lease_lost=False).reason == "closed"
    for node in ("w", "z"):  # a waiter, a newcomer: nothing left to train
        assert (
            join_step(step.state, Clock(now=0), node=node, settings=s).action is Action.ERROR_CLOSED
        )
    # a second success keeps the first reason; other departures close nothing
    again = leave_step(step.state, Clock(now=0), node="a", settings=s, reason="succeeded")
    assert again.state is not None and finished_in(again.state.closed_reason) == ("b", 4)
    for reason in ("scale_down", "shutdown", "rejoin"):
        other = leave_step(done, Clock(now=0), node="b", settings=s, reason=reason)
        assert other.state is not None and not other.state.closed, reason
    forming = dataclasses.replace(done, complete=False)  # trained nothing in this round
    left = leave_step(forming, Clock(now=0), node="b", settings=s, reason="succeeded")
    assert left.state is not None and not left.state.closed
    # a failure's close still ends every round
    failed = dataclasses.replace(done, closed=True, closed_reason={"cause": "hang", "round": 4})
    assert evaluate_round(failed, info, "a", lease_lost=False).reason == "closed"


def test_only_a_finished_reason_reads_as_finished() -> None:
    assert finished_in(finished_reason("n-1", 7)) == ("n-1", 7)
    crafted: list[object] = [
        None, {}, [], "finished", {"cause": "worker_failure", "round": 3, "node": "a"},
        {"finished": 1}, {"finished": []}, {"finished": {"node": "a"}},
        {"finished": {"node": 1, "round": 0}}, {"finished": {"node": "a", "round": True}},
        {"finished": {"node": "a", "round": 1.5}}, {"finished": {"node": "a", "round": "1"}},
    ]  # fmt: skip
    assert [finished_in(r) for r in crafted] == [None] * len(crafted)


# ======================================================================= on a real etcd


class Cluster:
    """Rendezvous nodes of one job, each with its own etcd client."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        self.endpoint = endpoint
        self.keys = Keys(prefix)
        self.admin = EtcdClient([endpoint])
        self._stores: list[EtcdClient] = [self.admin]
        self.handlers: list[EtcdRendezvousHandler] = []

    def node(self, name: str, s: RendezvousSettings) -> EtcdRendezvousHandler:
        store = EtcdClient([self.endpoint])
        self._stores.append(store)
        handler = EtcdRendezvousHandler(store, self.keys, name, s)
        self.handlers.append(handler)
        return handler

    def state(self) -> RendezvousState:
        got = self.admin.get(self.keys.rdzv_state)
        assert got is not None
        return decode_state(got[0])

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
        for store in self._stores:
            store.close()


@pytest.fixture
def cluster(etcd_endpoint: str, job_prefix: str) -> Iterator[Cluster]:
    c = Cluster(etcd_endpoint, job_prefix)
    yield c
    c.close()


class Joiner:
    """Runs ``next_rendezvous`` in a thread and keeps the outcome."""

    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self.handler = handler
        self.info: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self.took = 0.0
        self._thread = threading.Thread(target=self._run, name=f"join-{handler.node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.info = self.handler.next_rendezvous()
        except BaseException as exc:  # handed to the test
            self.error = exc
        self.took = time.monotonic() - started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 60.0) -> RendezvousInfo:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.handler.node} still joining"
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def join_all(handlers: list[EtcdRendezvousHandler], timeout: float = 60.0) -> list[RendezvousInfo]:
    joiners = [Joiner(h) for h in handlers]
    return [j.result(timeout) for j in joiners]


def check_reason(handler: EtcdRendezvousHandler, info: RendezvousInfo) -> Callable[[], str]:
    return lambda: handler.check_round(info).reason


def test_three_nodes_complete_one_round(cluster: Cluster) -> None:
    s = settings(min_nodes=3, max_nodes=3, last_call_timeout=30)
    nodes = [cluster.node(f"job-{i}", s) for i in (2, 0, 1)]
    started = time.monotonic()
    infos = join_all(nodes)
    took = time.monotonic() - started
    print(f"3-node rendezvous took {took * 1000:.1f} ms")
    assert {i.round for i in infos} == {0}
    assert sorted(i.group_rank for i in infos) == [0, 1, 2]
    assert all(i.group_world_size == 3 for i in infos)
    assert {i.participants for i in infos} == {("job-0", "job-1", "job-2")}
    for handler, info in zip(nodes, infos, strict=True):
        assert info.participants[info.group_rank] == handler.node
        assert handler.check_round(info).healthy
    assert took < 10  # max_nodes completes at once, not after the 30 s last call


def test_last_call_completes_between_min_and_max(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=4, last_call_timeout=1.0)
    started = time.monotonic()
    infos = join_all([cluster.node("a", s), cluster.node("b", s)])
    took = time.monotonic() - started
    assert [i.group_world_size for i in infos] == [2, 2]
    assert 0.9 <= took < 10, took


def test_late_node_waits_and_everyone_rejoins(cluster: Cluster) -> None:
    s = settings(min_nodes=3, max_nodes=4, last_call_timeout=0.5)
    first = [cluster.node(f"n{i}", s) for i in range(3)]
    infos = join_all(first)
    late = Joiner(cluster.node("n3", s))
    wait_for(lambda: first[0].num_nodes_waiting() == 1, 30, what="n3 on the wait list")
    for handler, info in zip(first, infos, strict=True):
        check = handler.check_round(info)
        assert (check.healthy, check.reason, check.nodes) == (False, "nodes_waiting", ("n3",))
    assert not late.done()
    new = join_all(first)
    new.append(late.result())
    assert {i.round for i in new} == {infos[0].round + 1}
    assert sorted(i.group_rank for i in new) == [0, 1, 2, 3]
    assert {i.group_world_size for i in new} == {4}
    assert all(h.check_round(i).healthy for h, i in zip([*first, late.handler], new, strict=True))


def test_dead_node_is_removed_and_survivors_rejoin(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=3, last_call_timeout=0.5, lease_ttl=2)
    nodes = [cluster.node(f"n{i}", s) for i in range(3)]
    infos = join_all(nodes)
    nodes[2].shutdown()  # the lease goes, no leave(): as if the sidecar was killed
    assert nodes[0].wait_for_change(20)
    started = time.monotonic()
    for handler, info in zip(nodes[:2], infos[:2], strict=True):
        check = handler.check_round(info)
        assert (check.reason, check.nodes) == ("participant_lost", ("n2",))
    print(f"dead node noticed {1000 * (time.monotonic() - started):.1f} ms after the wake-up")
    new = join_all(nodes[:2])
    assert {i.round for i in new} == {infos[0].round + 1}
    assert {i.participants for i in new} == {("n0", "n1")}


def test_expired_lease_counts_as_lost(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2, lease_ttl=1)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, info_b = join_all([a, b])
    assert b.state.lease is not None
    b.state.lease.stop_keep_alive()  # hung or partitioned: the lease expires after its TTL
    wait_for(lambda: check_reason(a, info_a)() == "participant_lost", 20, what="b lost")
    assert a.check_round(info_a).nodes == ("b",)
    wait_for(lambda: b.lease_lost or check_reason(b, info_b)() == "lease_lost", 20)
    assert b.check_round(info_b).reason == "lease_lost"
    # b comes back with a fresh lease and both form the next round
    new = join_all([a, b])
    assert {i.group_world_size for i in new} == {2} and not b.lease_lost


def test_leave_is_reported_as_participant_left(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=3, last_call_timeout=0.3)
    nodes = [cluster.node(f"n{i}", s) for i in range(3)]
    infos = join_all(nodes)
    nodes[1].leave("scale_down")
    nodes[1].shutdown()  # the lease goes too, but the departure was recorded first
    for handler, info in ((nodes[0], infos[0]), (nodes[2], infos[2])):
        check = handler.check_round(info)
        assert (check.reason, check.nodes) == ("participant_left", ("n1",))
        assert check.departures == (("n1", "scale_down"),)
    new = join_all([nodes[0], nodes[2]])
    assert {i.participants for i in new} == {("n0", "n2")}
    assert cluster.state().departed == {} and cluster.state().lost == frozenset()


def test_a_node_with_a_departure_notice_counts_as_left_not_lost(cluster: Cluster) -> None:
    s = settings(min_nodes=3, max_nodes=3)
    nodes = [cluster.node(f"n{i}", s) for i in range(3)]
    infos = join_all(nodes)
    # The operator scales n2 down: it posts the notice, then n2 dies without leaving.
    cluster.admin.put(cluster.keys.departing("n2"), b"scale_down")
    nodes[2].shutdown()
    check = nodes[0].check_round(infos[0])
    assert (check.reason, check.nodes) == ("participant_left", ("n2",))
    assert check.departures == (("n2", "scale_down"),)
    assert cluster.state().lost == frozenset()


def test_a_peer_that_succeeded_does_not_end_the_round(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, _ = join_all([a, b])
    b.leave("succeeded")
    b.shutdown()
    check = a.check_round(info_a)
    assert (check.healthy, check.reason) == (True, "")
    assert check.departures == (("b", "succeeded"),)


def test_a_node_joining_after_the_training_finished_ends_without_a_round(
    cluster: Cluster,
) -> None:
    s = settings(min_nodes=1, max_nodes=3, last_call_timeout=0.3)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, info_b = join_all([a, b])
    waiter = Joiner(cluster.node("c", s))  # back from a partition, or a scale-up
    wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="c on the wait list")
    assert a.check_round(info_a).reason == "nodes_waiting"
    b.leave("succeeded")  # every worker of b exited 0
    b.shutdown()
    assert a.check_round(info_a).healthy  # a finishes its own work
    with pytest.raises(RendezvousClosedError) as err:
        waiter.result()
    assert finished_in(err.value.reason) == ("b", info_b.round)
    with pytest.raises(RendezvousClosedError):
        cluster.node("d", s).next_rendezvous()
    a.leave("succeeded")
    assert finished_in(cluster.state().closed_reason) == ("b", info_b.round)


def test_close_stops_everyone_with_the_reason(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2)
    a, b = cluster.node("a", s), cluster.node("b", s)
    _, info_b = join_all([a, b])
    assert a.closed_reason() is None
    reason = {"cause": "restart_budget_exhausted", "round": 0}
    a.close(reason)
    a.close({"cause": "second close keeps the first reason"})
    assert b.check_round(info_b).reason == "closed"
    assert b.closed_reason() == reason
    for handler in (a, b, cluster.node("c", s)):
        with pytest.raises(RendezvousClosedError) as err:
            handler.next_rendezvous()
        assert err.value.reason == reason


def test_join_timeout(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2, join_timeout=1.0)
    lonely = cluster.node("lonely", s)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"did not finish within 1\.0s"):
        lonely.next_rendezvous()
    assert 1.0 <= time.monotonic() - started < 6
    assert "lonely" not in cluster.state().participants  # rolled back


def test_corrupt_state_is_replaced_but_another_runs_state_raises(cluster: Cluster) -> None:
    s = settings()
    handler = cluster.node("a", s)
    cluster.admin.put(cluster.keys.rdzv_state, b"\x80\x04\x95not json")
    info = handler.next_rendezvous()  # read as a fresh state, written over the garbage
    assert handler.corrupt_states == 1
    assert cluster.state().participants == {"a": 0} and info.round == cluster.state().round
    other_run = encode_state(RendezvousState(run_id="someone-else"))
    cluster.admin.put(cluster.keys.rdzv_state, other_run)
    with pytest.raises(RendezvousStateError, match="belongs to run 'someone-else'"):
        handler.num_nodes_waiting()


def test_redundant_node_steps_in_when_a_participant_dies(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2, last_call_timeout=0.5, join_timeout=2.0)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, _ = join_all([a, b])
    spare = Joiner(cluster.node("c", s))
    wait_for(lambda: "c" in cluster.state().redundancy_list, 30, what="c redundant")
    time.sleep(2.5)  # longer than join_timeout: a redundant node is not timed out
    assert not spare.done()
    assert a.num_nodes_waiting() == 0 and a.check_round(info_a).healthy
    b.shutdown()
    wait_for(lambda: check_reason(a, info_a)() == "participant_lost", 20)
    wait_for(lambda: a.num_nodes_waiting() == 1, 20, what="c on the wait list")
    new = [Joiner(a).result(), spare.result()]
    assert {i.participants for i in new} == {("a", "c")}


def test_shutdown_is_final(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=1)
    a = cluster.node("a", s)
    a.next_rendezvous()
    a.shutdown()
    a.shutdown()  # idempotent
    assert a.lease_lost
    assert cluster.admin.get(cluster.keys.alive("a")) is None
    with pytest.raises(RendezvousError, match="shut down"):
        a.next_rendezvous()


def test_restarted_node_takes_its_old_place(cluster: Cluster) -> None:
    """A sidecar restarted in the same Pod (same node name) rejoins cleanly."""
    s = settings(min_nodes=2, max_nodes=2, last_call_timeout=0.5)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, _ = join_all([a, b])
    b.shutdown()
    b2 = cluster.node("b", s)
    wait_for(lambda: a.check_round(info_a).reason in ("participant_lost", "participant_left"), 20)
    new = join_all([a, b2])
    assert {i.participants for i in new} == {("a", "b")}


def test_wait_for_change_is_event_driven(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=3, last_call_timeout=0.3)
    a = cluster.node("a", s)
    info = a.next_rendezvous()
    assert a.check_round(info).healthy
    assert a.wait_for_change(0.2) is False
    late = Joiner(cluster.node("b", s))
    started = time.monotonic()
    assert a.wait_for_change(20) is True
    assert time.monotonic() - started < 5
    wait_for(lambda: check_reason(a, info)() == "nodes_waiting", 10)
    join_all([a])
    late.result()


@pytest.mark.parametrize("incarnation", ["", "uid-1"])
def test_join_rides_out_an_etcd_outage(
    cluster: Cluster, etcd_endpoint: str, incarnation: str
) -> None:
    """A node cut off from etcd keeps trying until its join deadline, then joins. On
    Kubernetes (a Pod uid) the fence check it begins with rides the outage out too: its
    one read used to fail the Pod after the client's timeout (the partition test's 60 s
    cut, where the node went back to the rendezvous while still cut off)."""
    s = dataclasses.replace(settings(min_nodes=2, max_nodes=2, join_timeout=60),
                            incarnation=incarnation)  # fmt: skip
    proxy = OutageProxy(etcd_endpoint)
    proxy.up()
    b_store = EtcdClient([proxy.endpoint], timeout=0.5)
    try:
        b = EtcdRendezvousHandler(b_store, cluster.keys, "b", s)
        proxy.down()
        late = Joiner(b)
        early = Joiner(cluster.node("a", s))
        wait_for(lambda: cluster.admin.get(cluster.keys.rdzv_state) is not None, 20)
        wait_for(lambda: "a" in cluster.state().participants, 20, what="a joined")
        wait_for(lambda: b_store.request_counts().get("errors", 0) >= 2, 20,
                 what="b failing its etcd calls")  # fmt: skip
        assert not late.done() and not early.done()
        proxy.up()
        infos = [early.result(), late.result()]
        assert {i.participants for i in infos} == {("a", "b")}
    finally:
        b.shutdown()
        b_store.close()
        proxy.down()


@pytest.mark.parametrize("incarnation", ["", "uid-1"])
def test_leave_gives_up_soon_when_etcd_is_away(
    cluster: Cluster, etcd_endpoint: str, incarnation: str
) -> None:
    """A departure rides out an etcd outage for LEAVE_OUTAGE_TIMEOUT s, not close_timeout
    (on Kubernetes, with a Pod uid, the fence it reads first fails too and is passed)."""
    s = dataclasses.replace(
        settings(min_nodes=1, max_nodes=1, close_timeout=60), incarnation=incarnation
    )
    proxy = OutageProxy(etcd_endpoint)
    proxy.up()
    store = EtcdClient([proxy.endpoint], timeout=0.5)
    handler = EtcdRendezvousHandler(store, cluster.keys, "a", s)
    try:
        handler.next_rendezvous()
        proxy.down()
        started = time.monotonic()
        with pytest.raises(EtcdError):
            handler.leave("shutdown")
        assert LEAVE_OUTAGE_TIMEOUT <= time.monotonic() - started < 30  # not 60
    finally:
        handler.shutdown()
        store.close()
        proxy.down()


def test_join_gives_up_when_etcd_stays_away(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=1, join_timeout=1.0)
    with EtcdClient(["127.0.0.1:1"], timeout=0.3) as dead:
        handler = EtcdRendezvousHandler(dead, cluster.keys, "a", s)
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as err:  # torch's term, at the boundary
            handler.next_rendezvous()
        assert 1.0 <= time.monotonic() - started < 4
        assert isinstance(err.value.__cause__, EtcdUnavailable)  # ridden out until the deadline
        assert isinstance(err.value, (RendezvousError, EtcdError))


def test_a_fenced_incarnation_does_not_join_and_another_of_its_name_does(cluster: Cluster) -> None:
    """The operator declared Pod uid-old lost (its Node dead) and created another Pod of
    the name: should the old one's sidecar come back, it refuses to join; the new one
    (another uid) and a node without a uid (local mode) join as always."""
    cluster.admin.put(cluster.keys.fenced("uid-old"), encode_departure("node n-3 lost"))
    old = cluster.node("a", dataclasses.replace(settings(max_nodes=2), incarnation="uid-old"))
    with pytest.raises(RendezvousFencedError, match=r"a: this Pod \(uid uid-old\) was declared "
                       r"lost by the operator \(node n-3 lost\)"):  # fmt: skip
        old.next_rendezvous()
    assert cluster.admin.get(cluster.keys.rdzv_state) is None  # it wrote nothing
    new = cluster.node("a", dataclasses.replace(settings(max_nodes=1), incarnation="uid-new"))
    assert new.next_rendezvous().group_world_size == 1
    # the fenced one's leave and close touch nothing of the new incarnation's round
    old.leave("shutdown")
    old.close({"by": "a lost Pod"})
    assert cluster.state().participants == {"a": 0} and not cluster.state().closed
    # an unreadable fence still fences
    cluster.admin.put(cluster.keys.fenced("uid-x"), b"\xff" * 3)
    odd = cluster.node("b", dataclasses.replace(settings(max_nodes=2), incarnation="uid-x"))
    with pytest.raises(RendezvousFencedError, match=r"uid-x\) was declared lost"):
        odd.next_rendezvous()
