"""A local "kubelet" for the test cluster: runs the Pods bound to its Node as processes.

It registers a Node (Ready, with a set capacity, tainted: Pods need :data:`PLACEMENT`) and
runs every Pod the real scheduler binds to it with local mode's container runtime
(:class:`kelastic_operator.local.pods.LocalPod`):
native sidecars (init containers with ``restartPolicy: Always``) first, then the main
containers. It reports status through the API as a kubelet does:

- ``Pending`` with ``ContainerCreating`` while the "image" is being pulled (``pull_seconds``
  per image lets a test hold a Pod there), then ``Running`` and ``Ready``;
- ``Succeeded`` / ``Failed`` with each container's exit code, reason and termination
  message once the main containers exit (the native sidecars are then stopped);
- graceful deletion: a Pod with a ``deletionTimestamp`` gets SIGTERM, SIGKILL after its
  ``deletionGracePeriodSeconds``, its final status, then the final ``DELETE`` with grace 0
  and the Pod's UID as precondition (until then the Pod shows as Terminating).

What it maps, since every Pod shares this machine: pod IP 127.0.0.1 (the kelastic
sidecar's HTTP port is a free port per Pod); volumes are folders (``emptyDir`` per Pod, a
``persistentVolumeClaim`` per claim); ``workingDir`` is the folder ``images`` maps the image
to; ``terminationMessagePath`` a file per container. Not done: probes (a started container
is ready), restarts of containers (``restartPolicy: Never`` only), resource limits, logs
through the API.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kelastic_operator.local.pods import LocalContainer, LocalPod

from .cluster import ControlPlane

Obj = dict[str, Any]
NODE = "kelastic-local"
#: The Node's taint: only Pods that tolerate it (:data:`TOLERATION`) run as processes here;
#: anything else a test applies (an operator Deployment, an etcd StatefulSet) stays Pending
#: or goes to a :class:`~tests.k8s.nodes.ManualNode` instead of running on this machine.
TAINT = {"key": "kelastic.dev/local-kubelet", "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}
#: The Pod-spec fields that place a Pod on this kubelet.
PLACEMENT = {"nodeSelector": {"kubernetes.io/hostname": NODE}, "tolerations": [TOLERATION]}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Tracked:
    """A Pod the kubelet runs."""

    obj: Obj
    pod: LocalPod
    started_at: float
    running: bool = False
    done: bool = False
    stopping: bool = False
    ready_since: str = field(default_factory=_now)

    @property
    def key(self) -> tuple[str, str]:
        return (self.obj["metadata"]["namespace"], self.obj["metadata"]["name"])

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])


class LocalKubelet:
    """Runs the Pods bound to Node ``node`` as local processes until :meth:`stop`.

    Args:
        cluster: the control plane (the kubelet talks to it as the cluster admin).
        workdir: where Pods' folders, volumes and logs go.
        images: image name -> local folder used as the container's working directory.
        pull_seconds: image name -> seconds its Pods stay ``ContainerCreating``.
        node: the Node's name; ``capacity`` its allocatable resources.
        labels: extra labels of the Node.
        max_grace: an upper bound (seconds) on the grace period a deletion is given.
    """

    def __init__(
        self,
        cluster: ControlPlane,
        workdir: Path,
        images: dict[str, Path] | None = None,
        *,
        pull_seconds: dict[str, float] | None = None,
        node: str = NODE,
        capacity: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        max_grace: float = 30.0,
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.images = images or {}
        self.pull_seconds = pull_seconds or {}
        self.node = node
        self.capacity = capacity or {"cpu": "64", "memory": "256Gi", "pods": "250"}
        self.labels = labels or {}
        self.max_grace = max_grace
        self.pods: dict[tuple[str, str], _Tracked] = {}
        self.warnings: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="local-kubelet", daemon=True)
        self._api: Any = None

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> LocalKubelet:
        """Register the Node and start syncing in a background thread."""
        import kubernetes.client

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._api = kubernetes.client.CoreV1Api(self.cluster.admin.api_client())
        self.register_node()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing, kill every process it started and delete its Node."""
        self._stop.set()
        self._thread.join(30)
        for local in list(self.pods.values()):
            local.pod.stop(0.5)
        with contextlib.suppress(Exception):
            self._api.delete_node(self.node)
        self._api.api_client.close()

    def __enter__(self) -> LocalKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def register_node(self) -> None:
        """Create (or refresh) the Node, Ready, with its capacity and labels."""
        import kubernetes.client

        labels = {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **self.labels}  # fmt: skip
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node, "labels": labels},
        }
        try:
            self._api.create_node(body)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
        # the API server taints a new Node not-ready; the node-lifecycle controller (not run
        # here: this kubelet keeps its Node Ready itself) would lift it once Ready
        self._api.patch_node(self.node, {"spec": {"taints": [TAINT]}})
        self._api.patch_node_status(self.node, {"status": {
            "capacity": self.capacity, "allocatable": self.capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kelastic test kubelet is posting ready status",
                            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}],
            "nodeInfo": {"kubeletVersion": "v0.0.0-kelastic", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local://0",
                         "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""},
        }})  # fmt: skip

    def log(self, namespace: str, pod: str, container: str) -> str:
        """What a container of a Pod wrote (stdout and stderr)."""
        local = self.pods.get((namespace, pod))
        for c in local.pod.containers if local else []:
            if c.name == container:
                return c.log.read_text(errors="replace") if c.log.exists() else ""
        return ""

    # ------------------------------------------------------------------------ syncing

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._sync()
            except Exception as exc:  # keep the kubelet alive; the test will see the effect
                self.warnings.append(f"sync failed: {exc!r}")

    def _sync(self) -> None:
        listed = self._api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", _preload_content=False
        )
        import json

        items = json.loads(listed.data)["items"]
        seen: set[tuple[str, str]] = set()
        for obj in items:
            meta = obj["metadata"]
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            local = self.pods.get(key)
            if local is not None and local.uid != meta["uid"]:
                local.pod.stop(0.5)  # same name, a new Pod
                self.pods.pop(key, None)
                local = None
            if meta.get("deletionTimestamp"):
                self._delete(obj, local)
            elif local is None:
                if (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    self._admit(obj)
            elif not local.running:
                self._maybe_start(local)
            elif not local.done:
                self._check(local)
        for key in list(self.pods):
            if key not in seen:  # gone from the API (force-deleted)
                self.pods.pop(key).pod.stop(0.5)

    # ------------------------------------------------------------------ pod lifecycle

    def _admit(self, obj: Obj) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        local = _Tracked(
            obj,
            LocalPod(
                obj,
                self.workdir / ns / name,
                shared_dir=self.workdir / ns / "pvc",
                cwd=lambda c: self.images.get(str(c.get("image")), self.workdir),
                warn=self.warnings.append,
            ),
            started_at=time.monotonic(),
        )
        self.pods[(ns, name)] = local
        waiting = {"waiting": {"reason": "ContainerCreating"}}
        self._patch(local, {
            "phase": "Pending", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": _now(),
            "conditions": self._conditions(obj, initialized=False, ready=False),
            "initContainerStatuses": [self._status(c, waiting) for c in self._init(obj)],
            "containerStatuses": [self._status(c, waiting) for c in obj["spec"]["containers"]],
        })  # fmt: skip
        self._maybe_start(local)

    def _maybe_start(self, local: _Tracked) -> None:
        images = [str(c.get("image")) for c in self._all(local.obj)]
        pull = max((self.pull_seconds.get(i, 0.0) for i in images), default=0.0)
        if time.monotonic() - local.started_at < pull:
            return
        local.running = True
        try:
            local.pod.start()
        except (OSError, ValueError) as exc:
            self.warnings.append(f"{local.key}: cannot start: {exc}")
            local.pod.stop(0.5)
            local.done = True
            self._patch(local, {"phase": "Failed", "reason": "StartError", "message": str(exc)})
            return
        running = {"running": {"startedAt": _now()}}
        self._patch(local, {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": self._conditions(local.obj, initialized=True, ready=True),
            "initContainerStatuses": [self._status(c, running, ready=True)
                                      for c in self._init(local.obj)],
            "containerStatuses": [self._status(c, running, ready=True)
                                  for c in local.obj["spec"]["containers"]],
        })  # fmt: skip

    def _check(self, local: _Tracked) -> None:
        if not local.pod.main_done():
            return
        local.pod.stop_sidecars(self._grace(local.obj))
        self._finish(local)

    def _finish(self, local: _Tracked, deleted: bool = False) -> None:
        local.done = True
        main = [self._terminated(c) for c in local.pod.main]
        ok = all(s["state"]["terminated"]["exitCode"] == 0 for s in main) and not deleted
        self._patch(local, {
            "phase": "Succeeded" if ok else "Failed",
            "conditions": self._conditions(local.obj, initialized=True, ready=False),
            "containerStatuses": main,
            "initContainerStatuses": [self._terminated(c) for c in local.pod.sidecars],
        })  # fmt: skip

    def _delete(self, obj: Obj, local: _Tracked | None) -> None:
        """Graceful deletion: stop the containers within the grace period, report, then
        the final DELETE (in a thread: a long grace must not hold the other Pods)."""
        if local is not None and local.stopping:
            return
        meta = obj["metadata"]
        grace = min(float(meta.get("deletionGracePeriodSeconds") or 0), self.max_grace)
        if local is not None:
            local.stopping = True

        def run() -> None:
            if local is not None and local.running and not local.done:
                local.pod.stop(grace)
                self._finish(local, deleted=True)
            elif local is not None:
                local.pod.stop(0.5)
            import kubernetes.client

            with contextlib.suppress(kubernetes.client.ApiException):
                self._api.delete_namespaced_pod(
                    meta["name"], meta["namespace"], grace_period_seconds=0,
                    body=kubernetes.client.V1DeleteOptions(
                        grace_period_seconds=0,
                        preconditions=kubernetes.client.V1Preconditions(uid=meta["uid"])),
                )  # fmt: skip
            with self._lock:
                if local is not None and self.pods.get(local.key) is local:
                    self.pods.pop(local.key, None)

        threading.Thread(target=run, name=f"kubelet-delete-{meta['name']}", daemon=True).start()

    # ------------------------------------------------------------------ status pieces

    @staticmethod
    def _init(obj: Obj) -> list[Obj]:
        return list(obj["spec"].get("initContainers") or [])

    def _all(self, obj: Obj) -> list[Obj]:
        return self._init(obj) + list(obj["spec"]["containers"])

    @staticmethod
    def _grace(obj: Obj) -> float:
        value = obj["spec"].get("terminationGracePeriodSeconds")
        return 30.0 if value is None else float(value)

    @staticmethod
    def _status(c: Obj, state: Obj, ready: bool = False) -> Obj:
        image = str(c.get("image", ""))
        out = {"name": c["name"], "image": image, "imageID": "", "ready": ready,
               "restartCount": 0, "state": state}  # fmt: skip
        if "running" in state:
            out["imageID"] = f"local://{image}"
            out["started"] = True
        return out

    @staticmethod
    def _terminated(c: LocalContainer) -> Obj:
        code = c.exit_code if c.exit_code is not None else 137
        return {
            "name": c.name, "image": c.image, "imageID": f"local://{c.image}", "ready": False,
            "restartCount": 0, "started": False,
            "state": {"terminated": {
                "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                "message": c.termination_message(), "startedAt": _now(), "finishedAt": _now(),
            }},
        }  # fmt: skip

    @staticmethod
    def _conditions(obj: Obj, *, initialized: bool, ready: bool) -> list[Obj]:
        now = _now()
        kept = [c for c in (obj.get("status") or {}).get("conditions") or []
                if c["type"] == "PodScheduled"]  # fmt: skip

        def cond(kind: str, value: bool) -> Obj:
            return {"type": kind, "status": "True" if value else "False", "lastTransitionTime": now,
                    "lastProbeTime": None}  # fmt: skip

        return [*kept, cond("Initialized", initialized), cond("ContainersReady", ready),
                cond("Ready", ready)]  # fmt: skip

    def _patch(self, local: _Tracked, status: Obj) -> None:
        meta = local.obj["metadata"]
        code, body = self.cluster.request(
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"metadata": {"uid": meta["uid"]}, "status": status},
            "application/merge-patch+json",
        )
        if code < 300:
            local.obj = body
        elif code != 404:
            self.warnings.append(f"status of {meta['namespace']}/{meta['name']}: {code} {body}")
