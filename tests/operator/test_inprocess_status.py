"""In-process restarts in the operator: the bounded reader of the sidecars' iteration
record, its place in the rendezvous view (read in the same range request), and reconcile's
mapping into the status, the ``InProcessRestart`` Event and the restart counter's levels."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kelastic import contract
from kelastic_operator import metrics
from kelastic_operator.etcd_view import view_from_keys
from kelastic_operator.inprocess_record import (
    MAX_RECORD_BYTES,
    MAX_TEXT,
    InProcessRecord,
    decode_record,
)
from kelastic_operator.inprocess_status import LEVELS, apply_inprocess, restart_increases
from kelastic_operator.model import ElasticJobStatus
from kelastic_operator.reconcile import RendezvousView, reconcile

from .test_reconcile import T0, job, pod, spec

RECORD = {"iteration": 2, "round": 3, "restarts": 2, "cause": "exception", "node": "j-1",
          "rank": 3, "message": "InjectedFault: SIGUSR1", "time": 1.7e9}  # fmt: skip


def raw(**fields: Any) -> bytes:
    return json.dumps({**RECORD, **fields}).encode()


# ---------------------------------------------------------------------------- reader


def test_the_sidecars_record_decodes() -> None:
    assert decode_record(raw()) == InProcessRecord(
        iteration=2, restarts=2, cause="exception", node="j-1", rank=3,
        message="InjectedFault: SIGUSR1", time=1.7e9,
    )  # fmt: skip


def test_the_sidecars_own_encoder_is_read_alike() -> None:
    from kelastic_sidecar.inprocess.record import IterationRecord, encode_iteration_record

    written = IterationRecord(iteration=5, round=1, restarts=4, cause="hang", node="n",
                              rank=-1, message="m", time=1.8e9)  # fmt: skip
    read = decode_record(encode_iteration_record(written))
    assert read == InProcessRecord(5, 4, "hang", "n", None, "m", 1.8e9)  # rank -1: unknown


@pytest.mark.parametrize(
    "value",
    [
        None, b"", b"not json", b"[1, 2]", b"null", b'"text"',
        raw(iteration=-1), raw(iteration=True), raw(iteration=2**53 + 1), raw(iteration="2"),
        raw(restarts=None), raw(restarts=1.5),
        b'{"iteration": ' + b"9" * 5000 + b', "restarts": 1}',
        b'{"iteration": 1, "restarts": 1, "x": ' + b"[" * 50 + b"]" * 50 + b"}",
        b'{"iteration": 1, "restarts": NaN}',
        b" " * (MAX_RECORD_BYTES + 1),
    ],
)  # fmt: skip
def test_what_is_not_a_record_reads_as_none(value: bytes | None) -> None:
    assert decode_record(value) is None


def test_mistyped_details_are_refused_as_the_sidecars_refuse_them_and_texts_are_cut() -> None:
    """One codec for every reader. The operator once read a record with a
    mistyped detail (the sidecars refused it) as one with unknown details; now it shows
    none, as the sidecars see none."""
    for bad in (dict(cause=7), dict(cause="x"), dict(rank="3"), dict(time=1e300),
                dict(time=-5), dict(time=True), dict(iteration=2**31)):  # fmt: skip
        assert decode_record(raw(**bad)) is None, bad
    got = decode_record(raw(node=None, rank=-1, message="x" * (3 * MAX_TEXT), time=0))
    assert got is not None
    assert (got.node, got.rank, got.time) == ("", None, None)
    assert got.message == "x" * MAX_TEXT


def test_the_view_has_the_record_from_the_same_keys() -> None:
    keys = contract.Keys("/p/")
    kv = {keys.inprocess_iteration: raw(), keys.inprocess_ready(2, "j-1"): b"{}"}
    view = view_from_keys("/p/", kv, 2)
    assert view.inprocess is not None and view.inprocess.restarts == 2
    assert view_from_keys("/p/", {keys.inprocess_iteration: b"{"}, 2).inprocess is None
    assert view_from_keys("/p/", {}, 2).inprocess is None


# ------------------------------------------------------------------- status mapping


def test_a_restart_shows_in_the_status_and_is_announced_once() -> None:
    s = spec(inProcess={"enabled": True, "maxRestarts": 5})
    rdzv = RendezvousView(round=3, world_size=4, inprocess=decode_record(raw()))
    plan = reconcile(job(s, phase="Running", inProcessRestarts=1), [pod(0), pod(1)], T0, rdzv)
    st = plan.status.as_patch()
    assert st["inProcessRestarts"] == 2
    assert st["lastInProcessRestart"] == {
        "iteration": 2, "cause": "exception", "rank": 3, "node": "j-1",
        "message": "InjectedFault: SIGUSR1", "time": "2023-11-14T22:13:20Z",
    }  # fmt: skip
    (ev,) = [e for e in plan.events if e.reason == "InProcessRestart"]
    assert ev.type == "Warning"
    assert ev.message == (
        "in-process restart 2/5 (iteration 2): rank 3 on j-1: exception: InjectedFault: SIGUSR1"
    )
    assert plan.status_changed
    again = reconcile(job(s, **plan.status.as_patch()), [pod(0), pod(1)], T0, rdzv)
    assert not again.events and not again.status_changed


def test_no_record_keeps_the_status_and_iteration_zero_shows_no_restart() -> None:
    old = job(phase="Running", inProcessRestarts=3,
              lastInProcessRestart={"iteration": 3, "cause": "hang"})  # fmt: skip
    plan = reconcile(old, [pod(0), pod(1)], T0, RendezvousView(round=1, world_size=4))
    assert plan.status.in_process_restarts == 3
    assert plan.status.last_in_process_restart is not None
    assert not [e for e in plan.events if e.reason == "InProcessRestart"]
    fresh = reconcile(job(phase="Running"), [pod(0), pod(1)], T0,
                      RendezvousView(inprocess=InProcessRecord()))  # fmt: skip
    assert fresh.status.in_process_restarts == 0
    assert fresh.status.last_in_process_restart is None
    assert not [e for e in fresh.events if e.reason == "InProcessRestart"]


def test_an_unknown_rank_and_node_read_plainly() -> None:
    st = ElasticJobStatus()
    event = apply_inprocess(spec(), ElasticJobStatus(), st, InProcessRecord(1, 1))
    assert event is not None
    assert event.message == "in-process restart 1/10 (iteration 1): a rank: a fault"
    assert st.last_in_process_restart is not None and st.last_in_process_restart.time is None


# ------------------------------------------------------------------ restart counter


def test_restart_increases_count_each_rung_by_the_growth_of_the_stored_status() -> None:
    old = ElasticJobStatus.model_validate({"restartsSpent": 1, "replacements": 0})
    new = ElasticJobStatus.model_validate(
        {"restartsSpent": 2, "replacements": 1, "inProcessRestarts": 3}
    )
    assert restart_increases(old, new) == {"inprocess": 3, "process": 1, "pod": 1}
    assert restart_increases(new, new) == {}
    assert restart_increases(new, old) == {}  # a counter going down adds nothing


def test_the_operators_levels_are_the_ladders() -> None:
    assert metrics.RESTART_LEVELS == LEVELS
    m = metrics.OperatorMetrics()
    for level in LEVELS:  # every series exists from the start, at 0
        assert m.registry.get_sample_value("kelastic_operator_restarts_total",
                                           {"level": level}) == 0  # fmt: skip
