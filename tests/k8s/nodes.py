"""Nodes without a process-running kubelet, for tests that play the kubelet themselves.

:class:`ManualNode` is a Ready Node that the real scheduler binds Pods to (select it with
``nodeSelector: {kelastic.dev/test-node: <name>}``); nothing runs them. The test writes their
status (:meth:`ManualNode.set_status`: Running, Failed with a termination message...), and
the node's automatic duties are a kubelet's heartbeat (its Lease, which the real
node-lifecycle controller reads) and the last step of a deletion: a Pod given a
``deletionTimestamp`` is removed (``DELETE`` with grace 0) as if its containers had exited
at once, so deletions complete as on a real node instead of staying Terminating.
:meth:`ManualNode.die` stops both, as a kubelet that died or lost its network would: the
controller marks the Node not Ready and its Pods' deletions are never completed.
:func:`node_pair` gives two of one pool (a Pod may be moved from one to the other);
:func:`scheduled` waits until the scheduler bound a Pod.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from .cluster import Client, ControlPlane, pods_by_name, wait_until

Obj = dict[str, Any]
NODE_LABEL = "kelastic.dev/test-node"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ManualNode:
    """A Ready Node whose Pods' status the test writes.

    Args:
        cluster: the control plane.
        name: the Node's name (also its :data:`NODE_LABEL` value).
        pods: how many Pods fit (its ``pods`` capacity): the scheduler leaves the rest
            ``Unschedulable``.
        labels: more labels of the Node (e.g. a pool several nodes share).
    """

    def __init__(
        self,
        cluster: ControlPlane,
        name: str = "manual",
        pods: int = 250,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.capacity = {"cpu": "64", "memory": "256Gi", "pods": str(pods)}
        self.labels = dict(labels or {})
        self._stop = threading.Event()
        self._dead = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"node-{name}", daemon=True)

    @property
    def selector(self) -> dict[str, str]:
        """The ``nodeSelector`` that puts a Pod here."""
        return {NODE_LABEL: self.name}

    def __enter__(self) -> ManualNode:
        labels = {NODE_LABEL: self.name, "kubernetes.io/hostname": self.name, **self.labels}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
        }
        code, body = self.cluster.request("POST", "/api/v1/nodes", node)
        assert code in (201, 409), body
        self._patch(f"/api/v1/nodes/{self.name}", {"spec": {"taints": None}})
        self._patch(f"/api/v1/nodes/{self.name}/status", {"status": {
            "capacity": self.capacity, "allocatable": self.capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "played by the test", "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now()}],
        }})  # fmt: skip
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.cluster.request("DELETE", f"/api/v1/nodes/{self.name}")

    def _patch(self, path: str, body: Obj) -> Obj:
        code, out = self.cluster.request("PATCH", path, body, "application/merge-patch+json")
        assert code == 200, f"PATCH {path}: {code} {out}"
        return dict(out)

    def _heartbeat(self) -> None:
        """Renew the node's Lease, as a kubelet does (the node-lifecycle controller marks a
        Node whose Lease is not renewed NotReady and taints it)."""
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": now}
        code, _ = self.cluster.request("PATCH", lease_path, {"spec": spec},
                                       "application/merge-patch+json")  # fmt: skip
        if code == 404:
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": self.name}, "spec": spec}  # fmt: skip
            self.cluster.request("POST", lease_path.rsplit("/", 1)[0], lease)

    def _loop(self) -> None:
        """Renew the Lease and complete graceful deletions of this node's Pods."""
        path = f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}"
        beat = 0.0
        while not self._stop.wait(0.2):
            if self._dead.is_set():
                continue
            if time.monotonic() - beat > 5:
                self._heartbeat()
                beat = time.monotonic()
            code, listed = self.cluster.request("GET", path)
            if code != 200:
                continue
            for pod in listed["items"]:
                meta = pod["metadata"]
                if meta.get("deletionTimestamp"):
                    self.cluster.request(
                        "DELETE",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                    )

    def die(self) -> None:
        """Stop heart-beating and completing deletions, as a dead kubelet (or one cut off
        from the API server) does; the Node object stays."""
        self._dead.set()

    def ready(self) -> str | None:
        """The status of the Node's Ready condition (``True``, ``Unknown``...), None
        when it has none or is gone."""
        code, obj = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        conds = (obj.get("status") or {}).get("conditions") or [] if code == 200 else []
        return next((c.get("status") for c in conds if c.get("type") == "Ready"), None)

    def set_status(
        self,
        namespace: str,
        pod: str,
        phase: str,
        *,
        ready: bool = False,
        exit_code: int | None = None,
        message: str = "",
        container: str = "trainer",
    ) -> Obj:
        """Write a Pod's status as its kubelet would: ``phase``, Ready, pod IP and, with
        ``exit_code``, the trainer container terminated with ``message``."""
        status: Obj = {
            "phase": phase,
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()},
                {"type": "Ready", "status": "True" if ready else "False",
                 "lastTransitionTime": _now()},
            ],
        }  # fmt: skip
        if exit_code is not None:
            status["containerStatuses"] = [{
                "name": container, "ready": False, "restartCount": 0, "image": "x",
                "imageID": "", "state": {"terminated": {
                    "exitCode": exit_code, "message": message,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": _now(), "finishedAt": _now()}},
            }]  # fmt: skip
        return self._patch(f"/api/v1/namespaces/{namespace}/pods/{pod}/status", {"status": status})


@contextlib.contextmanager
def node_pair(
    cluster: ControlPlane, prefix: str, labels: dict[str, str]
) -> Iterator[dict[str, ManualNode]]:
    """Two :class:`ManualNode` s, ``<prefix>-a`` and ``<prefix>-b``, sharing ``labels`` (a
    pool a job's ``nodeSelector`` names), by name."""
    with (
        ManualNode(cluster, f"{prefix}-a", labels=labels) as a,
        ManualNode(cluster, f"{prefix}-b", labels=labels) as b,
    ):
        yield {a.name: a, b.name: b}


def scheduled(k8s: Client, pod: str, timeout: float) -> Obj:
    """Pod ``pod`` of ``k8s``'s namespace once the scheduler bound it to a Node.

    Raises:
        AssertionError: not bound within ``timeout`` seconds.
    """

    def bound() -> Obj | None:
        found = pods_by_name(k8s).get(pod)
        return found if found and (found.get("spec") or {}).get("nodeName") else None

    return wait_until(bound, timeout, what=f"{pod} scheduled")
