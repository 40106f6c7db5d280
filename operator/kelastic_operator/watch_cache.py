"""What the operator's watch streams say: each ElasticJob and its Pods, kept in memory.

kopf's event handlers feed it (every ADDED/MODIFIED/DELETED of a job or of a Pod labelled
with a job name), and so do the operator's own writes (the object the API returns), so a
reconcile pass reads the API only when its job is not known yet or when a relist is due:
an idle job costs no API request, as client-go's informers do for built-in controllers.

The relist (:meth:`WatchCache.due_for_relist`) heals what a watch cannot tell: a Pod deleted
while a watch was reconnecting and whose DELETED event was never delivered.

Objects are JSON dicts as the API returns them. Thread-safe: kopf's handlers run on its
event loop, reconcile passes in worker threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]
Key = tuple[str, str]


_POD_META = ("name", "namespace", "uid", "resourceVersion", "labels", "creationTimestamp",
             "deletionTimestamp")  # fmt: skip
_POD_STATUS = ("phase", "reason", "message", "conditions", "containerStatuses")


def slim_pod(pod: Obj) -> Obj:
    """The part of a Pod that reconciling reads (:func:`~kelastic_operator.reconcile.pod_view`):
    identity, labels, kelastic's annotations, times, node, phase, conditions and container
    states. A copy ~10x smaller than the Pod (thousands are kept); nested values are shared
    with ``pod``, which the caller must not change afterwards."""
    meta = pod.get("metadata") or {}
    slim_meta = {k: meta[k] for k in _POD_META if k in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k.startswith("kelastic.dev/")}  # fmt: skip
    if annotations:
        slim_meta["annotations"] = annotations
    status = pod.get("status") or {}
    out: Obj = {"metadata": slim_meta, "status": {k: status[k] for k in _POD_STATUS if k in status}}
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        out["spec"] = {"nodeName": node}
    return out


def _rv(obj: Obj) -> int | None:
    """The resourceVersion as an integer, None when it is not one (it is opaque: only
    compared when both sides parse)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or "")
    except ValueError:
        return None


class WatchCache:
    """Jobs by ``(namespace, name)`` and their Pods by ``(namespace, job name)``.

    Args:
        relist_seconds: how long a job's Pods are trusted before a pass lists them again
            (a watch that resumes replays every event, DELETED included; only a watch that
            had to start over after ``410 Gone`` can have missed one).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self, relist_seconds: float = 1800.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.relist_seconds = relist_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[Key, Obj] = {}
        self._pods: dict[Key, dict[str, Obj]] = {}
        self._listed: dict[Key, float] = {}

    # --- jobs -----------------------------------------------------------------------------

    def job(self, namespace: str, name: str) -> Obj | None:
        """The newest known body of a job, None when unknown."""
        with self._lock:
            return self._jobs.get((namespace, name))

    def put_job(self, obj: Obj) -> None:
        """Record a job's body unless a newer one is known."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or "default"), str(meta.get("name")))
        with self._lock:
            if self._newer_known(self._jobs.get(key), obj):
                return
            self._jobs[key] = obj

    def drop_job_body(self, namespace: str, name: str) -> None:
        """Forget only a job's body (a write found it stale); its Pods stay known."""
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def drop_job(self, namespace: str, name: str) -> None:
        """Forget a job and its Pods (it is gone)."""
        with self._lock:
            self._jobs.pop((namespace, name), None)
            self._pods.pop((namespace, name), None)
            self._listed.pop((namespace, name), None)

    # --- pods -----------------------------------------------------------------------------

    def pods(self, namespace: str, job: str) -> list[Obj] | None:
        """The job's Pods, None when they were never listed or a relist is due."""
        with self._lock:
            if self.due_for_relist_locked(namespace, job):
                return None
            return list(self._pods.get((namespace, job), {}).values())

    def due_for_relist_locked(self, namespace: str, job: str) -> bool:
        listed = self._listed.get((namespace, job))
        return listed is None or self._clock() - listed >= self.relist_seconds

    def replace_pods(self, namespace: str, job: str, pods: list[Obj]) -> None:
        """A full list of the job's Pods (from the API): it replaces what was known."""
        with self._lock:
            current = self._pods.get((namespace, job), {})
            fresh = {}
            for pod in map(slim_pod, pods):
                name = str(pod["metadata"]["name"])
                known = current.get(name)
                fresh[name] = known if self._newer_known(known, pod) and known else pod
            self._pods[(namespace, job)] = fresh
            self._listed[(namespace, job)] = self._clock()

    def put_pod(self, namespace: str, job: str, obj: Obj) -> None:
        """Record a Pod (an event or a write's answer; kept as :func:`slim_pod`) unless a
        newer one is known."""
        obj = slim_pod(obj)
        name = str(obj["metadata"]["name"])
        with self._lock:
            pods = self._pods.setdefault((namespace, job), {})
            if self._newer_known(pods.get(name), obj):
                return
            pods[name] = obj

    def drop_pod(self, namespace: str, job: str, name: str, uid: str | None = None) -> None:
        """Forget a Pod (deleted); with ``uid``, only that incarnation of the name."""
        with self._lock:
            pods = self._pods.get((namespace, job), {})
            known = pods.get(name)
            if known is not None and (uid is None or known["metadata"].get("uid") == uid):
                del pods[name]

    def jobs_on_node(self, node: str) -> list[Key]:
        """``(namespace, job)`` of the jobs with a known Pod bound to ``node`` (a Node
        whose readiness changed wakes them). One scan of the known Pods: Node changes of
        readiness are rare."""
        with self._lock:
            return [
                key
                for key, pods in self._pods.items()
                if any((p.get("spec") or {}).get("nodeName") == node for p in pods.values())
            ]

    @staticmethod
    def _newer_known(known: Obj | None, obj: Obj) -> bool:
        if known is None:
            return False
        if (known.get("metadata") or {}).get("uid") != (obj.get("metadata") or {}).get("uid"):
            return False  # another object of the same name: the later report wins
        old, new = _rv(known), _rv(obj)
        return old is not None and new is not None and old > new
