"""Worker processes for ``kelastic.launch``: spawn, tee, reap, terminate.

Semantics follow torch elastic's ``SubprocessContext`` / ``SubprocessHandler``
(``torch/distributed/elastic/multiprocessing/api.py``): each worker runs ``cmd`` in a
new session (so its whole process tree is one process group that can be signalled at
once), the group is closed with SIGTERM, then SIGKILL after a grace period. On top of
torch's behaviour:

- every worker gets ``PR_SET_PDEATHSIG=SIGKILL`` (Linux), so a SIGKILLed launcher leaves
  no orphan worker. The death signal fires when the *thread* that forked the worker
  exits, so workers must be spawned from the launcher's main thread;
- the launcher makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so
  descendants orphaned by a dying worker are reparented to the launcher, which reaps
  them (no zombies) and kills them when it stops the workers (no orphans);
- stdout and stderr are read through pipes by one thread each, appended to
  ``stdout.log``/``stderr.log`` as bytes arrive and teed line by line to the launcher's
  own stdout/stderr with a ``[<rank>]: `` prefix; the last stderr lines are kept for
  the exit report.

All children are reaped in one place, :func:`reap_children` (``waitpid(-1)``), called
from the launcher's main loop; ``Popen.wait``/``poll`` are never used.

Warm start (:mod:`kelastic._warm`: workers forked by a zygote that imported torch) is
another way to produce a :class:`Worker`'s pid in :meth:`Worker.start` (a
:data:`Spawner`); tee, reaping and termination do not depend on how the process was
created (the two ways are the strategies of :mod:`kelastic._starters`). Stdlib only,
Linux.

Over ~400 lines as one cohesive thing: the life of a worker process (spawn, output,
reap, terminate) and of the group of one attempt, which share these primitives.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kelastic import contract

__all__ = [
    "TAIL_LINES",
    "Spawner",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "become_subreaper",
    "child_preexec",
    "list_children",
    "reap_children",
]

logger = logging.getLogger("kelastic.launch")

#: Number of stderr lines kept per worker for the exit report.
TAIL_LINES = 20
#: Longest tail line kept (characters); longer lines are cut.
TAIL_LINE_MAX_CHARS = 2000
#: Longest line teed as one line (bytes); longer output is split.
TEE_LINE_MAX_BYTES = 64 * 1024
#: How long to wait for processes to vanish after SIGKILL (seconds).
KILL_TIMEOUT = 10.0

_PR_SET_PDEATHSIG = 1

#: Starts a worker another way than ``subprocess`` (warm start): called with the spec and
#: the write ends of the stdout and stderr pipes (the caller closes its copies), it
#: returns the pid of a child of this process that is its own process group leader, or
#: ``None`` to have the worker started with ``subprocess`` instead.
Spawner = Callable[["WorkerSpec", int, int], "int | None"]
_PR_SET_CHILD_SUBREAPER = 36


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return fn


_prctl = _load_prctl()


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``).

    Orphaned descendants are then reparented to this process instead of init, so the
    launcher can reap and kill them.

    Returns:
        Whether it worked (``False`` off Linux or if ``prctl`` failed; logged at debug).
    """
    if _prctl is None:
        logger.debug("prctl unavailable: not a child subreaper")
        return False
    if _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.debug("PR_SET_CHILD_SUBREAPER failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def child_preexec(parent_pid: int) -> None:
    """Runs in a forked child before exec: die with the launcher (``PR_SET_PDEATHSIG``).

    Args:
        parent_pid: the launcher's pid; the child SIGKILLs itself if its parent is
            already another process (the launcher died before ``prctl``).
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        # The launcher may have died between fork and prctl: then nobody will signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def list_children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``, from ``/proc/<pid>/stat`` (Linux; ``[]`` elsewhere)."""
    children: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fp:
                stat = fp.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parens.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid).encode():
            children.append(int(name))
    return children


def reap_children() -> list[tuple[int, int]]:
    """Reap every exited child without blocking (``waitpid(-1, WNOHANG)``).

    Returns:
        ``(pid, returncode)`` pairs, ``returncode`` as in ``subprocess``: the exit code,
        or ``-signum`` for a child killed by a signal.
    """
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped.append((pid, os.waitstatus_to_exitcode(status)))
    return reaped


class _Sink:
    """One of the launcher's output streams, shared by all tee threads (line-atomic)."""

    def __init__(self, stream: BinaryIO | None, name: str) -> None:
        self._stream = stream
        self._name = name
        self._lock = threading.Lock()

    def write_line(self, data: bytes) -> None:
        with self._lock:
            if self._stream is None:
                return
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError) as e:
                logger.warning(
                    "launcher %s is not writable any more (%s): tee disabled", self._name, e
                )
                self._stream = None


