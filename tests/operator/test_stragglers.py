"""Stragglers in the job (rule 11 of reconcile, :mod:`kelastic_operator.stragglers`): the
sidecars' verdicts in ``status.stragglers``, the ``Stragglers`` condition, an Event per
new one, and with ``spec.stragglers.action: Replace`` the Pod replaced with a departure
notice and its Node quarantined; the verdict's etcd value (its one codec, fuzzed) and the
operator's reading of it. The sidecar's side: ``tests/sidecar/test_steptime.py``,
``tests/sidecar/test_etcd_publish.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given

from kelastic import contract
from kelastic.etcd_values import CorruptValueError, decode_stragglers, encode_stragglers
from kelastic.etcd_values.stragglers import MAX_STRAGGLERS
from kelastic_operator.etcd_view import status_keys, view_from_keys
from kelastic_operator.pods import pod_spec_hash
from kelastic_operator.reconcile import DeletePod, PodView, RendezvousView, reconcile
from kelastic_operator.reconcile_views import StragglerView
from kelastic_operator.stragglers import REPLACE_STRAGGLER_REASON

from ..test_decoder_fuzz import json_values
from .test_reconcile import T0, cond, job, pod, spec

ENTRY = {"local_rank": 1, "scope": "train_step", "median_s": 0.3, "others_median_s": 0.1,
         "ratio": 3.0}  # fmt: skip
PREFIX = contract.job_prefix("ns", "j", "u1")
KEYS = contract.Keys(PREFIX)


def slow(node: str = "j-0", ratio: float = 3.0, since: datetime = T0, rank: int = 1) -> Any:
    return StragglerView(node, rank, "train_step", 0.1 * ratio, 0.1, ratio, since)


def placed(p: PodView, node: str) -> PodView:
    return dataclasses.replace(p, node_name=node)


PODS = [placed(pod(0, age=60), "gpu-a"), placed(pod(1, age=60), "gpu-b")]


# --------------------------------------------------------------------------- the codec


def test_the_value_round_trips_and_keeps_the_worst_ratios() -> None:
    raw = encode_stragglers("j-0", "uid-0", 5.5, [ENTRY])
    assert decode_stragglers(raw) == {
        "node": "j-0",
        "pod_uid": "uid-0",
        "time": 5.5,
        "stragglers": [ENTRY],
    }
    many = [{**ENTRY, "local_rank": i, "ratio": 1.0 + i} for i in range(MAX_STRAGGLERS + 10)]
    kept = decode_stragglers(encode_stragglers("j-0", "", 1.0, many))["stragglers"]
    assert len(kept) == MAX_STRAGGLERS and kept[0]["ratio"] == MAX_STRAGGLERS + 10
    long_scope = decode_stragglers(
        encode_stragglers("j-0", "", 1.0, [{**ENTRY, "scope": "s" * 999}])
    )
    assert len(long_scope["stragglers"][0]["scope"]) == 256
    assert decode_stragglers(encode_stragglers("j-0", "", 1.0, []))["stragglers"] == []


@pytest.mark.parametrize(
    "entry",
    [{**ENTRY, "ratio": float("nan")}, {**ENTRY, "ratio": 0}, {**ENTRY, "median_s": -1.0},
     {**ENTRY, "local_rank": -1}, {**ENTRY, "local_rank": True}, {**ENTRY, "extra": 1},
     {**ENTRY, "median_s": 1e300}, {k: v for k, v in ENTRY.items() if k != "scope"}],
)  # fmt: skip
def test_the_writer_refuses_what_is_out_of_bounds(entry: dict[str, Any]) -> None:
    with pytest.raises(CorruptValueError):
        encode_stragglers("j-0", "", 1.0, [entry])
    with pytest.raises(CorruptValueError):
        doc = {"node": "j-0", "pod_uid": "", "time": 1.0, "stragglers": [entry]}
        decode_stragglers(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[]", b"null", b'{"node": "j-0", "time": 1}', b"\xff",
     b'{"node": "j", "time": 1, "stragglers": []}',  # no pod_uid
     b'{"node": "j", "pod_uid": 7, "time": 1, "stragglers": []}',
     b'{"node": "", "pod_uid": "", "time": 1, "stragglers": []}',
     b'{"node": "j", "pod_uid": "", "time": -1, "stragglers": []}',
     b'{"node": "j", "pod_uid": "", "time": 1, "stragglers": {}}',
     b'{"node": "j", "pod_uid": "' + b"u" * 129 + b'", "time": 1, "stragglers": []}', b"[" * 50000],
)  # fmt: skip
def test_the_reader_refuses_what_no_writer_produces(raw: bytes) -> None:
    with pytest.raises(CorruptValueError):
        decode_stragglers(raw)


@given(value=json_values)
def test_fuzz_the_reader_raises_only_its_error(value: Any) -> None:
    base = {"node": "j-0", "pod_uid": "", "time": 1.0}
    for doc in (value, {**base, "stragglers": value}, {**base, "stragglers": [value]},
                {**base, "stragglers": [{**ENTRY, "ratio": value}]}):  # fmt: skip
        with contextlib.suppress(TypeError, ValueError):
            raw = json.dumps(doc).encode()
            with contextlib.suppress(CorruptValueError):
                decode_stragglers(raw)


def test_the_operator_reads_each_nodes_verdict_under_its_own_key() -> None:
    kv = {
        KEYS.straggler("j-0"): encode_stragglers("j-0", "uid-0", T0.timestamp(), [ENTRY]),
        KEYS.straggler("j-1"): encode_stragglers("j-9", "", T0.timestamp(), [ENTRY]),  # not its own
        KEYS.straggler("j-2"): b'{"node": "j-2"}',  # refused: read as missing
    }
    view = view_from_keys(PREFIX, kv, 2)
    assert view.stragglers == (StragglerView("j-0", 1, "train_step", 0.3, 0.1, 3.0, T0, "uid-0"),)
    assert KEYS.stragglers_prefix in status_keys(PREFIX)


# ------------------------------------------------------------------------------ the rule


def test_warn_names_the_straggler_once_and_sets_the_condition() -> None:
    plan = reconcile(job(phase="Running"), PODS, T0, RendezvousView(stragglers=(slow(),)))
    (shown,) = plan.status.stragglers
    assert (shown.pod, shown.local_rank, shown.scope, shown.ratio) == ("j-0", 1, "train_step", 3.0)
    assert [e.reason for e in plan.events if e.reason == "StragglerDetected"] == [
        "StragglerDetected"
    ]
    assert not plan.delete and not plan.depart_nodes  # Warn: nothing replaced
    status, reason, _ = cond(plan.status, "Stragglers")
    assert (status, reason) == ("True", "StragglersDetected")
    again = reconcile(job(**plan.status.as_patch()), PODS, T0 + timedelta(seconds=3),
                      RendezvousView(stragglers=(slow(),)))  # fmt: skip
    assert not again.events and not again.status_changed
    # it caught up: the list empties, the condition turns False (and stays)
    gone = reconcile(job(**again.status.as_patch()), PODS, T0, RendezvousView())
    assert gone.status.stragglers == [] and cond(gone.status, "Stragglers")[:2] == (
        "False", "NoStragglers")  # fmt: skip


def test_a_job_that_never_had_one_has_no_condition() -> None:
    plan = reconcile(job(phase="Running"), PODS, T0, RendezvousView())
    assert "Stragglers" not in {c.type for c in plan.status.conditions}


def test_a_verdict_older_than_its_pod_or_of_a_pod_not_running_is_ignored() -> None:
    stale = slow(since=T0 - timedelta(seconds=61))  # the Pod was created 60 s ago
    pods = [*PODS, placed(pod(2, phase="Pending"), "gpu-c")]
    found = (stale, slow("j-2"), slow("j-7"))
    plan = reconcile(
        job(spec(replicas=3), phase="Running"), pods, T0, RendezvousView(stragglers=found)
    )
    assert plan.status.stragglers == []


def test_a_verdict_names_its_pod_by_uid_when_it_has_one() -> None:
    """The sidecar writes its Pod's uid: a verdict of an earlier Pod of the name is
    ignored whatever its time; without a uid, a verdict of the Pod's first two seconds
    (its creation time is given to the second) is not taken as the Pod's."""
    pods = [dataclasses.replace(PODS[0], uid="new"), PODS[1]]
    later = T0 + timedelta(seconds=30)
    for view, taken in ((slow(since=later), True), (dataclasses.replace(slow(since=later),
                        pod_uid="old"), False), (dataclasses.replace(slow(since=later),
                        pod_uid="new"), True), (slow(since=T0 - timedelta(seconds=59)), False),
                        (slow(since=T0 - timedelta(seconds=58)), True)):  # fmt: skip
        plan = reconcile(job(phase="Running"), pods, later, RendezvousView(stragglers=(view,)))
        assert bool(plan.status.stragglers) is taken, view


