"""The operator's status watch (:class:`~kelastic_operator.rendezvous_watch.StatusFollower`)
on a real etcd: a change of a key the job's status is read from wakes the job's reconciler
at once (it used to wait for the 30 s resync: the chart e2e test saw a short job finish
before its status ever showed world size 4); other keys (liveness, join requests, the
barrier) do not wake it; a stalled etcd is retried."""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator

import pytest

from kelastic import contract
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, status_keys
from kelastic_operator.rendezvous_watch import StatusFollower
from kelastic_sidecar.etcd_store import EtcdStore
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)


class Wakes:
    """Counts ``on_change`` calls; :meth:`after` waits for more than ``n``."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def after(self, n: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count > n, timeout)


@pytest.fixture
def store(etcd_server: EmbeddedEtcd) -> Iterator[EtcdRendezvousStore]:
    rdzv = EtcdRendezvousStore([etcd_server.endpoint], timeout=3)
    yield rdzv
    rdzv.close()


def _prefix() -> str:
    return contract.job_prefix("ns", "j", uuid.uuid4().hex[:12])


def test_status_keys_are_the_ones_the_view_reads() -> None:
    keys = contract.Keys(_prefix())
    assert status_keys(keys.prefix) == [
        keys.rdzv_state, keys.restarts, keys.reports_prefix, keys.inprocess_iteration]  # fmt: skip


def test_each_status_key_wakes_and_other_keys_do_not(
    store: EtcdRendezvousStore, etcd_server: EmbeddedEtcd
) -> None:
    prefix = _prefix()
    keys = contract.Keys(prefix)
    wakes = Wakes()
    follower = StatusFollower(wakes, name="ns/j")
    follower.follow(store, prefix)
    try:
        assert wakes.after(0), "no wake once the watch was made"
        with EtcdStore([etcd_server.endpoint]) as etcd:
            for key in (keys.rdzv_state, keys.restarts, keys.report("j-1"),
                        keys.inprocess_iteration):  # fmt: skip
                seen = wakes.count
                etcd.put(key, json.dumps({"round": 1}).encode())
                assert wakes.after(seen), f"a put of {key} did not wake"
            seen = wakes.count
            # what the sidecars write all the time, and another job's state: no wake
            etcd.put(keys.alive("j-1"), b"{}")
            etcd.put(keys.joining("j-2"), b"{}")
            etcd.put(keys.inprocess_ready(3, "j-1"), b"{}")
            etcd.put(contract.Keys(_prefix()).rdzv_state, b"{}")
            etcd.delete(keys.report("j-1"))  # a barrier write after the noise: it is seen
            assert wakes.after(seen)
            assert wakes.count == seen + 1, "a key outside the status woke the reconciler"
    finally:
        follower.close()


def test_a_new_prefix_moves_the_watch_and_none_stops_it(
    store: EtcdRendezvousStore, etcd_server: EmbeddedEtcd
) -> None:
    first, second = _prefix(), _prefix()
    wakes = Wakes()
    follower = StatusFollower(wakes, name="ns/j", poll_seconds=0.1)
    follower.follow(store, first)
    assert wakes.after(0)
    follower.follow(store, first)  # the same target: the same watch, no new wake
    follower.follow(store, second)  # a new job uid: the watch follows it
    assert follower.following == second
    assert wakes.after(1)
    with EtcdStore([etcd_server.endpoint]) as etcd:
        seen = wakes.count
        etcd.put(contract.Keys(second).rdzv_state, b"{}")
        assert wakes.after(seen)
        follower.close()  # e.g. the job finished: no watch is kept
        assert follower.following is None
        wait_for(lambda: not any(t.name == "status-watch ns/j" for t in threading.enumerate()),
                 10, what="the watch thread to end")  # fmt: skip
        seen = wakes.count
        etcd.put(contract.Keys(second).rdzv_state, b"{}")
        etcd.put(contract.Keys(first).rdzv_state, b"{}")
        assert not wakes.after(seen, timeout=0.5)


def test_a_stalled_etcd_is_retried_until_it_answers() -> None:
    server = EmbeddedEtcd().start()
    assert server.proc is not None
    store = EtcdRendezvousStore([server.endpoint], timeout=1)
    prefix = _prefix()
    wakes = Wakes()
    follower = StatusFollower(wakes, name="ns/j", retry_seconds=0.2)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        follower.follow(store, prefix)
        assert not wakes.after(0, timeout=2.5), "woke while etcd could not have answered"
        assert any(t.name == "status-watch ns/j" for t in threading.enumerate())
        os.kill(server.proc.pid, signal.SIGCONT)
        assert wakes.after(0, timeout=15), "the watch was not made once etcd answered"
        seen = wakes.count
        with EtcdStore([server.endpoint]) as etcd:
            etcd.put(contract.Keys(prefix).restarts, b"{}")
        assert wakes.after(seen)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        follower.close()
        store.close()
        server.stop()
