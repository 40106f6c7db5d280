"""Run one Pod manifest as local processes (local mode's "kubelet").

Native sidecars (init containers with ``restartPolicy: Always``) start first, then the
main containers, each through :mod:`kelastic_operator.local.containers`. Volumes become
folders: ``emptyDir`` (and anything else) one per Pod, a ``persistentVolumeClaim`` one per
claim under ``shared_dir`` (so replicas share it like a ReadWriteMany volume), and an
``emptyDir`` with ``medium: Memory`` a folder of the Pod's in ``/dev/shm`` (memory, as
on a node; removed when the Pod stops; its ``sizeLimit`` is not enforced). Every Pod
shares this machine's network: pod IP 127.0.0.1, and the kelastic sidecar gets a free
``KELASTIC_HTTP_PORT`` of its own (and ``KELASTIC_REPLICA_PORT`` 0: it binds a free one
and records it). Stopping follows Kubernetes' order: main containers
first, then sidecars.

``kelastic run`` runs the Pods the operator's pod builder renders through this class, and
so does the tests' kubelet for the Pods the operator creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic.sockaddr import free_port

from .containers import base_env, container_env, local_argv, mount_map, start_process

#: Where local mode puts memory-backed volumes.
_SHM = Path("/dev/shm")

Obj = dict[str, Any]


@dataclass
class LocalContainer:
    """One running container.

    Attributes:
        name, image: from the spec.
        proc: the process (its own session).
        log: the file its output goes to (when not piped).
        termination_log: where its termination message lands.
        sidecar: a native sidecar (stopped after the main containers).
        http_port: the kelastic sidecar's HTTP port, 0 for other containers.
        run_dir: the kelastic sidecar's run dir on this machine (where it keeps its last
            status, :mod:`kelastic.last_status`); None for other containers.
    """

    name: str
    image: str
    proc: subprocess.Popen[bytes]
    log: Path
    termination_log: Path
    sidecar: bool
    http_port: int = 0
    run_dir: Path | None = None

    @property
    def exit_code(self) -> int | None:
        """Kubernetes' exit code (128 + signal for a signal death); None while running."""
        code = self.proc.poll()
        if code is None:
            return None
        return code if code >= 0 else 128 - code

    def termination_message(self) -> str:
        """The termination message, or the log's tail for a failure without one
        (``FallbackToLogsOnError``); at most 4096 characters."""
        message = ""
        with contextlib.suppress(OSError):
            message = self.termination_log.read_text(errors="replace")
        if not message and self.exit_code not in (None, 0):
            with contextlib.suppress(OSError):
                message = "\n".join(self.log.read_text(errors="replace").splitlines()[-80:])
        return message[-contract.TERMINATION_MESSAGE_MAX_BYTES :]


