"""A local "kubelet" for the emulator: runs its Pods as local processes.

It watches the emulator's Pods and runs each one with local mode's container runtime
(:mod:`kelastic_operator.local.containers`): native sidecars (init containers with
``restartPolicy: Always``) first, then the main containers; it writes the Pod status back
(Running with a pod IP, then Succeeded/Failed with each container's exit code and
termination message) and kills a Pod's processes when the Pod is deleted.

What it maps, since every Pod shares this machine:
- pod IP: 127.0.0.1 for every Pod; the kelastic sidecar's ``KELASTIC_HTTP_PORT`` is given
  a free port per Pod (ports would collide otherwise);
- volumes: ``emptyDir`` and anything else -> a folder per Pod; a ``persistentVolumeClaim``
  -> a folder per claim, shared by the Pods that mount it;
- ``workingDir``: the folder ``images`` maps the container's image to (else the kubelet's
  workdir); ``terminationMessagePath`` -> a file per container (via
  ``KELASTIC_TERMINATION_LOG``, which the launcher honours).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kelastic_operator.local.pods import LocalContainer, LocalPod

from .harness import K8sApi

Obj = dict[str, Any]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Tracked:
    """A Pod the kubelet runs."""

    pod: LocalPod
    uid: str
    namespace: str
    done: bool = False


class LocalKubelet:
    """Runs the emulator's Pods as local processes until :meth:`stop`.

    Args:
        api: the emulator.
        workdir: where Pods' folders, volumes and logs go.
        images: image name -> local folder used as the container's working directory.
        stop_grace: seconds between SIGTERM and SIGKILL when a Pod is deleted or its
            sidecars are stopped.
    """

    def __init__(
        self,
        api: K8sApi,
        workdir: Path,
        images: dict[str, Path] | None = None,
        stop_grace: float = 5.0,
    ) -> None:
        self.api = api
        self.workdir = workdir
        self.images = images or {}
        self.stop_grace = stop_grace
        self.pods: dict[tuple[str, str], _Tracked] = {}
        self.warnings: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="local-kubelet", daemon=True)

    def start(self) -> LocalKubelet:
        """Start syncing in a background thread."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing and kill every process it started."""
        self._stop.set()
        self._thread.join(30)
        for pod in list(self.pods.values()):
            self._kill(pod)

    def __enter__(self) -> LocalKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
        seen: set[tuple[str, str]] = set()
        for obj in self.api.objects("Pod"):
            meta = obj["metadata"]
            key = (meta.get("namespace", "default"), meta["name"])
            seen.add(key)
            local = self.pods.get(key)
            if local is not None and local.uid != meta.get("uid"):
                self._kill(local)  # same name, new Pod
                local = None
            if meta.get("deletionTimestamp"):
                if local is not None and not local.done:
                    self._kill(local)
                continue
            if local is None:
                if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                self._start(obj)
            elif not local.done:
                self._check(local)
        for key in list(self.pods):
            if key not in seen:
                self._kill(self.pods[key])  # the Pod was deleted

    # ------------------------------------------------------------------ pod lifecycle

    def _start(self, obj: Obj) -> None:
        meta = obj["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        local = _Tracked(
            LocalPod(
                obj,
                self.workdir / ns / name,
                shared_dir=self.workdir / "pvc",
                cwd=lambda c: self.images.get(str(c.get("image")), self.workdir),
                warn=self.warnings.append,
            ),
            uid=meta.get("uid", ""),
            namespace=ns,
        )
        self.pods[(ns, name)] = local
        try:
            local.pod.start()
        except (OSError, ValueError) as exc:
            self.warnings.append(f"{ns}/{name}: cannot start: {exc}")
            self._kill(local)
            self._patch(local, {"phase": "Failed", "reason": "StartError", "message": str(exc)})
            return

        def running(c: LocalContainer) -> Obj:
            return {
                "name": c.name, "ready": True, "restartCount": 0, "image": c.image,
                "imageID": f"local://{c.image}", "state": {"running": {"startedAt": _now()}},
            }  # fmt: skip

        self._patch(
            local,
            {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "hostIP": "127.0.0.1",
                "startTime": _now(),
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": _now()},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": _now()},
                ],
                "containerStatuses": [running(c) for c in local.pod.main],
                "initContainerStatuses": [running(c) for c in local.pod.sidecars],
            },
        )

    def _check(self, local: _Tracked) -> None:
        if not local.pod.main_done():
            return
        local.pod.stop_sidecars(self.stop_grace)
        local.done = True
        statuses = []
        for c in local.pod.main:
            code = c.exit_code or 0
            statuses.append(
                {"name": c.name, "ready": False, "restartCount": 0, "image": c.image,
                 "imageID": f"local://{c.image}", "state": {"terminated": {
                     "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                     "message": c.termination_message(), "finishedAt": _now()}}}
            )  # fmt: skip
        ok = all(s["state"]["terminated"]["exitCode"] == 0 for s in statuses)
        self._patch(
            local,
            {
                "phase": "Succeeded" if ok else "Failed",
                "conditions": [
                    {"type": "Ready", "status": "False", "lastTransitionTime": _now()},
                ],
                "containerStatuses": statuses,
            },
        )

    def _kill(self, local: _Tracked) -> None:
        """Stop a Pod's processes: main containers first, then sidecars (Kubernetes' order)."""
        local.pod.stop(self.stop_grace)
        local.done = True
        self.pods.pop((local.namespace, local.pod.name), None)

    def _patch(self, local: _Tracked, status: Obj) -> None:
        code, body = self.api.request(
            "PATCH",
            f"/api/v1/namespaces/{local.namespace}/pods/{local.pod.name}/status",
            {"status": status},
            "application/merge-patch+json",
        )
        if code >= 300 and code != 404:
            self.warnings.append(f"status of {local.namespace}/{local.pod.name}: {code} {body}")
