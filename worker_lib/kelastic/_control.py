"""The launcher's side of the control socket: JSON-lines framing.

One JSON object per line (UTF-8, ``\\n``-terminated, at most
:data:`kelastic.contract.CONTROL_MAX_LINE` bytes including the newline). The messages,
both directions, and their validating decoders are defined once in
:mod:`kelastic.control_messages` (re-exported here for existing imports); this module
splits the byte stream into lines. Stdlib only.
"""

from __future__ import annotations

from kelastic import contract
from kelastic.control_messages import (
    MAX_COUNTER,
    MAX_LOCAL_RANK,
    Assign,
    Message,
    ProtocolError,
    Shutdown,
    Stop,
    Unknown,
    WorkerAssignment,
    encode_message,
    excerpt,
    parse_message,
)

__all__ = [
    "MAX_COUNTER",
    "MAX_LOCAL_RANK",
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
                    "limit: " + excerpt(bytes(self._buf[start : start + 200]))
                )
            line = bytes(self._buf[start:end]).strip()
            if line:
                lines.append(line)
            start = end + 1
        del self._buf[:start]
        if len(self._buf) > self._max:
            raise ProtocolError(
                f"control line exceeds the {self._max}-byte limit without a newline: "
                + excerpt(bytes(self._buf[:200]))
            )
        return lines

    @property
    def pending(self) -> bytes:
        """Bytes received after the last newline (an unterminated line)."""
        return bytes(self._buf)
