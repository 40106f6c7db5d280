"""Lost nodes (rule 10 of reconcile): the Pods of a Node not Ready for ``nodeLostSeconds``
are force-deleted, leave the rendezvous and are created again; the Node reader
(:mod:`kelastic_operator.node_health`) and the watch cache's Node lookup.
The same on the real control plane with its node-lifecycle controller:
``tests/operator/test_e2e_node_lost.py``."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings

from kelastic_operator.model import DEFAULT_NODE_LOST_SECONDS, ElasticJobSpec
from kelastic_operator.node_health import NodeHealth, not_ready_since
from kelastic_operator.reconcile import (
    LOST_REASON,
    REPLACE_REASON,
    CreatePod,
    DeletePod,
    PodView,
    format_time,
    reconcile,
)
from kelastic_operator.watch_cache import WatchCache

from ..test_decoder_fuzz import json_values
from .test_reconcile import T0, job, pod, spec


def on(p: PodView, node: str = "n1", since: datetime | None = None) -> PodView:
    """``p`` bound to ``node``, which is not Ready since ``since`` (None: Ready)."""
    return dataclasses.replace(p, node_name=node, node_not_ready_since=since)


LOST = 60.0  # the default nodeLostSeconds
BEFORE = T0 - timedelta(seconds=LOST - 1)  # not Ready for 59 s at T0
PAST = T0 - timedelta(seconds=LOST)  # not Ready for exactly nodeLostSeconds at T0


def test_the_default_patience_is_a_minute_and_the_spec_bounds_it() -> None:
    assert spec().node_lost_seconds == DEFAULT_NODE_LOST_SECONDS == LOST
    assert spec(nodeLostSeconds=5).node_lost_seconds == 5
    for bad in (0, -1, 86401, "soon", float("nan"), float("inf")):
        with pytest.raises(ValueError):
            spec(nodeLostSeconds=bad)


def test_a_pod_on_a_not_ready_node_is_left_alone_until_node_lost_seconds() -> None:
    """A Node the control plane cannot hear may still train: nothing is removed or
    deleted before the patience ends; the pass asks to be woken then."""
    pods = [on(pod(0), since=BEFORE), on(pod(1), node="n2")]
    plan = reconcile(job(), pods, T0)
    assert not plan.delete and not plan.remove_nodes and not plan.create
    assert plan.requeue_after == pytest.approx(1.0)
    assert plan.status.phase == "Running" and plan.status.last_failure is None


def test_a_lost_pod_is_force_deleted_leaves_the_rendezvous_and_is_recorded() -> None:
    pods = [on(pod(0), since=PAST), on(pod(1), node="n2")]
    plan = reconcile(job(phase="Running"), pods, T0)
    assert plan.delete == [DeletePod("j-0", LOST_REASON, force=True)]
    assert plan.remove_nodes == ["j-0"] and not plan.depart_nodes  # not planned: node_lost
    assert not plan.create  # its name is taken until the deletion is seen
    failure = plan.status.last_failure
    assert failure is not None and failure.pod == "j-0" and failure.time == format_time(T0)
    assert failure.message == (
        f"node_lost: node n1 not Ready since {format_time(PAST)} (60s, nodeLostSeconds 60): "
        "pod j-0 force-deleted and replaced"
    )
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "PodLost")]
    assert plan.status.replacements == 0  # no replacement budget spent
    # gone: created again at once (rule 4), charged to nothing
    plan2 = reconcile(job(**plan.status.as_patch()), [on(pod(1), node="n2")], T0)
    assert plan2.create == [CreatePod("j-0", 0)] and plan2.status.replacements == 0
    assert "j-0" in plan2.remove_nodes  # any key left of the lost Pod goes first


def test_every_pod_of_a_lost_node_goes_and_other_nodes_pods_stay() -> None:
    pods = [on(pod(0), since=PAST), on(pod(1), since=PAST), on(pod(2), node="n2")]
    plan = reconcile(job(spec(replicas=3)), pods, T0)
    assert [(d.name, d.force) for d in plan.delete] == [("j-0", True), ("j-1", True)]
    assert plan.remove_nodes == ["j-0", "j-1"]
    assert [e.reason for e in plan.events].count("PodLost") == 2


@pytest.mark.parametrize(
    ("phase", "deleting", "force_deleted", "recorded"),
    [
        ("Pending", False, True, True),  # bound, never started: lost too
        ("Running", True, True, True),  # evicted or scaled down, never confirmed
        ("Failed", True, True, False),  # a replaced failed Pod stuck Terminating
        ("Failed", False, False, False),  # rule 5 counts and deletes it first
        ("Succeeded", False, False, False),  # its success still counts
        ("Succeeded", True, True, False),
    ],
)
def test_which_pods_of_a_lost_node_are_force_deleted(
    phase: str, deleting: bool, force_deleted: bool, recorded: bool
) -> None:
    pods = [on(pod(0, phase=phase, deleting=deleting), since=PAST), on(pod(1), node="n2")]
    plan = reconcile(job(), pods, T0)
    assert (DeletePod("j-0", LOST_REASON, force=True) in plan.delete) is force_deleted
    lost = plan.status.last_failure is not None and plan.status.last_failure.message.startswith(
        "node_lost"
    )
    assert lost is recorded
    assert ("PodLost" in [e.reason for e in plan.events]) is recorded


def test_a_failed_pod_of_a_lost_node_is_counted_then_force_deleted() -> None:
    """Rule 5 counts the replacement (gracefully deleting it); once it is being deleted,
    the next pass force-deletes it: the replacement is counted once."""
    failed = on(pod(0, phase="Failed", msg="boom"), since=PAST)
    s = spec(podReplacement={"backoffSeconds": 0})
    plan = reconcile(job(s), [failed, on(pod(1), node="n2")], T0)
    assert DeletePod("j-0", REPLACE_REASON) in plan.delete and plan.status.replacements == 1
    stuck = dataclasses.replace(failed, deleting=True)
    plan2 = reconcile(job(s, **plan.status.as_patch()), [stuck, on(pod(1), node="n2")], T0)
    assert DeletePod("j-0", LOST_REASON, force=True) in plan2.delete
    assert plan2.status.replacements == 1


def test_a_finished_job_force_deletes_only_the_pods_it_is_deleting() -> None:
    """cleanupPolicy decides what goes; a lost Node's Pod it deletes would stay
    Terminating, so it is forced; nothing is recorded or removed for a finished job."""
    done = job(phase="Succeeded")
    pods = [on(pod(0, phase="Running", deleting=True), since=PAST),
            on(pod(1, phase="Succeeded"), since=PAST)]  # fmt: skip
    plan = reconcile(done, pods, T0)
    assert plan.delete == [DeletePod("j-0", LOST_REASON, force=True)]
    assert not plan.events and plan.status.last_failure is None


def test_a_suspended_job_force_deletes_a_lost_pod_it_stops() -> None:
    plan = reconcile(job(spec(suspend=True)), [on(pod(0), since=PAST), on(pod(1))], T0)
    assert plan.delete[0] == DeletePod("j-0", LOST_REASON, force=True)
    assert [d.name for d in plan.delete if not d.force] == ["j-1"]  # the rest, gracefully


def test_a_node_ready_again_in_time_leaves_its_pods_running() -> None:
    plan = reconcile(job(), [on(pod(0), since=BEFORE), on(pod(1))], T0)
    assert plan.requeue_after == pytest.approx(1.0)
    later = T0 + timedelta(seconds=2)
    plan2 = reconcile(job(**plan.status.as_patch()), [on(pod(0)), on(pod(1))], later)
    assert not plan2.delete and not plan2.remove_nodes and plan2.requeue_after is None


def test_a_longer_patience_from_the_spec() -> None:
    s = spec(nodeLostSeconds=600)
    plan = reconcile(job(s), [on(pod(0), since=PAST), on(pod(1))], T0)
    assert not plan.delete and plan.requeue_after == pytest.approx(540.0)


def test_a_lost_pod_counts_once_as_the_last_failure() -> None:
    """A pass whose force-deletion failed (an API error) runs again: the failure is not
    newer the second time."""
    pods = [on(pod(0), since=PAST), on(pod(1))]
    plan = reconcile(job(), pods, T0)
    again = reconcile(job(**plan.status.as_patch()), pods, T0 + timedelta(seconds=5))
    assert again.status.last_failure == plan.status.last_failure
    assert DeletePod("j-0", LOST_REASON, force=True) in again.delete


# ---------------------------------------------------------------------- the Node reader


def node(status: str | None, changed: str | None = "2026-01-01T11:58:00Z", **extra: Any) -> Any:
    cond: dict[str, Any] = {"type": "Ready", "status": status}
    if changed is not None:
        cond["lastTransitionTime"] = changed
    conds = [{"type": "MemoryPressure", "status": "False"}, cond] if status else []
    return {"metadata": {"name": "n1"}, "status": {"conditions": conds}, **extra}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (node("True"), None),
        (node("Unknown"), datetime.fromisoformat("2026-01-01T11:58:00+00:00")),  # no heartbeats
        (node("False"), datetime.fromisoformat("2026-01-01T11:58:00+00:00")),  # kubelet says so
        (node("Unknown", changed=None), T0),  # no time: from when it was seen
        (node("Unknown", changed="yesterday"), T0),
        (node("Unknown", changed="2027-01-01T00:00:00Z"), T0),  # a clock ahead: now
        (node("Unknown", changed=12), T0),
        (node(None), None),  # no Ready condition: never posted, nothing runs there
        ({}, None),
        ({"status": None}, None),
        ({"status": {"conditions": "Ready"}}, None),
        ({"status": {"conditions": [None, 3, ["Ready"]]}}, None),
        ({"status": {"conditions": [{"type": "Ready"}]}}, T0),  # no status: not True
    ],
)
def test_not_ready_since_reads_the_ready_condition(obj: Any, expected: datetime | None) -> None:
    assert not_ready_since(obj, T0) == expected


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_not_ready_since_never_raises_on_crafted_nodes(value: Any) -> None:
    for obj in (value, {"status": value}, {"status": {"conditions": value}},
                {"status": {"conditions": [{"type": "Ready", "status": "Unknown",
                                            "lastTransitionTime": value}]}}):  # fmt: skip
        since = not_ready_since(obj if isinstance(obj, dict) else {}, T0)
        assert since is None or since <= T0


def test_node_health_reports_changes_and_forgets_deleted_nodes() -> None:
    health = NodeHealth(forget_after=timedelta(minutes=10))
    assert health.observe("n1", node("True"), T0) is False and health.since("n1") is None
    assert health.observe("n1", node("Unknown"), T0) is True
    assert health.since("n1") == datetime.fromisoformat("2026-01-01T11:58:00+00:00")
    assert health.observe("n1", node("Unknown"), T0 + timedelta(seconds=9)) is False
    assert health.observe("n1", node("True"), T0) is True and health.since("n1") is None
    # deleted: not Ready since then; a deletion of an already not-Ready Node keeps its time
    assert health.deleted("n2", T0) is True and health.since("n2") == T0
    health.observe("n3", node("Unknown"), T0)
    assert health.deleted("n3", T0) is False
    assert health.since("n3") == datetime.fromisoformat("2026-01-01T11:58:00+00:00")
    assert len(health) == 2
    # forgotten after forget_after (bounded memory under autoscaling), or when seen again
    health.deleted("n4", T0 + timedelta(minutes=11))
    assert health.since("n2") is None and health.since("n3") is None and len(health) == 1
    assert health.observe("n4", node("True"), T0) is True and health.since("n4") is None


def test_the_watch_cache_names_the_jobs_with_pods_on_a_node() -> None:
    cache = WatchCache()

    def pod_obj(name: str, node_name: str | None) -> dict[str, Any]:
        obj: dict[str, Any] = {"metadata": {"name": name, "uid": name, "resourceVersion": "1"}}
        if node_name:
            obj["spec"] = {"nodeName": node_name}
        return obj

    cache.put_pod("a", "j1", pod_obj("j1-0", "n1"))
    cache.put_pod("a", "j1", pod_obj("j1-1", "n2"))
    cache.put_pod("b", "j2", pod_obj("j2-0", "n1"))
    cache.put_pod("b", "j3", pod_obj("j3-0", None))
    assert sorted(cache.jobs_on_node("n1")) == [("a", "j1"), ("b", "j2")]
    assert cache.jobs_on_node("n2") == [("a", "j1")] and cache.jobs_on_node("n9") == []


def test_the_crd_declares_the_field() -> None:
    from kelastic_operator.crd import crd

    props = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = props["properties"]["nodeLostSeconds"]
    assert (field["type"], field["default"], field["maximum"]) == ("number", 60.0, 86400)
    assert (
        ElasticJobSpec.model_validate(
            {
                "replicas": 1,
                "template": {"spec": {"containers": [{"name": "trainer", "command": ["x"]}]}},
            }
        ).node_lost_seconds
        == 60
    )


def test_a_lost_pod_is_fenced_by_its_uid_before_it_goes() -> None:
    """The fence names the incarnation: should its Node come back, its sidecar refuses to
    join beside the new Pod of its name (``tests/sidecar/test_rendezvous.py``)."""
    lost = dataclasses.replace(on(pod(0), since=PAST), uid="uid-0")
    plan = reconcile(job(phase="Running"), [lost, on(pod(1), node="n2")], T0)
    assert plan.fence == [("uid-0", "node n1 lost")]
    unknown = reconcile(job(phase="Running"), [on(pod(0), since=PAST), on(pod(1))], T0)
    assert unknown.fence == []  # no uid known (an old API object): nothing to name


def test_the_store_writes_the_fence(etcd_endpoint: str) -> None:
    from kelastic import contract
    from kelastic.etcd_values import decode_departure
    from kelastic_etcd import EtcdClient
    from kelastic_operator.rendezvous_store import EtcdRendezvousStore

    prefix = contract.job_prefix("ns", "fence", "u1")
    store = EtcdRendezvousStore([etcd_endpoint])
    try:
        store.fence(prefix, "uid-0", "node n1 lost")
    finally:
        store.close()
    with EtcdClient([etcd_endpoint]) as client:
        got = client.get(contract.Keys(prefix).fenced("uid-0"))
    assert got is not None and decode_departure(got[0]) == "node n1 lost"
