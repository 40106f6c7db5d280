"""Watcher (one long-lived etcd watch stream) against a real etcd: wake-ups, the
deletions-only filter, no request per wait, outages, compaction and closing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kelastic_etcd import EtcdClient, EtcdError, Watcher
from tests.conftest import wait_for
from tests.etcd_client.test_etcd_store import OutageProxy


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdClient]:
    s = EtcdClient([etcd_endpoint], timeout=5.0)
    yield s
    s.close()


def _wait_in_thread(
    watcher: Watcher, since: int, timeout: float
) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(watcher.wait(since, timeout))
        except Exception as exc:  # the test asserts on it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_wakes_a_waiter_on_a_put_and_a_deletion(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state", job_prefix + "notes/"])
    try:
        since = store.read([job_prefix + "state"]).revision
        thread, out = _wait_in_thread(watcher, since, 30)
        store.put(job_prefix + "notes/a", b"1")
        thread.join(30)
        assert out == [True]
        since = store.read([job_prefix + "state"]).revision
        thread, out = _wait_in_thread(watcher, since, 30)
        store.delete(job_prefix + "notes/a")
        thread.join(30)
        assert out == [True]
    finally:
        watcher.close()


def test_other_keys_do_not_count_and_the_wait_times_out(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"])
    try:
        since = store.read([job_prefix + "state"]).revision
        store.put(job_prefix + "state-not", b"1")  # a key sharing the name's start
        store.put(job_prefix + "other", b"1")
        started = time.monotonic()
        assert watcher.wait(since, 0.3) is False
        assert time.monotonic() - started >= 0.3
    finally:
        watcher.close()


def test_a_change_before_the_wait_returns_at_once(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"])
    try:
        since = store.read([job_prefix + "state"]).revision
        store.put(job_prefix + "state", b"1")
        wait_for(lambda: watcher.wait(since, 0), 10, what="the event to arrive")
        assert watcher.wait(since, 30) is True  # no blocking once it is known
        now = store.read([job_prefix + "state"]).revision
        assert watcher.wait(now, 0.05) is False  # nothing after the latest read
    finally:
        watcher.close()


def test_a_revision_older_than_the_watch_means_re_read(store: EtcdClient, job_prefix: str) -> None:
    before = store.read([job_prefix + "state"]).revision
    store.put(job_prefix + "state", b"1")  # made before the watch existed
    watcher = Watcher(store, [job_prefix + "state"])
    try:
        covered = watcher.covered_from
        assert covered is not None and covered > before
        assert watcher.wait(before, 30) is True
        assert watcher.wait(covered, 0.05) is False
    finally:
        watcher.close()


def test_deletions_only_ignores_puts(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"], deletions=[job_prefix + "alive/"])
    try:
        lease = store.grant_lease(5)
        store.put(job_prefix + "alive/a", b"x", lease=lease.id)
        since = store.read([job_prefix + "alive/"]).revision
        store.put(job_prefix + "alive/b", b"x")  # a peer appears: not a change
        assert watcher.wait(since, 0.3) is False
        lease.revoke()  # the lease goes: its key is deleted
        assert watcher.wait(since, 30) is True
    finally:
        watcher.close()


def test_waits_send_no_requests(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"], deletions=[job_prefix + "alive/"])
    try:
        before = store.request_counts()
        assert before.get("watch") == 1
        for _ in range(20):
            since = store.read([job_prefix + "state"]).revision
            store.put(job_prefix + "state", b"v")
            assert watcher.wait(since, 30) is True
        after = store.request_counts()
        assert after.get("watch") == 1  # still the one stream
        assert after.get("wait_change", 0) == before.get("wait_change", 0)
    finally:
        watcher.close()


def test_outage_raises_after_the_timeout_and_nothing_is_missed(
    etcd_endpoint: str, job_prefix: str
) -> None:
    proxy = OutageProxy(etcd_endpoint)
    proxy.up()
    direct = EtcdClient([etcd_endpoint], timeout=5.0)
    cut_off = EtcdClient([proxy.endpoint], timeout=1.0)
    errors: list[EtcdError] = []
    cut_off.on_error = errors.append
    watcher = Watcher(cut_off, [job_prefix + "state"])
    try:
        since = direct.read([job_prefix + "state"]).revision
        proxy.down()
        started = time.monotonic()
        with pytest.raises(EtcdError, match="watch"):
            watcher.wait(since, 30)
        assert 0.9 <= time.monotonic() - started < 10
        assert errors, "the broken stream was not reported"
        direct.put(job_prefix + "state", b"written while cut off")
        proxy.up()
        # the watch resumes from the last revision it saw: the put is reported (until
        # the stream is back, waits keep saying etcd is unavailable)
        wait_for(lambda: _changed(watcher, since), 15, what="the put made while cut off")
        assert cut_off.request_counts()["watch"] >= 2
    finally:
        watcher.close()
        proxy.down()
        cut_off.close()
        direct.close()


def test_compacted_history_means_re_read(etcd_endpoint: str, job_prefix: str) -> None:
    from pyetcd import etcdrpc

    proxy = OutageProxy(etcd_endpoint)
    proxy.up()
    direct = EtcdClient([etcd_endpoint], timeout=5.0)
    cut_off = EtcdClient([proxy.endpoint], timeout=5.0)
    watcher = Watcher(cut_off, [job_prefix + "state"])
    try:
        covered = watcher.covered_from
        assert covered is not None
        proxy.down()
        wait_for(lambda: cut_off.request_counts().get("errors"), 15, what="the stream to break")
        for i in range(3):
            direct.put(job_prefix + "unwatched", str(i).encode())
        head = direct.read([job_prefix + "state"]).revision
        direct.endpoint().kv.Compact(etcdrpc.CompactionRequest(revision=head, physical=True))
        proxy.up()
        # resuming at covered + 1 is refused (compacted): the watch starts again from
        # now, and a wait for any revision before that says "re-read"
        wait_for(lambda: (watcher.covered_from or 0) > covered, 15, what="the watch to restart")
        assert watcher.wait(head - 1, 0) is True
        new = watcher.covered_from
        assert new is not None and watcher.wait(new, 0.05) is False
    finally:
        watcher.close()
        proxy.down()
        cut_off.close()
        direct.close()


def test_wake_ends_a_wait_or_the_next_one_once(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"])
    try:
        since = store.read([job_prefix + "state"]).revision
        thread, out = _wait_in_thread(watcher, since, 60)
        wait_for(lambda: thread.is_alive(), 5)
        watcher.wake()  # a waiter: it returns True, nothing having changed
        thread.join(10)
        assert not thread.is_alive() and out == [True]
        watcher.wake()  # nobody waiting: the next wait returns at once, the one after waits
        assert watcher.wait(since, 30) is True
        assert watcher.wait(since, 0.05) is False
    finally:
        watcher.close()


def test_close_wakes_waiters_and_ends_the_thread(store: EtcdClient, job_prefix: str) -> None:
    watcher = Watcher(store, [job_prefix + "state"])
    since = store.read([job_prefix + "state"]).revision
    thread, out = _wait_in_thread(watcher, since, 60)
    wait_for(lambda: thread.is_alive(), 5)
    watcher.close()
    thread.join(10)
    assert not thread.is_alive()
    assert len(out) == 1 and isinstance(out[0], EtcdError)
    assert not watcher._thread.is_alive()
    watcher.close()  # idempotent


def test_closing_the_store_wakes_waiters(etcd_endpoint: str, job_prefix: str) -> None:
    store = EtcdClient([etcd_endpoint], timeout=5.0)
    watcher = Watcher(store, [job_prefix + "state"])
    since = store.read([job_prefix + "state"]).revision
    thread, out = _wait_in_thread(watcher, since, 60)
    store.close()
    thread.join(10)
    assert len(out) == 1 and isinstance(out[0], EtcdError)
    wait_for(lambda: not watcher._thread.is_alive(), 10, what="the watch thread to end")


def test_bad_arguments_and_a_dead_etcd(store: EtcdClient) -> None:
    with pytest.raises(ValueError, match="nothing to watch"):
        Watcher(store, [])
    with pytest.raises(ValueError):
        Watcher(store, [""])
    sock_port = _free_port()
    dead = EtcdClient([f"127.0.0.1:{sock_port}"], timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(EtcdError):
            Watcher(dead, ["/x"])
        assert time.monotonic() - started < 5
    finally:
        dead.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _changed(watcher: Watcher, since: int) -> bool:
    try:
        return watcher.wait(since, 0.5)
    except EtcdError:
        return False


def test_the_value_of_a_lone_put_comes_with_the_event(store: EtcdClient, job_prefix: str) -> None:
    state, alive = job_prefix + "state", job_prefix + "alive/"
    watcher = Watcher(store, [state, job_prefix + "notes/"], deletions=[alive])
    try:
        since = store.read([state]).revision
        assert watcher.value_if_only_change(state, since) is None  # nothing yet
        store.put(job_prefix + "unwatched", b"x")
        store.put(state, b"v1")
        store.put(state, b"v2")
        assert watcher.wait(since, 30)
        head = store.read([state]).revision
        got = wait_for(
            lambda: (v := watcher.value_if_only_change(state, since)) and v[1] == head and v,
            10,
            what="v2's event",
        )
        value, revision = got
        assert value == b"v2"
        assert watcher.value_if_only_change(state, revision) is None  # nothing newer
        store.put(job_prefix + "notes/a", b"1")  # another watched change after it
        wait_for(lambda: watcher.wait(revision, 0), 10, what="the note's event")
        assert watcher.value_if_only_change(state, since) is None  # read instead
        mark = store.read([state]).revision
        store.delete(state)  # a deletion of the key itself is not a value
        wait_for(lambda: watcher.wait(mark, 0), 10, what="the deletion's event")
        assert watcher.value_if_only_change(state, mark) is None
        with pytest.raises(KeyError):
            watcher.value_if_only_change(job_prefix + "notes/", since)  # a prefix
    finally:
        watcher.close()


def test_the_journal_replays_every_change_in_order(store: EtcdClient, job_prefix: str) -> None:
    state, notes, alive = job_prefix + "state", job_prefix + "notes/", job_prefix + "alive/"
    watcher = Watcher(store, [state, notes], deletions=[alive], journal=True)
    plain = Watcher(store, [state])
    try:
        since = store.read([state]).revision
        assert watcher.events_since(since) == []  # nothing yet
        assert plain.events_since(since) is None  # no journal: read instead
        covered = watcher.covered_from
        assert covered is not None and watcher.events_since(covered - 1) is None
        store.put(notes + "a", b"1")
        store.put(job_prefix + "unwatched", b"x")
        store.put(alive + "n", b"")
        store.delete(alive + "n")  # a deletions-only watch: woken, not journaled
        store.put(state, b"v1")
        store.delete(notes + "a")
        head = store.read([state]).revision
        got = wait_for(lambda: (e := watcher.events_since(since)) and e[-1][2] == head and e, 10,
                       what="every event")  # fmt: skip
        assert [(k, v) for k, v, _ in got] == [(notes + "a", b"1"), (state, b"v1"),
                                               (notes + "a", None)]  # fmt: skip
        assert [r for _, _, r in got] == sorted(r for _, _, r in got)
        assert watcher.events_since(got[0][2]) == got[1:]
        assert watcher.events_since(head) == []
    finally:
        watcher.close()
        plain.close()


def test_a_journal_without_values_keeps_keys_and_deletions(
    store: EtcdClient, job_prefix: str
) -> None:
    notes = job_prefix + "notes/"
    watcher = Watcher(store, [notes], journal=True, journal_values=False)
    try:
        since = store.read([notes]).revision
        store.put(notes + "big", b"x" * 100_000)
        store.delete(notes + "big")
        head = store.read([notes]).revision
        got = wait_for(lambda: (e := watcher.events_since(since)) and e[-1][2] == head and e, 10,
                       what="both events")  # fmt: skip
        assert [(k, v) for k, v, _ in got] == [(notes + "big", b""), (notes + "big", None)]
    finally:
        watcher.close()


def test_a_full_journal_drops_the_oldest_and_says_read(store: EtcdClient, job_prefix: str) -> None:
    notes = job_prefix + "notes/"
    watcher = Watcher(store, [notes], journal=True, journal_limit=3)
    try:
        since = store.read([notes]).revision
        for i in range(5):
            store.put(notes + str(i), str(i).encode())
        head = store.read([notes]).revision
        wait_for(lambda: watcher.wait(head - 1, 0), 10, what="the last event")
        assert watcher.events_since(since) is None  # two were dropped: read instead
        kept = watcher.events_since(head - 3)  # the 3 kept: 2, 3, 4
        assert kept is not None and [k for k, _, _ in kept] == [notes + str(i) for i in (2, 3, 4)]
        assert watcher.events_since(head - 4) is None  # would need 1, dropped
    finally:
        watcher.close()
