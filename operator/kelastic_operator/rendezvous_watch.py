"""Wake a job's reconciler when its rendezvous status changes in etcd.

The job's status (round, world size, restarts spent, in-process restarts, the nodes'
final reports) is read from etcd, which the sidecars write; Kubernetes sends no event
when a round completes. Without a watch the status would follow only the job's and its
Pods' events and the resync (30 s by default): ``kubectl get ej`` showed a round's world
size up to 30 s late, or never, for a short job (seen in the chart's e2e test).

:class:`StatusFollower` keeps one watch (:meth:`RendezvousStore.watch
<kelastic_operator.rendezvous_store.RendezvousStore.watch>`: one etcd watch stream on the
few keys the status is read from, :func:`~kelastic_operator.rendezvous_store.status_keys`)
per job on a daemon thread and calls ``on_change`` on every change. etcd unreachable:
the watch is tried again every ``retry_seconds``; meanwhile the resync still reconciles.
A burst of changes (every node's final report at the end of a job) wakes the reconciler
once per pass: the wake-up is an event that the next pass clears.

Cost: a thread and an etcd watch stream per job (no requests while nothing changes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .rendezvous_store import RendezvousStore, RendezvousStoreError

__all__ = ["StatusFollower"]

log = logging.getLogger("kelastic_operator")


class StatusFollower:
    """Calls ``on_change`` whenever the followed job's status keys change in etcd.

    Args:
        on_change: called from the follower's thread, once the watch is created (a
            change between the reconciler's read and the watch is not missed) and after
            each change; must not block (e.g. ``loop.call_soon_threadsafe(event.set)``).
        name: the job (``namespace/name``), for the logs and the thread's name.
        retry_seconds: wait before creating the watch again after etcd failed.
        poll_seconds: longest wait on the watch before checking for :meth:`close` (no
            request is sent: a wait is a condition variable).

    Thread-safe; :meth:`follow` and :meth:`close` never block.
    """

    def __init__(
        self,
        on_change: Callable[[], object],
        *,
        name: str,
        retry_seconds: float = 5.0,
        poll_seconds: float = 1.0,
    ) -> None:
        self._on_change = on_change
        self._name = name
        self._retry = retry_seconds
        self._poll = poll_seconds
        self._lock = threading.Lock()
        self._target: tuple[RendezvousStore, str] | None = None
        self._stop: threading.Event | None = None

    def follow(self, store: RendezvousStore | None, prefix: str | None) -> None:
        """Watch ``prefix`` (a job prefix) on ``store``; a new target replaces the old one.
        ``None`` for either stops watching (no usable etcd)."""
        target = None if store is None or prefix is None else (store, prefix)
        with self._lock:
            if target == self._target:
                return
            if self._stop is not None:
                self._stop.set()
            self._target, self._stop = target, None
            if target is None:
                return
            stop = self._stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(*target, stop), name=f"status-watch {self._name}", daemon=True
        )
        thread.start()

    def close(self) -> None:
        """Stop watching (the thread ends within ``poll_seconds``). Idempotent."""
        self.follow(None, None)

    @property
    def following(self) -> str | None:
        """The prefix being watched, or None."""
        with self._lock:
            return None if self._target is None else self._target[1]

    def _run(self, store: RendezvousStore, prefix: str, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                watch = store.watch(prefix)
            except RendezvousStoreError as exc:
                log.info("%s: no status watch (%s); retrying in %.0fs", self._name, exc,
                         self._retry)  # fmt: skip
                stop.wait(self._retry)
                continue
            try:
                since = watch.latest_revision
                self._on_change()
                while not stop.is_set():
                    if watch.wait(since, self._poll):
                        since = watch.latest_revision
                        self._on_change()
            except Exception as exc:  # the stream broke for good (EtcdError), or a bug:
                # either way the resync still reconciles; watch again after a pause
                log.warning("%s: status watch ended: %s: %s", self._name,
                            type(exc).__name__, exc)  # fmt: skip
                stop.wait(self._retry)
            finally:
                watch.close()
