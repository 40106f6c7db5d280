"""The launcher's side of the control socket: JSON-lines framing and message validation.

One JSON object per line (UTF-8, ``\\n``-terminated, at most
:data:`kelastic.contract.CONTROL_MAX_LINE` bytes including the newline). Message types
and fields are listed in :mod:`kelastic.contract` (``MSG_*``). This module turns lines
from the sidecar into typed messages and raises :class:`ProtocolError` with a readable
reason for anything malformed. Stdlib only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from kelastic import contract
from kelastic._safejson import UnsafeJSONError, loads_bounded

__all__ = [
    "Assign",
    "LineBuffer",
    "Message",
    "ProtocolError",
    "Shutdown",
    "Stop",
    "Unknown",
    "WorkerAssignment",
    "encode_message",
    "parse_message",
]


#: Bounds of decoded fields: attempts and rounds (2**53: exact as a float), local ranks.
MAX_COUNTER: Final = 2**53
MAX_LOCAL_RANK: Final = 4095


class ProtocolError(Exception):
    """A control message could not be framed, decoded or validated.

    ``str(error)`` names the problem and quotes (a prefix of) the offending line.
    """


@dataclass(frozen=True)
class WorkerAssignment:
    """One worker of an ``assign``: its local rank and the env the supervisor set."""

    local_rank: int
    env: dict[str, str]


@dataclass(frozen=True)
class Assign:
    """``{"type": "assign", "attempt", "round", "workers": [{"local_rank", "env"}]}``."""

    attempt: int
    round: int
    workers: tuple[WorkerAssignment, ...]


@dataclass(frozen=True)
class Stop:
    """``{"type": "stop", "attempt", "reason"}``: stop every worker of ``attempt``."""

    attempt: int
    reason: str


@dataclass(frozen=True)
class Shutdown:
    """``{"type": "shutdown", "exitcode", "summary"}``: stop, write summary, exit."""

    exitcode: int
    summary: str


@dataclass(frozen=True)
class Unknown:
    """A well-formed message of a type this launcher does not know (version skew)."""

    type: str


Message = Assign | Stop | Shutdown | Unknown


def _excerpt(line: bytes, limit: int = 200) -> str:
    text = line[:limit].decode("utf-8", errors="replace")
    return repr(text) + ("..." if len(line) > limit else "")


def _int_field(obj: dict[str, Any], name: str, line: bytes, minimum: int | None = None) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_COUNTER:
        raise ProtocolError(
            f"{obj.get('type')!r} message needs an integer {name!r}, got {value!r}: "
            + _excerpt(line)
        )
    if minimum is not None and value < minimum:
        raise ProtocolError(
            f"{obj.get('type')!r} message has {name}={value}, below {minimum}: " + _excerpt(line)
        )
    return value


def _str_field(obj: dict[str, Any], name: str, line: bytes) -> str:
    value = obj.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(
            f"{obj.get('type')!r} message needs a string {name!r}, got {value!r}: " + _excerpt(line)
        )
    return value


def _env(value: object, index: int, line: bytes) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ProtocolError(f"assign workers[{index}].env must be an object: " + _excerpt(line))
    env: dict[str, str] = {}
    for key, val in value.items():
        if not key or "=" in key or "\0" in key:
            raise ProtocolError(
                f"assign workers[{index}].env has an invalid name {key!r}: " + _excerpt(line)
            )
        # Integers are accepted for convenience (RANK: 0); everything else must be a string.
        if isinstance(val, int) and not isinstance(val, bool):
            val = str(val)
        if not isinstance(val, str) or "\0" in val:
            raise ProtocolError(
                f"assign workers[{index}].env[{key!r}] must be a string, got {val!r}: "
                + _excerpt(line)
            )
        env[key] = val
    return env


def _parse_assign(obj: dict[str, Any], line: bytes) -> Assign:
    attempt = _int_field(obj, "attempt", line, minimum=0)
    round_ = _int_field(obj, "round", line, minimum=0)
    raw_workers = obj.get("workers")
    if not isinstance(raw_workers, list):
        raise ProtocolError("assign message needs a list 'workers': " + _excerpt(line))
    workers: list[WorkerAssignment] = []
    seen: set[int] = set()
    for i, entry in enumerate(raw_workers):
        if not isinstance(entry, dict):
            raise ProtocolError(f"assign workers[{i}] must be an object: " + _excerpt(line))
        local_rank = entry.get("local_rank")
        if (
            not isinstance(local_rank, int)
            or isinstance(local_rank, bool)
            or not 0 <= local_rank <= MAX_LOCAL_RANK
        ):
            raise ProtocolError(
                f"assign workers[{i}].local_rank must be an integer in 0..{MAX_LOCAL_RANK}, "
                f"got {local_rank!r}: " + _excerpt(line)
            )
        if local_rank in seen:
            raise ProtocolError(
                f"assign workers[{i}] repeats local_rank {local_rank}: " + _excerpt(line)
            )
        seen.add(local_rank)
        workers.append(WorkerAssignment(local_rank, _env(entry.get("env", {}), i, line)))
    return Assign(attempt=attempt, round=round_, workers=tuple(workers))


def parse_message(line: bytes) -> Message:
    """Decode and validate one line from the sidecar.

    Args:
        line: one line without its trailing newline.

    Returns:
        :class:`Assign`, :class:`Stop`, :class:`Shutdown`, or :class:`Unknown` for a
        JSON object whose ``type`` is a string this version does not know (extra fields
        of known types are ignored, for forward compatibility).

    Hostile input is bounded (:func:`kelastic._safejson.loads_bounded`): at most
    ``contract.CONTROL_MAX_LINE`` bytes nested at most 32 deep, integers of at most 19
    digits, finite numbers; attempts and rounds at most :data:`MAX_COUNTER`, local
    ranks at most :data:`MAX_LOCAL_RANK`.

    Raises:
        ProtocolError: not UTF-8, not JSON, over a bound, not an object, no string
            ``type``, or a known type with missing or mistyped fields. Never another
            exception, whatever ``line`` holds.
    """
    try:
        obj = loads_bounded(line, max_bytes=contract.CONTROL_MAX_LINE)
    except UnsafeJSONError as e:
        raise ProtocolError(f"control message is not JSON ({e}): " + _excerpt(line)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("control message is not a JSON object: " + _excerpt(line))
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("control message has no string 'type': " + _excerpt(line))
    if kind == contract.MSG_ASSIGN:
        return _parse_assign(obj, line)
    if kind == contract.MSG_STOP:
        return Stop(
            attempt=_int_field(obj, "attempt", line), reason=_str_field(obj, "reason", line)
        )
    if kind == contract.MSG_SHUTDOWN:
        exitcode = _int_field(obj, "exitcode", line, minimum=0)
        if exitcode > 255:
            raise ProtocolError(f"shutdown exitcode {exitcode} is above 255: " + _excerpt(line))
        return Shutdown(exitcode=exitcode, summary=_str_field(obj, "summary", line))
    return Unknown(type=kind)


def encode_message(obj: dict[str, Any]) -> bytes:
    """Encode one message as a compact UTF-8 JSON line (with the trailing newline).

    Raises:
        ValueError: the encoded line is longer than ``contract.CONTROL_MAX_LINE`` bytes,
            or ``obj`` is not JSON-serializable.
    """
    data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    if len(data) > contract.CONTROL_MAX_LINE:
        raise ValueError(
            f"{obj.get('type')!r} message is {len(data)} bytes, above the "
            f"{contract.CONTROL_MAX_LINE}-byte control line limit"
        )
    return data


class LineBuffer:
    """Split a byte stream into lines, enforcing the control line length limit.

    Args:
        max_line: longest accepted line in bytes, newline included.
    """

    def __init__(self, max_line: int = contract.CONTROL_MAX_LINE) -> None:
        self._buf = bytearray()
        self._max = max_line

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the complete lines (without newlines, blanks dropped).

        Raises:
            ProtocolError: a line (complete or still open) exceeds the limit.
        """
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while True:
            end = self._buf.find(b"\n", start)
            if end < 0:
                break
            if end + 1 - start > self._max:
                raise ProtocolError(
                    f"control line of {end + 1 - start} bytes exceeds the {self._max}-byte "
                    "limit: " + _excerpt(bytes(self._buf[start : start + 200]))
                )
            line = bytes(self._buf[start:end]).strip()
            if line:
                lines.append(line)
            start = end + 1
        del self._buf[:start]
        if len(self._buf) > self._max:
            raise ProtocolError(
                f"control line exceeds the {self._max}-byte limit without a newline: "
                + _excerpt(bytes(self._buf[:200]))
            )
        return lines

    @property
    def pending(self) -> bytes:
        """Bytes received after the last newline (an unterminated line)."""
        return bytes(self._buf)
