"""LatestPublisher: the newest of a series of values to one etcd key, off the caller's
thread, coalescing, never older than what it wrote; and the sidecar's straggler report
through it (``wiring.straggler_reporter``), by the value's one codec."""

from __future__ import annotations

import logging
import threading

import pytest

from kelastic import contract
from kelastic.etcd_values import decode_stragglers
from kelastic_etcd import EtcdClient
from kelastic_sidecar.etcd_publish import LatestPublisher
from kelastic_sidecar.steptime import Straggler
from kelastic_sidecar.wiring import straggler_reporter

KEY = contract.Keys(contract.job_prefix("ns", "j", "u")).straggler("j-0")


def test_the_newest_version_is_written_and_an_older_one_never_after(store: EtcdClient) -> None:
    out = LatestPublisher(store, KEY, "stragglers")
    out.put(2, b"two")
    out.put(1, b"one")  # older than one given: dropped
    assert out.idle(10)
    got = store.get(KEY)
    assert got is not None and got[0] == b"two"
    out.put(3, b"three")
    assert out.idle(10) and store.get(KEY)[0] == b"three"  # type: ignore[index]


class _Gate:
    """An etcd whose put waits until released (a stalled etcd), recording what it got."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.values: list[bytes] = []

    def put(self, key: str, value: bytes) -> None:
        self.entered.set()
        self.release.wait(30)
        self.values.append(value)


def test_a_stalled_etcd_blocks_no_caller_and_the_values_meanwhile_coalesce() -> None:
    gate = _Gate()
    out = LatestPublisher(gate, KEY, "stragglers")  # type: ignore[arg-type]
    out.put(1, b"1")
    assert gate.entered.wait(10)  # the first write is stuck in etcd; put returned
    for version in range(2, 50):
        out.put(version, str(version).encode())
    gate.release.set()
    assert out.idle(10)
    assert gate.values == [b"1", b"49"]  # the flaps in between cost no write


def test_a_dead_etcd_is_logged_and_the_next_value_still_goes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with EtcdClient(["127.0.0.1:1"], timeout=0.5) as dead, caplog.at_level(logging.WARNING):
        out = LatestPublisher(dead, KEY, "stragglers")
        out.put(1, b"x")
        assert out.idle(30) and out.failed == 1
        out.put(2, b"y")
        assert out.idle(30) and out.failed == 2
    assert "cannot write the stragglers (version 1) to etcd" in caplog.text


def test_the_straggler_report_is_the_values_codec(store: EtcdClient) -> None:
    out = LatestPublisher(store, KEY, "stragglers")
    report = straggler_reporter("j-0", "uid-0", out)
    report(1, [Straggler(3, "train_step", 0.3, 0.1, 3.0)])
    assert out.idle(10)
    doc = decode_stragglers(store.get(KEY)[0])  # type: ignore[index]
    assert (doc["node"], doc["pod_uid"]) == ("j-0", "uid-0") and doc["time"] > 0
    assert doc["stragglers"] == [{"local_rank": 3, "scope": "train_step", "median_s": 0.3,
                                  "others_median_s": 0.1, "ratio": 3.0}]  # fmt: skip
    report(2, [])
    assert out.idle(10) and decode_stragglers(store.get(KEY)[0])["stragglers"] == []  # type: ignore[index]
    # a verdict the codec refuses (a NaN) is logged, nothing is written
    report(3, [Straggler(1, "s", float("nan"), 0.1, float("nan"))])
    assert out.idle(10) and out.written == 2
