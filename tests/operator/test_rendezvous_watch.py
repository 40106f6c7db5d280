"""The operator's status watch (:mod:`kelastic_operator.rendezvous_watch`) on a real etcd:
a change of a key the job's status is read from wakes that job's reconciler at once (it
used to wait for the 30 s resync: the chart e2e test saw a short job finish before its
status ever showed world size 4); other keys (liveness, join requests, the barrier) and
other jobs' keys do not wake it; all jobs share one watch stream; a stalled etcd is
retried."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.etcd_view import status_keys
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.rendezvous_store import EtcdRendezvousStore
from kelastic_operator.rendezvous_watch import (
    StatusFollower,
    StatusHub,
    StatusHubs,
    job_of_status_key,
)
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


@pytest.fixture
def hubs() -> Iterator[StatusHubs]:
    made = StatusHubs(retry_seconds=0.2)
    yield made
    made.close()


def _prefix() -> str:
    return contract.job_prefix("ns", "j", uuid.uuid4().hex[:12])


def _watch_threads() -> int:
    return sum(t.name.startswith("status-watch") for t in threading.enumerate())


def test_the_status_keys_and_only_they_name_their_job() -> None:
    prefix = _prefix()
    keys = contract.Keys(prefix)
    for key in [*status_keys(prefix), keys.report("j-7")]:
        if not key.endswith("/"):
            assert job_of_status_key(key) == prefix, key
    for key in (keys.alive("j-1"), keys.joining("j-1"), keys.departing("j-1"), keys.master(2),
                keys.inprocess_ready(3, "j-1"), keys.reports_prefix, prefix, "/kelastic/x",
                "/other/ns/j/u/rdzv/state", "/kelastic//j/u/restarts",
                prefix + "restarts/extra"):  # fmt: skip
        assert job_of_status_key(key) is None, key


@given(st.text(max_size=80))
def test_job_of_status_key_never_raises(key: str) -> None:
    found = job_of_status_key(key)
    assert found is None or (key.startswith(found) and found.startswith("/kelastic/"))


def test_each_status_key_wakes_its_job_only(
    store: EtcdRendezvousStore, hubs: StatusHubs, etcd_server: EmbeddedEtcd
) -> None:
    prefix, other = _prefix(), _prefix()
    keys = contract.Keys(prefix)
    wakes, others = Wakes(), Wakes()
    mine, theirs = StatusFollower(hubs, wakes), StatusFollower(hubs, others)
    mine.follow(store, prefix)
    theirs.follow(store, other)
    try:
        wait_for(lambda: hubs.hub(store).watching, 10, what="the stream")
        assert wakes.count >= 1 and others.count >= 1, "no wake once followed"
        assert _watch_threads() == 1, "two jobs of one etcd: one stream"
        with EtcdClient([etcd_server.endpoint]) as etcd:
            for key in (keys.rdzv_state, keys.restarts, keys.report("j-1"),
                        keys.inprocess_iteration):  # fmt: skip
                seen, theirs_seen = wakes.count, others.count
                etcd.put(key, b'{"round": 1}')
                assert wakes.after(seen), f"a put of {key} did not wake"
                assert others.count == theirs_seen, f"a put of {key} woke another job"
            seen = wakes.count
            # what the sidecars write all the time: no wake
            etcd.put(keys.alive("j-1"), b"{}")
            etcd.put(keys.joining("j-2"), b"{}")
            etcd.put(keys.inprocess_ready(3, "j-1"), b"{}")
            etcd.delete(keys.report("j-1"))  # a status change after the noise: it is seen
            assert wakes.after(seen)
            assert wakes.count == seen + 1, "a key outside the status woke the reconciler"
    finally:
        mine.close()
        theirs.close()


def test_a_new_prefix_moves_the_registration_and_none_ends_it(
    store: EtcdRendezvousStore, hubs: StatusHubs, etcd_server: EmbeddedEtcd
) -> None:
    first, second = _prefix(), _prefix()
    wakes = Wakes()
    follower = StatusFollower(hubs, wakes)
    follower.follow(store, first)
    assert wakes.after(0)
    follower.follow(store, first)  # the same target: no new registration, no wake
    follower.follow(store, second)  # a new job uid: the registration follows it
    assert follower.following == second and hubs.hub(store).jobs == 1
    assert wakes.after(1)
    with EtcdClient([etcd_server.endpoint]) as etcd:
        seen = wakes.count
        etcd.put(contract.Keys(second).rdzv_state, b"{}")
        assert wakes.after(seen)
        follower.close()  # e.g. the job finished: no stream is kept for it
        assert follower.following is None and hubs.hub(store).jobs == 0
        wait_for(lambda: _watch_threads() == 0, 10, what="the idle hub's thread to end")
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
    hub = StatusHub(store, retry_seconds=0.2)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        unregister = hub.register(prefix, wakes)
        assert wakes.count == 1  # registering wakes once: a change since the last read
        assert not wakes.after(1, timeout=2.5), "woke while etcd could not have answered"
        assert _watch_threads() == 1 and not hub.watching
        os.kill(server.proc.pid, signal.SIGCONT)
        assert wakes.after(1, timeout=15), "no wake once the stream was made"
        wait_for(lambda: hub.watching, 10, what="the stream")
        seen = wakes.count
        with EtcdClient([server.endpoint]) as etcd:
            etcd.put(contract.Keys(prefix).restarts, b"{}")
        assert wakes.after(seen)
        unregister()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        hub.close()
        store.close()
        server.stop()


def test_a_failing_callback_does_not_stop_the_others(
    store: EtcdRendezvousStore, etcd_server: EmbeddedEtcd
) -> None:
    prefix = _prefix()
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        if len(calls) > 1:
            raise RuntimeError("a bug in one job's wake-up")

    wakes = Wakes()
    hub = StatusHub(store)
    try:
        hub.register(prefix, broken)
        hub.register(prefix, wakes)
        assert wakes.after(0)
        with EtcdClient([etcd_server.endpoint]) as etcd:
            for n in range(3):
                seen = wakes.count
                etcd.put(contract.Keys(prefix).rdzv_state, str(n).encode())
                assert wakes.after(seen), n
    finally:
        hub.close()
