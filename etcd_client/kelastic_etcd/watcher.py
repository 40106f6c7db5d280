"""Event-driven waiting on a fixed set of etcd keys over one long-lived watch stream.

:meth:`Watches.wait_change <kelastic_etcd.watch.Watches.wait_change>` opens a
stream per wait: fine for a one-off wait, costly for a node that waits again and again.
Each stream costs the client ~0.35 ms of CPU per watch it creates (gRPC-Python sends
the create requests one by one through a thread), and etcd a watcher to set up and tear
down; a sidecar's watch loop waits every second, so 1000 nodes meant thousands of watch
creates per second on etcd. A :class:`Watcher` creates its watches once, as etcd's own
``clientv3`` watcher keeps one stream per client, and a wait is then a condition
variable: no request at all.

Semantics: a change is an event on a watched key with ``mod_revision`` greater than the
revision the caller last read (the ``revision`` of a
:class:`~kelastic_etcd.kv.Snapshot`). The watcher reports every change after
the revision at which its watches were created (:attr:`Watcher.covered_from`); a wait
for an older revision returns at once (the caller re-reads). When the stream breaks
(etcd restarts, a member fails over) the watches are re-created from the revision after
the last one seen, so nothing is missed; when etcd compacted that history away, waits
report a change (re-read) as soon as the watches are back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from pyetcd import etcdrpc

from .call import Backoff, classify, describe
from .errors import EtcdError, EtcdUnavailable
from .kv import items_of, key_range
from .watch import Watches

log = logging.getLogger("kelastic_etcd")

_PUT: int = etcdrpc.kv_pb2.Event.PUT  # an event's type; the other one is DELETE


class Watcher:
    """Watches ``changes`` (any put or deletion) and ``deletions`` (deletions only).

    Args:
        store: the client whose endpoints (and failover) the stream uses.
        changes: keys, or prefixes ending with ``/``, where any put or deletion counts.
        deletions: keys or prefixes where only a deletion counts (a lease expiring
            deletes its keys): a waiter that must notice a peer's key vanish is not
            woken by every peer that writes one.
        journal: keep the events of ``changes`` (at most ``journal_limit``, the oldest
            dropped first) for :meth:`events_since`: a caller that keeps a copy of the
            watched keys applies each change instead of reading them all again (one
            read per change of N keys is N^2 key reads for N writers).
        journal_limit: most events kept.
        journal_values: keep the values of puts in the journal; without them a put's
            value reads ``b""`` (a caller that needs only which keys changed, watching
            many large values, keeps ``journal_limit`` keys, not values).

    Blocks until etcd created the watches. One background thread reads the stream.
    Thread-safe: any number of threads may :meth:`wait` at once.

    Raises:
        ValueError: nothing to watch.
        EtcdUnavailable: the watches were not created within ``store.timeout``
            seconds.
    """

    def __init__(
        self,
        store: Watches,
        changes: Sequence[str],
        deletions: Sequence[str] = (),
        *,
        journal: bool = False,
        journal_limit: int = 65536,
        journal_values: bool = True,
    ) -> None:
        items = [(item, False) for item in items_of(changes)]
        items += [(item, True) for item in items_of(deletions)]
        if not items:
            raise ValueError("nothing to watch")
        self._store = store
        self._ranges = [(*key_range(item), only_deletions) for item, only_deletions in items]
        # Per exact key of ``changes``: its latest put (value, mod_revision), and the
        # latest revision of any other event, for :meth:`value_if_only_change`.
        exact = [item.encode() for item, only in items if not only and not item.endswith("/")]
        self._puts: dict[bytes, tuple[bytes, int]] = {}
        self._latest_other: dict[bytes, int] = dict.fromkeys(exact, 0)
        self._cond = threading.Condition()
        # (key, value or None for a deletion, mod_revision), in the order seen; events at
        # or below the floor may have been dropped.
        self._journal: collections.deque[tuple[str, bytes | None, int]] | None = (
            collections.deque(maxlen=journal_limit) if journal else None
        )
        self._journal_floor = 0
        self._journal_values = journal_values
        self._journal_only = [only for _, only in items]  # per watch: deletions only
        self._covered_from: int | None = None
        self._latest = 0  # the highest mod_revision of an event seen
        self._resume = [0] * len(items)  # per watch: revision to re-create it from (0: now)
        self._broken_since: float | None = None
        self._broken_reason = ""
        self._closing = threading.Event()
        self._woken = False  # wake() called; the next wait returns at once
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + store.timeout
        with self._cond:
            while self._covered_from is None and not self._closing.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            established = self._covered_from is not None
            reason = self._broken_reason or f"no answer within {store.timeout:.1f}s"
        if not established:
            self.close()
            raise EtcdUnavailable(store.endpoints[0], f"watch: {reason}")

    @property
    def covered_from(self) -> int | None:
        """Every change after this store revision is reported (``None`` while re-creating
        the watches after etcd compacted the history they needed)."""
        with self._cond:
            return self._covered_from

    @property
    def latest_revision(self) -> int:
        """The newest revision known to be covered: the highest ``mod_revision`` of an
        event seen, or :attr:`covered_from` when that is newer (0 while re-creating). A
        caller that acted on a change waits next from here."""
        with self._cond:
            return max(self._latest, self._covered_from or 0)

    def wait(self, since_revision: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a change after ``since_revision``.

        Returns:
            True on a change, and at once when ``since_revision`` is older than
            :attr:`covered_from` (a change may have been missed: re-read), or after
            :meth:`wake`; False when ``timeout`` passed without one.

        Raises:
            EtcdUnavailable: the stream has been broken for ``store.timeout``
                seconds, or the watcher or its store was closed.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing.is_set() or self._store.closed:
                    raise EtcdUnavailable(self._netloc(), "watch: closed")
                if self._woken:
                    self._woken = False
                    return True
                covered = self._covered_from
                if covered is not None and (
                    since_revision < covered or self._latest > since_revision
                ):
                    return True
                now = time.monotonic()
                left = deadline - now
                broken = self._broken_since
                if broken is not None:
                    if now - broken >= self._store.timeout:
                        raise EtcdUnavailable(
                            self._netloc(),
                            f"watch: unavailable for {now - broken:.1f}s ({self._broken_reason})",
                        )
                    left = min(left, broken + self._store.timeout - now)
                if left <= 0:
                    return False
                self._cond.wait(left)

    def wake(self) -> None:
        """Make the current :meth:`wait`, or the next one if none is waiting, return True
        at once: a caller whose thread waits here learns that something else changed
        (what it must watch, say) without waiting out its timeout. Thread-safe."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def value_if_only_change(self, key: str, since_revision: int) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key`` when every change seen after
        ``since_revision`` was a put of ``key``; else ``None`` (read instead).

        ``key`` must be an exact key of ``changes``. A waiter woken by a write of that
        key learns the value from the event, with no read: when a round completes, its
        nodes need not all read the state at once. Events still in flight are not
        known, as with any read.

        Raises:
            KeyError: ``key`` is not an exact key of ``changes``.
        """
        raw = key.encode()
        with self._cond:
            latest_other = self._latest_other[raw]
            covered = self._covered_from
            got = self._puts.get(raw)
        if covered is None or since_revision < covered or latest_other > since_revision:
            return None
        if got is None or got[1] <= since_revision:
            return None
        return got

    def events_since(self, since_revision: int) -> list[tuple[str, bytes | None, int]] | None:
        """The events of ``changes`` after ``since_revision``, oldest first, each
        ``(key, value, mod_revision)`` with ``value`` None for a deletion; None when they
        are not all known (``since_revision`` older than :attr:`covered_from` or than the
        oldest event kept, the history compacted, or no ``journal``): read instead.
        Events still in flight are not known, as with any read."""
        with self._cond:
            covered = self._covered_from
            if self._journal is None or covered is None:
                return None
            if since_revision < covered or since_revision < self._journal_floor:
                return None
            return [ev for ev in self._journal if ev[2] > since_revision]

    def close(self) -> None:
        """Cancel the stream and stop the thread; waits then raise. Idempotent."""
        self._closing.set()
        with self._cond:
            call = self._call
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store.timeout + 1.0)

    # -------------------------------------------------------------------- internals

    def _netloc(self) -> str:
        return self._store.endpoint().netloc

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # closed: waiters raise instead of waiting out their timeouts
            with self._cond:
                self._cond.notify_all()

    def _loop(self) -> None:
        backoff = Backoff()
        while not self._closing.is_set() and not self._store.closed:
            ep = self._store.endpoint()
            self._store.count("watch")
            try:
                self._stream(ep)
                backoff.reset()  # it had been established; it ended or was reset
            except grpc.RpcError as exc:
                if self._closing.is_set() or self._store.closed:
                    return
                if ep.auth is not None and "permission denied" in describe(exc):
                    ep.auth.invalidate()  # how etcd cancels a watch whose token expired
                ep.forget_expired_token(exc)  # the next try authenticates again
                fallback = EtcdUnavailable(ep.netloc, f"watch: {describe(exc)}")
                self._broken(classify(ep.netloc, "watch", exc) or fallback)
                self._store.fail_over(ep)
                self._closing.wait(backoff.next())

    def _stream(self, ep: Any) -> None:
        """One stream: create the watches, then record events until it ends.

        Raises:
            grpc.RpcError: the stream failed or the server ended it.
        """
        creates = []
        for i, (key, end, only_deletions) in enumerate(self._ranges):
            create = etcdrpc.WatchCreateRequest(
                key=key, range_end=end, start_revision=self._resume[i]
            )
            if only_deletions:
                create.filters.append(etcdrpc.WatchCreateRequest.NOPUT)
            creates.append(etcdrpc.WatchRequest(create_request=create))
        # The request iterator ends after the creates (a half-close): etcd keeps the
        # watches until the stream is cancelled, and no thread waits on the iterator.
        call = ep.watch.Watch(iter(creates))
        with self._cond:
            self._call = call
        if self._closing.is_set():
            call.cancel()
            return
        index: dict[int, int] = {}  # watch id -> index into self._ranges (creation order)
        try:
            for resp in call:
                if resp.created:
                    index[resp.watch_id] = len(index)
                    if len(index) == len(self._ranges):
                        self._established(int(resp.header.revision))
                if resp.events:
                    self._record(index.get(resp.watch_id), resp.events)
                if resp.canceled:
                    if resp.compact_revision:
                        self._compacted(int(resp.compact_revision))
                        return
                    raise _Cancelled(resp.cancel_reason or "cancelled by etcd")
        finally:
            call.cancel()
        if not self._closing.is_set():
            raise _Cancelled("the watch stream ended")

    def _established(self, revision: int) -> None:
        with self._cond:
            if self._covered_from is None:
                self._covered_from = revision
            for i, resume in enumerate(self._resume):
                if resume == 0:
                    self._resume[i] = revision + 1
            if self._broken_since is not None:
                log.info("etcd watch re-established at revision %d", revision)
            self._broken_since = None
            self._cond.notify_all()

    def _record(self, i: int | None, events: Any) -> None:
        revision = max(int(ev.kv.mod_revision) for ev in events)
        with self._cond:
            if i is not None:
                self._resume[i] = max(self._resume[i], revision + 1)
            journal = self._journal
            if journal is not None and (i is None or not self._journal_only[i]):
                for ev in events:
                    if len(journal) == journal.maxlen:
                        self._journal_floor = max(self._journal_floor, journal[0][2])
                    value = (bytes(ev.kv.value) if self._journal_values else b"") if (
                        ev.type == _PUT) else None  # fmt: skip
                    journal.append((bytes(ev.kv.key).decode(errors="replace"), value,
                                    int(ev.kv.mod_revision)))  # fmt: skip
            for ev in events:
                rev, key = int(ev.kv.mod_revision), bytes(ev.kv.key)
                is_put = ev.type == _PUT
                if is_put and key in self._latest_other and rev > self._puts.get(key, (b"", 0))[1]:
                    self._puts[key] = (bytes(ev.kv.value), rev)
                for exact, other in self._latest_other.items():
                    if exact != key or not is_put:
                        self._latest_other[exact] = max(other, rev)
            if revision > self._latest:
                self._latest = revision
                self._cond.notify_all()

    def _compacted(self, revision: int) -> None:
        """etcd no longer has the history to resume from: start over from now."""
        log.warning("etcd watch: history compacted at revision %d; watching from now", revision)
        with self._cond:
            self._covered_from = None  # set again once re-created: older waits re-read
            if self._journal is not None:  # what came before is no longer complete
                self._journal.clear()
            self._resume = [0] * len(self._resume)

    def _broken(self, exc: EtcdError) -> None:
        with self._cond:
            if self._broken_since is None:
                self._broken_since = time.monotonic()
                log.warning("etcd watch broken (%s); re-creating it", exc)
            self._broken_reason = str(exc)
            self._cond.notify_all()
        self._store.report(exc)


class _Cancelled(grpc.RpcError):  # type: ignore[misc]
    """etcd cancelled a watch (other than for compaction) or ended the stream."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self._reason = reason

    def code(self) -> Any:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._reason
