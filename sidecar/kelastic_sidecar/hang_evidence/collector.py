"""Collecting a hung worker's Python stacks from outside it with ``py-spy dump``, within a
time budget, just before the sidecar kills it.

``py-spy dump --nonblocking`` reads the target's memory (``process_vm_readv``) without
pausing it: a worker already stopped (``SIGSTOP``, state ``T``) cannot be paused again,
and py-spy's default (ptrace-attach, then ``waitpid``) fails on one with ``Failed to
suspend process``. Reading needs the kernel's ptrace access to the worker: the same user
(locally), or ``CAP_SYS_PTRACE`` where Yama or the container runtime restrict it (on
Kubernetes the sidecar shares the Pod's pid namespace with the trainer; without the
capability py-spy fails and the evidence says so).

The budget bounds everything: py-spy runs in its own session with its output in a file
(not a pipe a stray child could hold open); past the budget its whole process group is
SIGKILLed and the evidence says ``unavailable``. Nothing here raises: a missing
``py-spy``, a failing or hanging one, a process already gone, an unwritable directory,
each gives an :class:`~.evidence.Evidence` that says why, and the reap goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Final

from kelastic.flight_recorder import Collective, FlightRecord, record_name

from .evidence import Evidence, Outcome
from .flight import await_record, request_record
from .pyspy_text import summary, truncate

__all__ = ["DEFAULT_BUDGET", "DEFAULT_MAX_BYTES", "ENV_BUDGET", "StackCollector", "worker_rank"]

log = logging.getLogger("kelastic_sidecar.hang_evidence")

#: Seconds one collection may take (the kill waits at most this long for it).
DEFAULT_BUDGET: Final = 2.0
#: Largest stack file written, bytes (longer dumps are cut, with a marker).
DEFAULT_MAX_BYTES: Final = 64 * 1024
#: py-spy runs per collection at most: ``--nonblocking`` reads a running process's memory
#: while it changes, and a read can be torn (``Failed to copy PyCodeObject: Bad address``,
#: seen once in CI on a rank waiting for its peers); a torn read is tried again within the
#: budget, a refusal (no ptrace access) is not.
DUMP_ATTEMPTS = 3
_TORN = re.compile(r"Bad address|Failed to copy|Failed to get stack trace", re.I)

#: The sidecar's setting of the budget, seconds (0: no collection).
ENV_BUDGET: Final = "KELASTIC_HANG_EVIDENCE_BUDGET"
#: Seconds a killed py-spy is waited for before it is left to a background reaper.
_REAP_SLACK: Final = 0.2


def worker_rank(pid: int) -> str | None:
    """The global ``RANK`` in ``pid``'s environment (``/proc/<pid>/environ``); None when
    unreadable or absent."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fp:
            environ = fp.read()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"RANK="):
            value = entry[5:].decode(errors="replace")
            return value if value.isdigit() else None
    return None


