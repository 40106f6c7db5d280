"""One-off waits on etcd keys: each wait opens its own watch stream and closes it before
returning (a node that waits again and again keeps one stream open instead:
:class:`~kelastic_etcd.watcher.Watcher`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc
from pyetcd import etcdrpc

from .call import Backoff, Endpoint, classify, describe, is_deadline
from .errors import EtcdError, EtcdRefused, EtcdUnavailable
from .kv import KV, key_range


class _StreamEnded(grpc.RpcError):  # type: ignore[misc]
    """The server ended a watch stream without an error status."""

    def code(self) -> Any:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the watch stream ended"


class Watches(KV):
    """Waiting for changes with etcd watches (and the reads that go with it)."""

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
            EtcdUnavailable: the watch could not be (re-)established for
                ``self.timeout`` seconds.
        """
        try:
            return self._wait_change(keys_or_prefixes, since_revision, timeout)
        except EtcdError as exc:
            self.report(exc)
            raise

    def _wait_change(
        self, keys_or_prefixes: Sequence[str], since_revision: int, timeout: float
    ) -> bool:
        items = [keys_or_prefixes] if isinstance(keys_or_prefixes, str) else list(keys_or_prefixes)
        if not items:
            raise ValueError("nothing to watch")
        requests, checks = [], []
        for item in items:
            key, end = key_range(item)
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
        backoff = Backoff()
        reauthenticated = False
        while True:
            if self.closed:
                raise EtcdUnavailable(self.endpoint().netloc, "wait_change: the client is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ep = self.endpoint()
            self.count("wait_change")
            try:
                return self._watch_once(ep, requests, check, left)
            except EtcdRefused:
                # etcd cancels a watch whose auth token expired as "permission denied"
                if ep.auth is None or reauthenticated:
                    raise
                ep.auth.invalidate()
                reauthenticated = True
            except grpc.RpcError as exc:
                error = classify(ep.netloc, "wait_change", exc)
                if ep.forget_expired_token(exc):
                    error = None  # authenticate again and retry
                if error is not None:
                    raise error from exc
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.timeout or now + backoff.first >= deadline:
                    raise EtcdUnavailable(
                        ep.netloc,
                        f"wait_change: unavailable for {now - failing_since:.1f}s "
                        f"({describe(exc)})",
                    ) from None
                self.fail_over(ep)
                self.wait_closed(backoff.next())

    def _watch_once(self, ep: Endpoint, requests: list[Any], check: Any, timeout: float) -> bool:
        """One watch stream: True on an event, False at the deadline.

        Once etcd created every watch, ``check`` (a transaction of range requests) runs:
        True when it finds a key.

        The request iterator ends after the create requests (a half-close); etcd keeps
        the watches until the stream is cancelled, which ``finally`` does.

        Raises:
            grpc.RpcError: the stream failed (``UNAVAILABLE`` when the server ended it).
            EtcdUnavailable: etcd cancelled the watch for a reason other than
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
                        self.count("read")
                        left = max(deadline - time.monotonic(), 0.001)
                        found = ep.kv.Txn(check, timeout=left)
                        if any(op.response_range.kvs for op in found.responses):
                            return True
                if resp.canceled:
                    if resp.compact_revision:
                        return True  # history gone: the caller must re-read anyway
                    reason = str(resp.cancel_reason)
                    kind = EtcdRefused if "permission denied" in reason else EtcdUnavailable
                    raise kind(ep.netloc, f"wait_change: watch cancelled: {reason}")
        except grpc.RpcError as exc:
            if is_deadline(exc):
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
