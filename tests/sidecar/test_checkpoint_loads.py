"""The sidecar's part that tells the operator what its workers loaded
(kelastic_sidecar/checkpoint_loads.py), with a real etcd and the workers' own records
written by the worker library's writer (kelastic.checkpoint.restored)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic import contract
from kelastic.checkpoint.restored import Restored, write_restored
from kelastic.etcd_values.loads import LoadDoc, decode_load
from kelastic_etcd import EtcdClient
from kelastic_sidecar.checkpoint_loads import LoadReporter
from tests.conftest import wait_for as wait_until


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdClient]:
    with EtcdClient([etcd_endpoint]) as client:
        yield client


def _value(store: EtcdClient, key: str) -> LoadDoc | None:
    got = store.get(key)
    return decode_load(got[0]) if got else None


def test_the_load_is_written_once_every_worker_of_the_node_loaded(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    key = contract.Keys(job_prefix).checkpoint_load("j-0")
    reporter = LoadReporter(store, key, tmp_path)
    try:
        reporter.begin(5, 40, "peer", 2)
        write_restored(tmp_path, Restored(0, 5, 40, "memory", 0.012))
        write_restored(tmp_path, Restored(1, 4, 40, "memory", 3.0))  # an earlier round's
        seen = reporter.looks
        wait_until(lambda: reporter.looks > seen + 1, 5.0, what="two looks since")
        assert _value(store, key) is None and reporter.written == []  # one of two: nothing
        write_restored(tmp_path, Restored(1, 5, 40, "memory", 0.034))
        doc = wait_until(lambda: _value(store, key), 10.0, 0.05, what="the load written")
        assert (doc.round, doc.step, doc.tier, doc.ranks, doc.seconds) == (5, 40, "peer", 2, 0.034)
        assert reporter.written == [doc]
        # the next start drops what the last one waited for, and writes its own
        reporter.begin(6, 50, "disk", 1)
        write_restored(tmp_path, Restored(0, 6, 50, "disk", 0.5))
        doc = wait_until(lambda: (d := _value(store, key)) and d.round == 6 and d, 10.0, 0.05,
                         what="round 6's load")  # fmt: skip
        assert (doc.step, doc.tier, doc.ranks, doc.seconds) == (50, "disk", 1, 0.5)
    finally:
        reporter.close()
    assert reporter._thread is not None and not reporter._thread.is_alive()


def test_a_start_whose_workers_never_load_writes_nothing_and_costs_no_error(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    key = contract.Keys(job_prefix).checkpoint_load("j-0")
    reporter = LoadReporter(store, key, tmp_path / "missing")  # no folder at all
    try:
        reporter.begin(1, 3, "memory", 2)
        wait_until(lambda: reporter.looks >= 3, 5.0, what="three looks")
        assert _value(store, key) is None and reporter.written == []
    finally:
        reporter.close()


def test_a_dead_etcd_loses_the_load_time_of_that_round_only(
    job_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kelastic_operator.local.etcd import free_port

    dead = EtcdClient([f"127.0.0.1:{free_port()}"], timeout=0.5)
    reporter = LoadReporter(dead, contract.Keys(job_prefix).checkpoint_load("j-0"), tmp_path)
    try:
        reporter.begin(2, 7, "memory", 1)
        write_restored(tmp_path, Restored(0, 2, 7, "memory", 0.1))
        wait_until(lambda: reporter._wanted is None, 30.0, 0.05, what="given up")
        assert reporter.written == [] and "not written" in caplog.text
    finally:
        reporter.close()
        dead.close()
