"""The timer FIFO's wire format (used by :mod:`.server`).

Requests are torch's ``FileTimerClient`` JSON lines::

    {"version": 1, "pid": <int>, "scope_id": <str>, "expiration_time": <float>, "signal": <int>}

plus an optional ``"token": <str>`` that kelastic's own client
(:class:`kelastic.timer.FifoTimerClient`) adds from ``$KELASTIC_TIMER_TOKEN``. torch's
unmodified client sends no token; torch's server ignores unknown fields, so a line with a
token is still a valid torch request.

Who may write the FIFO is :mod:`kelastic_sidecar.ipc`'s rule (``$KELASTIC_IPC_ACCESS``).
"""

from __future__ import annotations

import collections
import math
import re
import select
from typing import Final, NamedTuple

from kelastic._safejson import UnsafeJSONError, loads_bounded
from kelastic.timer import MAX_SCOPE_LEN, WIRE_VERSION

__all__ = [
    "MAX_LINE",
    "MAX_PID",
    "MAX_SIGNAL",
    "MAX_TOKEN_LEN",
    "Backlog",
    "LineSplitter",
    "pid_hint",
]

#: Longest request line in bytes, newline excluded (torch's client checks the same bound).
MAX_LINE: Final = select.PIPE_BUF
#: Highest signal number accepted (Linux ``SIGRTMAX``).
MAX_SIGNAL: Final = 64
#: Upper bound of accepted pids (above Linux's largest ``pid_max``, 2**22).
MAX_PID: Final = 2**31 - 1
#: Longest ``token`` accepted, characters.
MAX_TOKEN_LEN: Final = 128
#: How many ``{"`` positions of a bad line are tried as the start of a glued request.
_SALVAGE_TRIES: Final = 8
#: The pid of a request line, found without parsing it (for the watched-worker fast path).
_PID_HINT: Final = re.compile(rb'"pid"\s*:\s*(\d{1,10})\s*[,}]')


class _Request(NamedTuple):
    pid: int
    scope_id: str
    expiration_time: float
    signal: int
    token: str | None = None


class _BadRequest(ValueError):
    pass


def _parse(line: bytes) -> _Request:
    """Decode and validate one request line (newline excluded).

    Raises:
        _BadRequest: (a ``ValueError``) with the reason; nothing else, whatever ``line``.
    """
    try:
        obj = loads_bounded(line, max_bytes=MAX_LINE, max_depth=4)
    except UnsafeJSONError as exc:
        raise _BadRequest(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _BadRequest("not a JSON object")
    version, pid, scope_id = obj.get("version"), obj.get("pid"), obj.get("scope_id")
    expiration_time, signal = obj.get("expiration_time"), obj.get("signal")
    token = obj.get("token")
    # type(x) is int: bool is a subclass of int and must not pass as one.
    if type(version) is not int or version != WIRE_VERSION:
        raise _BadRequest(f"unsupported version {version!r:.40}")
    if type(pid) is not int or not 0 < pid <= MAX_PID:
        raise _BadRequest(f"bad pid {pid!r:.40}")
    if not isinstance(scope_id, str) or len(scope_id) > MAX_SCOPE_LEN:
        raise _BadRequest(f"scope_id must be a string of at most {MAX_SCOPE_LEN} characters")
    if not isinstance(expiration_time, (int, float)) or isinstance(expiration_time, bool):
        raise _BadRequest(f"bad expiration_time {expiration_time!r:.40}")
    deadline = float(expiration_time)  # <= 19 digits: fits a float
    if not math.isfinite(deadline):
        raise _BadRequest(f"expiration_time not finite: {deadline}")
    if type(signal) is not int or not 0 <= signal <= MAX_SIGNAL:
        raise _BadRequest(f"bad signal {signal!r:.40}")
    if token is not None and (not isinstance(token, str) or len(token) > MAX_TOKEN_LEN):
        raise _BadRequest(f"token must be a string of at most {MAX_TOKEN_LEN} characters")
    return _Request(pid, scope_id, deadline, signal, token)


def _salvage(line: bytes) -> _Request | None:
    """Find a valid request glued after garbage (e.g. a partial line of a dead writer).

    A request written by ``json.dumps`` starts with ``{"`` and contains ``{"`` nowhere
    else that could start a valid object, so the candidates are tried from the right.
    """
    end = len(line)
    for _ in range(_SALVAGE_TRIES):
        start = line.rfind(b'{"', 1, end)
        if start < 0:
            return None
        try:
            return _parse(line[start:])
        except _BadRequest:
            end = start + 1
    return None


def pid_hint(line: bytes) -> int | None:
    """The pid a request line names, found by a pattern, without parsing (None if none).

    Only a hint for ordering work: a line is still parsed and validated before use.
    """
    match = _PID_HINT.search(line)
    return int(match.group(1)) if match else None


class LineSplitter:
    """Splits the FIFO byte stream into lines, bounding memory at :data:`MAX_LINE` bytes.

    A line over ``MAX_LINE`` bytes is reported as oversized with only its last
    ``MAX_LINE`` bytes, in which a request glued after the garbage can still be found.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._overflow = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """Add ``data``; return the completed ``(line, oversized)`` pairs, newline removed."""
        self._buf += data
        out: list[tuple[bytes, bool]] = []
        last = self._buf.rfind(b"\n")
        if last >= 0:
            chunk = bytes(self._buf[:last])
            del self._buf[: last + 1]
            for line in chunk.split(b"\n"):
                oversized = self._overflow or len(line) > MAX_LINE
                self._overflow = False
                out.append((line[-MAX_LINE:], oversized))
        if len(self._buf) > MAX_LINE:  # discard until the next newline, keeping a tail
            self._overflow = True
            del self._buf[:-MAX_LINE]
        return out


class Backlog:
    """Lines read from the FIFO but not yet applied, in order, with how many lines
    naming each pid (:func:`pid_hint`) are queued. Not thread-safe."""

    def __init__(self) -> None:
        self._lines: collections.deque[tuple[bytes, bool, int | None]] = collections.deque()
        self._pids: collections.Counter[int | None] = collections.Counter()

    def __len__(self) -> int:
        return len(self._lines)

    def holds(self, pid: int | None) -> bool:
        """Whether a line naming ``pid`` (:func:`pid_hint`) is queued. A
        request glued after garbage is named too (the hint searches the whole line)."""
        return bool(self._pids[pid])

    def push(self, line: bytes, oversized: bool, pid: int | None) -> None:
        """Queue ``line`` (``oversized`` as :class:`LineSplitter` said), naming ``pid``."""
        self._lines.append((line, oversized, pid))
        self._pids[pid] += 1

    def pop(self) -> tuple[bytes, bool]:
        """The oldest ``(line, oversized)``.

        Raises:
            IndexError: nothing is queued.
        """
        line, oversized, pid = self._lines.popleft()
        self._pids[pid] -= 1
        if not self._pids[pid]:
            del self._pids[pid]
        return line, oversized
