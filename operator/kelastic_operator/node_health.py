"""Which Nodes are not Ready, and since when: what the operator's Node watch tells it.

A Node's readiness is its ``Ready`` condition. Its kubelet posts it; the node-lifecycle
controller sets it to ``Unknown`` when the kubelet's heartbeats (its Lease in
``kube-node-lease``) stopped for the node-monitor grace period (about 50 s), and the
kubelet itself says ``False`` when it cannot run Pods (container runtime down, ...).
Either way the Node's Pods get no more status, and a graceful deletion of them is never
confirmed: on a real cluster they stay ``Terminating`` for good (kubeflow/trainer#2072).
Rule 10 of :mod:`~kelastic_operator.reconcile` counts such a Pod lost
``spec.nodeLostSeconds`` after the time this module reports.

:func:`not_ready_since` reads one Node object (a dict as the API returns it; it never
raises, whatever the object holds); :class:`NodeHealth` keeps, per Node name, only the
Nodes that are not Ready (a few bytes each: a cluster of thousands of Nodes costs the
operator no copy of them).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from .reconcile_views import parse_time

__all__ = ["NodeHealth", "not_ready_since"]


def not_ready_since(node: Mapping[str, Any], now: datetime) -> datetime | None:
    """Since when ``node`` has not been Ready; None while it is, or cannot be told.

    Args:
        node: a Node object (``status.conditions[type=Ready]`` is read).
        now: the current time (timezone-aware).

    Returns:
        None when the Ready condition is ``True``, or when there is none (a Node whose
        kubelet never posted: nothing runs there yet). Otherwise the condition's
        ``lastTransitionTime``, or ``now`` when that is missing, unreadable or later than
        ``now`` (a clock ahead of ours must not postpone the verdict).
    """
    status = node.get("status") if isinstance(node, Mapping) else None
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, list):
        return None
    for cond in conditions:
        if not isinstance(cond, Mapping) or cond.get("type") != "Ready":
            continue
        if cond.get("status") == "True":
            return None
        changed = cond.get("lastTransitionTime")
        since = parse_time(changed) if isinstance(changed, str) else None
        return now if since is None or since > now else since
    return None


class NodeHealth:
    """The not-Ready Nodes by name, with since when. Thread-safe (kopf's Node handler
    writes, reconcile passes in worker threads read).

    A deleted Node counts as not Ready since it was deleted (its Pods can never run
    again); it is forgotten ``forget_after`` after that, or when a Node of its name is
    seen again.

    Args:
        forget_after: how long a deleted Node's entry is kept (a Pod bound to it is gone
            long before: the Pod garbage collector deletes it within a minute).
    """

    def __init__(self, forget_after: timedelta = timedelta(hours=1)) -> None:
        self.forget_after = forget_after
        self._lock = threading.Lock()
        self._since: dict[str, datetime] = {}
        self._deleted: dict[str, datetime] = {}

    def observe(self, name: str, node: Mapping[str, Any], now: datetime) -> bool:
        """Record what ``node`` (an ADDED or MODIFIED Node) says.

        Returns:
            True when the Node's entry changed (it went not Ready, or Ready again, or its
            time moved): the jobs with Pods on it should reconcile.
        """
        since = not_ready_since(node, now)
        with self._lock:
            self._deleted.pop(name, None)
            old = self._since.get(name)
            if since is None:
                self._since.pop(name, None)
            else:
                self._since[name] = since
            return old != since

    def deleted(self, name: str, now: datetime) -> bool:
        """Record that the Node ``name`` was deleted at ``now`` (not Ready since then,
        unless it already was earlier). Entries of Nodes deleted longer than
        ``forget_after`` ago are dropped. Returns True when the entry changed."""
        with self._lock:
            for gone, at in list(self._deleted.items()):
                if now - at > self.forget_after:
                    del self._deleted[gone]
                    self._since.pop(gone, None)
            old = self._since.get(name)
            self._since[name] = min(old, now) if old is not None else now
            self._deleted[name] = now
            return old is None

    def since(self, name: str) -> datetime | None:
        """Since when the Node ``name`` has not been Ready; None when it is Ready or
        unknown."""
        with self._lock:
            return self._since.get(name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._since)
