"""EtcdClient against a real etcd: compare-and-set, leases, watches, and failure behaviour."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic_etcd import EtcdClient, EtcdError, EtcdLeaseNotFound
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.conftest import wait_for


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdClient]:
    s = EtcdClient([etcd_endpoint], timeout=5.0)
    yield s
    s.close()


def _etcd_gauge(endpoint: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"etcd exports no {name}"
    return float(match.group(1))


# ----------------------------------------------------------------------- key/value + CAS


def test_get_put_delete_and_prefixes(store: EtcdClient, job_prefix: str) -> None:
    assert store.get(job_prefix + "a") is None
    store.put(job_prefix + "a", b"1")
    store.put(job_prefix + "d/x", b"2")
    store.put(job_prefix + "d/y", b"3")
    value, rev = store.get(job_prefix + "a") or (b"", 0)
    assert value == b"1" and rev > 0
    assert {k: v for k, (v, _) in store.get_prefix(job_prefix + "d/").items()} == {
        job_prefix + "d/x": b"2",
        job_prefix + "d/y": b"3",
    }
    assert store.delete(job_prefix + "a") is True
    assert store.delete(job_prefix + "a") is False
    assert store.delete_prefix(job_prefix + "d/") == 2
    assert store.get_prefix(job_prefix) == {}


def test_cas_create_only(store: EtcdClient, job_prefix: str) -> None:
    key = job_prefix + "state"
    ok, value, rev = store.cas(key, b"first", None)
    assert (ok, value) == (True, b"first") and rev > 0
    ok2, value2, rev2 = store.cas(key, b"second", None)
    assert (ok2, value2, rev2) == (False, b"first", rev)
    assert store.get(key) == (b"first", rev)


def test_cas_token_mismatch_and_match(store: EtcdClient, job_prefix: str) -> None:
    key = job_prefix + "state"
    _, _, rev = store.cas(key, b"v1", None)
    ok, value, current = store.cas(key, b"v2", rev + 1000)
    assert (ok, value, current) == (False, b"v1", rev)
    ok, value, new_rev = store.cas(key, b"v2", rev)
    assert (ok, value) == (True, b"v2") and new_rev > rev
    # the old token is stale now
    assert store.cas(key, b"v3", rev) == (False, b"v2", new_rev)


def test_cas_on_missing_key_with_token(store: EtcdClient, job_prefix: str) -> None:
    assert store.cas(job_prefix + "gone", b"x", 5) == (False, None, 0)
    assert store.get(job_prefix + "gone") is None


def test_cas_is_atomic_under_contention(store: EtcdClient, job_prefix: str) -> None:
    key = job_prefix + "counter"

    def bump(times: int) -> None:
        for _ in range(times):
            while True:
                got = store.get(key)
                current = int(got[0]) if got else 0
                ok, _, _ = store.cas(key, str(current + 1).encode(), got[1] if got else None)
                if ok:
                    break

    threads = [threading.Thread(target=bump, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.get(key) is not None
    assert int((store.get(key) or (b"0", 0))[0]) == 100


def test_read_is_one_consistent_snapshot(store: EtcdClient, job_prefix: str) -> None:
    store.put(job_prefix + "state", b"s")
    store.put(job_prefix + "alive/a", b"1")
    store.put(job_prefix + "alive/b", b"2")
    snap = store.read([job_prefix + "state", job_prefix + "alive/", job_prefix + "missing"])
    assert set(snap.values) == {
        job_prefix + "state",
        job_prefix + "alive/a",
        job_prefix + "alive/b",
    }
    assert snap.revision >= max(rev for _, rev in snap.values.values())


# ---------------------------------------------------------------------------- leases


def test_lease_expiry_removes_keys(store: EtcdClient, job_prefix: str) -> None:
    lease = store.grant_lease(1)
    store.put(job_prefix + "alive/n", b"x", lease=lease.id)
    assert store.get(job_prefix + "alive/n") is not None
    lease.stop_keep_alive()  # as if the node died
    wait_for(lambda: store.get(job_prefix + "alive/n") is None, 15, what="lease expiry")
    with pytest.raises(EtcdLeaseNotFound):
        store.put(job_prefix + "alive/n", b"x", lease=lease.id)


def test_lease_keep_alive_outlives_ttl(store: EtcdClient, job_prefix: str) -> None:
    before = store.request_counts().get("keep_alive", 0)
    lease = store.grant_lease(1)
    store.put(job_prefix + "alive/n", b"x", lease=lease.id)
    # three TTLs: 9 keep-alives, one per TTL/3 (only they can hold the key that long)
    wait_for(lambda: store.request_counts().get("keep_alive", 0) >= before + 9, 30,
             what="9 keep-alives of the lease")  # fmt: skip
    assert store.get(job_prefix + "alive/n") is not None
    assert not lease.lost
    lease.revoke()
    assert store.get(job_prefix + "alive/n") is None
    assert lease.lost
    lease.revoke()  # idempotent


def test_lease_revoked_elsewhere_is_reported_lost(
    store: EtcdClient, etcd_endpoint: str, job_prefix: str
) -> None:
    lease = store.grant_lease(1)
    with EtcdClient([etcd_endpoint]) as other:
        other.revoke_lease(lease.id)
    wait_for(lambda: lease.lost, 10, what="lease reported lost")


# --------------------------------------------------------------------------- watches


def test_wait_change_wakes_on_put(store: EtcdClient, job_prefix: str) -> None:
    key = job_prefix + "state"
    since = store.read([key]).revision
    writer = threading.Timer(0.3, lambda: store.put(key, b"new"))
    writer.start()
    started = time.monotonic()
    assert store.wait_change([key], since, timeout=20) is True
    assert time.monotonic() - started < 10
    writer.join()


def test_wait_change_sees_change_made_before_the_call(store: EtcdClient, job_prefix: str) -> None:
    since = store.read([job_prefix + "state"]).revision
    store.put(job_prefix + "alive/x", b"1")
    started = time.monotonic()
    assert store.wait_change([job_prefix + "state", job_prefix + "alive/"], since, 20) is True
    assert time.monotonic() - started < 2


def test_wait_change_prefix_delete(store: EtcdClient, job_prefix: str) -> None:
    store.put(job_prefix + "alive/x", b"1")
    since = store.read([job_prefix + "alive/"]).revision
    threading.Timer(0.2, lambda: store.delete(job_prefix + "alive/x")).start()
    assert store.wait_change([job_prefix + "alive/"], since, 20) is True


def test_wait_change_ignores_other_keys_and_times_out(store: EtcdClient, job_prefix: str) -> None:
    since = store.read([job_prefix + "state"]).revision
    store.put(job_prefix + "unrelated", b"1")
    store.put(job_prefix + "statefoo", b"1")  # an exact key is not a prefix
    started = time.monotonic()
    assert store.wait_change([job_prefix + "state"], since, timeout=0.5) is False
    assert 0.45 <= time.monotonic() - started < 3


def test_wait_change_leaks_no_threads_or_watches(
    store: EtcdClient, etcd_endpoint: str, job_prefix: str
) -> None:
    baseline_watchers = _etcd_gauge(etcd_endpoint, "etcd_debugging_mvcc_watcher_total")
    since = store.read([job_prefix + "state"]).revision
    store.wait_change([job_prefix + "state"], since, 0.05)  # warm up gRPC's own threads
    threads = threading.active_count()
    for i in range(20):
        since = store.read([job_prefix + "state"]).revision
        if i % 2:
            store.wait_change([job_prefix + "state", job_prefix + "alive/"], since, 0.05)
        else:
            threading.Timer(0.01, lambda: store.put(job_prefix + "state", b"x")).start()
            assert store.wait_change([job_prefix + "state"], since, 20)
    wait_for(lambda: threading.active_count() <= threads, 10, what="threads to end")
    wait_for(
        lambda: (
            _etcd_gauge(etcd_endpoint, "etcd_debugging_mvcc_watcher_total") <= baseline_watchers
        ),
        10,
        what="etcd watchers to be cancelled",
    )


def test_wait_value(store: EtcdClient, job_prefix: str) -> None:
    key = job_prefix + "rounds/0/master"
    store.put(key, b"ready")
    assert store.wait_value(key, 1) == b"ready"
    later = job_prefix + "rounds/1/master"
    threading.Timer(0.2, lambda: store.put(later, b"later")).start()
    assert store.wait_value(later, 20) == b"later"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not appear"):
        store.wait_value(job_prefix + "never", 0.3)
    assert time.monotonic() - started < 3


# ------------------------------------------------------------------------- failures


@pytest.fixture
def dead_endpoint() -> str:
    """An etcd that ran once and is stopped now."""
    server = EmbeddedEtcd().start()
    endpoint = server.endpoint
    with EtcdClient([endpoint], timeout=2) as s:
        s.put("/warm", b"1")
    server.stop()
    return endpoint


def test_dead_etcd_fails_within_timeout(dead_endpoint: str) -> None:
    timeout = 1.0
    with EtcdClient([dead_endpoint], timeout=timeout) as s:
        calls = {
            "get": lambda: s.get("/k"),
            "put": lambda: s.put("/k", b"v"),
            "cas": lambda: s.cas("/k", b"v", None),
            "read": lambda: s.read(["/k", "/p/"]),
            "delete_prefix": lambda: s.delete_prefix("/p/"),
            "grant_lease": lambda: s.grant_lease(5),
            "wait_change": lambda: s.wait_change(["/k"], 1, timeout=30),
            "wait_value": lambda: s.wait_value("/k", timeout=30),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(EtcdError) as err:
                call()
            took = time.monotonic() - started
            assert took < timeout + 1.5, f"{name} took {took:.2f}s"
            assert dead_endpoint in str(err.value) and err.value.endpoint == dead_endpoint
            assert isinstance(err.value, ConnectionError)


def test_unresponsive_endpoint_times_out() -> None:
    """A peer that accepts TCP but never speaks (a hung etcd) must not hang a call."""
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(16)
        endpoint = f"127.0.0.1:{sink.getsockname()[1]}"
        with EtcdClient([endpoint], timeout=1.0) as s:
            for call in (lambda: s.get("/k"), lambda: s.cas("/k", b"v", None)):
                started = time.monotonic()
                with pytest.raises(EtcdError):
                    call()
                assert time.monotonic() - started < 2.5


def test_fails_over_to_a_live_endpoint(
    dead_endpoint: str, etcd_endpoint: str, job_prefix: str
) -> None:
    with EtcdClient([dead_endpoint, etcd_endpoint], timeout=5) as s:
        for i in range(5):
            s.put(job_prefix + "k", str(i).encode())
            got = s.get(job_prefix + "k")
            assert got is not None and got[0] == str(i).encode()


class OutageProxy:
    """A TCP proxy on a fixed port that can be cut and restored (an etcd outage)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def up(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def down(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def test_recovers_after_an_outage(etcd_endpoint: str, job_prefix: str) -> None:
    proxy = OutageProxy(etcd_endpoint)
    proxy.up()
    try:
        with EtcdClient([proxy.endpoint], timeout=1.0) as s:
            s.put(job_prefix + "k", b"before")
            proxy.down()
            with pytest.raises(EtcdError):
                s.get(job_prefix + "k")
            proxy.up()
            started = time.monotonic()

            def works() -> bool:
                try:
                    return s.get(job_prefix + "k") is not None
                except EtcdError:
                    return False

            wait_for(works, 15, what="store to reconnect")
            assert time.monotonic() - started < 5
    finally:
        proxy.down()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        EtcdClient([])
    with pytest.raises(ValueError):
        EtcdClient(["127.0.0.1:2379"], timeout=0)
    with pytest.raises(ValueError):
        EtcdClient(["ftp://x:1"])
    with EtcdClient(["http://127.0.0.1:1", "localhost"], timeout=1) as s:
        assert s.endpoints == ("127.0.0.1:1", "localhost:2379")
        with pytest.raises(ValueError):
            s.grant_lease(0)
    closed = EtcdClient(["127.0.0.1:1"])
    closed.close()
    with pytest.raises(EtcdError, match="closed"):
        closed.get("/k")


def test_tls_with_client_certificate(tls_etcd: tuple[str, Path]) -> None:
    endpoint, tls_dir = tls_etcd
    with EtcdClient([endpoint], tls_dir=tls_dir) as s:
        s.put("/tls/k", b"secret")
        assert s.cas("/tls/k", b"v2", (s.get("/tls/k") or (b"", 0))[1])[0]
        lease = s.grant_lease(5)
        s.put("/tls/alive", b"1", lease=lease.id)
        since = s.read(["/tls/k"]).revision
        threading.Timer(0.1, lambda: s.put("/tls/k", b"v3")).start()
        assert s.wait_change(["/tls/k"], since, 20)
        lease.revoke()
    # the server insists on a client certificate, and on TLS at all
    only_ca = tls_dir.parent / "only-ca"
    only_ca.mkdir()
    shutil.copy(tls_dir / "ca.crt", only_ca / "ca.crt")
    for kwargs in ({"tls_dir": only_ca}, {}):
        with EtcdClient([endpoint], timeout=1, **kwargs) as s, pytest.raises(EtcdError):
            s.get("/tls/k")


# ------------------------------------------------- one-request compare-and-set and writes


def test_failed_cas_returns_current_value_in_the_same_request(
    store: EtcdClient, job_prefix: str
) -> None:
    key = job_prefix + "state"
    ok, _, rev = store.cas(key, b"v1", None)
    assert ok
    before = store.request_counts()
    ok, current, current_rev = store.cas(key, b"v2", rev - 1)  # a stale token
    assert (ok, current, current_rev) == (False, b"v1", rev)
    after = store.request_counts()
    spent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: n for k, n in spent.items() if n} == {"cas": 1, "cas_failed": 1}


def test_cas_read_reads_other_items_in_the_same_transaction(
    store: EtcdClient, job_prefix: str
) -> None:
    key, alive = job_prefix + "state", job_prefix + "alive/"
    store.put(alive + "a", b"payload")
    ok, snap = store.cas_read(key, b"v1", None, [alive], keys_only=[alive])
    assert ok
    assert snap.values[key][0] == b"v1"
    assert snap.values[alive + "a"][0] == b""  # keys only
    assert snap.revision == snap.values[key][1]  # read after the write
    store.put(alive + "b", b"x")
    ok, snap = store.cas_read(key, b"v2", None, [alive])  # loses: the key exists
    assert not ok
    assert snap.values[key][0] == b"v1"
    assert {k for k in snap.values if k.startswith(alive)} == {alive + "a", alive + "b"}
    assert snap.values[alive + "a"][0] == b"payload"


def test_cas_read_require_and_delete(store: EtcdClient, job_prefix: str) -> None:
    key, other = job_prefix + "state", job_prefix + "req/x"
    store.put(other, b"1")
    other_rev = store.get(other)[1]  # type: ignore[index]
    ok, _ = store.cas_read(key, b"v1", None, require={other: other_rev + 1}, delete=[other])
    assert not ok  # the required revision does not match: nothing written or deleted
    assert store.get(key) is None and store.get(other) is not None
    ok, _ = store.cas_read(key, b"v1", None, require={job_prefix + "missing": 0})
    assert ok  # 0: the required key must not exist
    rev = store.get(key)[1]  # type: ignore[index]
    ok, snap = store.cas_read(key, b"v2", rev, [job_prefix + "req/"], require={other: other_rev},
                              delete=[other])  # fmt: skip
    assert ok
    assert store.get(other) is None and other not in snap.values


def test_put_read_writes_with_a_lease_and_reads_after(store: EtcdClient, job_prefix: str) -> None:
    lease = store.grant_lease(5)
    a, b = job_prefix + "alive/a", job_prefix + "joining/a"
    snap = store.put_read({a: b"1", b: b"2"}, [job_prefix + "alive/", b], lease=lease.id)
    assert snap.values[a][0] == b"1" and snap.values[b][0] == b"2"
    assert snap.revision == snap.values[a][1] == snap.values[b][1]  # one transaction
    lease.revoke()
    assert store.get(a) is None and store.get(b) is None  # both bound to the lease
    with pytest.raises(EtcdLeaseNotFound):
        store.put_read({a: b"1"}, [a], lease=lease.id)
    assert store.get(a) is None


def test_wait_change_sees_a_deletion_made_before_the_call(
    store: EtcdClient, job_prefix: str
) -> None:
    store.put(job_prefix + "alive/x", b"1")
    since = store.read([job_prefix + "alive/"]).revision
    store.delete(job_prefix + "alive/x")
    store.put(job_prefix + "unrelated", b"1")  # the revision moves on
    assert store.wait_change([job_prefix + "alive/"], since, 20) is True


def test_failed_calls_and_lease_refreshes_are_reported(etcd_endpoint: str) -> None:
    """Every failed call reaches ``on_error`` (the sidecar's etcd_errors metric), the
    lease keep-alive's refreshes included."""
    from tests.ship.tcpproxy import TcpProxy

    errors: list[EtcdError] = []
    with TcpProxy(etcd_endpoint) as proxy:
        store = EtcdClient([proxy.endpoint], timeout=0.5)
        store.on_error = errors.append
        try:
            lease = store.grant_lease(5)
            assert not errors
            proxy.cut()
            with pytest.raises(EtcdError):
                store.get("/kl-test/x")
            assert any(str(e).count("get(") for e in errors), errors
            # the keep-alive (every ttl/3 s) fails on its own and says so
            wait_for(lambda: any("keep_alive(" in str(e) for e in errors), timeout=15,
                     what="a failed lease refresh reported")  # fmt: skip
            assert store.request_counts()["errors"] == len(errors)
            lease.stop_keep_alive()
        finally:
            store.close()
    n = len(errors)
    with pytest.raises(EtcdError):
        store.get("/kl-test/x")  # closed: not an etcd failure
    assert len(errors) == n