@dataclass
class LocalPod:
    """A Pod manifest run as local processes.

    Args:
        pod: the Pod manifest (``metadata`` and ``spec``).
        pod_dir: this Pod's folder (volumes, logs, termination messages).
        shared_dir: parent of the per-claim folders of ``persistentVolumeClaim`` volumes.
        cwd: the working directory of a container (images have no local meaning).
        pipe: which containers get stdout/stderr pipes (the caller reads them); the others
            write both to ``<pod_dir>/<container>.log``.
        env: extra env for every container (after the Pod's own).
        warn: called with a line for what cannot be mapped locally.
        die_with_parent: each container process dies with the thread that started it
            (see :func:`~kelastic_operator.local.containers.start_process`).
    """

    pod: Obj
    pod_dir: Path
    shared_dir: Path
    cwd: Callable[[Obj], Path]
    pipe: Callable[[Obj], bool] = lambda c: False
    env: dict[str, str] = field(default_factory=dict)
    warn: Callable[[str], None] = lambda line: None
    containers: list[LocalContainer] = field(default_factory=list)
    die_with_parent: bool = False
    #: the folders of its memory-backed volumes, removed when it stops
    memory_dirs: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def main(self) -> list[LocalContainer]:
        """The main (non-sidecar) containers."""
        return [c for c in self.containers if not c.sidecar]

    @property
    def sidecars(self) -> list[LocalContainer]:
        """The native sidecars."""
        return [c for c in self.containers if c.sidecar]

    def start(self) -> None:
        """Start the native sidecars, then the main containers.

        Raises:
            OSError, ValueError: a container cannot be started (those already started
                keep running: call :meth:`stop`).
        """
        meta, spec = self.pod["metadata"], self.pod["spec"]
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        volumes: dict[str, Path] = {}
        for vol in spec.get("volumes") or []:
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            folder = self.shared_dir / claim if claim else self.pod_dir / "volumes" / vol["name"]
            if (vol.get("emptyDir") or {}).get("medium") == "Memory" and _SHM.is_dir():
                folder = Path(tempfile.mkdtemp(prefix=f"kelastic-{meta['name']}-", dir=_SHM))
                self.memory_dirs.append(folder)
            folder.mkdir(parents=True, exist_ok=True)
            volumes[vol["name"]] = folder
        fields = {
            "metadata.name": str(meta["name"]),
            "metadata.namespace": str(meta.get("namespace", "default")),
            "metadata.uid": str(meta.get("uid", "")),
            "status.podIP": "127.0.0.1",
            "spec.nodeName": "local",
        }
        for k, v in (meta.get("labels") or {}).items():
            fields[f"metadata.labels['{k}']"] = str(v)
        init = spec.get("initContainers") or []
        sidecars = [c for c in init if c.get("restartPolicy") == "Always"]
        for c in sidecars:
            self.containers.append(self._run(c, volumes, fields, sidecar=True))
        for c in spec.get("containers") or []:
            self.containers.append(self._run(c, volumes, fields, sidecar=False))

    def _run(
        self, c: Obj, volumes: dict[str, Path], fields: dict[str, str], *, sidecar: bool
    ) -> LocalContainer:
        env = container_env(c, mount_map(c, volumes), fields, self.warn)
        termination_log = self.pod_dir / f"{c['name']}.termination-log"
        env[contract.ENV_TERMINATION_LOG] = str(termination_log)
        http_port = 0
        if contract.ENV_HTTP_PORT in env or c.get("command") == ["kelastic-sidecar"]:
            http_port = free_port()
            env[contract.ENV_HTTP_PORT] = str(http_port)
            env[contract.ENV_HTTP_HOST] = "127.0.0.1"
        if contract.ENV_REPLICA_PORT in env:  # the Pods share the host: any free port
            env[contract.ENV_REPLICA_PORT] = "0"
        argv = local_argv([str(x) for x in (c.get("command") or []) + (c.get("args") or [])])
        full_env = base_env({**env, **self.env})
        log = self.pod_dir / f"{c['name']}.log"
        tied = self.die_with_parent
        if self.pipe(c):
            proc = start_process(
                argv, full_env, self.cwd(c), subprocess.PIPE, subprocess.PIPE, die_with_parent=tied
            )
        else:
            with open(log, "ab") as out:
                proc = start_process(
                    argv, full_env, self.cwd(c), out, subprocess.STDOUT, die_with_parent=tied
                )
        image = str(c.get("image", ""))
        run_dir = Path(full_env.get(contract.ENV_RUN_DIR, contract.DEFAULT_RUN_DIR))
        return LocalContainer(c["name"], image, proc, log, termination_log, sidecar, http_port,
                              run_dir if http_port else None)  # fmt: skip

    def main_done(self) -> bool:
        """True once every main container has exited."""
        return all(c.proc.poll() is not None for c in self.main)

    def stop_sidecars(self, grace: float) -> None:
        """Stop the native sidecars (SIGTERM, SIGKILL after ``grace`` seconds): what the
        kubelet does once every main container has exited."""
        _terminate(self.sidecars, grace)
        self._release_memory()

    def _release_memory(self) -> None:
        for folder in self.memory_dirs:
            shutil.rmtree(folder, ignore_errors=True)

    def stop(self, grace: float) -> None:
        """Stop everything: main containers, then sidecars (SIGTERM, SIGKILL after
        ``grace`` seconds), then anything left in their process groups."""
        _terminate(self.main, grace)
        _terminate(self.sidecars, grace)
        for c in self.containers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
        self._release_memory()


def _terminate(containers: list[LocalContainer], grace: float) -> None:
    live = [c for c in containers if c.proc.poll() is None]
    for c in live:
        with contextlib.suppress(ProcessLookupError):
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in live:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
