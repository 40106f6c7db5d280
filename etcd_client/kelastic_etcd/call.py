"""Call machinery: channels to the members, one deadline per call, failover, back-off,
and the classification of gRPC failures into :mod:`kelastic_etcd.errors`.

Every request of the client goes through :meth:`Connection.call`: ``UNAVAILABLE``
(connection refused, leader change, server overloaded) is retried on the next member
after a jittered back-off (:class:`Backoff`) until the call's deadline; an answer etcd
will give again (``INVALID_ARGUMENT``, ``PERMISSION_DENIED``, ...) raises
:class:`~kelastic_etcd.errors.EtcdRefused` at once, never retried.

Authentication: TLS (a CA, optionally a client certificate) and/or etcd's user and
password (:class:`~kelastic_etcd.auth.TokenAuth` on each member's channel); a token etcd
no longer accepts is replaced once per call.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

from .auth import TokenAuth, token_expired
from .errors import EtcdError, EtcdLeaseNotFound, EtcdRefused, EtcdUnavailable

log = logging.getLogger("kelastic_etcd")

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

#: Codes of answers etcd gives again for the same request: :class:`EtcdRefused`.
REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class Backoff:
    """Exponential back-off: ``first`` seconds doubling up to ``cap``, optionally jittered
    (a delay drawn from ``[d/2, d]``). The one back-off helper of the client."""

    def __init__(self, first: float = 0.05, cap: float = 0.5, *, jitter: bool = False) -> None:
        self.first, self.cap, self.jitter = first, cap, jitter
        self._delay = first

    def next(self) -> float:
        """The next pause, seconds; the one after is twice as long (up to ``cap``)."""
        delay = self._delay
        self._delay = min(self._delay * 2, self.cap)
        return delay * random.uniform(0.5, 1.0) if self.jitter else delay

    def reset(self) -> None:
        """Start again from ``first`` (after a success)."""
        self._delay = self.first


#: A DNS name (RFC 1123 labels; ``_`` allowed as Kubernetes Service records use it).
_HOSTNAME = re.compile(
    r"^(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?$"
)


def _port(raw: str, text: str) -> str:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"etcd endpoint {raw!r}: port {text!r} is not in 1..65535")
    return str(int(text))


def parse_endpoint(raw: str) -> tuple[str, bool]:
    """``host:port`` (port defaults to 2379) and whether the scheme asked for TLS.

    Accepted: an optional ``http://`` or ``https://``, then a DNS name, an IPv4 address,
    or an IPv6 address (``[::1]`` with a port; bare ``::1`` without), then ``:port``
    (1..65535) or nothing, then an optional ``/``.

    Raises:
        ValueError: a scheme other than http(s), a host that is none of those (spaces,
            several colons, empty), a port that is not in 1..65535; the message quotes
            ``raw``.
    """
    text = raw.strip()
    secure = False
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {raw!r}: scheme must be http or https")
        secure = scheme == "https"
    text = text.rstrip("/")
    bad = ValueError(f"etcd endpoint {raw!r} is not host:port")
    if text.startswith("["):  # [v6] or [v6]:port
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise bad
        port = _port(raw, rest[1:]) if rest else ""
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
        return f"[{host}]:{port or DEFAULT_PORT}", secure
    with contextlib.suppress(ValueError):  # a bare IPv6 address: no port
        return f"[{ipaddress.IPv6Address(text)}]:{DEFAULT_PORT}", secure
    host, sep, port = text.partition(":")
    if not _HOSTNAME.match(host) or (sep and not port):
        raise bad
    return f"{host}:{_port(raw, port) if sep else DEFAULT_PORT}", secure


def code_of(exc: grpc.RpcError) -> Any:
    """The status code of a gRPC error (``None`` when it has none)."""
    return exc.code() if hasattr(exc, "code") else None


def is_deadline(exc: grpc.RpcError) -> bool:
    """The call ran out of time (etcd may answer its own ``UNKNOWN: context deadline exceeded``)."""
    code = code_of(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return code == grpc.StatusCode.UNKNOWN and "deadline exceeded" in str(exc.details())


def describe(exc: grpc.RpcError) -> str:
    """``CODE: details`` of a gRPC error."""
    code = code_of(exc)
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"


def classify(netloc: str, what: str, exc: grpc.RpcError) -> EtcdError | None:
    """The error a failed try raises, or ``None`` when it is retried (``UNAVAILABLE``)."""
    text = describe(exc)
    code = code_of(exc)
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in text:
        return EtcdLeaseNotFound(netloc, f"{what}: {text}")
    if is_deadline(exc):
        return EtcdUnavailable(netloc, f"{what}: no answer in time ({text})")
    if code in REFUSED_CODES:
        return EtcdRefused(netloc, f"{what}: {text}")
    if code != grpc.StatusCode.UNAVAILABLE:
        return EtcdUnavailable(netloc, f"{what}: {text}")  # not retried, as before
    return None


@dataclass
class Endpoint:
    """One member: its channel and the stubs of the services the client uses."""

    netloc: str
    channel: Any
    kv: Any
    watch: Any
    lease: Any
    auth: TokenAuth | None = None

    def forget_expired_token(self, exc: grpc.RpcError) -> bool:
        """After ``exc``: when it says the auth token expired, forget the token (the next
        request authenticates again) and return True."""
        if self.auth is None or not token_expired(exc):
            return False
        self.auth.invalidate()
        return True


def _credentials(tls_dir: Path | None) -> Any:
    if tls_dir is None:
        return None
    ca = (tls_dir / "ca.crt").read_bytes()
    cert_path, key_path = tls_dir / "tls.crt", tls_dir / "tls.key"
    if cert_path.exists() and key_path.exists():
        return grpc.ssl_channel_credentials(ca, key_path.read_bytes(), cert_path.read_bytes())
    return grpc.ssl_channel_credentials(ca)


def _open(netloc: str, creds: Any, user: str | None, password: str) -> Endpoint:
    if creds is not None:
        raw = grpc.secure_channel(netloc, creds, options=_CHANNEL_OPTIONS)
    else:
        raw = grpc.insecure_channel(netloc, options=_CHANNEL_OPTIONS)
    auth = TokenAuth(raw, user, password) if user else None
    channel = grpc.intercept_channel(raw, auth) if auth is not None else raw
    return Endpoint(
        netloc,
        raw,
        etcdrpc.KVStub(channel),
        etcdrpc.WatchStub(channel),
        etcdrpc.LeaseStub(channel),
        auth,
    )


class Connection:
    """The members of one etcd cluster and the machinery every request goes through.

    Args:
        endpoints: ``host:port`` (or ``http(s)://host:port``) of etcd members, or one
            comma-separated string; calls go to one and move to the next when it is
            unavailable.
        tls_dir: directory with ``ca.crt`` and, for client-certificate auth,
            ``tls.crt`` and ``tls.key``; ``None`` for plain-text gRPC.
        timeout: seconds one call may take, retries included.
        user, password: etcd user and password (etcd's auth), beside or without TLS.

    Raises:
        ValueError: no endpoints, a malformed endpoint, or ``timeout <= 0``.
        OSError: a TLS file cannot be read.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls_dir: Path | None = None,
        timeout: float = 5.0,
        user: str | None = None,
        password: str = "",
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = float(timeout)
        creds = _credentials(tls_dir)
        self._endpoints: list[Endpoint] = []
        for raw in endpoints:
            netloc, https = parse_endpoint(raw)
            if https and creds is None:
                creds = grpc.ssl_channel_credentials()
            self._endpoints.append(_open(netloc, creds, user, password))
        self._current = random.randrange(len(self._endpoints))
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        #: Called with each :class:`~kelastic_etcd.errors.EtcdError` a call raises (a
        #: lease refresh and a watch included; not a lease-not-found answer), e.g. to
        #: count it in a metric; exceptions are logged.
        self.on_error: Callable[[EtcdError], None] | None = None
        self._closed = threading.Event()
        #: ``time.monotonic()`` of the last call etcd answered (0.0: none yet), so that
        #: a caller can tell an outage that goes on from one that is over.
        self.last_success = 0.0

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The ``host:port`` of every configured member."""
        return tuple(e.netloc for e in self._endpoints)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed.is_set()

    def request_counts(self) -> dict[str, int]:
        """How many requests this client sent to etcd, by operation (instrumentation).

        Keys are the operation names (``"read"``, ``"get"``, ``"cas"``, ``"put"``,
        ``"put_read"``, ``"grant_lease"``, ``"keep_alive"``, ``"wait_change"``,
        ``"watch"`` (a :class:`~kelastic_etcd.watch.Watcher`'s stream), ...); each try
        counts, retries included; a watch stream counts once. ``"cas_failed"`` counts
        compare-and-sets that did not write, ``"errors"`` the calls that failed.
        """
        with self._lock:
            return dict(self._counts)

    def count(self, what: str) -> None:
        """Count one request (or event) named ``what`` in :meth:`request_counts`."""
        with self._lock:
            self._counts[what] += 1

    def endpoint(self) -> Endpoint:
        """The member calls go to now."""
        with self._lock:
            return self._endpoints[self._current]

    def fail_over(self, failed: Endpoint) -> None:
        """Move to the next member, unless another thread already moved away from ``failed``."""
        with self._lock:
            if self._endpoints[self._current] is failed:
                self._current = (self._current + 1) % len(self._endpoints)

    def wait_closed(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until :meth:`close`; return :attr:`closed`."""
        return self._closed.wait(seconds)

    def report(self, exc: EtcdError) -> None:
        """Count a failed call and tell :attr:`on_error` (not after :meth:`close`)."""
        if self._closed.is_set():
            return
        self.count("errors")
        hook = self.on_error
        if hook is not None:
            try:
                hook(exc)
            except Exception:
                log.exception("etcd client: on_error hook failed")

    def call(
        self, what: str, fn: Callable[[Endpoint, float], T], timeout: float | None = None
    ) -> T:
        """Run ``fn(endpoint, seconds_left)`` until it succeeds or the deadline passes.

        ``UNAVAILABLE`` is retried on the next endpoint after a short back-off; every
        other failure, and the deadline, raise (see :func:`classify`), reported to
        :attr:`on_error` first unless it is :class:`EtcdLeaseNotFound`.
        """
        try:
            return self._call(what, fn, timeout)
        except EtcdLeaseNotFound:
            raise  # an answer about the lease, not a failure to reach etcd
        except EtcdError as exc:
            self.report(exc)
            raise

    def _call(self, what: str, fn: Callable[[Endpoint, float], T], timeout: float | None) -> T:
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        backoff = Backoff(jitter=True)
        last = ""
        reauthenticated = False
        while True:
            ep = self.endpoint()
            if self._closed.is_set():
                raise EtcdUnavailable(ep.netloc, f"{what}: the client is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdUnavailable(
                    ep.netloc, f"{what}: no answer within {budget:.1f}s (last error: {last})"
                )
            self.count(what.partition("(")[0])
            try:
                result = fn(ep, left)
                self.last_success = time.monotonic()
                return result
            except grpc.RpcError as exc:
                last = describe(exc)
                if not reauthenticated and ep.forget_expired_token(exc):
                    reauthenticated = True  # authenticate again, once per call
                    continue
                error = classify(ep.netloc, what, exc)
                if error is not None:
                    raise error from None
            self.fail_over(ep)
            pause = min(backoff.next(), deadline - time.monotonic())
            log.debug("%s on %s: %s; retrying in %.2fs", what, ep.netloc, last, max(pause, 0))
            if pause > 0:
                self._closed.wait(pause)

    def close(self) -> None:
        """Close the channels (calls then raise :class:`EtcdUnavailable`); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        for ep in self._endpoints:
            ep.channel.close()