def test_replace_replaces_the_pod_with_a_departure_notice_and_quarantines_its_node() -> None:
    s = spec(stragglers={"action": "Replace"})
    plan = reconcile(job(s, phase="Running"), PODS, T0,
                     RendezvousView(stragglers=(slow(), slow(rank=2, ratio=2.0))))  # fmt: skip
    assert plan.delete == [DeletePod("j-0", REPLACE_STRAGGLER_REASON)]  # once per Pod
    assert plan.depart_nodes == ["j-0"] and "j-0" in plan.remove_nodes  # planned: no charge
    assert plan.status.quarantined_nodes == ["gpu-a"]
    assert plan.status.replacements == 0
    assert [e.reason for e in plan.events].count("ReplacingStraggler") == 1
    # the Pod being deleted is not replaced twice; its replacement, newer than the
    # verdict, is not judged by it
    deleting = [dataclasses.replace(PODS[0], deleting=True), PODS[1]]
    later = reconcile(job(s, **plan.status.as_patch()), deleting, T0,
                      RendezvousView(stragglers=(slow(),)))  # fmt: skip
    assert not later.delete and not [e for e in later.events if e.reason == "ReplacingStraggler"]
    fresh = [placed(pod(0, age=1), "gpu-c"), PODS[1]]
    older = RendezvousView(stragglers=(slow(since=T0 - timedelta(seconds=5)),))
    newest = reconcile(job(s, **later.status.as_patch()), fresh, T0 + timedelta(seconds=30), older)
    assert not newest.delete and newest.status.stragglers == []


