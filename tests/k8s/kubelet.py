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

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic_operator.local.containers import (
    base_env,
    container_env,
    local_argv,
    mount_map,
    start_process,
)
from kelastic_operator.local.etcd import free_port

from .harness import K8sApi

Obj = dict[str, Any]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Container:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    termination_log: Path
    sidecar: bool
    image: str = ""


@dataclass
class _LocalPod:
    namespace: str
    name: str
    uid: str
    dir: Path
    containers: list[_Container] = field(default_factory=list)
    done: bool = False

    @property
    def main(self) -> list[_Container]:
        return [c for c in self.containers if not c.sidecar]


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
        self.pods: dict[tuple[str, str], _LocalPod] = {}
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
        for c in local.containers if local else []:
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

    def _volumes(self, spec: Obj, pod_dir: Path) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for vol in spec.get("volumes") or []:
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            folder = self.workdir / "pvc" / claim if claim else pod_dir / "volumes" / vol["name"]
            folder.mkdir(parents=True, exist_ok=True)
            out[vol["name"]] = folder
        return out

    def _start(self, obj: Obj) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        pod_dir = self.workdir / ns / name
        pod_dir.mkdir(parents=True, exist_ok=True)
        local = _LocalPod(ns, name, meta.get("uid", ""), pod_dir)
        self.pods[(ns, name)] = local
        volumes = self._volumes(spec, pod_dir)
        fields = {
            "metadata.name": name,
            "metadata.namespace": ns,
            "metadata.uid": local.uid,
            "status.podIP": "127.0.0.1",
            "spec.nodeName": "local",
        }
        for k, v in (meta.get("labels") or {}).items():
            fields[f"metadata.labels['{k}']"] = str(v)
        sidecars = [
            c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"
        ]
        try:
            for c in sidecars:
                local.containers.append(self._run(c, volumes, fields, pod_dir, sidecar=True))
            for c in spec.get("containers") or []:
                local.containers.append(self._run(c, volumes, fields, pod_dir, sidecar=False))
        except (OSError, ValueError) as exc:
            self.warnings.append(f"{ns}/{name}: cannot start: {exc}")
            self._kill(local)
            self._patch(local, {"phase": "Failed", "reason": "StartError", "message": str(exc)})
            return
        statuses = [
            {"name": c.name, "ready": True, "restartCount": 0, "image": c.image,
             "imageID": f"local://{c.image}", "state": {"running": {"startedAt": _now()}}}
            for c in local.containers
        ]  # fmt: skip
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
                "containerStatuses": [s for s in statuses if not self._is_sidecar(local, s)],
                "initContainerStatuses": [s for s in statuses if self._is_sidecar(local, s)],
            },
        )

    @staticmethod
    def _is_sidecar(local: _LocalPod, status: Obj) -> bool:
        return any(c.sidecar and c.name == status["name"] for c in local.containers)

    def _run(
        self, c: Obj, volumes: dict[str, Path], fields: dict[str, str], pod_dir: Path,
        *, sidecar: bool,
    ) -> _Container:  # fmt: skip
        mounts = mount_map(c, volumes)
        env = container_env(c, mounts, fields, self.warnings.append)
        termination_log = pod_dir / f"{c['name']}.termination-log"
        env[contract.ENV_TERMINATION_LOG] = str(termination_log)
        if contract.ENV_HTTP_PORT in env or c.get("command") == ["kelastic-sidecar"]:
            env[contract.ENV_HTTP_PORT] = str(free_port())
            env[contract.ENV_HTTP_HOST] = "127.0.0.1"
        argv = local_argv([str(x) for x in (c.get("command") or []) + (c.get("args") or [])])
        cwd = self.images.get(str(c.get("image")), self.workdir)
        log = pod_dir / f"{c['name']}.log"
        with open(log, "ab") as out:
            proc = start_process(argv, base_env(env), cwd, out, subprocess.STDOUT)
        return _Container(c["name"], proc, log, termination_log, sidecar, str(c.get("image", "")))

    def _check(self, local: _LocalPod) -> None:
        if any(c.proc.poll() is None for c in local.main):
            return
        self._terminate([c for c in local.containers if c.sidecar])
        local.done = True
        statuses = []
        for c in local.main:
            code = c.proc.returncode
            exit_code = code if code >= 0 else 128 - code
            message = ""
            with contextlib.suppress(OSError):
                message = c.termination_log.read_text(errors="replace")
            if not message and exit_code != 0:  # FallbackToLogsOnError
                with contextlib.suppress(OSError):
                    message = "\n".join(c.log.read_text(errors="replace").splitlines()[-80:])
            statuses.append(
                {"name": c.name, "ready": False, "restartCount": 0, "image": c.image,
                 "imageID": f"local://{c.image}", "state": {"terminated": {
                     "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                     "message": message[-4096:], "finishedAt": _now()}}}
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

    def _terminate(self, containers: list[_Container]) -> None:
        live = [c for c in containers if c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()

    def _kill(self, local: _LocalPod) -> None:
        """Stop a Pod's processes: main containers first, then sidecars (Kubernetes' order)."""
        self._terminate(local.main)
        self._terminate([c for c in local.containers if c.sidecar])
        for c in local.containers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
        local.done = True
        self.pods.pop((local.namespace, local.name), None)

    def _patch(self, local: _LocalPod, status: Obj) -> None:
        code, body = self.api.request(
            "PATCH",
            f"/api/v1/namespaces/{local.namespace}/pods/{local.name}/status",
            {"status": status},
            "application/merge-patch+json",
        )
        if code >= 300 and code != 404:
            self.warnings.append(f"status of {local.namespace}/{local.name}: {code} {body}")
