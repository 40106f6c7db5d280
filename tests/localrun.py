"""Helpers to run ``kelastic run`` on small jobs in tests and read its output."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import yaml

WORKERS = Path(__file__).resolve().parent / "workers"
#: A worker's step line, as the launcher prefixes it: ``[<rank>]: step <n>``.
STEP_LINE = re.compile(r"^\[(\d+)\]: step (\d+)$")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kelastic run ARGS`` to the end (for ``--help`` and refused options: nothing is
    started), with a wide terminal so that argparse does not wrap its help."""
    return subprocess.run(
        [sys.executable, "-m", "kelastic_operator.cli", "run", *args],
        capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        timeout=timeout,
    )  # fmt: skip


def write_job(
    path: Path,
    *,
    name: str = "steps",
    replicas: int = 2,
    nproc: int = 1,
    max_restarts: int = 3,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    last_call: float = 1.0,
    lease_ttl: int = 3,
    pod_replacement: dict[str, Any] | None = None,
) -> Path:
    """Write an ElasticJob manifest running ``tests/workers/steps.py`` (by default)."""
    spec: dict[str, Any] = {
        "replicas": replicas,
        "nprocPerNode": nproc,
        "maxRestarts": max_restarts,
        "rendezvous": {"lastCallTimeoutSeconds": last_call, "leaseTTLSeconds": lease_ttl},
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "command": command or ["python", str(WORKERS / "steps.py")],
                        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                    }
                ]
            }
        },
    }
    if min_replicas is not None:
        spec["minReplicas"] = min_replicas
    if max_replicas is not None:
        spec["maxReplicas"] = max_replicas
    if pod_replacement is not None:
        spec["podReplacement"] = pod_replacement
    doc = {"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
           "metadata": {"name": name}, "spec": spec}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return path


#: Every run started, until :func:`stop_leftovers` (a test that timed out or failed
#: before its own cleanup leaves its run to it).
_STARTED: list[KelasticRun] = []


def stop_leftovers() -> list[str]:
    """Interrupt (Ctrl-C, then wait) every run started since the last call that still
    runs; return their manifests. ``tests/conftest.py`` calls it after each test: a run a
    test left behind (pytest-timeout interrupted the test in ``wait``) otherwise trains
    on, restarting workers, for the rest of the session, loading the machine under the
    tests that follow."""
    left = [r for r in _STARTED if r.proc.poll() is None]
    _STARTED.clear()
    for run in left:
        run.interrupt(timeout=30)
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    return [str(r.manifest) for r in left]


class KelasticRun:
    """``kelastic run`` as a subprocess whose output is collected line by line.

    Every process it starts inherits ``KELASTIC_TEST_MARKER=<marker>``, so
    :meth:`strays` can find anything left behind.
    """

    def __init__(
        self,
        manifest: Path,
        *args: str,
        workdir: Path,
        env: dict[str, str] | None = None,
        sigint_blocked: bool = False,
    ) -> None:
        """``sigint_blocked``: start it with SIGINT blocked (the mask survives ``exec``), as
        a supervisor does: a SIGINT sent before ``kelastic run`` installed its handler
        stays pending until it has (it unblocks SIGINT then)."""
        self.marker = uuid.uuid4().hex
        env = dict(env or os.environ, KELASTIC_TEST_MARKER=self.marker, TERM="dumb", COLUMNS="200")
        # The mask is this thread's; the child inherits it through fork and exec.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT] if sigint_blocked else [])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kelastic_operator.cli", "run", str(manifest),
                 "--workdir", str(workdir), "--status-interval", "2", "--stop-grace", "2", *args],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env,
            )  # fmt: skip
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.manifest = manifest
        _STARTED.append(self)
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() each line was read
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self.times.append(time.monotonic())
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def has(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def wait(self, timeout: float = 240.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"kelastic run did not finish in {timeout}s:\n{self.output}"
            ) from None
        self._reader.join(10)
        return code

    def finish(self, stop: Path, rank: int | None = None, more: int = 20) -> None:
        """End a steps job that is training: wait for ``more`` further steps of ``rank``
        (any: None), touch the workers' ``stop`` file, and assert the run exits 0."""
        steps = len(self.step_times(rank))
        deadline = time.monotonic() + 30
        while len(self.step_times(rank)) <= steps + more:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {more} more steps in 30 s:\n{self.output}")
            time.sleep(0.02)
        stop.touch()
        assert self.wait(60) == 0, self.output

    def interrupt(self, timeout: float = 60.0) -> None:
        """Ctrl-C the run if it still runs, and wait for it (a test's cleanup)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.wait(timeout)

    def when(self, text: str) -> float | None:
        """``time.monotonic()`` of the first line containing ``text``; None if none."""
        for t, line in zip(list(self.times), list(self.lines), strict=False):
            if text in line:
                return t
        return None

    def step_times(self, rank: int | None = None) -> list[float]:
        """When each step line of ``rank`` (any rank: None) was read, in order."""
        pairs = zip(list(self.times), list(self.lines), strict=False)
        return [
            t
            for t, line in pairs
            if (m := STEP_LINE.match(line)) and (rank is None or int(m.group(1)) == rank)
        ]

    def time_lost(self, rank: int | None = None) -> float:
        """The longest stretch (seconds) in which worker ``rank`` (None: every worker of
        the job) took no step, between its first step and its last: the training time a
        fault cost. Steps take ~0.05 s."""
        times = self.step_times(rank)
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def restarts_charged(self) -> int:
        """Restarts the runner reported as charged (its ``restart N/M`` lines)."""
        found = [re.search(r"\brestart (\d+)/\d+:", line) for line in list(self.lines)]
        return max((int(m.group(1)) for m in found if m), default=0)

    def processes(self, *needles: str) -> list[psutil.Process]:
        """Live processes of this run whose command line contains every needle."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                if (
                    proc.pid != os.getpid()
                    and proc.environ().get("KELASTIC_TEST_MARKER") == self.marker
                    and all(n in cmd for n in needles)
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def strays(self) -> list[str]:
        """Processes (other than pytest) carrying this run's marker."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if (
                    proc.pid != os.getpid()
                    and proc.environ().get("KELASTIC_TEST_MARKER") == self.marker
                ):
                    found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
            except psutil.Error:
                continue
        return found
