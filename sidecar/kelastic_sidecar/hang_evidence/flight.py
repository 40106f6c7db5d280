"""Asking a hung worker for its flight record (torch's collectives, as the worker's own
thread reads them: :mod:`kelastic.flight_recorder`) and reading it within the
collection's budget. Plain functions; nothing here raises.

The ask is a line written to the worker's ``ask-<pid>`` FIFO, opened without blocking:
with no reader (no armed worker listens: the recorder is off, the worker died and its
pid was reused) the open fails and nothing is asked; no signal is ever sent. A stopped
worker (``T``) is not asked: it cannot answer, and its stop already names it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Final

from kelastic.flight_recorder import (
    FlightRecord,
    FlightRecordError,
    ask_fifo,
    decode_record,
    record_name,
)
from kelastic.procstat import process_stat

__all__ = ["POLL_SECONDS", "await_record", "request_record"]

#: Seconds between looks for the record while it is being written.
POLL_SECONDS: Final = 0.01
#: Process states that cannot answer: stopped, traced, zombie, dead.
_SILENT: Final = frozenset({"T", "t", "Z", "X", "x"})


def request_record(directory: Path, pid: int, rank: int | None) -> str | None:
    """Ask ``pid`` for its record, named by ``rank`` (``<rank>\\n`` on its FIFO: the
    rank the stacks' file is named by), its earlier record removed first; None when
    asked, else why not (``not armed ...``, ``not asked ...``)."""
    proc = process_stat(pid)
    if proc is None:
        return f"process {pid} is gone"
    if proc[0] in _SILENT:
        return f"not asked: the process is in state {proc[0]}"
    try:
        fd = os.open(ask_fifo(directory, pid), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "not armed (no TORCH_FR_BUFFER_SIZE, or no @record)"
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return f"not armed (nothing listens on ask-{pid}: another process than the armed one)"
        return f"could not ask: {exc}"
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return f"could not ask: ask-{pid} is not a FIFO"
        (directory / record_name(pid, rank)).unlink(missing_ok=True)
        os.write(fd, f"{'?' if rank is None else rank}\n".encode())  # the name to write
    except OSError as exc:
        return f"could not ask: {exc}"
    finally:
        os.close(fd)
    return None


def await_record(directory: Path, pid: int, rank: int | None,
                 deadline: float) -> FlightRecord | str:  # fmt: skip
    """``pid``'s record once written (after :func:`request_record`), or why there is none
    by ``deadline`` (``time.monotonic()``): not written in time, or not a record (its
    decoder's error)."""
    path = directory / record_name(pid, rank)
    while True:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = None
        except OSError as exc:
            return f"unreadable: {exc}"
        if raw is not None:
            try:
                record = decode_record(raw)
            except FlightRecordError as exc:
                return str(exc)[:300]
            if record.pid != pid:
                return f"the record names pid {record.pid}, not {pid}"
            return record
        if time.monotonic() >= deadline:
            return "not written within the budget"
        time.sleep(POLL_SECONDS)
