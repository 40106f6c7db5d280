"""One connection of the replication protocol, read and written by its server and its
clients alike: message lines (:mod:`.wire`) and raw slot bytes, each wait bounded.

Raw bytes are received into a file through one reusable buffer (``recv_into``, then
``os.write``: never a slot-sized ``bytes`` in memory) and sent from a file with
``sendfile`` (zero copy). ``sendfile`` queues references to the file's page-cache pages,
not copies: a page rewritten after the call returned (a trainer's next save) may still
reach the peer rewritten. The trailer's commit word is an early check only; a replica is
used only after its every chunk's crc32 was verified
(:func:`kelastic.checkpoint.scan.verified_step`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import BinaryIO, Final

__all__ = [
    "BUFFER_BYTES",
    "LineTooLong",
    "PeerClosed",
    "SinkError",
    "Stream",
    "connect",
    "write_all",
]

#: Bytes received per ``os.write`` (and sent per paced ``sendfile``): a slot's chunk size.
BUFFER_BYTES: Final = 4 * 1024 * 1024


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole message or all the raw bytes came."""


class LineTooLong(ValueError):
    """No line end within the protocol's longest line: no message of the protocol."""


class SinkError(Exception):
    """Writing received bytes into their file failed (no space, an I/O error); the cause
    is the ``OSError``. Not an ``OSError`` itself, so that it is never taken for a
    socket's failure."""


def connect(address: tuple[str, int], timeout: float) -> socket.socket:
    """A TCP connection to ``address`` (``TCP_NODELAY``: the trailer goes at once).

    Raises:
        OSError: it failed or took over ``timeout`` seconds (``TimeoutError``).
    """
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        sock.close()
        raise
    return sock


def write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd`` at its offset.

    Raises:
        SinkError: a write failed (no space, an I/O error).
    """
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            raise SinkError(f"cannot write the received bytes: {exc}") from exc
        view = view[written:]


class Stream:
    """A connected socket read as message lines and raw bytes.

    Args:
        sock: the connection (owned by the caller, who closes it).
        timeout: seconds each receive or send may wait (a peer that stalls that long
            mid-transfer raises ``TimeoutError``).
    """

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        #: A reply was sent (a refusal then would break the protocol: just close); set by
        #: whoever sends it.
        self.answered = False
        self._pending = bytearray()  # read past a line: the next bytes of the stream

    def read_line(self, timeout: float, max_line: int) -> bytes:
        """The next line, its newline included, which must come whole within ``timeout``
        seconds and ``max_line`` bytes (:data:`.wire.MAX_LINE`).

        Raises:
            TimeoutError: it did not come in time.
            PeerClosed: the peer closed first.
            OSError: the connection failed.
            LineTooLong: no newline within ``max_line`` bytes.
        """
        deadline = time.monotonic() + timeout
        while (end := self._pending.find(b"\n")) < 0:
            if len(self._pending) >= max_line:
                raise LineTooLong(f"no line end within {max_line} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole line within {timeout:g} s")
            self.sock.settimeout(left)
            chunk = self.sock.recv(max_line - len(self._pending))
            if not chunk:
                raise PeerClosed(f"the peer closed after {len(self._pending)} bytes of a line")
            self._pending += chunk
        line = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        return line

    def _recv_into(self, view: memoryview) -> int:
        """Receive into ``view`` (the bytes read past a line first): 1 byte or more."""
        if self._pending:
            got = min(len(view), len(self._pending))
            view[:got] = self._pending[:got]
            del self._pending[:got]
            return got
        got = self.sock.recv_into(view)
        if not got:
            raise PeerClosed("the peer closed mid-transfer")
        return got

    def recv_exact(self, view: memoryview) -> None:
        """Receive exactly ``len(view)`` raw bytes into ``view``.

        Raises:
            TimeoutError: no byte came for :attr:`timeout` seconds.
            PeerClosed: the peer closed first.
            OSError: the connection failed.
        """
        self.sock.settimeout(self.timeout)
        filled = 0
        while filled < len(view):
            filled += self._recv_into(view[filled:])

    def recv_to_fd(self, fd: int, nbytes: int, buffer: bytearray) -> None:
        """Receive exactly ``nbytes`` raw bytes and write them to ``fd`` at its offset,
        through ``buffer`` (filled, then written).

        Raises:
            TimeoutError: no byte came for :attr:`timeout` seconds.
            PeerClosed: the peer closed first.
            OSError: the connection failed.
            SinkError: writing ``fd`` failed.
        """
        view = memoryview(buffer)
        left = nbytes
        while left:
            want = min(left, len(view))
            self.recv_exact(view[:want])
            write_all(fd, view[:want])
            left -= want

    def send(self, data: bytes) -> None:
        """Send ``data`` whole (each wait at most :attr:`timeout` seconds).

        Raises:
            OSError: the connection failed or stalled (``TimeoutError``).
        """
        self.sock.settimeout(self.timeout)
        self.sock.sendall(data)

    def send_file(self, file: BinaryIO, offset: int, count: int) -> int:
        """Send ``count`` bytes of ``file`` from ``offset`` with ``sendfile``; returns the
        bytes sent (fewer: the file ended first).

        Raises:
            OSError: the connection failed or stalled (``TimeoutError``).
        """
        self.sock.settimeout(self.timeout)
        return self.sock.sendfile(file, offset, count)
