"""The supervisor's end of the control socket (launcher <-> supervisor, JSON lines).

The launcher in the trainer container connects to ``control.sock`` on the shared volume
and speaks the protocol of :mod:`kelastic.contract` (``hello``, ``started``, ``exited``,
``stopped``, ``checked`` upward; ``assign``, ``stop``, ``shutdown``, ``check`` and the
in-process restart's ``respawn``, ``promote`` downward). One launcher is served
at a time; a new connection replaces the old one (the trainer container restarted).

Messages are handed to a callback from the reader thread; a malformed line is logged and
dropped (it never kills the sidecar), and the connection's end is reported as a
:class:`Disconnected` message. Each line is decoded within bounds into a typed message
(:func:`kelastic.control_messages.parse_launcher_message`, the protocol defined once in
the worker library), so the supervisor can use its fields without further checks.

The socket is created with the same access rule as the timer FIFO
(:func:`~kelastic_sidecar.ipc.ipc_access`, ``$KELASTIC_IPC_ACCESS``): locally
only the sidecar's user may connect, on Kubernetes any user of the Pod.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kelastic import contract
from kelastic.control_messages import (
    MAX_NPROC,
    MAX_PID,
    Assign,
    Check,
    Exited,
    Hello,
    LauncherMessage,
    Promote,
    ProtocolError,
    Respawn,
    Shutdown,
    Started,
    Stop,
    Stopped,
    Unknown,
    parse_launcher_message,
)
from kelastic.sockaddr import listen_unix

from .ipc import ipc_access, socket_mode

__all__ = [
    "MAX_NPROC",
    "MAX_PID",
    "MSG_DISCONNECTED",
    "ControlProtocolError",
    "ControlServer",
    "Disconnected",
    "Exited",
    "Hello",
    "Message",
    "SidecarMessage",
    "Started",
    "Stopped",
    "Unknown",
    "parse_launcher_message",
]

log = logging.getLogger("kelastic_sidecar.control")

#: Pseudo message delivered when the launcher's connection ends.
MSG_DISCONNECTED = "disconnected"

#: A line from the launcher is not a valid message (reason in the text); a ValueError.
ControlProtocolError = ProtocolError


@dataclass(frozen=True)
class Disconnected:
    """Delivered (never sent) when the launcher's connection ends."""

    type: ClassVar[str] = MSG_DISCONNECTED


#: What :class:`ControlServer` hands to its callback.
Message = LauncherMessage | Disconnected

#: What the supervisor sends to the launcher.
SidecarMessage = Assign | Stop | Shutdown | Respawn | Promote | Check


class ControlServer:
    """Listens on a Unix stream socket for the launcher.

    Args:
        path: socket path (removed and re-created on :meth:`start`).
        on_message: called from the reader thread with each decoded message
            (:data:`kelastic.control_messages.LauncherMessage`), and with
            :class:`Disconnected` when a connection ends.
        access: who may connect (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.ipc.ipc_access`.

    Raises:
        ValueError: a bad ``access`` (or ``$KELASTIC_IPC_ACCESS``).
    """

    def __init__(
        self, path: Path, on_message: Callable[[Message], None], access: str | None = None
    ) -> None:
        self.path = path
        self._mode = socket_mode(access or ipc_access())
        self._on_message = on_message
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self.malformed = 0

    def start(self) -> None:
        """Bind the socket and start accepting in a daemon thread.

        Raises:
            OSError: the socket cannot be created (e.g. the run dir is missing).
        """
        # The access mode (see the module doc), not umask's.
        self._listener = listen_unix(self.path, self._mode, 4)
        threading.Thread(target=self._accept_loop, name="control-accept", daemon=True).start()

    @property
    def connected(self) -> bool:
        """True while a launcher is connected."""
        return self._conn is not None

    def send(self, msg: SidecarMessage) -> bool:
        """Send one message to the launcher; False if none is connected or the send failed."""
        data = (json.dumps(msg.as_dict(), separators=(",", ":")) + "\n").encode()
        with self._send_lock:
            conn = self._conn
            if conn is None:
                return False
            try:
                conn.sendall(data)
                return True
            except OSError as exc:
                log.warning("sending %s to the launcher failed: %s", msg.type, exc)
                return False

    def close(self) -> None:
        """Stop accepting, drop the connection and remove the socket file; idempotent."""
        self._closed.set()
        with self._lock:
            for sock in (self._listener, self._conn):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            self._listener = self._conn = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                old, self._conn = self._conn, conn
            if old is not None:
                log.warning("a new launcher connected; dropping the previous connection")
                with contextlib.suppress(OSError):
                    old.shutdown(socket.SHUT_RDWR)
            threading.Thread(
                target=self._read_loop, args=(conn,), name="control-read", daemon=True
            ).start()

    def _read_loop(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._dispatch(line)
                if len(buf) > contract.CONTROL_MAX_LINE:
                    log.error(
                        "launcher sent a line over %d bytes; dropping it", contract.CONTROL_MAX_LINE
                    )
                    self.malformed += 1
                    buf = b""
        except OSError:
            pass
        finally:
            with self._lock:
                current = self._conn is conn
                if current:
                    self._conn = None
            conn.close()
            if current and not self._closed.is_set():
                self._on_message(Disconnected())

    def _dispatch(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = parse_launcher_message(line)
        except ControlProtocolError as exc:
            self.malformed += 1
            log.error("malformed control message from the launcher (%s): %.200r", exc, line)
            return
        self._on_message(msg)
