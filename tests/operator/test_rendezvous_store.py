"""The operator's etcd access: parsing a job's keys, and the real client against real etcd."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kelastic import contract
from kelastic.etcd_values import encode_hang
from kelastic.hang_where import HangWhere, RankWhere
from kelastic_operator.etcd_view import status_keys, view_from_keys
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from kelastic_operator.model import ElasticJobStatus
from kelastic_operator.reconcile import Event, RendezvousView
from kelastic_operator.rendezvous_store import (
    EtcdRendezvousStore,
    RendezvousStoreError,
    StoreCache,
    parse_endpoint,
)
from kelastic_operator.status import event_body, status_patch

PREFIX = contract.job_prefix("ns", "j", "u1")
KEYS = contract.Keys(PREFIX)


def enc(doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_view_from_keys_reads_round_world_restarts_and_reports() -> None:
    kv = {
        KEYS.rdzv_state: enc(
            {"round": 3, "complete": True, "participants": {"j-0": 0, "j-1": 1, "j-2": 2}}
        ),
        KEYS.restarts: enc({"count": 2}),
        KEYS.report("j-0"): enc({"outcome": "failed", "summary": "job failed: boom"}),
        KEYS.report("j-1"): enc({"outcome": "succeeded", "summary": "ok"}),
        KEYS.report("j-2"): b"not json",
        KEYS.report("j-3"): enc({"outcome": "failed", "summary": "rendezvous failed: timeout"}),
        KEYS.alive("j-0"): b"x",
        KEYS.departing("j-4"): contract.DEPARTURE_SCALE_DOWN.encode(),
    }
    view = view_from_keys(PREFIX, kv, nproc_per_node=4)
    assert (view.round, view.world_size, view.restarts_spent) == (3, 12, 2)
    assert dict(view.failed_reports) == {"j-0": "job failed: boom"}
    assert view.succeeded_nodes == frozenset({"j-1"})
    assert view.departing == frozenset({"j-4"})


def test_view_from_keys_reads_every_nodes_hang_evidence_and_the_newest_restart() -> None:
    where = HangWhere(4, "j-1", (RankWhere(2, 0, 9, "T", True, "main thread at t.py:1 in f"),))
    history = [
        {"round": 2, "cause": "worker_failure", "node": "j-0", "detail": {}, "time": 1.0},
        {"round": 4, "cause": "hang", "node": "j-1", "time": 2.0,
         "detail": {"summary": "hang: rank 2 on j-1 (round 4): stopped " + "x" * 5000}},
    ]  # fmt: skip
    kv = {
        KEYS.hang("j-1"): encode_hang(where),
        KEYS.hang("j-0"): b'{"round": 4, "node": "j-0", "ranks": "not a list"}',  # refused
        KEYS.hang("j-2"): b"\xff" * 10,
        KEYS.restarts: enc({"count": 2, "history": history}),
    }
    view = view_from_keys(PREFIX, kv, 2)
    assert view.hangs == (where,)
    last = view.last_restart
    assert last is not None and (last.round, last.cause, last.node) == (4, "hang", "j-1")
    assert len(last.message) == 1024
    assert last.message.startswith("hang: rank 2 on j-1 (round 4): stopped x")
    # a charge without a summary says its cause and node; no history: none
    history[-1]["detail"] = {"summary": 7}
    last = view_from_keys(PREFIX, {KEYS.restarts: enc({"history": history})}, 2).last_restart
    assert last is not None and last.message == "hang on j-1"
    assert view_from_keys(PREFIX, {KEYS.restarts: enc({"count": 1})}, 2).last_restart is None
    history[-1]["detail"] = {"summary": "worker_failure: rank 1", "ignored": True}
    last = view_from_keys(PREFIX, {KEYS.restarts: enc({"history": history})}, 2).last_restart
    assert (
        last is not None and last.message == "not charged (an Ignore rule): worker_failure: rank 1"
    )
    assert KEYS.hangs_prefix in status_keys(PREFIX)  # a node's evidence wakes the job


@pytest.mark.parametrize(
    "kv",
    [
        {},
        {KEYS.rdzv_state: b"{broken", KEYS.restarts: b"[]"},
        {KEYS.rdzv_state: enc({"round": "x", "complete": True, "participants": []})},
    ],
)
def test_view_from_keys_tolerates_missing_and_corrupt_keys(kv: dict[str, bytes]) -> None:
    assert view_from_keys(PREFIX, kv, 2) == RendezvousView()


def test_an_incomplete_round_has_no_world_size() -> None:
    kv = {KEYS.rdzv_state: enc({"round": 1, "complete": False, "participants": {"j-0": 0}})}
    assert view_from_keys(PREFIX, kv, 2) == RendezvousView(round=1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("etcd:2379", ("etcd", 2379)),
        ("http://10.0.0.1:2379/", ("10.0.0.1", 2379)),
        ("[::1]:2379", ("::1", 2379)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["etcd", "etcd:port", ":2379"])
def test_parse_endpoint_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(text)


def test_the_real_store_reads_removes_and_deletes(etcd_server: EmbeddedEtcd) -> None:
    import pyetcd

    prefix = contract.job_prefix("ns", "j", uuid.uuid4().hex[:12])
    keys = contract.Keys(prefix)
    host, port = etcd_server.endpoint.rsplit(":", 1)
    raw = pyetcd.MultiEndpointEtcd3Client(
        [pyetcd.Endpoint(host, int(port), secure=False, time_retry=1)], timeout=5, failover=True
    )
    other = contract.job_prefix("ns", "j", "another-run")
    for key in (keys.alive("j-0"), keys.alive("j-1"), other + "rdzv/state"):
        raw.put(key, "x")
    raw.put(keys.rdzv_state, json.dumps({"round": 2, "complete": True, "participants": {"j-0": 0}}))
    store = EtcdRendezvousStore([etcd_server.endpoint], timeout=3, time_retry=0.5)
    try:
        assert store.read(prefix, 2) == RendezvousView(round=2, world_size=2)
        store.remove_nodes(prefix, ["j-1"])
        left = {m.key.decode() for _, m in raw.get_prefix(prefix)}
        assert left == {keys.alive("j-0"), keys.rdzv_state}
        store.mark_departing(prefix, ["j-0", "j-1"], contract.DEPARTURE_SCALE_DOWN)
        assert store.read(prefix, 2).departing == frozenset({"j-0", "j-1"})
        store.clear_departing(prefix, ["j-1", "j-9"])  # an absent notice is no error
        assert store.read(prefix, 2).departing == frozenset({"j-0"})
        store.delete_prefix(prefix)
        assert not list(raw.get_prefix(prefix))
        assert list(raw.get_prefix(other))  # another run's keys are untouched
        with pytest.raises(ValueError, match="refusing"):
            store.delete_prefix("/")
    finally:
        store.close()
        raw.delete_prefix(other)


def test_an_unreachable_etcd_fails_fast_with_the_endpoint_named() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    store = EtcdRendezvousStore([endpoint], timeout=1, time_retry=0.5)
    started = time.monotonic()
    with pytest.raises(RendezvousStoreError, match=endpoint):
        store.read(PREFIX, 1)
    assert time.monotonic() - started < 10
    store.close()


def test_store_cache_reuses_stores_per_endpoint_list() -> None:
    made: list[tuple[str, ...]] = []

    def factory(eps: tuple[str, ...]) -> EtcdRendezvousStore:
        made.append(eps)
        return EtcdRendezvousStore(eps)

    cache = StoreCache(factory)
    a = cache.get(["127.0.0.1:1"])
    assert cache.get(("127.0.0.1:1",)) is a
    cache.get(["127.0.0.1:2"])
    assert made == [("127.0.0.1:1",), ("127.0.0.1:2",)]
    cache.close()


# ----------------------------------------------------------------- status and events


def test_status_patch_sends_changes_and_nulls_for_removed_fields() -> None:
    old = ElasticJobStatus.model_validate(
        {
            "phase": "Restarting",
            "replicas": 2,
            "nextReplacementTime": "2026-01-01T00:00:00Z",
            "kopf": {"progress": {}},
        }
    )
    new = old.model_copy(update={"phase": "Running", "next_replacement_time": None})
    assert status_patch(old, new) == {"status": {"phase": "Running", "nextReplacementTime": None}}
    assert status_patch(old, old) == {"status": {}}


def test_event_body_names_the_job() -> None:
    from datetime import datetime, timezone

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    body = event_body(Event("Warning", "PodFailed", "x" * 2000), "j", "ns", "u1", now)
    assert body["involvedObject"] == {"apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob", "name": "j", "namespace": "ns", "uid": "u1"}  # fmt: skip
    assert (body["type"], body["reason"], len(body["message"])) == ("Warning", "PodFailed", 1024)
    assert body["metadata"]["name"].startswith("j.")
    assert body["lastTimestamp"] == "2026-01-01T00:00:00Z"


def test_the_operator_talks_to_an_etcd_that_requires_client_certificates(
    tls_etcd: tuple[str, Path],
) -> None:
    endpoint, tls_dir = tls_etcd
    prefix = contract.job_prefix("default", "tls", "u1")
    store = EtcdRendezvousStore([endpoint], timeout=3, time_retry=0.5, tls_dir=tls_dir)
    try:
        store.mark_departing(prefix, ["tls-1"], contract.DEPARTURE_SCALE_DOWN)
        store.delete_prefix(prefix)
        assert store.read(prefix, 1).round is None
    finally:
        store.close()
    plain = EtcdRendezvousStore([endpoint], timeout=1, time_retry=0.5)
    try:
        with pytest.raises(RendezvousStoreError, match="failed"):
            plain.delete_prefix(prefix)
    finally:
        plain.close()


def test_a_field_gone_from_a_nested_status_object_is_nulled_too() -> None:
    # A JSON merge patch merges nested objects key by key: a field the new value lacks
    # stays unless the patch nulls it (lastCheckpoint's step once stayed beside tier none).
    old = ElasticJobStatus.model_validate({
        "lastCheckpoint": {"round": 1, "step": 8, "tier": "memory", "time": "2026-01-01T00:00:00Z"},
        "lastInProcessRestart": {"iteration": 2, "cause": "exception", "rank": 3},
    })  # fmt: skip
    new = ElasticJobStatus.model_validate({
        "lastCheckpoint": {"round": 2, "tier": "none", "time": "2026-01-01T00:00:00Z"},
        "lastInProcessRestart": {"iteration": 3, "cause": "hang"},
    })  # fmt: skip
    patch = status_patch(old, new)["status"]
    assert patch == {
        "lastCheckpoint": {"round": 2, "step": None, "tier": "none"},
        "lastInProcessRestart": {"iteration": 3, "cause": "hang", "rank": None},
    }
    # applied as the API server applies a merge patch (RFC 7386), it gives the new status
    assert _merge(old.as_patch(), patch) == new.as_patch()


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out
