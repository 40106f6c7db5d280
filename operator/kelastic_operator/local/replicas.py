"""A local run's replicas as processes: render each Pod, start it, stream it, stop them all.

Replica ``n`` is the Pod the operator would create (:func:`kelastic_operator.pods.build_pod`),
its trainer command wrapped for this interpreter, run by
:class:`~kelastic_operator.local.pods.LocalPod` around folders standing in for its volumes.
The trainer's output is streamed line by line to ``echo``; a thread per sidecar reports its
exit (the replacement policy decides what it means). Whether a replica failed and what then
happens is :mod:`kelastic_operator.local.replacement`'s; what the replicas report is
:mod:`kelastic_operator.local.progress`'s.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kelastic import contract

from ..labels import SIDECAR_CONTAINER
from ..model import ElasticJob
from ..pods import PodSettings, build_pod
from ..pods import trainer_name as trainer_container_name
from .containers import local_launcher_argv
from .pods import LocalContainer, LocalPod

#: Env marker on every process local mode starts (used to find strays).
ENV_LOCAL_RUN = "KELASTIC_LOCAL_RUN"


@dataclass
class Replica:
    """One replica: the rendered Pod running as local processes."""

    index: int
    local: LocalPod
    trainer: LocalContainer
    sidecar: LocalContainer | None
    #: The sidecar's last ``/status`` document (see :mod:`~.progress`).
    status: dict[str, Any] = field(default_factory=dict)
    #: Why the Pod failed (set once; a failed Pod is replaced or fails the job).
    failed: str = ""

    @property
    def name(self) -> str:
        return self.local.name

    @property
    def dir(self) -> Path:
        return self.local.pod_dir

    @property
    def launcher(self) -> subprocess.Popen[bytes]:
        return self.trainer.proc

    @property
    def http_port(self) -> int:
        return self.sidecar.http_port if self.sidecar else 0

    @property
    def sidecar_run_dir(self) -> Path | None:
        """The kelastic sidecar's run dir (its last status is kept there), if any."""
        return self.sidecar.run_dir if self.sidecar else None

    @property
    def termination_log(self) -> Path:
        return self.trainer.termination_log

    def termination_message(self) -> str:
        """The trainer's termination message ("" when none)."""
        with contextlib.suppress(OSError):
            return self.termination_log.read_text(errors="replace").strip()
        return ""

    def job_failed(self) -> bool:
        """The trainer ended because the *job* failed (budget spent, rendezvous closed)."""
        return self.launcher.poll() is not None and self.termination_message().startswith(
            contract.JOB_FAILED_PREFIX
        )


