"""The supervisor's end of the control socket (launcher <-> supervisor, JSON lines).

The launcher in the trainer container connects to ``control.sock`` on the shared volume
and speaks the protocol of :mod:`kelastic.contract` (``hello``, ``started``, ``exited``,
``stopped`` upward; ``assign``, ``stop``, ``shutdown`` downward). One launcher is served
at a time; a new connection replaces the old one (the trainer container restarted).

Messages are handed to a callback from the reader thread; a malformed line is logged and
dropped (it never kills the sidecar), and the connection's end is reported as a
``{"type": "disconnected"}`` message. Each line is decoded within bounds and the fields
of known message types are checked (:func:`parse_launcher_message`), so the supervisor
can use them without further checks.

The socket is created with the same access rule as the timer FIFO
(:func:`~kelastic_sidecar.timer_wire.ipc_access`, ``$KELASTIC_IPC_ACCESS``): locally
only the sidecar's user may connect, on Kubernetes any user of the Pod.
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
from typing import Any, Final

from kelastic import contract
from kelastic._safejson import UnsafeJSONError, loads_bounded
from kelastic.sockaddr import unix_address

from .timer_wire import ipc_access, socket_mode

log = logging.getLogger("kelastic_sidecar.control")

#: Pseudo message delivered when the launcher's connection ends.
MSG_DISCONNECTED = "disconnected"

Message = dict[str, Any]

#: Bounds of launcher messages: workers per node, pids, exit codes.
MAX_NPROC: Final = 4096
MAX_PID: Final = 2**31 - 1
_MAX_ATTEMPT: Final = 2**53
_MAX_TYPE_LEN: Final = 64


class ControlProtocolError(ValueError):
    """A line from the launcher is not a valid message (reason in the text)."""


def _check_int(msg: Message, name: str, low: int, high: int, *, optional: bool = False) -> None:
    value = msg.get(name)
    if optional and value is None:
        return
    if type(value) is not int or not low <= value <= high:  # bool is not an int here
        raise ControlProtocolError(
            f"{msg['type']!r} message needs {name!r} in {low}..{high}, got {value!r:.40}"
        )


def _check_started(msg: Message) -> None:
    pids = msg.get("pids")
    if not isinstance(pids, dict) or len(pids) > MAX_NPROC:
        raise ControlProtocolError("'started' message needs a 'pids' object")
    for rank, pid in pids.items():
        if not (rank.isascii() and rank.isdigit() and len(rank) <= 5 and int(rank) < MAX_NPROC):
            raise ControlProtocolError(f"'started' pids has a bad local rank {rank!r:.40}")
        if type(pid) is not int or not 1 <= pid <= MAX_PID:
            raise ControlProtocolError(f"'started' pids has a bad pid {pid!r:.40}")
    _check_int(msg, "warm", 0, MAX_NPROC, optional=True)


def _check_exited(msg: Message) -> None:
    _check_int(msg, "local_rank", 0, MAX_NPROC - 1)
    _check_int(msg, "pid", 1, MAX_PID, optional=True)
    _check_int(msg, "exitcode", -(2**31), 2**31 - 1, optional=True)
    _check_int(msg, "signal", 1, 64, optional=True)
    error, tail = msg.get("error"), msg.get("tail")
    if error is not None and not isinstance(error, dict):
        raise ControlProtocolError("'exited' message: 'error' must be an object or null")
    if tail is not None and not (isinstance(tail, list) and all(isinstance(t, str) for t in tail)):
        raise ControlProtocolError("'exited' message: 'tail' must be a list of strings or null")


def parse_launcher_message(line: bytes) -> Message:
    """Decode and validate one line from the launcher (newline excluded).

    The line is decoded by :func:`kelastic._safejson.loads_bounded` (at most
    :data:`kelastic.contract.CONTROL_MAX_LINE` bytes, nested at most 32 deep, integers
    of at most 19 digits, finite numbers). Known types are checked: ``hello`` (``pid``,
    ``nproc`` in 1..:data:`MAX_NPROC`), ``started`` (``attempt``, ``pids`` mapping
    local ranks to pids, ``warm``), ``exited`` (``attempt``, ``local_rank``, ``pid``,
    ``exitcode``, ``signal`` in 1..64, ``error`` object, ``tail`` strings),
    ``stopped`` (``attempt``). Other types pass with a string ``type`` only.

    Returns:
        The message (a dict with a string ``type``).

    Raises:
        ControlProtocolError: not bounded JSON, not an object, or a bad field.
    """
    try:
        msg = loads_bounded(line, max_bytes=contract.CONTROL_MAX_LINE)
    except UnsafeJSONError as exc:
        raise ControlProtocolError(str(exc)) from None
    if not isinstance(msg, dict):
        raise ControlProtocolError("not a JSON object")
    kind = msg.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= _MAX_TYPE_LEN:
        raise ControlProtocolError("no string 'type'")
    if kind == contract.MSG_HELLO:
        _check_int(msg, "pid", 1, MAX_PID, optional=True)
        _check_int(msg, "nproc", 1, MAX_NPROC, optional=True)
    elif kind in (contract.MSG_STARTED, contract.MSG_EXITED, contract.MSG_STOPPED):
        _check_int(msg, "attempt", 0, _MAX_ATTEMPT)
        if kind == contract.MSG_STARTED:
            _check_started(msg)
        elif kind == contract.MSG_EXITED:
            _check_exited(msg)
    return msg


class ControlServer:
    """Listens on a Unix stream socket for the launcher.

    Args:
        path: socket path (removed and re-created on :meth:`start`).
        on_message: called from the reader thread with each decoded message (a dict with a
            string ``type``), and with ``{"type": "disconnected"}`` when a connection ends.
        access: who may connect (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.timer_wire.ipc_access`.

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
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(self.path) as address:
            listener.bind(address)
        # The access mode (see the module doc), not umask's.
        os.chmod(self.path, self._mode)
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
            msg = parse_launcher_message(line)
        except ControlProtocolError as exc:
            self.malformed += 1
            log.error("malformed control message from the launcher (%s): %.200r", exc, line)
            return
        self._on_message(msg)
