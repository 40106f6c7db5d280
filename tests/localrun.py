"""Helpers to run ``kelastic run`` on small jobs in tests and read its output."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import psutil
import yaml

WORKERS = Path(__file__).resolve().parent / "workers"


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
) -> Path:
    """Write an ElasticJob manifest running ``tests/workers/steps.py`` (by default)."""
    spec: dict[str, Any] = {
        "replicas": replicas,
        "nprocPerNode": nproc,
        "maxRestarts": max_restarts,
        "rendezvous": {"lastCallTimeoutSeconds": last_call, "leaseTTLSeconds": 3},
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
    doc = {"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
           "metadata": {"name": name}, "spec": spec}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return path


class KelasticRun:
    """``kelastic run`` as a subprocess whose output is collected line by line.

    Every process it starts inherits ``KELASTIC_TEST_MARKER=<marker>``, so
    :meth:`strays` can find anything left behind.
    """

    def __init__(self, manifest: Path, *args: str, workdir: Path) -> None:
        self.marker = uuid.uuid4().hex
        env = dict(os.environ, KELASTIC_TEST_MARKER=self.marker, TERM="dumb", COLUMNS="200")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kelastic_operator.cli", "run", str(manifest),
             "--workdir", str(workdir), "--status-interval", "2", "--stop-grace", "2", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
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