def test_the_action_does_not_change_the_pods_digest_but_the_verdict_does() -> None:
    plain = pod_spec_hash(spec())
    assert pod_spec_hash(spec(stragglers={"action": "Replace"})) == plain
    assert pod_spec_hash(spec(stragglers={"factor": 2.0})) != plain
    assert pod_spec_hash(spec(nodeLostSeconds=5)) == plain


@pytest.mark.parametrize(
    "bad",
    [{"action": "Evict"}, {"factor": 1.0}, {"factor": float("nan")}, {"minSteps": 0},
     {"minSteps": 65}, {"extra": 1}],
)  # fmt: skip
def test_the_spec_refuses_a_bad_policy(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        spec(stragglers=bad)


def test_the_sidecar_gets_the_verdicts_settings() -> None:
    from kelastic_operator.pods import PodSettings, sidecar_env

    env = {e["name"]: e.get("value") for e in sidecar_env(
        "j", "u1", spec(stragglers={"factor": 2.5, "minSteps": 8}),
        PodSettings(etcd_endpoints=("e:2379",)))}  # fmt: skip
    assert env[contract.ENV_STRAGGLER_FACTOR] == "2.5"
    assert env[contract.ENV_STRAGGLER_MIN_STEPS] == "8"


def test_a_suspended_or_finished_job_lists_no_straggler() -> None:
    listed = reconcile(job(phase="Running"), PODS, T0, RendezvousView(stragglers=(slow(),)))
    assert listed.status.stragglers
    for s, phase in ((spec(suspend=True), "Running"), (spec(), "Succeeded")):
        status = {**listed.status.as_patch(), "phase": phase}
        plan = reconcile(job(s, **status), PODS, T0, RendezvousView(stragglers=(slow(),)))
        assert plan.status.stragglers == [], phase
