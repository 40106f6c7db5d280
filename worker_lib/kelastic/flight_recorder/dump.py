"""A worker's flight record written when its sidecar asks, even while the worker's main
thread is stuck in a collective.

The sidecar reads a hung worker's Python stacks from outside (py-spy); torch's flight
recorder, which says which collective each rank entered, lives inside the process. A
Python signal handler runs only when the main thread next runs Python code, never while
it waits in a C++ collective, and a process-directed signal goes to whichever thread
does not block it (torch's own threads, started at import, do not). So the ask is a
FIFO, not a signal: :func:`arm` makes ``ask-<pid>`` in
:func:`kelastic.contract.flight_records_dir` and a thread of its own waits on it; the
sidecar writes a line to it (the rank to name the record by) and the thread writes the
record beside it (:func:`~.codec.record_name`, whole: a temporary file renamed), whatever
the main thread does.

A process is asked only while it listens: the sidecar's non-blocking open of the FIFO
fails (``ENXIO``) without a reader, so a FIFO left by a worker that died, or a pid reused
by a process that never armed, is never mistaken for an armed one, and nothing is ever
signalled. Armed only where the job enables torch's recorder (``TORCH_FR_BUFFER_SIZE``
> 0): otherwise nothing is made or started.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import contract
from .codec import MAX_RECORD_BYTES, encode_record, record_name

__all__ = ["arm", "ask_fifo", "enabled", "write_record"]

log = logging.getLogger("kelastic.flight_recorder")

_lock = threading.Lock()
_armed_pid: int | None = None  # the process armed (a forked child is not)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torch's flight recorder is on: ``TORCH_FR_BUFFER_SIZE`` a positive integer."""
    value = (os.environ if environ is None else environ).get(contract.ENV_FLIGHT_RECORDER_BUFFER)
    return value is not None and value.strip().isdigit() and int(value) > 0


def ask_fifo(directory: Path, pid: int) -> Path:
    """The FIFO on which ``pid`` hears its sidecar ask for its record:
    ``<directory>/ask-<pid>``."""
    return directory / f"ask-{pid}"


def _rank(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) <= 9 else None


def write_record(
    directory: Path, trace: dict[str, Any] | None = None, rank: int | None = None
) -> Path:
    """Write this process's record to ``directory`` (whole: a temporary file renamed);
    ``trace``: torch's dump (default: taken now from torch's recorder); ``rank``: the
    rank it is named by (default ``$RANK``). Returns its path.

    Raises:
        OSError: the directory is not writable.
        RuntimeError: torch's recorder could not be read (torch missing, no recorder).
    """
    if trace is None:
        try:
            from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
                _dump_fr_trace_json,
            )
        except ImportError as exc:
            raise RuntimeError(f"torch's flight recorder is not available: {exc}") from exc
        trace = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    pid = os.getpid()
    rank = rank if rank is not None else _rank(os.environ.get("RANK", ""))
    raw = encode_record(pid, rank, trace or {}, MAX_RECORD_BYTES)
    path = directory / record_name(pid, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(raw)
    tmp.replace(path)
    return path


def _serve(directory: Path, fifo: Path) -> None:
    """The listening thread: each ask on ``fifo`` (``<rank>\\n`` or ``?\\n``, the rank
    its sidecar knows it by: an in-process restart may have renumbered it since its
    ``$RANK``) writes a record; never raises (a failure is logged and it listens
    again)."""
    while True:
        try:
            fd = os.open(fifo, os.O_RDONLY)  # blocks until the sidecar opens it to ask
            try:
                asked = os.read(fd, 64)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("flight recorder: no longer listening on %s: %s", fifo, exc)
            return
        if not asked:  # opened and closed without asking
            continue
        try:  # the ask names the rank its sidecar reads the record by (``?``: none)
            rank = _rank(asked.split(b"\n", 1)[0].decode("ascii", "replace"))
            path = write_record(directory, rank=rank)
            log.info("flight record written to %s", path)
        except Exception as exc:  # a dump must not end the worker
            log.warning("could not write the flight record: %s", exc)


def _unlink_if_mine(fifo: Path, pid: int) -> None:
    """At exit: the FIFO goes (a forked child exiting leaves its parent's)."""
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            fifo.unlink()


def arm(directory: Path | None = None) -> bool:
    """Make this process answer its sidecar's ask with its flight record in
    ``directory`` (default :func:`kelastic.contract.flight_records_dir`), when torch's
    recorder is on (:func:`enabled`). Once per process (a forked child arms again, under
    its own pid). Returns whether it is armed; a failure (no directory) is logged, and
    the worker runs on unarmed.
    """
    global _armed_pid
    with _lock:
        if _armed_pid == os.getpid():
            return True
        if not enabled():
            return False
        directory = directory or contract.flight_records_dir()
        fifo = ask_fifo(directory, os.getpid())
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fifo.unlink(missing_ok=True)  # a dead process's, under a reused pid
            os.mkfifo(fifo)
            # the sidecar may run as another user (root with CAP_KILL alone, no
            # CAP_DAC_OVERRIDE, when the trainer's image picks its own): anyone in the Pod
            # may ask (write); only the worker reads
            os.chmod(fifo, 0o622)
        except OSError as exc:
            log.warning("flight recorder dumps are off: %s", exc)
            return False
        threading.Thread(
            target=_serve, args=(directory, fifo), name="kelastic-flight-recorder", daemon=True
        ).start()
        _armed_pid = os.getpid()
        atexit.register(_unlink_if_mine, fifo, _armed_pid)  # a clean exit leaves none behind
        return True