class StackCollector:
    """``collect(pid) -> Evidence``: one bounded ``py-spy dump`` of a worker, written to
    ``out_dir/rank-<RANK>-pid-<pid>.txt`` (``pid-<pid>.txt`` when its rank is unknown).

    Thread-safe (each call is independent).

    Args:
        out_dir: where stack files go (created when needed): the run's volume.
        budget: seconds a collection may take (> 0; 0: collection off, every call says
            so at once).
        exe: the py-spy program, looked up at each call on ``$PATH``, then beside this
            interpreter (its scripts directory, where pip installs py-spy).
        max_bytes: largest file written (>= 1024).
        library_dirs: directories whose frames are the library's, not the user's, for
            the summary (besides site-packages and the stdlib).
        on_outcome: told each collection's outcome (the metric).
        on_record: told the outcome of each ask for a flight record (an armed worker's;
            not told when the worker was not asked: not armed, stopped, records off).
        flight_dir: where armed workers write their flight records
            (:func:`kelastic.contract.flight_records_dir`); each armed, not stopped
            worker is asked for its record at the start of its collection, and the
            record is read within the same budget. None: records are not asked for.

    Raises:
        ValueError: ``budget`` negative or not finite, ``max_bytes`` < 1024.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        budget: float = DEFAULT_BUDGET,
        exe: str = "py-spy",
        max_bytes: int = DEFAULT_MAX_BYTES,
        library_dirs: Sequence[str] = (),
        on_outcome: Callable[[Outcome], None] | None = None,
        flight_dir: Path | None = None,
        on_record: Callable[[Outcome], None] | None = None,
    ) -> None:
        if not 0.0 <= budget < float("inf"):
            raise ValueError(f"budget must be a finite number of seconds >= 0, got {budget}")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
        self.out_dir: Final = out_dir
        self.budget: Final = float(budget)
        self._exe = exe
        self._max_bytes = max_bytes
        self._library_dirs = tuple(library_dirs)
        self._on_outcome = on_outcome
        self.flight_dir: Final = flight_dir
        self._on_record = on_record

    def __call__(self, pid: int) -> Evidence:
        """Collect ``pid``'s stacks within the budget; never raises (see the module doc)."""
        try:
            evidence = self._collect(pid)
        except Exception as exc:  # a bug here must not stop the reap
            log.exception("hang evidence: collecting pid %d failed", pid)
            evidence = Evidence(pid, Outcome.UNAVAILABLE, f"stacks unavailable: {exc!r}")
        if self._on_outcome is not None:
            with contextlib.suppress(Exception):
                self._on_outcome(evidence.outcome)
        return evidence

    def _collect(self, pid: int) -> Evidence:
        rank = worker_rank(pid)
        deadline = time.monotonic() + self.budget
        rank_no = int(rank) if rank is not None and len(rank) <= 9 else None
        # asked first, so that the worker writes its record while py-spy reads its stacks
        flight = self.flight_dir if self.budget > 0 else None
        asked = request_record(flight, pid, rank_no) if flight is not None else ""
        text, why = self._dump(pid, deadline)
        if why is not None:
            body = f"stacks of pid {pid} unavailable: {why}\n"
            line, outcome = f"stacks unavailable: {why}", Outcome.UNAVAILABLE
        else:
            assert text is not None
            body = text
            found = summary(text, pid, self._library_dirs)
            line, outcome = (
                found or "no Python frame of the main thread in the dump",
                (Outcome.COLLECTED),
            )
        # An earlier collection's dump is not overwritten by a later "unavailable".
        path = self._write(pid, rank, body, keep=outcome is Outcome.UNAVAILABLE)
        log.warning("hang evidence of pid %d (rank %s): %s", pid, rank or "?", line)
        collectives, flight_note = self._record(flight, pid, rank_no, asked, deadline)
        return Evidence(pid, outcome, line, path, collectives, flight_note)

    def _record(
        self, flight: Path | None, pid: int, rank: int | None, asked: str | None, deadline: float
    ) -> tuple[tuple[Collective, ...], str]:
        """``pid``'s flight record once asked (``asked`` None), read by ``deadline``:
        (its collectives, its path), else ((), why there is none; ``""``: records off)."""
        if asked is not None or flight is None:
            if asked:
                log.info("no flight record of pid %d: %s", pid, asked)
            return (), asked or ""
        record = await_record(flight, pid, rank, deadline)
        got = Outcome.COLLECTED if isinstance(record, FlightRecord) else Outcome.UNAVAILABLE
        if self._on_record is not None:
            with contextlib.suppress(Exception):
                self._on_record(got)
        if not isinstance(record, FlightRecord):
            log.info("no flight record of pid %d: %s", pid, record)
            return (), record
        last = "; ".join(c.describe() for c in record.last) or "no collective"
        log.warning("flight record of pid %d (rank %s): %s", pid, rank, last)
        return record.last, str(flight / record_name(pid, rank))

    def _dump(self, pid: int, deadline: float) -> tuple[str | None, str | None]:
        """(py-spy's output, None), or (None, why there is none), by ``deadline``."""
        if self.budget <= 0:
            return None, "collection is off (budget 0 s)"
        exe = _find(self._exe)
        if exe is None:
            return None, f"{self._exe} not found on PATH"
        if not os.path.exists(f"/proc/{pid}"):
            return None, f"process {pid} is gone"
        for attempt in range(1, DUMP_ATTEMPTS + 1):
            text, why, torn = self._dump_once(exe, pid, deadline - time.monotonic())
            if not torn or attempt == DUMP_ATTEMPTS or time.monotonic() >= deadline:
                return text, why
            log.info("hang evidence: py-spy's read of pid %d was torn (%s); reading again", pid,
                     why)  # fmt: skip
        raise AssertionError("unreachable")  # pragma: no cover

    def _dump_once(self, exe: str, pid: int, budget: float) -> tuple[str | None, str | None, bool]:
        """One ``py-spy dump`` within ``budget`` seconds: (output, None, False), or (None,
        why, torn) where ``torn`` says a read of a running process may succeed again."""
        argv = [exe, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                return None, f"{self._exe} could not start: {exc}", False
            try:
                code = proc.wait(max(budget, 0.0))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                why = f"{self._exe} did not answer within the budget of {self.budget:g} s"
                return None, why, False
            if code != 0:
                alive = os.path.exists(f"/proc/{pid}")
                error = _error_of(err)
                gone = "" if alive else f"process {pid} is gone; "
                torn = alive and _TORN.search(error) is not None
                return None, f"{gone}{self._exe} failed (exit {code}): {error}", torn
            return _read(out), None, False

    def _write(self, pid: int, rank: str | None, body: str, keep: bool) -> Path | None:
        """Write ``body`` (truncated) to the pid's file; return its path (None: not
        written; ``keep``: an existing file is left as it is)."""
        name = f"rank-{rank}-pid-{pid}.txt" if rank is not None else f"pid-{pid}.txt"
        path = self.out_dir / name
        if keep and path.exists():
            return None
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(truncate(body, self._max_bytes))
            tmp.replace(path)
        except OSError as exc:
            log.error("hang evidence: could not write %s: %s", path, exc)
            return None
        return path


def _find(exe: str) -> str | None:
    """``exe`` on ``$PATH``, else beside this interpreter's scripts (where pip puts
    py-spy's binary: a sidecar started by path need not have it on ``$PATH``)."""
    return shutil.which(exe) or shutil.which(exe, path=sysconfig.get_path("scripts"))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group; wait for it briefly, else reap it in the
    background (a py-spy in ``D`` state dies when it wakes)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(_REAP_SLACK)
    except subprocess.TimeoutExpired:
        threading.Thread(target=proc.wait, name="kelastic-pyspy-reaper", daemon=True).start()


def _read(fp: IO[bytes]) -> str:
    fp.seek(0)
    return fp.read().decode(errors="replace")


def _error_of(fp: IO[bytes]) -> str:
    """py-spy's error from its stderr, its causes joined (``Error: A``, ``Caused by:``,
    ``0: B``... -> ``A: B``; the Rust backtrace after them dropped), at most 300
    characters."""
    text = _read(fp).split("Stack backtrace:", 1)[0]
    parts = []
    for raw in text.splitlines():
        line = re.sub(r"^(Error:|\d+:)\s*", "", raw.strip())
        if line and line != "Caused by:":
            parts.append(line)
    return (": ".join(parts) or "no output")[:300]
