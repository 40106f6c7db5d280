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
