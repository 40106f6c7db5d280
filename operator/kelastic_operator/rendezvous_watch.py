"""Wake a job's reconciler when its rendezvous status changes in etcd.

The job's status (round, world size, restarts spent, in-process restarts, the nodes'
final reports) is read from etcd, which the sidecars write; Kubernetes sends no event
when a round completes. Without a watch the status followed only the job's and its Pods'
events and the resync (30 s by default): ``kubectl get ej`` showed a round's world size up
to 30 s late, or never, for a short job (seen in the chart's e2e test).

One :class:`StatusHub` per etcd (per store) keeps **one** watch stream on every job's keys
(the prefix :data:`kelastic.contract.ETCD_ROOT`), reads which keys changed from the
watch's journal (keys only: values are not kept) and calls back the jobs whose
*status keys* changed (:func:`~kelastic_operator.etcd_view.status_keys`); other
keys (liveness, join requests, the in-process barrier) wake no one. A stream per job cost
the operator ~0.03 % of a core per idle job (gRPC's stream threads: 3 % for 100 jobs,
measured); one stream costs the same for any number of jobs.

:class:`StatusFollower` is a job daemon's handle: :meth:`StatusFollower.follow` the job's
prefix on its store, :meth:`StatusFollower.close` when done. etcd unreachable: the hub
tries again every ``retry_seconds``, and meanwhile the resync still reconciles. A burst of
changes (every node's report at the end of a job) wakes a reconciler once per pass: the
wake-up is an event that the next pass clears. When the watch's history is incomplete
(etcd compacted it, or the stream was re-created) every registered job is woken.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from kelastic import contract

from .etcd_view import status_keys
from .rendezvous_store import RendezvousStore, RendezvousStoreError, StatusWatch

__all__ = ["StatusFollower", "StatusHub", "StatusHubs", "job_of_status_key"]

log = logging.getLogger("kelastic_operator")

#: Seconds one wait on the watch may last: a change ends it at once, and so does closing
#: the hub (it closes the watch); a bound, not a poll.
_IDLE_WAIT: Final = 300.0

OnChange = Callable[[], object]


def job_of_status_key(key: str) -> str | None:
    """The job prefix (``/kelastic/<ns>/<job>/<uid>/``) of ``key`` when ``key`` is one of
    that job's status keys (:func:`~kelastic_operator.etcd_view.status_keys`, a
    prefix there standing for the keys under it); None for any other key."""
    root = contract.ETCD_ROOT + "/"
    if not key.startswith(root):
        return None
    parts = key[len(root) :].split("/", 3)
    if len(parts) != 4 or not all(parts[:3]):
        return None
    prefix = f"{root}{parts[0]}/{parts[1]}/{parts[2]}/"
    for status in status_keys(prefix):
        under = status.endswith("/") and key.startswith(status) and key != status
        if under or (key == status and not status.endswith("/")):
            return prefix
    return None


class StatusHub:
    """One watch stream on ``store`` that wakes the jobs registered with it.

    Args:
        store: the jobs' etcd.
        name: for the logs and the thread's name.
        retry_seconds: wait before creating the watch again after etcd failed.

    Thread-safe. The thread starts with the first registration and ends with the last
    unregistration (or :meth:`close`).
    """

    def __init__(
        self, store: RendezvousStore, *, name: str = "", retry_seconds: float = 5.0
    ) -> None:
        self._store = store
        self._name = name or "etcd"
        self._retry = retry_seconds
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, OnChange]] = {}
        self._ids = 0
        self._stop: threading.Event | None = None
        self._watch: StatusWatch | None = None
        self._watching = False

    def register(self, prefix: str, on_change: OnChange) -> Callable[[], None]:
        """Call ``on_change`` (from the hub's thread; it must not block) whenever one of
        the status keys of job ``prefix`` changes, and once now (what changed between the
        caller's last read and this call is not missed). Returns the unregister call."""
        with self._lock:
            self._ids += 1
            token = self._ids
            self._jobs.setdefault(prefix, {})[token] = on_change
            if self._stop is None:
                stop = self._stop = threading.Event()
                threading.Thread(target=self._loop, args=(stop,), daemon=True,
                                 name=f"status-watch {self._name}").start()  # fmt: skip
        on_change()

        def unregister() -> None:
            with self._lock:
                calls = self._jobs.get(prefix, {})
                calls.pop(token, None)
                if not calls:
                    self._jobs.pop(prefix, None)
                idle = not self._jobs
            if idle:
                self._end()

        return unregister

    @property
    def watching(self) -> bool:
        """True while the stream is up (and every job was woken once it came up)."""
        with self._lock:
            return self._watching

    @property
    def jobs(self) -> int:
        """Job prefixes registered now."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Stop the thread and drop every registration. Idempotent; never blocks."""
        with self._lock:
            self._jobs.clear()
        self._end()

    # ------------------------------------------------------------------ internals

    def _end(self) -> None:
        with self._lock:
            if self._jobs:
                return  # registered again meanwhile
            stop, watch = self._stop, self._watch
            self._stop = self._watch = None
        if stop is not None:
            stop.set()
        if watch is not None:  # closing joins the stream's thread: not on the caller's
            threading.Thread(target=watch.close, name="status-watch close", daemon=True).start()

    def _callbacks(self, prefixes: set[str] | None) -> list[OnChange]:
        with self._lock:
            chosen = self._jobs if prefixes is None else {
                p: self._jobs[p] for p in prefixes if p in self._jobs}  # fmt: skip
            return [call for calls in chosen.values() for call in calls.values()]

    def _wake(self, prefixes: set[str] | None) -> None:
        for call in self._callbacks(prefixes):
            try:
                call()
            except Exception:  # one job's callback must not stop the others' wake-ups
                log.exception("%s: a status wake-up failed", self._name)

    def _open(self, stop: threading.Event) -> StatusWatch | None:
        while not stop.is_set():
            try:
                watch = self._store.watch(contract.ETCD_ROOT + "/")
            except RendezvousStoreError as exc:
                log.info("%s: no status watch (%s); retrying in %.0fs", self._name, exc,
                         self._retry)  # fmt: skip
                stop.wait(self._retry)
                continue
            with self._lock:
                if self._stop is stop:
                    self._watch = watch
                    return watch
            watch.close()  # ended meanwhile
        return None

    def _loop(self, stop: threading.Event) -> None:
        while (watch := self._open(stop)) is not None:
            try:
                since = watch.latest_revision
                self._wake(None)  # what changed before the stream existed
                with self._lock:
                    self._watching = self._watch is watch
                while not stop.is_set():
                    if not watch.wait(since, _IDLE_WAIT):
                        continue
                    events = watch.events_since(since)
                    if events:
                        since = max(rev for _, _, rev in events)
                        changed = {job_of_status_key(key) for key, _, _ in events}
                        self._wake({p for p in changed if p is not None})
                    else:  # history incomplete (compacted, re-created): everyone re-reads
                        since = watch.latest_revision
                        self._wake(None)
            except Exception as exc:  # closed by _end(), the stream broke for good
                # (EtcdError), or a bug: the resync still reconciles; watch again
                if stop.is_set():
                    return
                log.warning("%s: status watch ended: %s: %s", self._name,
                            type(exc).__name__, exc)  # fmt: skip
                stop.wait(self._retry)
            finally:
                with self._lock:
                    self._watching = False
                watch.close()


class StatusHubs:
    """One :class:`StatusHub` per store (the operator's ``OperatorContext.status_hubs``).

    Args:
        retry_seconds: passed to each hub.
    """

    def __init__(self, retry_seconds: float = 5.0) -> None:
        self._retry = retry_seconds
        self._lock = threading.Lock()
        self._hubs: dict[int, tuple[RendezvousStore, StatusHub]] = {}

    def hub(self, store: RendezvousStore) -> StatusHub:
        """The hub of ``store`` (created on first use)."""
        with self._lock:
            found = self._hubs.get(id(store))
            if found is None or found[0] is not store:
                found = (store, StatusHub(store, retry_seconds=self._retry))
                self._hubs[id(store)] = found
            return found[1]

    def close(self) -> None:
        """Close every hub."""
        with self._lock:
            hubs = [hub for _, hub in self._hubs.values()]
            self._hubs.clear()
        for hub in hubs:
            hub.close()


class StatusFollower:
    """A job daemon's registration with the hubs: ``on_change`` is called whenever the
    followed job's status keys change in etcd.

    Args:
        hubs: the operator's hubs.
        on_change: called from a hub's thread; must not block (e.g.
            ``loop.call_soon_threadsafe(event.set)``).

    Thread-safe; :meth:`follow` and :meth:`close` never block.
    """

    def __init__(self, hubs: StatusHubs, on_change: OnChange) -> None:
        self._hubs = hubs
        self._on_change = on_change
        self._lock = threading.Lock()
        self._target: tuple[RendezvousStore, str] | None = None
        self._unregister: Callable[[], None] | None = None

    def follow(self, store: RendezvousStore | None, prefix: str | None) -> None:
        """Follow job ``prefix`` on ``store``; a new target replaces the old one. ``None``
        for either stops following (no usable etcd, or the job finished)."""
        target = None if store is None or prefix is None else (store, prefix)
        with self._lock:
            if target == self._target:
                return
            old, self._unregister, self._target = self._unregister, None, target
        if old is not None:
            old()
        if target is not None:
            unregister = self._hubs.hub(target[0]).register(target[1], self._on_change)
            with self._lock:
                if self._target == target and self._unregister is None:
                    self._unregister = unregister
                    return
            unregister()  # replaced meanwhile

    def close(self) -> None:
        """Stop following. Idempotent."""
        self.follow(None, None)

    @property
    def following(self) -> str | None:
        """The prefix followed, or None."""
        with self._lock:
            return None if self._target is None else self._target[1]
