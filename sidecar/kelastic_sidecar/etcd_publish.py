"""The newest of a series of values, written to one etcd key off the caller's thread.

A sidecar reports things the operator reads (a node's stragglers now) from threads that
must never wait on etcd (the timer server's). :class:`LatestPublisher` takes each new
value with its version and returns at once; one daemon thread at a time writes the newest
version not yet written, skipping those superseded meanwhile (a flapping verdict costs
one write per etcd round trip, not one per flap), and never a version older than one it
wrote. A failed write is logged and dropped: the next value is written as usual.
"""

from __future__ import annotations

import logging
import threading

from kelastic_etcd import EtcdClient, EtcdError

__all__ = ["LatestPublisher"]
log = logging.getLogger("kelastic_sidecar.etcd_publish")


class LatestPublisher:
    """Writes the newest value :meth:`put` was given to ``key`` (see the module doc).

    Args:
        store: the etcd client.
        key: the key written.
        what: what the value is, for the log.
    """

    def __init__(self, store: EtcdClient, key: str, what: str) -> None:
        self._store = store
        self.key = key
        self._what = what
        self._cond = threading.Condition()
        self._pending: tuple[int, bytes] | None = None
        self._newest = -1  # the newest version given (pending or written)
        self._busy = False
        #: The versions written, and the writes that failed.
        self.written = 0
        self.failed = 0

    def put(self, version: int, value: bytes) -> None:
        """Queue ``value`` as version ``version``; ignored when a version as new was
        given already. Never blocks on etcd."""
        with self._cond:
            if version <= self._newest:
                return
            self._newest, self._pending = version, (version, value)
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._drain, name="kelastic-publish", daemon=True).start()

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def _drain(self) -> None:
        while True:
            with self._cond:
                if self._pending is None:
                    self._busy = False
                    self._cond.notify_all()
                    return
                version, value = self._pending
                self._pending = None
            try:
                self._store.put(self.key, value)
                self.written += 1
            except EtcdError as exc:
                self.failed += 1
                log.warning(
                    "cannot write the %s (version %d) to etcd: %s", self._what, version, exc
                )
