"""A small, well-behaved etcd v3 client: the sidecar's only way to talk to etcd.

:class:`EtcdStore` wraps the gRPC stubs that ``etcd-sdk-python`` (``pyetcd``) generates
from etcd's protobufs. It does not use pyetcd's high-level client, whose failover marks
an endpoint dead for 300 s after one failed call and whose shared watch thread outlives
the calls that use it. Instead every call here has one deadline (``timeout`` seconds,
retries included), errors surface as :class:`EtcdUnavailableError` naming the endpoint,
and each :meth:`EtcdStore.wait_change` opens its own watch stream and closes it before
returning (a node that waits again and again keeps one stream open instead:
:class:`~kelastic_sidecar.etcd_watch.Watcher`).

Semantics used by the rendezvous (see DESIGN.md, "Rendezvous"):

- compare-and-set on a key's ``mod_revision`` in one etcd transaction (:meth:`EtcdStore.cas`);
- leases with a background keep-alive (:class:`Lease`); keys bound to a lease vanish
  when it expires or is revoked;
- event-driven waiting with etcd watches (:meth:`EtcdStore.wait_change`, and
  :class:`~kelastic_sidecar.etcd_watch.Watcher` on a long-lived stream).

A call that fails with ``UNAVAILABLE`` (connection refused, leader change, server
overloaded) is retried on the next endpoint with a short backoff until its deadline. A
write whose outcome is unknown may still have happened; :meth:`EtcdStore.cas` handles
that by comparing the value it finds with the value it meant to write.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

log = logging.getLogger("kelastic_sidecar.etcd")

T = TypeVar("T")

#: etcd's client port, used when an endpoint names no port.
DEFAULT_PORT = 2379

# Reconnect quickly after etcd comes back (gRPC's default backoff grows to 120 s), and
# notice a half-open connection under a long watch. etcd refuses client pings more
# often than every 5 s (--grpc-keepalive-min-time), hence 10 s.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

_BACKOFF_FIRST = 0.05  # seconds
_BACKOFF_MAX = 0.5  # seconds


class EtcdUnavailableError(ConnectionError):
    """etcd could not serve a request (unreachable, timed out, or refused it).

    Attributes:
        endpoint: the ``host:port`` last tried.
    """

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(f"etcd at {endpoint}: {message}")
        self.endpoint = endpoint


class EtcdLeaseNotFoundError(EtcdUnavailableError):
    """A write named a lease that etcd no longer knows (expired or revoked)."""


@dataclass(frozen=True)
class Snapshot:
    """Keys read together in one etcd transaction, consistent at one revision.

    Attributes:
        revision: the store revision the read saw; pass it to
            :meth:`EtcdStore.wait_change` to wait for anything newer.
        values: key -> (value, mod_revision) for every key that exists.
    """

    revision: int
    values: dict[str, tuple[bytes, int]]


@dataclass
class _Endpoint:
    netloc: str
    channel: Any
    kv: Any
    watch: Any
    lease: Any


def _parse_endpoint(raw: str) -> tuple[str, bool]:
    """``host:port`` (port defaults to 2379) and whether the scheme asked for TLS."""
    text = raw.strip()
    secure = False
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {raw!r}: scheme must be http or https")
        secure = scheme == "https"
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or (":" in host and not host.endswith("]")):
        host, port = text, ""  # no port given
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
    if not host or "/" in host:
        raise ValueError(f"etcd endpoint {raw!r} is not host:port")
    return f"{host}:{port or DEFAULT_PORT}", secure


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (etcd's rule)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _range(key_or_prefix: str) -> tuple[bytes, bytes]:
    """(key, range_end) for an exact key, or for a prefix when it ends with ``/``."""
    if not key_or_prefix:
        raise ValueError("an etcd key or prefix must not be empty")
    raw = key_or_prefix.encode()
    return (raw, _prefix_end(raw)) if key_or_prefix.endswith("/") else (raw, b"")


def _items(keys_or_prefixes: Sequence[str]) -> list[str]:
    """The keys and prefixes of a read, a single string being one item."""
    return [keys_or_prefixes] if isinstance(keys_or_prefixes, str) else list(keys_or_prefixes)


def _range_ops(items: Sequence[str], keys_only: Sequence[str] = ()) -> list[Any]:
    """One transaction range operation per key or prefix (see :func:`_range`); those also
    in ``keys_only`` come back without their values."""
    ops = []
    for item in items:
        key, end = _range(item)
        request = etcdrpc.RangeRequest(key=key, range_end=end, keys_only=item in keys_only)
        ops.append(etcdrpc.RequestOp(request_range=request))
    return ops


def _snapshot(resp: Any) -> Snapshot:
    """The keys that the range operations of a transaction response found."""
    values: dict[str, tuple[bytes, int]] = {}
    for op in resp.responses:
        if op.WhichOneof("response") != "response_range":
            continue
        for kv in op.response_range.kvs:
            values[kv.key.decode()] = (bytes(kv.value), int(kv.mod_revision))
    return Snapshot(int(resp.header.revision), values)


class _StreamEnded(grpc.RpcError):  # type: ignore[misc]
    """The server ended a watch stream without an error status."""

    def code(self) -> Any:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the watch stream ended"


def _is_deadline(exc: grpc.RpcError) -> bool:
    """The call ran out of time (etcd may answer its own ``UNKNOWN: context deadline exceeded``)."""
    if not hasattr(exc, "code"):
        return False
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return exc.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in str(exc.details())


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"


class Lease:
    """An etcd lease kept alive by a background thread (refresh every ``ttl / 3`` s).

    Obtain one with :meth:`EtcdStore.grant_lease`. Keys put with ``lease=lease.id``
    are deleted by etcd when the lease expires or is revoked.

    Attributes:
        id: the etcd lease id.
        ttl: the granted time-to-live, seconds.
    """

    def __init__(self, store: EtcdStore, lease_id: int, ttl: int) -> None:
        self.id = lease_id
        self.ttl = ttl
        self._store = store
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"etcd-lease-{lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once etcd said the lease is gone, or no refresh succeeded for ``ttl`` s."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until the lease is lost; return :attr:`lost`."""
        return self._lost.wait(timeout)

    def check(self) -> bool:
        """Ask etcd now whether the lease lives (one keep-alive round trip, which also
        refreshes it); a lease etcd says is gone is marked :attr:`lost`.

        Returns:
            False when the lease is lost; True when it lives, or when etcd did not
            answer (the keep-alive goes on deciding then).
        """
        if self.lost:
            return False
        try:
            left = self._store._refresh(self.id, timeout=min(self._store.timeout, 2.0))
        except EtcdUnavailableError:
            return True
        if left <= 0:
            log.error("lease %x lost: etcd says it expired or was revoked", self.id)
            self._lost.set()
            return False
        return True

    def stop_keep_alive(self) -> None:
        """Stop refreshing without revoking: the lease expires ``ttl`` s after its last refresh."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store.timeout + 1.0)

    def revoke(self) -> None:
        """Stop the keep-alive and revoke the lease now (its keys vanish); idempotent.

        Raises:
            EtcdUnavailableError: etcd did not answer; the lease then expires by its TTL.
        """
        self.stop_keep_alive()
        if not self._lost.is_set():
            self._store._revoke(self.id)
            self._lost.set()

    def _keep_alive(self) -> None:
        interval = max(self.ttl / 3.0, 0.1)
        last_ok = time.monotonic()
        wait = interval
        while not self._stop.wait(wait):
            try:
                left = self._store._refresh(self.id, timeout=min(self._store.timeout, interval))
            except EtcdUnavailableError as exc:
                silent = time.monotonic() - last_ok
                if silent >= self.ttl:
                    log.error("lease %x lost: no refresh for %.1fs (%s)", self.id, silent, exc)
                    self._lost.set()
                    return
                log.warning("lease %x: refresh failed (%s); retrying", self.id, exc)
                wait = min(interval, 0.5)
                continue
            if left <= 0:
                log.error("lease %x lost: etcd says it expired or was revoked", self.id)
                self._lost.set()
                return
            last_ok = time.monotonic()
            wait = interval


class EtcdStore:
    """Key-value access to etcd v3 with compare-and-set, leases and watches.

    Args:
        endpoints: ``host:port`` (or ``http(s)://host:port``) of etcd members; calls go
            to one and move to the next when it is unavailable.
        tls_dir: directory with ``ca.crt`` and, for client-certificate auth,
            ``tls.crt`` and ``tls.key``; ``None`` for plain-text gRPC.
        timeout: seconds one call may take, retries included.

    Raises:
        ValueError: no endpoints, a malformed endpoint, or ``timeout <= 0``.
        OSError: a TLS file cannot be read.

    Every method raises :class:`EtcdUnavailableError` (a :class:`ConnectionError`)
    when etcd cannot serve it within ``timeout``. Thread-safe.
    """

    def __init__(
        self, endpoints: Sequence[str], *, tls_dir: Path | None = None, timeout: float = 5.0
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = float(timeout)
        creds = self._credentials(tls_dir)
        self._endpoints: list[_Endpoint] = []
        for raw in endpoints:
            netloc, https = _parse_endpoint(raw)
            if https and creds is None:
                creds = grpc.ssl_channel_credentials()
            if creds is not None:
                channel = grpc.secure_channel(netloc, creds, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.insecure_channel(netloc, options=_CHANNEL_OPTIONS)
            self._endpoints.append(
                _Endpoint(
                    netloc,
                    channel,
                    etcdrpc.KVStub(channel),
                    etcdrpc.WatchStub(channel),
                    etcdrpc.LeaseStub(channel),
                )
            )
        self._current = random.randrange(len(self._endpoints))
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        #: Called with each :class:`EtcdUnavailableError` a call raises (a lease refresh
        #: and a watch included), e.g. to count it in a metric; exceptions are logged.
        self.on_error: Callable[[EtcdUnavailableError], None] | None = None
        self._closed = threading.Event()
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        #: ``time.monotonic()`` of the last call etcd answered (0.0: none yet), so that
        #: a caller can tell an outage that goes on from one that is over.
        self.last_success = 0.0

    @staticmethod
    def _credentials(tls_dir: Path | None) -> Any:
        if tls_dir is None:
            return None
        ca = (tls_dir / "ca.crt").read_bytes()
        cert_path, key_path = tls_dir / "tls.crt", tls_dir / "tls.key"
        if cert_path.exists() and key_path.exists():
            return grpc.ssl_channel_credentials(ca, key_path.read_bytes(), cert_path.read_bytes())
        return grpc.ssl_channel_credentials(ca)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The ``host:port`` of every configured member."""
        return tuple(e.netloc for e in self._endpoints)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed.is_set()

    def request_counts(self) -> dict[str, int]:
        """How many requests this store sent to etcd, by operation (instrumentation).

        Keys are the operation names (``"read"``, ``"get"``, ``"cas"``, ``"put"``,
        ``"put_read"``, ``"grant_lease"``, ``"keep_alive"``, ``"wait_change"``,
        ``"watch"`` (a :class:`~kelastic_sidecar.etcd_watch.Watcher`'s stream), ...);
        each try counts, retries included; a watch stream counts once. ``"cas_failed"``
        counts compare-and-sets that did not write, ``"errors"`` the calls that failed
        (:class:`EtcdUnavailableError`).
        """
        with self._lock:
            return dict(self._counts)

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    # ------------------------------------------------------------------ call machinery

    def _endpoint(self) -> _Endpoint:
        with self._lock:
            return self._endpoints[self._current]

    def _fail_over(self, failed: _Endpoint) -> None:
        with self._lock:
            if self._endpoints[self._current] is failed:
                self._current = (self._current + 1) % len(self._endpoints)

    def _report(self, exc: EtcdUnavailableError) -> None:
        """Count a failed call and tell :attr:`on_error` (not after :meth:`close`)."""
        if self._closed.is_set():
            return
        self._count("errors")
        hook = self.on_error
        if hook is not None:
            try:
                hook(exc)
            except Exception:
                log.exception("etcd store: on_error hook failed")

    def _call(
        self, what: str, fn: Callable[[_Endpoint, float], T], timeout: float | None = None
    ) -> T:
        """Run ``fn(endpoint, seconds_left)`` until it succeeds or the deadline passes.

        ``UNAVAILABLE`` is retried on the next endpoint after a short backoff; every
        other failure, and the deadline, raise :class:`EtcdUnavailableError` (reported
        to :attr:`on_error` first).
        """
        try:
            return self._call_once(what, fn, timeout)
        except EtcdLeaseNotFoundError:
            raise  # an answer, not a failure to reach etcd
        except EtcdUnavailableError as exc:
            self._report(exc)
            raise

    def _call_once(
        self, what: str, fn: Callable[[_Endpoint, float], T], timeout: float | None
    ) -> T:
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        delay = _BACKOFF_FIRST
        last = ""
        while True:
            ep = self._endpoint()
            if self._closed.is_set():
                raise EtcdUnavailableError(ep.netloc, f"{what}: the store is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdUnavailableError(
                    ep.netloc, f"{what}: no answer within {budget:.1f}s (last error: {last})"
                )
            self._count(what.partition("(")[0])
            try:
                result = fn(ep, left)
                self.last_success = time.monotonic()
                return result
            except grpc.RpcError as exc:
                last = _describe(exc)
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.NOT_FOUND and "lease not found" in last:
                    raise EtcdLeaseNotFoundError(ep.netloc, f"{what}: {last}") from None
                if _is_deadline(exc):
                    raise EtcdUnavailableError(
                        ep.netloc, f"{what}: no answer within {budget:.1f}s ({last})"
                    ) from None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise EtcdUnavailableError(ep.netloc, f"{what}: {last}") from None
            self._fail_over(ep)
            pause = min(delay * random.uniform(0.5, 1.0), deadline - time.monotonic())
            log.debug("%s on %s: %s; retrying in %.2fs", what, ep.netloc, last, max(pause, 0))
            if pause > 0:
                self._closed.wait(pause)
            delay = min(delay * 2, _BACKOFF_MAX)

    # -------------------------------------------------------------------- key/value API

    def get(self, key: str) -> tuple[bytes, int] | None:
        """Return ``(value, mod_revision)`` of ``key``, or ``None`` when it does not exist."""
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self._call(f"get({key!r})", lambda ep, t: ep.kv.Range(req, timeout=t))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return bytes(kv.value), int(kv.mod_revision)

    def get_prefix(self, prefix: str) -> dict[str, tuple[bytes, int]]:
        """Return ``{key: (value, mod_revision)}`` for every key starting with ``prefix``."""
        if not prefix:
            raise ValueError("prefix must not be empty")
        raw = prefix.encode()
        req = etcdrpc.RangeRequest(key=raw, range_end=_prefix_end(raw))
        resp = self._call(f"get_prefix({prefix!r})", lambda ep, t: ep.kv.Range(req, timeout=t))
        return {kv.key.decode(): (bytes(kv.value), int(kv.mod_revision)) for kv in resp.kvs}

    def read(self, keys_or_prefixes: Sequence[str], *, keys_only: Sequence[str] = ()) -> Snapshot:
        """Read several keys and prefixes atomically (one transaction, one revision).

        An item ending with ``/`` is a prefix, anything else an exact key. Items also
        listed in ``keys_only`` are read without their values (``b""`` in the snapshot).
        """
        items = _items(keys_or_prefixes)
        req = etcdrpc.TxnRequest(compare=[], success=_range_ops(items, keys_only), failure=[])
        resp = self._call(f"read({items!r})", lambda ep, t: ep.kv.Txn(req, timeout=t))
        return _snapshot(resp)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Write ``value`` at ``key``, bound to ``lease`` (an id) when given.

        Raises:
            EtcdLeaseNotFoundError: the lease has expired or was revoked.
        """
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease or 0)
        self._call(f"put({key!r})", lambda ep, t: ep.kv.Put(req, timeout=t))

    def put_read(
        self,
        puts: Mapping[str, bytes],
        read: Sequence[str],
        lease: int | None = None,
        *,
        keys_only: Sequence[str] = (),
    ) -> Snapshot:
        """Write keys (bound to ``lease`` when given), then read, in one transaction: one
        request instead of :meth:`put` calls and a :meth:`read`.

        Args:
            puts: key -> the bytes written there.
            read: keys and prefixes (ending with ``/``) read after the writes.
            lease: the lease id the keys are bound to.
            keys_only: items of ``read`` read without their values (``b""``).

        Returns:
            the items of ``read`` as of the writes (them included), at their revision.

        Raises:
            EtcdLeaseNotFoundError: the lease has expired or was revoked (nothing written).
        """
        writes = [
            etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease or 0)
            )
            for key, value in puts.items()
        ]
        reads = _range_ops(_items(read), keys_only)
        req = etcdrpc.TxnRequest(compare=[], success=[*writes, *reads], failure=[])
        resp = self._call(f"put_read({list(puts)!r})", lambda ep, t: ep.kv.Txn(req, timeout=t))
        return _snapshot(resp)

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None
    ) -> tuple[bool, bytes | None, int]:
        """Compare-and-set in one etcd transaction (one request, even when it fails).

        Writes ``value`` if the key's ``mod_revision`` equals ``expected_mod_revision``,
        or, when that is ``None``, only if the key does not exist.

        Returns:
            ``(ok, current value, current mod_revision)``: after a successful write the
            value written and its new revision; otherwise what the key holds now, read
            in the same transaction (``None`` and ``0`` when it does not exist).

        A try whose outcome is unknown (connection lost mid-call) is retried; when the
        retry finds exactly ``value`` in place, the first try is taken to have won.
        """
        ok, snap = self.cas_read(key, value, expected_mod_revision)
        current, revision = snap.values.get(key, (None, 0))
        return ok, current, revision

    def cas_read(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int | None,
        read: Sequence[str] = (),
        *,
        keys_only: Sequence[str] = (),
        require: Mapping[str, int] | None = None,
        delete: Sequence[str] = (),
    ) -> tuple[bool, Snapshot]:
        """Compare-and-set ``key`` and read ``key`` and ``read``, all in one transaction.

        Both outcomes come back in the one request: a writer that lost learns the
        current value (and the other items) without another round trip.

        Args:
            key: the key compared and written.
            value: the bytes written when the comparison holds.
            expected_mod_revision: the ``mod_revision`` the key must have; ``None``:
                the key must not exist.
            read: further keys and prefixes (ending with ``/``) read in the same
                transaction, after the write when there was one.
            keys_only: items of ``read`` read without their values (``b""``).
            require: further keys -> the ``mod_revision`` each must have (``0``: must
                not exist) for the write to happen.
            delete: keys deleted together with the write (not when it fails).

        Returns:
            ``(ok, snapshot)``: whether ``value`` was written, and ``key`` (when it
            exists) plus the items of ``read`` as of the transaction's revision.

        A try whose outcome is unknown (connection lost mid-call) is retried; when the
        retry finds exactly ``value`` in place, the first try is taken to have won.
        """
        raw = key.encode()
        wanted = {key: expected_mod_revision or 0, **(require or {})}
        compares = [
            etcdrpc.Compare(
                key=name.encode(),
                target=etcdrpc.Compare.MOD,
                result=etcdrpc.Compare.EQUAL,
                mod_revision=revision,
            )
            for name, revision in wanted.items()
        ]
        items = [key, *(item for item in _items(read) if item != key)]
        reads = _range_ops(items, keys_only)
        writes = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=raw, value=value))]
        writes += [
            etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=name.encode()))
            for name in delete
        ]
        req = etcdrpc.TxnRequest(compare=compares, success=[*writes, *reads], failure=reads)
        attempts = 0

        def txn(ep: _Endpoint, left: float) -> Any:
            nonlocal attempts
            attempts += 1
            return ep.kv.Txn(req, timeout=left)

        resp = self._call(f"cas({key!r})", txn)
        snap = _snapshot(resp)
        current = snap.values.get(key)
        ok = bool(resp.succeeded) or (attempts > 1 and current is not None and current[0] == value)
        if not ok:
            self._count("cas_failed")
        return ok, snap

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        resp = self._call(f"delete({key!r})", lambda ep, t: ep.kv.DeleteRange(req, timeout=t))
        return int(resp.deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; return how many were deleted."""
        if not prefix:
            raise ValueError("prefix must not be empty")
        raw = prefix.encode()
        req = etcdrpc.DeleteRangeRequest(key=raw, range_end=_prefix_end(raw))
        resp = self._call(
            f"delete_prefix({prefix!r})", lambda ep, t: ep.kv.DeleteRange(req, timeout=t)
        )
        return int(resp.deleted)

    # --------------------------------------------------------------------------- leases

    def grant_lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (>= 1) and keep it alive in the background."""
        if ttl < 1:
            raise ValueError(f"lease ttl must be >= 1 s, got {ttl}")
        req = etcdrpc.LeaseGrantRequest(TTL=int(ttl), ID=0)
        resp = self._call(f"grant_lease({ttl})", lambda ep, t: ep.lease.LeaseGrant(req, timeout=t))
        if resp.error:
            raise EtcdUnavailableError(self._endpoint().netloc, f"grant_lease: {resp.error}")
        lease = Lease(self, int(resp.ID), int(resp.TTL))
        self._leases.add(lease)
        log.debug("granted lease %x (ttl %ds)", lease.id, lease.ttl)
        return lease

    def _refresh(self, lease_id: int, timeout: float) -> int:
        """One keep-alive round trip; return the TTL etcd grants (<= 0: lease gone)."""

        def once(ep: _Endpoint, left: float) -> int:
            request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            call = ep.lease.LeaseKeepAlive(iter([request]), timeout=left)
            try:
                for resp in call:
                    return int(resp.TTL)
                return 0
            finally:
                call.cancel()

        return self._call(f"keep_alive({lease_id:x})", once, timeout=timeout)

    def _revoke(self, lease_id: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(EtcdLeaseNotFoundError):  # already expired or revoked
            self._call(f"revoke({lease_id:x})", lambda ep, t: ep.lease.LeaseRevoke(req, timeout=t))

    # --------------------------------------------------------------------------- watches

    def wait_change(
        self, keys_or_prefixes: Sequence[str], since_revision: int, timeout: float
    ) -> bool:
        """Block until any of the keys changes after ``since_revision``, or ``timeout`` s.

        An item ending with ``/`` is a prefix, anything else an exact key. Pass the
        ``revision`` of a :class:`Snapshot` (or a ``mod_revision``) read before: a
        change between that read and this call is seen at once. Opens one etcd watch
        stream and closes it before returning (no thread or stream outlives the call).

        etcd serves a watch that starts at a past revision from a catch-up loop that
        runs every 100 ms, so the watches start now, and once etcd has created them one
        range request asks for keys written after ``since_revision``. Deletions in
        between come from watches that start at ``since_revision + 1`` (deletions only),
        up to 100 ms late.

        Returns:
            True when a change (or a compaction past ``since_revision``) was seen,
            False when ``timeout`` passed without one.

        Raises:
            EtcdUnavailableError: the watch could not be (re-)established for
                ``self.timeout`` seconds.
        """
        try:
            return self._wait_change(keys_or_prefixes, since_revision, timeout)
        except EtcdUnavailableError as exc:
            self._report(exc)
            raise

    def _wait_change(
        self, keys_or_prefixes: Sequence[str], since_revision: int, timeout: float
    ) -> bool:
        items = [keys_or_prefixes] if isinstance(keys_or_prefixes, str) else list(keys_or_prefixes)
        if not items:
            raise ValueError("nothing to watch")
        requests, checks = [], []
        for item in items:
            key, end = _range(item)
            now = etcdrpc.WatchCreateRequest(key=key, range_end=end)
            deletions = etcdrpc.WatchCreateRequest(
                key=key,
                range_end=end,
                start_revision=since_revision + 1,
                filters=[etcdrpc.WatchCreateRequest.NOPUT],
            )
            requests += [etcdrpc.WatchRequest(create_request=c) for c in (now, deletions)]
            written = etcdrpc.RangeRequest(
                key=key, range_end=end, keys_only=True, min_mod_revision=since_revision + 1
            )
            checks.append(etcdrpc.RequestOp(request_range=written))
        check = etcdrpc.TxnRequest(compare=[], success=checks, failure=[])
        deadline = time.monotonic() + timeout
        failing_since: float | None = None
        delay = _BACKOFF_FIRST
        while True:
            if self._closed.is_set():
                raise EtcdUnavailableError(
                    self._endpoint().netloc, "wait_change: the store is closed"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ep = self._endpoint()
            self._count("wait_change")
            try:
                return self._watch_once(ep, requests, check, left)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise EtcdUnavailableError(ep.netloc, f"wait_change: {_describe(exc)}") from exc
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.timeout or now + delay >= deadline:
                    raise EtcdUnavailableError(
                        ep.netloc,
                        f"wait_change: unavailable for {now - failing_since:.1f}s "
                        f"({_describe(exc)})",
                    ) from None
                self._fail_over(ep)
                self._closed.wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX)

    def _watch_once(self, ep: _Endpoint, requests: list[Any], check: Any, timeout: float) -> bool:
        """One watch stream: True on an event, False at the deadline.

        Once etcd created every watch, ``check`` (a transaction of range requests) runs:
        True when it finds a key.

        The request iterator ends after the create requests (a half-close); etcd keeps
        the watches until the stream is cancelled, which ``finally`` does.

        Raises:
            grpc.RpcError: the stream failed (``UNAVAILABLE`` when the server ended it).
            EtcdUnavailableError: etcd cancelled the watch for a reason other than
                compaction.
        """
        deadline = time.monotonic() + timeout
        call = ep.watch.Watch(iter(requests), timeout=timeout)
        pending = len(requests)
        try:
            for resp in call:
                if resp.events:
                    return True
                if resp.created:
                    pending -= 1
                    if not pending:
                        self._count("read")
                        left = max(deadline - time.monotonic(), 0.001)
                        found = ep.kv.Txn(check, timeout=left)
                        if any(op.response_range.kvs for op in found.responses):
                            return True
                if resp.canceled:
                    if resp.compact_revision:
                        return True  # history gone: the caller must re-read anyway
                    raise EtcdUnavailableError(
                        ep.netloc, f"wait_change: watch cancelled: {resp.cancel_reason}"
                    )
        except grpc.RpcError as exc:
            if _is_deadline(exc):
                return False
            raise
        finally:
            call.cancel()
        raise _StreamEnded()

    def wait_value(self, key: str, timeout: float) -> bytes:
        """Return the value of ``key`` once it exists, waiting up to ``timeout`` seconds.

        Raises:
            TimeoutError: the key did not appear in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            snap = self.read([key])
            if key in snap.values:
                return snap.values[key][0]
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_change([key], snap.revision, left):
                raise TimeoutError(f"etcd key {key!r} did not appear within {timeout:.1f}s")

    # -------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Stop lease keep-alives (leases then expire by TTL) and close channels; idempotent."""
        if self._closed.is_set():
            return
        for lease in list(self._leases):
            lease.stop_keep_alive()
        self._closed.set()
        for ep in self._endpoints:
            ep.channel.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
