"""The operator's watch cache: newest body wins, a new object of the same name replaces the
old one, a relist is due after its interval, deletions forget the right incarnation."""

from __future__ import annotations

from typing import Any

from kelastic_operator.watch_cache import WatchCache


def obj(name: str, rv: str, uid: str = "u1", ns: str = "ns", **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": rv},
            **extra}  # fmt: skip


def test_the_newest_job_body_wins_whatever_the_order_of_arrival() -> None:
    cache = WatchCache()
    cache.put_job(obj("j", "12", status={"phase": "Running"}))
    cache.put_job(obj("j", "11", status={"phase": "Pending"}))  # a late event: ignored
    assert cache.job("ns", "j")["status"]["phase"] == "Running"  # type: ignore[index]
    cache.put_job(obj("j", "3", uid="u2"))  # a new job of the same name: its own count
    assert cache.job("ns", "j")["metadata"]["uid"] == "u2"  # type: ignore[index]
    cache.put_job(obj("j", "not-a-number", uid="u2"))  # opaque versions: the later wins
    assert cache.job("ns", "j")["metadata"]["resourceVersion"] == "not-a-number"  # type: ignore[index]
    cache.drop_job_body("ns", "j")
    assert cache.job("ns", "j") is None


def test_pods_are_unknown_until_listed_and_again_when_a_relist_is_due() -> None:
    now = [0.0]
    cache = WatchCache(relist_seconds=60, clock=lambda: now[0])
    cache.put_pod("ns", "j", obj("j-0", "5"))
    assert cache.pods("ns", "j") is None  # events alone: never listed
    cache.replace_pods("ns", "j", [obj("j-0", "4"), obj("j-1", "6")])
    pods = {p["metadata"]["name"]: p for p in cache.pods("ns", "j") or []}
    assert pods["j-0"]["metadata"]["resourceVersion"] == "5"  # the event was newer
    assert set(pods) == {"j-0", "j-1"}
    now[0] = 59.9
    assert cache.pods("ns", "j") is not None
    now[0] = 60.0
    assert cache.pods("ns", "j") is None  # relist due


def test_a_deletion_forgets_only_the_incarnation_it_names() -> None:
    cache = WatchCache()
    cache.replace_pods("ns", "j", [obj("j-0", "4", uid="new")])
    cache.drop_pod("ns", "j", "j-0", uid="old")  # the old Pod's DELETED, arriving late
    assert [p["metadata"]["uid"] for p in cache.pods("ns", "j") or []] == ["new"]
    cache.drop_pod("ns", "j", "j-0", uid="new")
    assert cache.pods("ns", "j") == []
    cache.put_job(obj("j", "1"))
    cache.drop_job("ns", "j")
    assert cache.job("ns", "j") is None and cache.pods("ns", "j") is None


def test_a_slim_pod_reads_the_same_to_reconcile_as_the_whole_pod() -> None:
    from kelastic_operator.reconcile import pod_view
    from kelastic_operator.watch_cache import slim_pod

    pod = {
        "metadata": {"name": "j-1", "namespace": "ns", "uid": "u", "resourceVersion": "9",
                     "creationTimestamp": "2026-01-01T12:00:00Z",
                     "deletionTimestamp": "2026-01-01T12:05:00Z",
                     "labels": {"kelastic.dev/job-name": "j", "kelastic.dev/job-uid": "x"},
                     "annotations": {"kelastic.dev/pod-spec-hash": "abc", "other": "y" * 999},
                     "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "image": "x",
                                                    "env": [{"name": "A", "value": "1"}] * 50}]},
        "status": {"phase": "Failed", "reason": "Evicted", "message": "low memory",
                   "conditions": [{"type": "PodScheduled", "status": "True"},
                                  {"type": "Ready", "status": "False"}],
                   "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                       "exitCode": 137, "message": "killed", "reason": "Error",
                       "finishedAt": "2026-01-01T12:04:00Z"}}}]},
    }  # fmt: skip
    slim = slim_pod(pod)
    assert pod_view("j", slim) == pod_view("j", pod)
    assert "managedFields" not in slim["metadata"] and "containers" not in slim["spec"]
    assert slim["metadata"]["annotations"] == {"kelastic.dev/pod-spec-hash": "abc"}
    assert len(repr(slim)) * 4 < len(repr(pod))
