"""The job's global restart budget on a real etcd."""

from __future__ import annotations

import json
import threading

import pytest

from kelastic.contract import Keys
from kelastic_etcd import EtcdClient
from kelastic_sidecar.restart_budget import (
    HISTORY_LIMIT,
    BudgetCharge,
    RestartBudget,
    RestartRecord,
    RestartRecordError,
    apply_charge,
    decode_record,
    encode_record,
)


@pytest.fixture
def keys(job_prefix: str) -> Keys:
    return Keys(job_prefix)


def test_empty_budget(store: EtcdClient, keys: Keys) -> None:
    record = RestartBudget(store, keys, 3).read()
    assert record == RestartRecord(count=0, last_round=-1, history=())


def test_charge_once_per_round(store: EtcdClient, keys: Keys) -> None:
    budget = RestartBudget(store, keys, max_restarts=2)
    assert budget.charge(0, "worker_failure", "n0", {"exitcode": 1}) == BudgetCharge(1, True, False)
    assert budget.charge(0, "node_lost", "n1", {}) == BudgetCharge(1, False, False)
    assert budget.charge(1, "hang", "n1", {}) == BudgetCharge(2, True, False)
    # a late report of an older round spends nothing
    assert budget.charge(0, "worker_failure", "n2", {}) == BudgetCharge(2, False, False)
    third = budget.charge(2, "worker_failure", "n0", {"exitcode": 137})
    assert third == BudgetCharge(3, True, True)  # count > max_restarts: the job must fail
    assert budget.charge(2, "worker_failure", "n1", {}) == BudgetCharge(3, False, True)
    record = budget.read()
    assert record.count == 3 and record.last_round == 2
    assert [(h["round"], h["cause"], h["node"]) for h in record.history] == [
        (0, "worker_failure", "n0"),
        (1, "hang", "n1"),
        (2, "worker_failure", "n0"),
    ]
    assert record.history[2]["detail"] == {"exitcode": 137}
    assert isinstance(record.history[0]["time"], float)


def test_zero_restarts_allowed(store: EtcdClient, keys: Keys) -> None:
    assert RestartBudget(store, keys, 0).charge(5, "c", "n", {}).exhausted


def test_concurrent_reports_of_one_round_charge_once(etcd_endpoint: str, keys: Keys) -> None:
    """Every node sees the same failure and reports it at once: one restart is spent."""
    nodes = 8
    stores = [EtcdClient([etcd_endpoint]) for _ in range(nodes)]
    charges: dict[int, BudgetCharge] = {}
    start = threading.Barrier(nodes)

    def report(i: int) -> None:
        start.wait()
        charges[i] = RestartBudget(stores[i], keys, 3).charge(7, "worker_failure", f"n{i}", {})

    try:
        threads = [threading.Thread(target=report, args=(i,)) for i in range(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(charges) == nodes
        assert sum(c.charged for c in charges.values()) == 1
        assert {c.count for c in charges.values()} == {1}
        assert RestartBudget(stores[0], keys, 3).read().count == 1
    finally:
        for s in stores:
            s.close()


def test_concurrent_rounds_all_count(etcd_endpoint: str, keys: Keys) -> None:
    """Failures of different rounds each spend one, whatever the interleaving."""
    stores = [EtcdClient([etcd_endpoint]) for _ in range(4)]

    def report(i: int) -> None:
        budget = RestartBudget(stores[i], keys, 100)
        for r in range(i * 5, i * 5 + 5):
            budget.charge(r, "c", f"n{i}", {})

    try:
        threads = [threading.Thread(target=report, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        # rounds only grow: a report for a round older than the last charged one is late
        record = RestartBudget(stores[0], keys, 100).read()
        assert 5 <= record.count <= 20
        assert record.last_round == 19
        assert [h["round"] for h in record.history] == sorted(h["round"] for h in record.history)
    finally:
        for s in stores:
            s.close()


def test_history_is_capped() -> None:
    record = RestartRecord()
    for r in range(HISTORY_LIMIT + 20):
        new = apply_charge(record, r, "c", "n", {"i": r}, now=float(r))
        assert new is not None
        record = new
    assert record.count == HISTORY_LIMIT + 20
    assert len(record.history) == HISTORY_LIMIT
    assert record.history[0]["round"] == 20
    assert decode_record(encode_record(record)) == record


def test_corrupt_record_is_replaced_another_version_is_an_error(
    store: EtcdClient, keys: Keys
) -> None:
    budget = RestartBudget(store, keys, 3)
    store.put(keys.restarts, b"three restarts")
    with pytest.raises(RestartRecordError, match=r"restarts: not JSON"):
        budget.read()
    charge = budget.charge(1, "c", "n", {})  # a corrupt record is replaced, then charged
    assert (charge.count, charge.charged, budget.repaired) == (1, True, 1)
    store.put(keys.restarts, json.dumps({"version": 2, "count": 1}).encode())
    with pytest.raises(RestartRecordError, match="version 2"):
        budget.read()
    with pytest.raises(RestartRecordError, match="version 2"):  # never overwritten
        budget.charge(2, "c", "n", {})


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"version": 1, "count": -1, "last_round": 0, "history": []},
        {"version": 1, "count": True, "last_round": 0, "history": []},
        {"version": 1, "count": 1, "last_round": "0", "history": []},
        {"version": 1, "count": 1, "last_round": 0, "history": {}},
        {"version": 1, "count": 1, "last_round": 0, "history": [{"round": 0}]},
    ],
)
def test_decode_rejects_malformed_records(doc: object) -> None:
    with pytest.raises(RestartRecordError):
        decode_record(json.dumps(doc).encode())


def test_bad_arguments(store: EtcdClient, keys: Keys) -> None:
    with pytest.raises(ValueError):
        RestartBudget(store, keys, -1)
    budget = RestartBudget(store, keys, 1)
    with pytest.raises(ValueError):
        budget.charge(-1, "c", "n", {})
    with pytest.raises((TypeError, ValueError)):
        budget.charge(0, "c", "n", {"bad": object()})
    assert budget.read().count == 0
