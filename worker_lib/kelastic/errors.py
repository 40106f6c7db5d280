"""Error files: the ``record`` decorator and a robust reader, in torch elastic's format.

A worker's entry point decorated with :func:`record` writes its uncaught exception to
the file named by ``$TORCHELASTIC_ERROR_FILE`` (set per worker by ``kelastic.launch``),
then re-raises. The launcher reads the file back with :func:`read_error_file` when the
worker exits and forwards the result to the sidecar as the failure's root cause.

The file format is exactly the one written by torch's
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception``::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

so files written by torch's own ``@record`` and by ours are read alike, and torch's
``ProcessFailure`` can read ours. :func:`read_error_file` also accepts torch's "new"
flat format ``{"message": "...", "timestamp": 1700000000}``. Ours may add
``extraInfo.fault_time``: when the exception was raised, in seconds with a fraction
(:func:`stamp_fault`; ``kelastic.inprocess`` stamps the faults it re-raises later, after
the sidecar gave up), so that a fault orders before the errors it caused in peers that
exited first; torch's readers ignore the key.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, ParamSpec, TypedDict, TypeVar

from kelastic import contract, flight_recorder

__all__ = [
    "FAULT_TIME_ATTR",
    "ErrorInfo",
    "fault_time",
    "read_error_file",
    "record",
    "stamp_fault",
    "write_error_file",
]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Error files larger than this (bytes) are read only up to it; the rest is dropped
#: and the (then unparsable) file is reported as corrupt.
MAX_ERROR_FILE_BYTES = 8 << 20


class _ErrorInfoKeys(TypedDict):
    message: str
    traceback: str | None
    timestamp: int | None


class ErrorInfo(_ErrorInfoKeys, total=False):
    """A worker's recorded failure, as returned by :func:`read_error_file`.

    Keys:
        message: ``"<ExceptionType>: <str(exception)>"`` (torch's ``message``).
        traceback: the formatted Python traceback (torch's ``extraInfo.py_callstack``),
            or ``None`` when the file has none.
        timestamp: when the error was recorded, seconds since the epoch, or ``None``.
        fault_time: (only when the file has a valid one) when the exception was raised,
            seconds since the epoch with a fraction (:func:`stamp_fault`).
    """

    fault_time: float


#: The attribute :func:`stamp_fault` sets on an exception.
FAULT_TIME_ATTR: Final = "kelastic_fault_time"


def _valid_time(value: object) -> float | None:
    """``value`` as seconds since the epoch when it is a finite number in ``0..2**53``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value <= 2**53 else None  # NaN compares False


def stamp_fault(exc: BaseException, when: float | None = None) -> None:
    """Record on ``exc`` when it was raised, unless it has a time already (a fault keeps
    the time of its first raise). :func:`write_error_file` writes it as
    ``extraInfo.fault_time``. Never raises (an exception that takes no attributes keeps
    none).

    Args:
        exc: the exception.
        when: seconds since the epoch (``time.time()`` clock); default now.
    """
    if fault_time(exc) is None:
        with contextlib.suppress(Exception):
            setattr(exc, FAULT_TIME_ATTR, time.time() if when is None else float(when))


def fault_time(exc: BaseException) -> float | None:
    """When ``exc`` was raised, as :func:`stamp_fault` recorded it (seconds since the
    epoch), or None."""
    return _valid_time(getattr(exc, FAULT_TIME_ATTR, None))


def _error_file_data(exc: BaseException) -> dict[str, Any]:
    """The JSON document torch's ``ErrorHandler.record_exception`` writes for ``exc``
    (plus ``fault_time`` when ``exc`` was stamped)."""
    raised = fault_time(exc)
    extra: dict[str, Any] = {
        "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "timestamp": str(int(time.time() if raised is None else raised)),
    }
    if raised is not None:
        extra["fault_time"] = raised
    return {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": extra}}


def write_error_file(path: str | os.PathLike[str], exc: BaseException) -> None:
    """Write ``exc`` to ``path`` in torch elastic's error-file format.

    The write is atomic (temporary file in the same directory, then rename), so a reader
    never sees a partial file even if the process is killed mid-write; the directory is
    created if missing.

    Args:
        path: the error file, normally ``$TORCHELASTIC_ERROR_FILE``.
        exc: the exception to record; its ``__traceback__`` is formatted.

    Raises:
        OSError: the file could not be written (:func:`record` catches this).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(_error_file_data(exc))
    fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            fp.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a worker's entry point so an uncaught exception lands in its error file.

    Semantics follow torch's ``torch.distributed.elastic.multiprocessing.errors.record``:
    on an ``Exception`` escaping ``fn``, the exception and its traceback are written to
    the file named by ``$TORCHELASTIC_ERROR_FILE`` (see :func:`write_error_file`) and the
    exception is re-raised unchanged. ``SystemExit`` and ``KeyboardInterrupt`` are not
    recorded (as in torch). When the variable is unset or empty nothing is written. A
    failure to write the file is logged as a warning and never masks the original
    exception. Like torch's ``ErrorHandler.initialize``, the wrapper enables
    :mod:`faulthandler` (if not already enabled) so fatal signals dump the Python stacks
    of all threads to stderr, which the launcher keeps in the worker's ``stderr.log``.
    Where the job turns torch's flight recorder on (``TORCH_FR_BUFFER_SIZE`` > 0), it
    arms the worker to write its record when its sidecar asks on a hang
    (:func:`kelastic.flight_recorder.arm`: a FIFO and a thread, no signal).

    Use it once per process, on the top-level function::

        @record
        def main() -> None: ...

    Args:
        fn: the function to wrap.

    Returns:
        A wrapper with ``fn``'s signature and return value.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        flight_recorder.arm()  # only where TORCH_FR_BUFFER_SIZE turns torch's recorder on
        if not faulthandler.is_enabled():
            try:
                faulthandler.enable(all_threads=True)
            except Exception as e:  # e.g. sys.stderr has no file descriptor
                logger.debug("could not enable faulthandler: %s", e)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            path = os.environ.get(contract.TORCHELASTIC_ERROR_FILE)
            if path:
                try:
                    write_error_file(path, exc)
                except Exception as write_exc:
                    logger.warning("could not write error file %s: %s", path, write_exc)
            raise

    return wrapper


def _parse_timestamp(value: object) -> int | None:
    """torch writes ``str(int(time.time()))``; accept ints, floats and numeric strings.

    None beyond 0..2**53 seconds: the timestamp travels on in the launcher's control
    messages, whose reader refuses integers of more than 19 digits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= 2**53 else None
    if isinstance(value, float):
        return int(value) if 0 <= value <= 2**53 else None  # NaN compares False
    if isinstance(value, str):
        try:
            return _parse_timestamp(int(value.strip()))
        except ValueError:
            try:
                return _parse_timestamp(float(value))
            except ValueError:
                return None
    return None


def _last_line(text: str) -> str | None:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def parse_error_data(data: object) -> ErrorInfo | None:
    """Extract :class:`ErrorInfo` from a decoded error-file document.

    Accepts torch's nested format ``{"message": {"message", "extraInfo": {"py_callstack",
    "timestamp"}}}`` (extra keys such as ``errorCode`` are ignored) and the flat format
    ``{"message": str, "timestamp": ...}`` that torch's ``ProcessFailure`` also reads.

    Args:
        data: the result of ``json.loads`` on the file.

    Returns:
        The error, or ``None`` when ``data`` has neither shape (the caller logs why).
    """
    if not isinstance(data, dict):
        return None
    inner = data.get("message")
    if isinstance(inner, str):
        return {
            "message": inner,
            "traceback": None,
            "timestamp": _parse_timestamp(data.get("timestamp")),
        }
    if not isinstance(inner, dict):
        return None
    extra = inner.get("extraInfo")
    if not isinstance(extra, dict):
        extra = {}
    callstack = extra.get("py_callstack")
    tb = callstack if isinstance(callstack, str) and callstack else None
    message = inner.get("message")
    if not isinstance(message, str):
        # No message but a traceback: its last line is "<Type>: <message>".
        message = _last_line(tb) if tb else None
        if message is None:
            return None
    timestamp = _parse_timestamp(extra.get("timestamp", inner.get("timestamp")))
    info: ErrorInfo = {"message": message, "traceback": tb, "timestamp": timestamp}
    raised = _valid_time(extra.get("fault_time"))
    if raised is not None:
        info["fault_time"] = raised
    return info


def read_error_file(path: str | os.PathLike[str]) -> ErrorInfo | None:
    """Read a worker's error file written by :func:`record` or by torch's ``@record``.

    Never raises: a missing file returns ``None`` silently (the worker did not record an
    error, e.g. it was killed by a signal or does not use ``@record``); an unreadable,
    empty, truncated, non-JSON or wrongly shaped file returns ``None`` and logs a warning
    naming the file and the reason.

    Args:
        path: the error file (``logs/attempt_<n>/<local_rank>/error.json``).

    Returns:
        ``{"message": str, "traceback": str | None, "timestamp": int | None}`` or ``None``.
    """
    try:
        with open(path, "rb") as fp:
            raw = fp.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("cannot read error file %s: %s", path, e)
        return None
    if len(raw) > MAX_ERROR_FILE_BYTES:
        logger.warning("error file %s is larger than %d bytes", path, MAX_ERROR_FILE_BYTES)
        return None
    if not raw.strip():
        logger.warning("error file %s is empty", path)
        return None
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError) as e:
        logger.warning("error file %s is not valid JSON (partial write?): %s", path, e)
        return None
    info = parse_error_data(data)
    if info is None:
        logger.warning(
            "error file %s has an unknown shape (expected torch elastic's error format)", path
        )
    return info
