"""witness.publish: a node's hang evidence into etcd for the operator, by the value's one
codec, on a thread of its own (a stalled or dead etcd never holds up the round's end)."""

from __future__ import annotations

import logging
import threading

import pytest

from kelastic import contract
from kelastic.etcd_values import decode_hang
from kelastic.hang_where import HangWhere, RankWhere
from kelastic_etcd import EtcdClient
from kelastic_sidecar.witness import publish

WHERE = HangWhere(2, "j-1", (RankWhere(1, 1, 77, "T", True, "main thread at t.py:3 in f"),))
KEY = contract.Keys(contract.job_prefix("ns", "j", "u")).hang("j-1")


def test_the_evidence_is_written_for_the_operator(store: EtcdClient) -> None:
    publish(store, KEY, WHERE).join(10)
    got = store.get(KEY)
    assert got is not None and decode_hang(got[0]) == WHERE


def test_a_dead_etcd_is_logged_and_raises_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with EtcdClient(["127.0.0.1:1"], timeout=0.5) as dead, caplog.at_level(logging.WARNING):
        thread = publish(dead, KEY, WHERE)
        thread.join(30)
        assert not thread.is_alive()
    assert "cannot publish the hang evidence of round 2" in caplog.text


class _StalledStore:
    """An etcd whose put does not return until released (a stalled etcd)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.entered.set()
        self.release.wait(30)


def test_the_caller_never_waits_on_etcd() -> None:
    stalled = _StalledStore()
    thread = publish(stalled, KEY, WHERE)  # type: ignore[arg-type]
    assert stalled.entered.wait(10)  # the put is under way, and publish has returned
    assert thread.is_alive() and thread.daemon
    stalled.release.set()
    thread.join(10)
