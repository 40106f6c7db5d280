"""The in-process iteration record on a real etcd (fencing by compare-and-set), and the
termination barrier's verdict over ready keys."""

from __future__ import annotations

import threading

import pytest

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_sidecar.inprocess.record import (
    MAX_ITERATION,
    Advance,
    AdvanceOutcome,
    IterationRecord,
    IterationRecordError,
    ReadyRecord,
    RestartCause,
    advance_iteration,
    decode_iteration_record,
    decode_ready,
    encode_iteration_record,
    encode_ready,
)
from kelastic_sidecar.inprocess.round import RoundContext, barrier_verdict, go_env, go_verdict


def _advance(
    store: EtcdClient, key: str, faulted: int, budget: int = 10, node: str = "n"
) -> Advance:
    out = advance_iteration(
        store, key, faulted, budget, round_=1, cause="exception", node=node, rank=0,
        message="boom", now=1.0,
    )  # fmt: skip
    return out.kind


def test_round_trip_and_defaults() -> None:
    record = IterationRecord(4, 2, 3, "soft_timeout", "job-1", 7, "no progress in 60s", 1.5)
    assert decode_iteration_record(encode_iteration_record(record)) == record
    ready = ReadyRecord(1, "10.0.0.2", 29500, 4)
    assert decode_ready(encode_ready(ready)) == ready
    assert decode_ready(b'{"group_rank": 1, "addr": "a", "port": 1}').round == -1  # unstated
    for bad in (b"[]", b'{"iteration": 1}', b'{"iteration": true, "round": 0}', b"\xff"):
        with pytest.raises(IterationRecordError):
            decode_iteration_record(bad)


