"""The worker's connection to the sidecar's in-process coordinator (stdlib only).

One unix stream socket per worker process to :func:`kelastic.contract.inprocess_socket_path`,
JSON lines both ways (:mod:`kelastic.inprocess_messages`). Sends come from the main
thread (faults, barrier) and the monitor thread (soft timeout), so they are serialized by
a lock; only the monitor thread receives.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from kelastic._control import LineBuffer
from kelastic.inprocess_messages import (
    MAX_LINE,
    CoordinatorMessage,
    ProtocolError,
    WorkerMessage,
    encode,
    parse_coordinator_message,
)
from kelastic.sockaddr import unix_address

__all__ = ["CONNECT_TIMEOUT", "Closed", "Connection"]

#: Seconds a worker keeps trying to reach the sidecar's socket before it gives up.
CONNECT_TIMEOUT: Final = 30.0


class Closed:
    """The sidecar closed the connection (or it broke); ``why`` says how."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"Closed({self.why!r})"


class Connection:
    """A connected in-process socket.

    Use :meth:`connect` to make one. :meth:`send` is thread-safe; :meth:`messages` is
    for one reader thread.
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path: Final = path
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, path: Path, timeout: float = CONNECT_TIMEOUT) -> Connection:
        """Connect to the coordinator at ``path``, retrying until ``timeout`` seconds passed
        (the sidecar may still be starting: the socket file is missing or refuses).

        Raises:
            ConnectionError: no connection within ``timeout`` seconds; the message names
                the path and the last error.
        """
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with unix_address(path) as address:  # paths past sun_path's 108 bytes
                    sock.connect(address)
            except OSError as exc:
                sock.close()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionError(
                        f"kelastic.inprocess: cannot connect to the sidecar's in-process "
                        f"coordinator at {path} within {timeout:g} s ({exc.strerror or exc}); "
                        "is the kelastic sidecar running with in-process restart enabled?"
                    ) from exc
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)
                continue
            return cls(sock, path)

    def send(self, msg: WorkerMessage) -> bool:
        """Send one message; False (and nothing raised) when the connection is gone."""
        data = encode(msg)
        with self._send_lock:
            if self._closed:
                return False
            try:
                self._sock.sendall(data)
            except OSError:
                return False
        return True

    def messages(
        self, tick: Callable[[], float], stop: threading.Event
    ) -> Iterator[CoordinatorMessage | Closed | None]:
        """Yield each message received, ``None`` after ``tick()`` seconds without one (for
        the caller's timers), and a final :class:`Closed` when the peer went away, the
        stream broke the protocol, or ``stop`` was set."""
        buffer = LineBuffer(MAX_LINE)
        while not stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], tick())
            except (OSError, ValueError) as exc:  # closed under us
                yield Closed(f"socket error: {exc}")
                return
            if not ready:
                yield None
                continue
            try:
                data = self._sock.recv(65536)
            except OSError as exc:
                yield Closed(f"socket error: {exc}")
                return
            if not data:
                yield Closed("the sidecar closed the connection")
                return
            try:
                lines = buffer.feed(data)
                decoded = [parse_coordinator_message(line) for line in lines]
            except ProtocolError as exc:
                yield Closed(f"protocol error: {exc}")
                return
            yield from decoded
        yield Closed("stopped")

    def wake(self) -> None:
        """Make a blocked :meth:`messages` reader return (shuts the socket's read side)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        """Close the socket. Idempotent; later sends return False."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
