"""etcd's user/password authentication: a token per member's channel.

With a user, every request on a member's channel carries the token etcd's
``Authenticate`` returned; simple tokens are local to the member that issued them,
hence one per channel. They expire ``--auth-token-ttl`` seconds (300 by default) after
their last use: the call machinery then forgets the token (:meth:`TokenAuth.invalidate`)
and the next request authenticates again.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import grpc
from pyetcd import etcdrpc


class _Details(NamedTuple):
    method: Any
    timeout: Any
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class TokenAuth(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds etcd's auth token to every request on one member's channel.

    The token is fetched with ``Authenticate`` (on the plain channel) before the first
    request and after :meth:`invalidate`.
    """

    def __init__(self, channel: Any, user: str, password: str) -> None:
        self._auth = etcdrpc.AuthStub(channel)
        self._user, self._password = user, password
        self._token: str | None = None
        self._lock = threading.Lock()

    def token(self, timeout: float) -> str:
        """The current token, authenticating first when there is none.

        Raises:
            grpc.RpcError: ``Authenticate`` failed (wrong password: ``INVALID_ARGUMENT``).
        """
        with self._lock:
            if self._token is None:
                req = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
                self._token = str(self._auth.Authenticate(req, timeout=timeout).token)
            return self._token

    def invalidate(self) -> None:
        """Forget the token: the next request authenticates again."""
        with self._lock:
            self._token = None

    def _with_token(self, details: Any) -> Any:
        timeout = details.timeout if details.timeout is not None else 5.0
        metadata = [*(details.metadata or ()), ("token", self.token(timeout))]
        return _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


def token_expired(exc: grpc.RpcError) -> bool:
    """etcd no longer accepts the request's auth token (it expired: simple tokens live
    ``--auth-token-ttl`` seconds, 300 by default, after their last use)."""
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return "invalid auth token" in str(details)
