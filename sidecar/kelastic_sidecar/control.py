"""The supervisor's end of the control socket (launcher <-> supervisor, JSON lines).

The launcher in the trainer container connects to ``control.sock`` on the shared volume
and speaks the protocol of :mod:`kelastic.contract` (``hello``, ``started``, ``exited``,
``stopped`` upward; ``assign``, ``stop``, ``shutdown`` downward). One launcher is served
at a time; a new connection replaces the old one (the trainer container restarted).

Messages are handed to a callback from the reader thread; a malformed line is logged and
dropped (it never kills the sidecar), and the connection's end is reported as a
``{"type": "disconnected"}`` message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic.sockaddr import unix_address

log = logging.getLogger("kelastic_sidecar.control")

#: Pseudo message delivered when the launcher's connection ends.
MSG_DISCONNECTED = "disconnected"

Message = dict[str, Any]


class ControlServer:
    """Listens on a Unix stream socket for the launcher.

    Args:
        path: socket path (removed and re-created on :meth:`start`).
        on_message: called from the reader thread with each decoded message (a dict with a
            string ``type``), and with ``{"type": "disconnected"}`` when a connection ends.
    """

    def __init__(self, path: Path, on_message: Callable[[Message], None]) -> None:
        self.path = path
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
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(self.path) as address:
            listener.bind(address)
        # Any user of the Pod may connect: the trainer need not run as the sidecar's
        # user, and only the Pod's containers see the run volume.
        os.chmod(self.path, 0o666)
        listener.listen(4)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="control-accept", daemon=True).start()

    @property
    def connected(self) -> bool:
        """True while a launcher is connected."""
        return self._conn is not None

    def send(self, msg: Message) -> bool:
        """Send one message to the launcher; False if none is connected or the send failed."""
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._send_lock:
            conn = self._conn
            if conn is None:
                return False
            try:
                conn.sendall(data)
                return True
            except OSError as exc:
                log.warning("sending %s to the launcher failed: %s", msg.get("type"), exc)
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
                self._on_message({"type": MSG_DISCONNECTED})

    def _dispatch(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            self.malformed += 1
            log.error("malformed control message from the launcher: %.200r", line)
            return
        self._on_message(msg)