def _binary(stream: object) -> BinaryIO | None:
    buffer: BinaryIO | None = getattr(stream, "buffer", None)
    return buffer


#: The launcher's own stdout/stderr, which worker output is teed to.
STDOUT_SINK = _Sink(_binary(sys.stdout), "stdout")
STDERR_SINK = _Sink(_binary(sys.stderr), "stderr")


class _Tee(threading.Thread):
    """Copy a worker pipe to its log file (as bytes arrive) and to a sink (per line)."""

    def __init__(
        self,
        fd: int,
        log_path: Path,
        sink: _Sink,
        tail: collections.deque[str] | None,
        spec: WorkerSpec,
    ) -> None:
        super().__init__(name=f"tee-{spec.local_rank}-{log_path.stem}", daemon=True)
        self._log = open(log_path, "ab")  # noqa: SIM115  (closed by the thread)
        self._fd = fd
        self._sink = sink
        self._prefix = f"[{spec.label}]: ".encode()
        self._tail = tail

    def _emit(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        self._sink.write_line(self._prefix + line)
        if self._tail is not None:
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            self._tail.append(text[:TAIL_LINE_MAX_CHARS])

    def relabel(self, label: str) -> None:
        """Prefix the lines from now on with ``label`` (a promoted spare's new rank)."""
        self._prefix = f"[{label}]: ".encode()

    def discard(self) -> None:
        """Close the log file of a tee that will never run (the spawn failed)."""
        self._log.close()

    def run(self) -> None:
        buf = bytearray()
        try:
            while True:
                try:
                    data = os.read(self._fd, 65536)
                except OSError as e:
                    logger.debug("%s: read failed: %s", self.name, e)
                    break
                if not data:
                    break
                if not self._log.closed:
                    try:
                        self._log.write(data)
                        self._log.flush()
                    except OSError as e:  # e.g. disk full: keep teeing, stop logging
                        logger.warning("%s: cannot write the log file, giving up: %s", self.name, e)
                        with contextlib.suppress(OSError):
                            self._log.close()
                buf += data
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    self._emit(bytes(buf[start : end + 1]))
                    start = end + 1
                del buf[:start]
                while len(buf) >= TEE_LINE_MAX_BYTES:
                    self._emit(bytes(buf[:TEE_LINE_MAX_BYTES]))
                    del buf[:TEE_LINE_MAX_BYTES]
            if buf:  # the last, unterminated line
                self._emit(bytes(buf))
        finally:
            with contextlib.suppress(OSError):
                self._log.close()
            os.close(self._fd)


@dataclass
class WorkerSpec:
    """What to start for one local rank.

    Attributes:
        local_rank: the worker's local rank (also its log directory name).
        label: the tee prefix label, the worker's global ``RANK`` (or the local rank).
        env: the complete environment of the process.
        log_dir: ``logs/attempt_<n>/<local_rank>/``.
    """

    local_rank: int
    label: str
    env: dict[str, str]
    log_dir: Path

    @property
    def error_file(self) -> Path:
        """The worker's ``error.json`` (may be overridden by the assignment's env)."""
        return Path(self.env.get(contract.TORCHELASTIC_ERROR_FILE) or self.log_dir / "error.json")


class Worker:
    """One worker process: its pid, tee threads, exit status and stderr tail.

    ``returncode`` follows ``subprocess``: the exit code, or ``-signum`` if killed by a
    signal; ``None`` while running. A worker that could not be started has ``pid``
    ``None``, ``returncode`` 127 (command not found), 126 (not executable) or 1, and
    ``spawn_error`` set.

    Args:
        spec: what to start.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.returncode: int | None = None
        self.spawn_error: str | None = None
        #: Whether a spawner (warm start) made the process, not ``subprocess``.
        self.warm = False
        #: Set once the launcher sent the ``exited`` message.
        self.reported = False
        #: The last :data:`TAIL_LINES` lines of stderr.
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._popen: subprocess.Popen[bytes] | None = None
        self._tees: list[_Tee] = []
        self._group_gone = False

    def start(self, cmd: list[str], spawner: Spawner | None = None) -> None:
        """Spawn ``cmd`` for this worker; on failure set ``spawn_error`` (never raises).

        The child runs in a new session (its pid is its process group id) with
        ``PR_SET_PDEATHSIG=SIGKILL``, stdin from ``/dev/null`` and stdout/stderr on
        pipes read by two tee threads.

        Args:
            cmd: the command line (for ``subprocess``).
            spawner: tried first when given (warm start); ``subprocess`` starts ``cmd``
                if it returns ``None``.
        """
        spec = self.spec
        fds: list[int] = []
        tees: list[_Tee] = []
        try:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            # A stale error file from an earlier run with the same attempt number would
            # be misread as this worker's root cause.
            spec.error_file.unlink(missing_ok=True)
            out_r, out_w = os.pipe()
            fds += (out_r, out_w)
            err_r, err_w = os.pipe()
            fds += (err_r, err_w)
            tees = [
                _Tee(out_r, spec.log_dir / contract.STDOUT_LOG_NAME, STDOUT_SINK, None, spec),
                _Tee(err_r, spec.log_dir / contract.STDERR_LOG_NAME, STDERR_SINK, self.tail, spec),
            ]
            pid = spawner(spec, out_w, err_w) if spawner is not None else None
            if pid is None:
                self._popen = subprocess.Popen(
                    cmd,
                    env=spec.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    start_new_session=True,
                    preexec_fn=functools.partial(child_preexec, os.getpid()),
                )
                pid = self._popen.pid
        except OSError as e:
            for tee in tees:
                tee.discard()
            for fd in fds:
                os.close(fd)
            if isinstance(e, FileNotFoundError):
                self.returncode = 127
            elif isinstance(e, PermissionError):
                self.returncode = 126
            else:
                self.returncode = 1
            self.spawn_error = f"failed to start worker {cmd[0]!r}: {type(e).__name__}: {e}"
            self._group_gone = True
            logger.error("local_rank %d: %s", spec.local_rank, self.spawn_error)
            return
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.warm = self._popen is None
        self._tees = tees
        for tee in tees:
            tee.start()

    @property
    def running(self) -> bool:
        """Started and not yet reaped."""
        return self.pid is not None and self.returncode is None

    @property
    def exitcode(self) -> int | None:
        """The exit code; ``None`` if killed by a signal or still running."""
        rc = self.returncode
        return rc if rc is not None and rc >= 0 else None

    @property
    def signal(self) -> int | None:
        """The number of the signal that killed the worker, else ``None``."""
        rc = self.returncode
        return -rc if rc is not None and rc < 0 else None

    def relabel(self, spec: WorkerSpec) -> None:
        """This process is now ``spec``'s worker (a spare promoted to a dead local rank):
        its exit, error file and tee prefix are ``spec``'s from now on (its logs stay in
        the files it writes, ``self.spec.log_dir``)."""
        self.spec = spec
        for tee in self._tees:
            tee.relabel(spec.label)

    def set_reaped(self, returncode: int) -> None:
        """Record the exit status obtained by :func:`reap_children`."""
        self.returncode = returncode
        if self._popen is not None:
            self._popen.returncode = returncode  # so Popen never waits for it itself

    def wait_output(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for both pipes to reach EOF; return whether they did.

        EOF comes late if a descendant of the worker still holds the pipes.
        """
        deadline = time.monotonic() + timeout
        for tee in self._tees:
            tee.join(max(0.0, deadline - time.monotonic()))
        return not any(tee.is_alive() for tee in self._tees)

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group; return whether it still has members.

        Once the group was found empty it is never signalled again (its id may be reused).
        """
        if self.pid is None or self._group_gone:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            self._group_gone = True
            return False
        except PermissionError as e:
            logger.warning("cannot signal process group %d: %s", self.pid, e)
        return True


class WorkerGroup:
    """The workers of one attempt.

    Args:
        attempt: the supervisor's attempt number.
        specs: one spec per local rank.
        keep: pids of the launcher's own helpers (the warm-start zygote), which are
            never taken for stray descendants of the workers.
    """

    def __init__(
        self, attempt: int, specs: Iterable[WorkerSpec], keep: frozenset[int] = frozenset()
    ) -> None:
        self.attempt = attempt
        self._keep = keep
        self.workers: dict[int, Worker] = {s.local_rank: Worker(s) for s in specs}
        #: Spare workers (in-process restart's spare ranks), by spare slot: stopped with
        #: the group, never reported as the attempt's workers (see :mod:`kelastic._spares`).
        self.spares: dict[int, Worker] = {}
        #: Set once a stop began: exits are then expected and not reported.
        self.stopping = False
        #: Set once :meth:`terminate` finished.
        self.stopped = False

    def start(self, cmd: list[str], spawner: Spawner | None = None) -> None:
        """Spawn every worker (from the calling thread, which must outlive them).

        Args:
            cmd: the command line.
            spawner: see :meth:`Worker.start`.
        """
        for worker in self.workers.values():
            worker.start(cmd, spawner)
            if worker.pid is not None:
                logger.info(
                    "attempt %d: started local_rank %d (rank %s) pid %d%s",
                    self.attempt,
                    worker.spec.local_rank,
                    worker.spec.label,
                    worker.pid,
                    " (warm)" if worker.warm else "",
                )

    def respawn(self, spec: WorkerSpec, cmd: list[str], spawner: Spawner | None = None) -> Worker:
        """Start the worker of ``spec.local_rank`` again (its last process exited and was
        reported); its logs append to the same files.

        Raises:
            ValueError: no such local rank, or its process still runs.
        """
        old = self.workers.get(spec.local_rank)
        if old is None or old.running or not old.reported:
            raise ValueError(f"local_rank {spec.local_rank} has no exited, reported worker")
        worker = Worker(spec)
        self.workers[spec.local_rank] = worker
        worker.start(cmd, spawner)
        if worker.pid is not None:
            logger.info(
                "attempt %d: started local_rank %d (rank %s) again, pid %d%s",
                self.attempt, spec.local_rank, spec.label, worker.pid,
                " (warm)" if worker.warm else "",
            )  # fmt: skip
        return worker

    def _everyone(self) -> list[Worker]:
        return [*self.workers.values(), *self.spares.values()]

    @property
    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the workers that were started."""
        return {r: w.pid for r, w in self.workers.items() if w.pid is not None}

    def by_pid(self, pid: int) -> Worker | None:
        """The worker (or spare) with this pid, if any."""
        for worker in self._everyone():
            if worker.pid == pid:
                return worker
        return None

    @property
    def any_running(self) -> bool:
        """Whether some worker (or spare) has not been reaped yet."""
        return any(w.running for w in self._everyone())

    def unreported_exits(self) -> list[Worker]:
        """Workers that ended (or failed to start) and were not reported yet."""
        return [
            w
            for w in self.workers.values()
            if w.returncode is not None and not w.reported and not self.stopping
        ]

    def _strays(self) -> list[int]:
        """Children of the launcher outside every worker's process group (adopted orphans)."""
        own = {w.pid for w in self._everyone() if w.pid is not None}
        strays: list[int] = []
        for pid in list_children(os.getpid()):
            if pid in self._keep:
                continue
            try:
                if os.getpgid(pid) in own:
                    continue
            except ProcessLookupError:
                continue
            strays.append(pid)
        return strays

    def _signal_all(self, sig: int) -> bool:
        """Signal every non-empty worker group and every stray; return whether any exist."""
        alive = False
        for worker in self._everyone():
            if worker.signal_group(sig) or worker.running:
                alive = True
        for pid in self._strays():
            try:
                os.kill(pid, sig)
                alive = True
            except ProcessLookupError:
                pass
        return alive

    def _all_gone(self) -> bool:
        if self.any_running:
            return False
        for worker in self._everyone():
            if worker.signal_group(0):
                return False
        return not self._strays()

    def terminate(self, grace: float, wait: Callable[[float], bool]) -> None:
        """Stop every worker: SIGTERM the process groups, SIGKILL after ``grace`` s, reap.

        Like torch's ``SubprocessContext._close``: the death signal goes to each worker's
        whole process group, survivors get SIGKILL when the grace period ends.
        Descendants that left their group (and were reparented to the launcher) are
        signalled too. Never raises.

        Args:
            grace: seconds between SIGTERM and SIGKILL.
            wait: blocks up to the given seconds for something to happen and reaps
                children; returns ``True`` to cut the grace period short (a second
                termination signal to the launcher).
        """
        self.stopping = True
        if self._signal_all(signal.SIGTERM):
            logger.info("attempt %d: sent SIGTERM to the workers, grace %.1fs", self.attempt, grace)
            deadline = time.monotonic() + grace
            hurry = False
            while not self._all_gone() and not hurry:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                hurry = wait(min(left, 0.05))
            if not self._all_gone():
                logger.warning(
                    "attempt %d: workers %s still alive after %s: SIGKILL",
                    self.attempt,
                    sorted(r for r, w in self.workers.items() if w.running) or "(descendants)",
                    "a second signal" if hurry else f"{grace:.1f}s",
                )
                deadline = time.monotonic() + KILL_TIMEOUT
                while self._signal_all(signal.SIGKILL) and not self._all_gone():
                    if time.monotonic() > deadline:
                        logger.error(
                            "attempt %d: processes survive SIGKILL after %.0fs; giving up",
                            self.attempt,
                            KILL_TIMEOUT,
                        )
                        break
                    wait(0.05)
        for worker in self._everyone():
            if not worker.wait_output(1.0):
                logger.warning(
                    "local_rank %d: output pipes still open after stop", worker.spec.local_rank
                )
        self.stopped = True