def test_racing_nodes_advance_an_iteration_once(store: EtcdClient, job_prefix: str) -> None:
    key = contract.Keys(job_prefix).inprocess_iteration
    outcomes: list[Advance] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def report(i: int) -> None:
        start.wait()
        kind = _advance(store, key, 0, node=f"n{i}")
        with lock:
            outcomes.append(kind)

    threads = [threading.Thread(target=report, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(o.value for o in outcomes) == ["advanced"] + ["superseded"] * 7
    got = store.get(key)
    assert got is not None
    record = decode_iteration_record(got[0])
    assert (record.iteration, record.restarts) == (1, 1)
    # a stale report of iteration 0 spends nothing; the next iteration's fault does
    assert _advance(store, key, 0) is Advance.SUPERSEDED
    assert _advance(store, key, 1) is Advance.ADVANCED


def test_budget_and_a_record_behind(store: EtcdClient, job_prefix: str) -> None:
    key = contract.Keys(job_prefix).inprocess_iteration
    assert _advance(store, key, 0, budget=1) is Advance.ADVANCED
    assert _advance(store, key, 1, budget=1) is Advance.EXHAUSTED
    # a record behind the faulted iteration (rewritten by hand) moves past it, restarts kept
    store.put(key, encode_iteration_record(IterationRecord(iteration=0, restarts=1)))
    out: AdvanceOutcome = advance_iteration(
        store, key, 5, 3, round_=2, cause="exception", node="n", rank=1, message="", now=0.0
    )
    assert out.kind is Advance.ADVANCED and out.record is not None
    assert (out.record.iteration, out.record.restarts, out.record.round) == (6, 2, 2)
    # a corrupt record met by a fault is replaced (it was a process restart
    # for every fault until the next round), the caller's restarts counted, not refilled
    store.put(key, b"{corrupt")
    put = store.get(key)[1]  # type: ignore[index]
    fixed = advance_iteration(
        store, key, 6, 3, round_=2, cause="exception", node="n", rank=1, message="", now=0.0,
        known_restarts=1,
    )  # fmt: skip
    assert fixed.kind is Advance.ADVANCED and fixed.record is not None
    assert (fixed.record.iteration, fixed.record.restarts) == (7, 2)
    assert "not JSON" in fixed.replaced and fixed.replaced_revision == put
    got = store.get(key)
    assert got is not None and decode_iteration_record(got[0]) == fixed.record
    # a record no writer can advance (iteration at its bound): refused, nothing written
    top = IterationRecord(iteration=MAX_ITERATION, round=1, restarts=0, time=1.0)
    store.put(key, encode_iteration_record(top))
    refused = advance_iteration(
        store, key, MAX_ITERATION, 3, round_=2, cause="exception", node="n", rank=1,
        message="", now=0.0,
    )  # fmt: skip
    assert refused.kind is Advance.CORRUPT and "2147483647" in refused.error
    got = store.get(key)
    assert got is not None and decode_iteration_record(got[0]) == top


def test_a_lost_node_takes_over_a_free_restart_into_its_iteration(
    store: EtcdClient, job_prefix: str
) -> None:
    # The lost node's own sidecar may move the record first as a change that spends
    # nothing (membership); the node that sees the loss charges that restart instead of
    # aborting again: one compare-and-set, the iteration unchanged.
    key = contract.Keys(job_prefix).inprocess_iteration

    def lost(faulted: int, budget: int = 3) -> AdvanceOutcome:
        return advance_iteration(
            store, key, faulted, budget, round_=2, cause=RestartCause.NODE_LOST, node="n0",
            rank=-1, message="node n1 lost", now=0.0, take_over=True,
        )  # fmt: skip

    free = IterationRecord(iteration=4, round=2, restarts=1, cause=RestartCause.MEMBERSHIP)
    store.put(key, encode_iteration_record(free))
    out = lost(3)
    assert out.kind is Advance.TAKEN_OVER and out.record is not None
    assert (out.record.iteration, out.record.restarts, out.record.cause) == (4, 2, "node_lost")
    got = store.get(key)
    assert got is not None and decode_iteration_record(got[0]) == out.record
    assert got[1] == out.revision
    # charged already (no longer a free restart): superseded, nothing written
    assert lost(3).kind is Advance.SUPERSEDED
    assert store.get(key) == got
    # a free restart with the budget spent: exhausted, nothing written
    store.put(key, encode_iteration_record(free))
    assert lost(3, budget=1).kind is Advance.EXHAUSTED
    # without take_over a free restart is only superseded
    plain = advance_iteration(
        store, key, 3, 3, round_=2, cause=RestartCause.NODE_LOST, node="n0", rank=-1,
        message="", now=0.0,
    )  # fmt: skip
    assert plain.kind is Advance.SUPERSEDED and plain.record == free


def _ctx(round_: int = 3, participants: tuple[str, ...] = ("a", "b")) -> RoundContext:
    return RoundContext(
        round=round_, group_rank=1, group_world_size=2, nproc=1,
        envs={0: {contract.RANK: "1", contract.MASTER_PORT: "1"}}, pod_ip="10.0.0.2",
        participants=participants,
    )  # fmt: skip


def test_the_barrier_counts_only_this_rounds_participants() -> None:
    prefix = "/p/inprocess/ready/4/"
    ctx = _ctx()

    def val(group_rank: int, round_: int = 3, port: int = 29500) -> tuple[bytes, int]:
        return encode_ready(ReadyRecord(group_rank, f"10.0.0.{group_rank + 1}", port, round_)), 1

    assert barrier_verdict({prefix + "a": val(0)}, prefix, ctx).master is None
    stale = {prefix + "a": val(0), prefix + "b": val(1, round_=2)}  # b's key of round 2
    assert barrier_verdict(stale, prefix, ctx).ready == {0}
    wrong = {prefix + "a": val(0), prefix + "c": val(1)}  # c is not b
    assert barrier_verdict(wrong, prefix, ctx).master is None
    corrupt = {prefix + "a": val(0), prefix + "b": (b'{"port": 1e999}', 1)}
    verdict = barrier_verdict(corrupt, prefix, ctx)
    assert verdict.master is None and len(verdict.corrupt) == 1
    done = barrier_verdict({prefix + "a": val(0, port=4242), prefix + "b": val(1)}, prefix, ctx)
    assert done.master == ReadyRecord(0, "10.0.0.1", 4242, 3)
    env = go_env(ctx, 0, done.master, 4)
    assert env[contract.MASTER_ADDR] == "10.0.0.1" and env[contract.MASTER_PORT] == "4242"
    assert env[contract.RANK] == "1" and env[contract.ENV_INPROCESS_ITERATION] == "4"
    assert contract.ENV_CHECKPOINT_STEP not in env  # no checkpoints: none set
    # participants unknown: the group ranks the keys state count
    anon = barrier_verdict({prefix + "x": val(0), prefix + "y": val(1)}, prefix, _ctx(3, ()))
    assert anon.master is not None


def test_a_rank_started_mid_round_loads_no_agreed_step() -> None:
    """A dead rank started again (the hybrid rung) gets the go's env: its peers hold the
    state in process; the step agreed at the round's start may be gone from its slots."""
    ctx = _ctx()
    ctx.envs[0].update({contract.ENV_CHECKPOINT_STEP: "17",
                        contract.ENV_CHECKPOINT_TIER: contract.CHECKPOINT_TIER_DISK})  # fmt: skip
    env = go_env(ctx, 0, ReadyRecord(0, "10.0.0.1", 4242, 3), 5)
    assert env[contract.ENV_CHECKPOINT_STEP] == contract.CHECKPOINT_STEP_NONE
    assert contract.ENV_CHECKPOINT_TIER not in env
    assert ctx.envs[0][contract.ENV_CHECKPOINT_STEP] == "17"  # the round's own is kept


def test_the_earliest_fault_names_a_restart_another_node_recorded_first(
    store: EtcdClient, job_prefix: str
) -> None:
    """Two nodes report faults of one iteration while etcd is stalled; when it answers,
    the node with the later fault (a peer's "Connection closed by peer", a consequence of
    the first) may win the compare-and-set. The loser's fault came first: it names the
    restart (cause, node, rank, message, time), in one more compare-and-set that keeps the
    iteration and the restarts spent; a later fault never renames it."""
    key = contract.Keys(job_prefix).inprocess_iteration

    def fault(node: str, rank: int, message: str, now: float, faulted: int = 0) -> AdvanceOutcome:
        return advance_iteration(
            store, key, faulted, 10, round_=0, cause=RestartCause.EXCEPTION, node=node, rank=rank,
            message=message, now=now,
        )  # fmt: skip

    first = fault("steps-1", 2, "RuntimeError: Connection closed by peer", 1000.3)
    assert first.kind is Advance.ADVANCED
    renamed = fault("steps-0", 1, "ValueError: boom", 1000.2)  # raised 0.1 s before
    assert renamed.kind is Advance.SUPERSEDED and renamed.record is not None
    got = store.get(key)
    assert got is not None
    stored = decode_iteration_record(got[0])
    assert stored == renamed.record and got[1] == renamed.revision
    assert (stored.iteration, stored.restarts) == (1, 1)  # one restart, spent once
    assert (stored.node, stored.rank, stored.message, stored.time) == (
        "steps-0", 1, "ValueError: boom", 1000.2,
    )  # fmt: skip
    # a later fault of the same iteration changes nothing
    later = fault("steps-1", 3, "RuntimeError: Connection reset by peer", 1000.4)
    assert later.kind is Advance.SUPERSEDED and store.get(key) == got
    # nor, once the record moved on to the next iteration, a stale report of an earlier
    # iteration's fault, however early
    assert fault("steps-1", 2, "OSError: next", 1010.0, faulted=1).kind is Advance.ADVANCED
    moved = store.get(key)
    assert fault("steps-0", 0, "early", 999.0).kind is Advance.SUPERSEDED
    assert store.get(key) == moved


def test_a_go_counts_only_from_group_rank_0_of_this_round() -> None:
    key, ctx = "/p/inprocess/go/4", _ctx()
    master = ReadyRecord(0, "10.0.0.1", 4242, 3)
    assert go_verdict({}, key, ctx) == (None, None)
    assert go_verdict({key: (encode_ready(master), 9)}, key, ctx) == (master, None)
    other = {"/p/inprocess/go/3": (encode_ready(master), 9)}  # another iteration's go
    assert go_verdict(other, key, ctx) == (None, None)
    ended = ReadyRecord(0, "10.0.0.1", 4242, 2)  # the ended round's: a carried node's wait
    assert go_verdict({key: (encode_ready(ended), 9)}, key, ctx) == (None, None)
    not_zero = ReadyRecord(1, "10.0.0.2", 4242, 3)  # only group rank 0 writes a go
    assert go_verdict({key: (encode_ready(not_zero), 9)}, key, ctx) == (None, None)
    for raw in (
        b"",
        b"[]",
        b'{"port": 1e999}',
        b'{"group_rank": NaN}',
        b"[" * 10000,
        b'{"group_rank": 0, "addr": "a", "port": 99999999999999999999, "round": 3}',
    ):
        got, error = go_verdict({key: (raw, 9)}, key, ctx)
        assert got is None and error is not None and key in error, raw[:40]
