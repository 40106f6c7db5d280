"""The job's global restart budget on a real etcd."""

from __future__ import annotations

import json
import threading

import pytest

from kelastic.contract import Keys
from kelastic_etcd import EtcdClient
from kelastic_sidecar.restart_budget import (
    HISTORY_LIMIT,
    MAX_IGNORED,
    BudgetCharge,
    RestartBudget,
    RestartRecord,
    RestartRecordError,
    apply_amend,
    apply_charge,
    apply_ignore,
    decode_record,
    encode_record,
    recent_charges,
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


# --------------------------------------------- a stopped worker amends its round's charge

WAITED = {"summary": "hang: rank 2 on n1 (round 4): timer 'step' expired", "stopped": False}
STOPPED = {"summary": "hang: rank 1 on n0 (round 4): stopped (process state T)", "stopped": True}


def _charged(cause: str = "hang", detail: dict[str, object] | None = None) -> RestartRecord:
    entry = {"round": 4, "cause": cause, "node": "n1", "detail": detail or WAITED, "time": 9.0}
    return RestartRecord(count=2, last_round=4, history=({"round": 3}, entry))


@pytest.mark.parametrize(
    ("record", "round_", "cause", "detail", "amends"),
    [
        (_charged(), 4, "hang", STOPPED, True),
        (_charged(), 4, "hang", WAITED, False),  # not stopped: the first charge stays
        (_charged(), 4, "worker_failure", STOPPED, False),
        (_charged("worker_failure"), 4, "hang", STOPPED, False),  # another cause was charged
        (_charged(detail=STOPPED), 4, "hang", {**STOPPED, "summary": "x"}, False),  # once
        (_charged(), 3, "hang", STOPPED, False),  # not the newest round
        (_charged(), 5, "hang", STOPPED, False),  # not charged yet: amend never charges
        (RestartRecord(), 0, "hang", STOPPED, False),
        (_charged(), 4, "hang", {**STOPPED, "stopped": "yes"}, False),
    ],
)
def test_which_charges_a_stopped_worker_amends(
    record: RestartRecord, round_: int, cause: str, detail: dict[str, object], amends: bool
) -> None:
    new = apply_amend(record, round_, cause, "n0", detail)
    assert (new is not None) is amends
    if new is not None:
        assert (new.count, new.last_round, new.history[0]) == (2, 4, {"round": 3})
        entry = new.history[-1]
        assert (entry["node"], entry["cause"], entry["time"]) == ("n0", "hang", 9.0)
        assert entry["detail"] == {**STOPPED, "waited": WAITED["summary"]}


def test_the_charge_of_a_hang_names_the_stopped_worker_found_later(
    store: EtcdClient, keys: Keys
) -> None:
    """A peer whose timer expired while it waited charges first; the node of the stopped
    worker charges the same round after: the count stays, the entry names the culprit."""
    budget = RestartBudget(store, keys, max_restarts=3)
    assert budget.charge(4, "hang", "n1", WAITED) == BudgetCharge(1, True, False)
    assert budget.charge(4, "hang", "n0", STOPPED) == BudgetCharge(1, False, False)
    (entry,) = budget.read().history
    assert (entry["node"], entry["detail"]["summary"]) == ("n0", STOPPED["summary"])
    assert entry["detail"]["waited"] == WAITED["summary"]
    assert budget.charge(4, "hang", "n2", {**STOPPED, "summary": "other"}).count == 1
    assert budget.read().history[-1]["node"] == "n0"  # amended once


def test_an_amend_of_an_ignored_round_keeps_it_uncharged(store: EtcdClient, keys: Keys) -> None:
    budget = RestartBudget(store, keys, max_restarts=3)
    budget.charge(4, "hang", "n1", WAITED, ignored=True)
    assert budget.charge(4, "hang", "n0", STOPPED, ignored=True).count == 0
    entry = budget.read().history[-1]
    assert entry["node"] == "n0" and entry["detail"]["ignored"] is True


def test_amend_alone_never_charges(store: EtcdClient, keys: Keys) -> None:
    """The peer-restart path: a node finds its stopped worker after a peer ended the
    round; with the round charged it amends, without a charge it writes nothing."""
    budget = RestartBudget(store, keys, max_restarts=3)
    assert budget.amend(0, "hang", "n0", STOPPED) is False
    assert budget.read() == RestartRecord()
    budget.charge(0, "hang", "n1", WAITED)
    assert budget.amend(0, "hang", "n0", STOPPED) is True
    record = budget.read()
    assert record.count == 1 and record.history[-1]["node"] == "n0"
    with pytest.raises(ValueError):
        budget.amend(-1, "hang", "n0", STOPPED)


# ------------------------------------ an Ignore rule's restarts: recorded, bounded


def test_an_ignored_restart_is_recorded_without_a_charge(store: EtcdClient, keys: Keys) -> None:
    budget = RestartBudget(store, keys, max_restarts=0)  # one charge would fail the job
    assert budget.charge(3, "worker_failure", "n0", {"summary": "s"}, ignored=True) == (
        BudgetCharge(0, False, False))  # fmt: skip
    record = budget.read()
    assert (record.count, record.last_round) == (0, 3)
    assert record.history[-1]["detail"] == {"summary": "s", "ignored": True}
    # the round is recorded: another node's report of it adds nothing
    assert budget.charge(3, "worker_failure", "n1", {}, ignored=True).count == 0
    assert len(budget.read().history) == 1


def test_an_ignore_rule_matching_over_and_over_is_counted_at_its_cap(
    store: EtcdClient, keys: Keys
) -> None:
    """A failure an Ignore rule matches every round is deterministic: after MAX_IGNORED
    ignored restarts in the record, the next is charged (and may end the job)."""
    budget = RestartBudget(store, keys, max_restarts=2)
    for round_ in range(MAX_IGNORED):
        assert not budget.charge(round_, "worker_failure", "n0", {}, ignored=True).charged
    capped = budget.charge(MAX_IGNORED, "worker_failure", "n0", {}, ignored=True)
    assert capped == BudgetCharge(1, True, False)
    assert budget.read().history[-1]["detail"] == {"ignore_cap": True}
    # a Count failure in between is charged as always
    assert budget.charge(MAX_IGNORED + 1, "hang", "n0", {}).charged


@pytest.mark.parametrize(
    ("record", "round_", "applies"),
    [(RestartRecord(), 0, True), (RestartRecord(0, 4, ()), 4, False),
     (RestartRecord(0, 4, ()), 5, True)],
)  # fmt: skip
def test_apply_ignore(record: RestartRecord, round_: int, applies: bool) -> None:
    new = apply_ignore(record, round_, "c", "n", {"x": 1}, now=7.0)
    assert (new is not None) is applies
    if new is not None:
        assert (new.count, new.last_round) == (record.count, round_)
        assert new.history[-1] == {"round": round_, "cause": "c", "node": "n", "time": 7.0,
                                   "detail": {"x": 1, "ignored": True}}  # fmt: skip


def test_recent_charges_count_back_from_the_record_and_skip_ignored_rounds(
    store: EtcdClient, keys: Keys
) -> None:
    """A sidecar's ``/status`` ``charges``: each charged restart with its count and round
    (what ``kelastic run`` names a restart no poll saw by), the stderr tail left out."""
    budget = RestartBudget(store, keys, max_restarts=5)

    def failure(r: int, text: str) -> dict[str, object]:
        return {"round": r, "summary": text, "time": 1.0 + r, "tail": ["line"] * 50, "rank": 3}

    budget.charge(0, "worker_failure", "n0", failure(0, "a"))
    budget.charge(1, "worker_failure", "n1", failure(1, "b"), ignored=True)  # spends nothing
    budget.charge(2, "hang", "n0", failure(2, "c"))
    got = recent_charges(budget.read())
    assert [(c["count"], c["round"], c["summary"], c["rank"]) for c in got] == [
        (1, 0, "a", 3), (2, 2, "c", 3)]  # fmt: skip
    assert all("tail" not in c for c in got)
    assert recent_charges(budget.read(), limit=1) == got[-1:]
    # a record replaced after corruption keeps its count, not its history
    (last,) = budget.read().history[-1:]
    assert recent_charges(RestartRecord(7, 9, (last,))) == [{**got[-1], "count": 7}]
    assert recent_charges(RestartRecord()) == []
    # the history holds more entries than restarts spent: none is counted below 1
    assert [c["count"] for c in recent_charges(RestartRecord(1, 9, (last, last, last)))] == [1]
