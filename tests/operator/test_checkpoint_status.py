"""The job's ``status.lastCheckpoint`` and ``CheckpointNotRestored`` Event: what the current
round's workers restored from the in-memory checkpoints, read from the same etcd values
the sidecars agree on (``checkpoints/<node>`` and the rendezvous state, each by its one
codec). The sidecars' own part: ``tests/sidecar/test_checkpoint_records.py``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from kelastic import contract
from kelastic.etcd_values import encode_state
from kelastic.etcd_values.checkpoints import CheckpointsDoc, encode_checkpoints
from kelastic_operator.etcd_view import status_keys, view_from_keys
from kelastic_operator.reconcile import reconcile

from .test_reconcile import T0, job, pod

PREFIX = contract.job_prefix("ns", "j", "uid-1")
KEYS = contract.Keys(PREFIX)
PODS = [pod(0), pod(1)]


def _state(round_: int, participants: dict[str, int], complete: bool = True) -> bytes:
    return encode_state({
        "run_id": "uid-1", "round": round_, "complete": complete, "deadline": None,
        "closed": False, "closed_reason": None, "participants": participants, "wait_list": [],
        "redundancy_list": [], "departed": {}, "lost": [],
    })  # fmt: skip


def _kv(round_: int, records: dict[str, Any], participants: dict[str, int] | None = None
        ) -> dict[str, bytes]:  # fmt: skip
    kv = {KEYS.rdzv_state: _state(round_, participants or {"j-0": 0, "j-1": 1})}
    for node, record in records.items():
        raw = record if isinstance(record, bytes) else encode_checkpoints(record)
        kv[KEYS.checkpoint(node)] = raw
    return kv


def _doc(ranks: dict[int, tuple[int, ...]], time: float = 1767268800.0, job: str = "uid-1"
         ) -> CheckpointsDoc:  # fmt: skip
    return CheckpointsDoc(job, ranks, time)


def test_a_change_of_a_nodes_record_wakes_the_job() -> None:
    assert KEYS.checkpoints_prefix in status_keys(PREFIX)


def test_the_restored_step_shows_in_the_status_in_group_rank_order() -> None:
    # 2 workers per node: j-1 holds ranks 2, 3 (group rank 1), j-0 ranks 0, 1
    kv = _kv(4, {"j-0": _doc({0: (8, 7), 1: (8, 7)}), "j-1": _doc({2: (8, 7), 3: (8, 7)},
                                                                    1767268805.0)})  # fmt: skip
    plan = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2))
    last = plan.status.last_checkpoint
    assert last is not None
    assert (last.round, last.step, last.tier, last.time) == (4, 8, "memory", "2026-01-01T12:00:05Z")
    assert not [e for e in plan.events if e.reason == "CheckpointNotRestored"]
    # the same records, group ranks swapped: j-1 would run ranks 0, 1, which it never held
    swapped = view_from_keys(PREFIX, _kv(5, {"j-0": _doc({0: (8,), 1: (8,)}),
                                             "j-1": _doc({2: (8,), 3: (8,)})},
                                         {"j-0": 1, "j-1": 0}), 2)  # fmt: skip
    assert swapped.restore is not None and swapped.restore.step is None


def test_a_held_step_not_every_rank_has_is_announced_once_per_round() -> None:
    # j-1's Pod was replaced: its new slots hold nothing, j-0's still do
    kv = _kv(6, {"j-0": _doc({0: (9,), 1: (9,)}), "j-1": _doc({})})
    first = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2))
    last = first.status.last_checkpoint
    assert last is not None and (last.round, last.step, last.tier) == (6, None, "none")
    assert [(e.type, e.reason, e.message) for e in first.events
            if e.reason == "CheckpointNotRestored"] == [
        ("Warning", "CheckpointNotRestored", "round 6: no checkpoint step every one of its 4 "
         "ranks holds: the workers start without one")]  # fmt: skip
    again = reconcile(job(**first.status.as_patch()), PODS, T0 + timedelta(seconds=5),
                      view_from_keys(PREFIX, kv, 2))  # fmt: skip
    assert not [e for e in again.events if e.reason == "CheckpointNotRestored"]
    assert again.status.last_checkpoint == last


def test_a_fresh_start_or_a_job_without_checkpoints_shows_nothing() -> None:
    for kv in (_kv(0, {"j-0": _doc({}), "j-1": _doc({})}), _kv(0, {})):
        plan = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2))
        assert plan.status.last_checkpoint is None
        assert not [e for e in plan.events if e.reason == "CheckpointNotRestored"]
    # a round not complete yet says nothing of its records
    incomplete = {**_kv(1, {"j-0": _doc({0: (3,), 1: (3,)})}),
                  KEYS.rdzv_state: _state(1, {"j-0": 0}, complete=False)}  # fmt: skip
    assert view_from_keys(PREFIX, incomplete, 2).restore is None


@pytest.mark.parametrize(
    "record",
    [
        b"{",  # not JSON
        b'{"version": 2, "job": "uid-1", "ranks": {}, "time": 1}',  # another version's
        b'{"version": 1, "job": "uid-1", "ranks": {"0": [1e309]}, "time": 1}',
        b'{"version": 1, "job": "uid-1", "ranks": {"0": [' + b"9" * 400 + b"]}, \"time\": 1}",
        b'{"version": 1, "job": "uid-1", "ranks": {"0": ' + b"[" * 200 + b"]" * 200 + b"}}",
        b'{"version": 1, "job": "uid-1", "ranks": {"0": [1, 2, 3]}, "time": 1}',  # 3 slots
        b" " * 300_000,
    ],
)  # fmt: skip
def test_a_corrupt_or_foreign_record_is_read_as_missing_never_raises(record: bytes) -> None:
    # j-1's record is refused: it holds nothing, so the ranks have no step in common
    kv = _kv(2, {"j-0": _doc({0: (4,), 1: (4,)}), "j-1": record})
    view = view_from_keys(PREFIX, kv, 2)
    assert view.restore is not None and view.restore.step is None and view.restore.held
    # only refused values: nothing to say
    alone = view_from_keys(PREFIX, _kv(2, {"j-0": record, "j-1": record}), 2)
    assert alone.restore is None


def test_the_workers_load_time_shows_once_their_nodes_said_it() -> None:
    from kelastic.etcd_values.loads import LoadDoc, encode_load

    assert KEYS.checkpoint_loads_prefix in status_keys(PREFIX)  # a load wakes the job
    records = {"j-0": _doc({0: (8,), 1: (8,)}), "j-1": _doc({2: (8,), 3: (8,)})}
    kv = _kv(4, records)
    # none said yet: where from, no load time
    last = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2)
                     ).status.last_checkpoint  # fmt: skip
    assert last is not None and last.loaded_ranks is None and last.load_seconds is None
    kv[KEYS.checkpoint_load("j-0")] = encode_load(LoadDoc(4, 8, "memory", 2, 0.0123, 1.0e9))
    # another round's or another step's record (an earlier round) is not counted
    kv[KEYS.checkpoint_load("j-1")] = encode_load(LoadDoc(3, 8, "memory", 2, 9.0, 1.0e9))
    last = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2)
                     ).status.last_checkpoint  # fmt: skip
    assert last is not None and (last.loaded_ranks, last.load_seconds) == (2, 0.0123)
    kv[KEYS.checkpoint_load("j-1")] = encode_load(LoadDoc(4, 8, "memory", 2, 0.25, 1.0e9))
    plan = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2))
    last = plan.status.last_checkpoint
    assert last is not None and (last.loaded_ranks, last.load_seconds) == (4, 0.25)
    assert plan.status.as_patch()["lastCheckpoint"]["loadSeconds"] == 0.25
    # a crafted record reads as missing: the status keeps what the others said
    for bad in (
        b'{"round":4,"step":8,"tier":"memory","ranks":2,"seconds":1e999,"time":1}',
        b"[" * 100_000,
        b'{"round":4}',
        b"\xff",
    ):
        kv[KEYS.checkpoint_load("j-1")] = bad
        view = view_from_keys(PREFIX, kv, 2)
        assert set(view.loads) == {"j-0"}, bad[:40]


def test_a_rounds_restore_stays_what_it_was_when_its_records_change_after_it_began() -> None:
    """A round's restore is agreed from the records written before it completed; a node
    writes its record again once the round's workers stopped (before its next join), with
    the steps the round saved. Found on real nodes: the status said ``round 2, memory
    2771`` while the workers had agreed on none and started without a step."""
    from kelastic.etcd_values.loads import LoadDoc, encode_load

    # round 6 begins: j-1's Pod was replaced, its slots hold nothing: no step in common
    kv = _kv(6, {"j-0": _doc({0: (9,), 1: (9,)}), "j-1": _doc({})})
    first = reconcile(job(phase="Running"), PODS, T0, view_from_keys(PREFIX, kv, 2))
    last = first.status.last_checkpoint
    assert last is not None and (last.round, last.step, last.tier) == (6, None, "none")
    # round 6's workers trained and stopped; both nodes recorded step 40 before rejoining
    later = _kv(6, {"j-0": _doc({0: (40, 39), 1: (40, 39)}, 1767268900.0),
                    "j-1": _doc({2: (40, 39), 3: (40, 39)}, 1767268901.0)})  # fmt: skip
    view = view_from_keys(PREFIX, later, 2)
    assert view.restore is not None and view.restore.step == 40  # what the records say now
    again = reconcile(job(**first.status.as_patch()), PODS, T0 + timedelta(seconds=30), view)
    assert again.status.last_checkpoint == last  # what round 6 restored: nothing
    # an operator that first looks once the records changed (it was restarted, or the
    # round was short) reads the round's step and tier from what its workers loaded
    later[KEYS.checkpoint_load("j-0")] = encode_load(LoadDoc(6, 9, "memory", 2, 0.01, 1.0e9))
    loaded = reconcile(job(phase="Running"), PODS, T0 + timedelta(seconds=30),
                       view_from_keys(PREFIX, later, 2)).status.last_checkpoint  # fmt: skip
    assert loaded is not None
    assert (loaded.round, loaded.step, loaded.tier, loaded.loaded_ranks) == (6, 9, "memory", 2)
    # the next round is computed from its own records
    records = {"j-0": _doc({0: (40, 39), 1: (40, 39)}), "j-1": _doc({2: (40, 39), 3: (40, 39)})}
    nxt = reconcile(job(**first.status.as_patch()), PODS, T0 + timedelta(seconds=60),
                    view_from_keys(PREFIX, _kv(7, records), 2)).status.last_checkpoint  # fmt: skip
    assert nxt is not None and (nxt.round, nxt.step, nxt.tier) == (7, 40, "memory")