class Replicas:
    """The run's replicas, ``pods[index]`` each, as local processes.

    Args:
        job: the validated manifest.
        manifest_dir: folder the trainer command runs in.
        workdir: the run dir (``pods/<pod>/`` per Pod, ``volumes/`` per claim).
        run_id: this run's id (the Pods' uids; :data:`ENV_LOCAL_RUN` of every process).
        stop_grace: seconds a worker gets between SIGTERM and SIGKILL.
        say: prints one line of runner output.
        echo: prints one line of a trainer's output.
        on_sidecar_exit: called (on a thread of its own) with a replica and its sidecar's
            return code when that sidecar ends.
    """

    def __init__(
        self,
        job: ElasticJob,
        manifest_dir: Path,
        workdir: Path,
        run_id: str,
        stop_grace: float,
        say: Callable[[str], None],
        echo: Callable[[str, bool], None],
        on_sidecar_exit: Callable[[Replica, int], None],
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.manifest_dir = manifest_dir
        self.workdir = workdir
        self.run_id = run_id
        self.stop_grace = stop_grace
        self.say = say
        self.echo = echo
        self.on_sidecar_exit = on_sidecar_exit
        self.pods: list[Replica] = []
        self._threads: list[threading.Thread] = []

    def start(self, index: int, endpoints: list[str]) -> None:
        """Render replica ``index`` with the operator's pod builder and run it locally
        (as ``self.pods[index]``: appended, or replacing a failed Pod)."""
        meta = self.job.metadata
        settings = PodSettings(etcd_endpoints=tuple(endpoints), stop_grace=self.stop_grace)
        uid = meta.uid or self.run_id
        manifest = build_pod(meta.name, meta.namespace, uid, self.spec, index, settings)
        manifest["metadata"]["uid"] = f"{self.run_id}-{index}"
        trainer_name = trainer_container_name(self.spec.template)
        for c in manifest["spec"]["containers"]:
            if c.get("name") == trainer_name:  # its workers run this interpreter too
                c["command"] = local_launcher_argv([str(x) for x in c["command"]])
        local = LocalPod(
            manifest,
            self.workdir / "pods" / manifest["metadata"]["name"],
            shared_dir=self.workdir / "volumes",
            cwd=lambda c: self.manifest_dir,  # no image: the code is next to the manifest
            pipe=lambda c: c.get("name") == trainer_name,
            env={
                ENV_LOCAL_RUN: self.run_id,
                "PYTHONUNBUFFERED": "1",
                "KELASTIC_LOG_LEVEL": "WARNING",  # the runner reports rounds and restarts
            },
            warn=self.say,
            die_with_parent=True,
        )
        try:
            local.start()
        finally:
            # Whatever started is stopped by stop_all, even if a later container failed.
            started = {c.name: c for c in local.containers}
            if trainer_name in started:
                pod = Replica(index, local, started[trainer_name], started.get(SIDECAR_CONTAINER))
                if index < len(self.pods):
                    self.pods[index] = pod
                else:
                    self.pods.append(pod)
            elif local.containers:
                # No trainer: stop what did start (nothing else refers to it).
                local.stop(self.stop_grace)
        if pod.sidecar is not None:
            watch = threading.Thread(
                target=self._watch_sidecar, args=(pod,), name=f"sidecar-{pod.name}", daemon=True
            )
            watch.start()
        for stream, is_err in ((pod.launcher.stdout, False), (pod.launcher.stderr, True)):
            assert stream is not None
            t = threading.Thread(target=self._pump, args=(stream, is_err), daemon=True)
            t.start()
            self._threads.append(t)

    def _watch_sidecar(self, pod: Replica) -> None:
        assert pod.sidecar is not None
        self.on_sidecar_exit(pod, pod.sidecar.proc.wait())

    def _pump(self, stream: IO[bytes], is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            self.echo(raw.decode(errors="replace").rstrip("\n"), is_err)
        stream.close()

    # ------------------------------------------------- what the fault injector asks

    def training(self, rank: int) -> tuple[str, tuple[int, int]] | None:
        """``(pod, (attempt, in-process iteration))`` once the pod running global ``rank``
        has taken a timed step in its attempt and, after an in-process restart, every rank
        of it stepped again in the new iteration."""
        nproc = self.spec.nproc_per_node
        for pod in list(self.pods):
            st = pod.status
            if (
                st.get("phase") == "running"
                and st.get("group_rank") == rank // nproc
                and int(st.get("attempt_progress_count") or 0) > 0
                and not restarting_in_process(st)
            ):
                return pod.name, node_progress(st)
        return None

    def attempts(self) -> dict[str, tuple[int, int]]:
        """Each pod's ``(attempt, in-process iteration)``."""
        return {pod.name: node_progress(pod.status) for pod in list(self.pods)}

    def spare_pids(self) -> dict[int, int]:
        """Global rank -> pid of each spare worker promoted to it, as the sidecars say."""
        found: dict[int, int] = {}
        for pod in list(self.pods):
            inproc = pod.status.get("inprocess")
            spares = inproc.get("spares") if isinstance(inproc, dict) else None
            pids = spares.get("pids") if isinstance(spares, dict) else None
            for rank, pid in (pids or {}).items() if isinstance(pids, dict) else ():
                if str(rank).isdigit() and isinstance(pid, int) and not isinstance(pid, bool):
                    found[int(rank)] = pid
        return found

    def launcher_pids(self) -> list[int]:
        return [p.launcher.pid for p in self.pods if p.launcher and p.launcher.poll() is None]

    # ------------------------------------------------------------------------ stop

    def stop_all(self) -> None:
        """Stop every process of every replica; nothing is left running."""
        # Launchers first (they stop their workers), then sidecars (they leave rendezvous):
        # Kubernetes' order, for all Pods at once.
        for pod in self.pods:
            for c in (pod.trainer, pod.sidecar):
                if c is not None and c.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(signal.SIGTERM)
        for pod in self.pods:
            pod.local.stop(self.stop_grace + 10.0)
        for t in self._threads:
            t.join(timeout=5)


def node_progress(status: dict[str, Any]) -> tuple[int, int]:
    """``(attempt, in-process iteration)`` from a sidecar's status (iteration 0 when it
    reports none: in-process restart off, or an older sidecar)."""
    inproc = status.get("inprocess")
    iteration = int(inproc.get("iteration") or 0) if isinstance(inproc, dict) else 0
    return int(status.get("attempt") or 0), iteration


def restarting_in_process(status: dict[str, Any]) -> bool:
    """The node is in an in-process restart: aborting, at the barrier, or running the new
    iteration before every rank stepped again."""
    inproc = status.get("inprocess")
    if not isinstance(inproc, dict):
        return False
    if inproc.get("phase") in ("aborting", "barrier"):
        return True
    last = inproc.get("last")
    return (
        isinstance(last, dict)
        and last.get("iteration") == inproc.get("iteration")
        and last.get("resumed_s") is None
    )
