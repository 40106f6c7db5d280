"""The sidecar's end of ``inprocess.sock``: one session per wrapped worker process.

Workers wrapped by :class:`kelastic.inprocess.Wrapper` connect to
:func:`kelastic.contract.inprocess_socket_path` and speak the JSON lines of
:mod:`kelastic.inprocess_messages` (one connection per worker process, ``hello`` first).
Each decoded message is handed to a callback with its :class:`Session`; the
coordinator (:mod:`~kelastic_sidecar.inprocess.coordinator`) answers through
:meth:`Session.send`.

A worker is untrusted input, and one bad worker must cost nothing but its own session.
The connection is dropped (logged and counted by ``reason``, nothing else lost) when it:

- sends a line that is not a valid message (``malformed``), or anything before ``hello``
  but ``hello`` (``no_hello``);
- sends a line over :data:`kelastic.inprocess_messages.MAX_LINE` bytes (``oversized``;
  the buffer never holds more);
- has more than :data:`MAX_PENDING` messages not yet handled by the coordinator
  (``flood``): a flood never grows the sidecar's memory;
- does not read what it is sent within :data:`SEND_TIMEOUT` seconds (``send_timeout``).

At most :data:`MAX_SESSIONS` connections are served at once (``too_many``). The socket
is created with the access rule of the control socket
(:func:`~kelastic_sidecar.ipc.ipc_access`). The kernel's credentials of the peer
(``SO_PEERCRED``) give the worker's pid independently of what its ``hello`` claims.
A ``beat`` only stamps its session (:attr:`Session.heard`) in the reader thread: beats
never reach the coordinator's queue, so a worker beating fast costs no memory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kelastic.inprocess_messages import (
    MAX_LINE,
    Beat,
    CoordinatorMessage,
    Hello,
    ProtocolError,
    WorkerMessage,
    encode,
    parse_worker_message,
)
from kelastic.sockaddr import close_unix, listen_unix

from ..ipc import DROP_REASONS, DropReason, ipc_access, socket_mode

__all__ = [
    "DROP_REASONS",
    "MAX_PENDING",
    "MAX_SESSIONS",
    "SEND_TIMEOUT",
    "DropReason",
    "InProcessServer",
    "Session",
]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: Messages of one session read but not yet handled, before the session counts as a flood.
MAX_PENDING: Final = 256
#: Connections served at once.
MAX_SESSIONS: Final = 1024
#: Seconds a send may block on a worker that does not read before its session is dropped.
SEND_TIMEOUT: Final = 2.0


class Session:
    """One worker process's connection.

    Attributes:
        id: a number unique in this server's life.
        peer_pid: the connecting process's pid per the kernel (``SO_PEERCRED``), or None
            (unknown, or 0: the peer is outside this pid namespace).
        peer_known: whether the kernel answered ``SO_PEERCRED`` (then :attr:`peer_pid`
            is the only pid that may be killed for this session).
        hello: the worker's ``hello`` (None until it arrives).
        heard: when a line last came from the worker (monotonic seconds; stamped by the
            reader thread, so a busy coordinator never makes a worker look silent).
        beating: whether the worker sent a :class:`~kelastic.inprocess_messages.Beat`
            (a worker that does is watched for silence: :mod:`.silence`).
    """

    def __init__(self, server: InProcessServer, conn: socket.socket, session_id: int) -> None:
        self.id = session_id
        self._server = server
        self._conn = conn
        self._send_lock = threading.Lock()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.closed = threading.Event()
        self.peer_known, self.peer_pid = _peer_pid(conn)
        self.hello: Hello | None = None
        self.heard = time.monotonic()
        self.beating = False

    def __repr__(self) -> str:
        rank = self.hello.local_rank if self.hello else "?"
        return f"<session {self.id} local_rank={rank} pid={self.peer_pid}>"

    def send(self, msg: CoordinatorMessage) -> bool:
        """Send one message; False (and the session dropped) when it could not be sent."""
        data = encode(msg)
        with self._send_lock:
            if self.closed.is_set():
                return False
            try:
                self._conn.sendall(data)
                return True
            except OSError as exc:
                log.warning("%r: sending %s failed (%s); dropping it", self, msg.type, exc)
                reason = DropReason.SEND_TIMEOUT if _is_timeout(exc) else None
        self._server.drop(self, reason)
        return False

    def close(self) -> None:
        """Close the connection (the reader thread then reports the end); idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)

    def handled(self) -> None:
        """The coordinator handled one of this session's messages (flood accounting)."""
        with self._pending_lock:
            self._pending = max(0, self._pending - 1)

    def _queued(self) -> bool:
        """Count one more pending message; False when that makes a flood."""
        with self._pending_lock:
            self._pending += 1
            return self._pending <= MAX_PENDING


def _peer_pid(conn: socket.socket) -> tuple[bool, int | None]:
    """(whether the kernel told, the peer's pid in our pid namespace or None)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", raw)[0]
    except (OSError, AttributeError, struct.error):
        return False, None
    return True, (int(pid) if pid > 0 else None)


def _is_timeout(exc: OSError) -> bool:
    return isinstance(exc, TimeoutError | BlockingIOError) or exc.errno in (11, 110)


class InProcessServer:
    """Listens on a Unix stream socket for wrapped workers.

    Args:
        path: the socket path (removed and re-created by :meth:`start`).
        on_message: called from the session's reader thread with each decoded message
            (``hello`` first); the receiver calls :meth:`Session.handled` once it handled
            it. Keep it quick (queue it).
        on_closed: called from the reader thread when a session that sent ``hello`` ends.
        on_drop: called with a :data:`DROP_REASONS` value when a session is dropped for
            bad behaviour (for a metric).
        access: who may connect (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.ipc.ipc_access`.

    Raises:
        ValueError: a bad ``access`` (or ``$KELASTIC_IPC_ACCESS``).
    """

    def __init__(
        self,
        path: Path,
        on_message: Callable[[Session, WorkerMessage], None],
        on_closed: Callable[[Session], None],
        on_drop: Callable[[DropReason], None] = lambda reason: None,
        access: str | None = None,
    ) -> None:
        self.path = path
        self._mode = socket_mode(access or ipc_access())
        self._on_message = on_message
        self._on_closed = on_closed
        self._on_drop = on_drop
        self._listener: socket.socket | None = None
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        #: Sessions dropped, by reason.
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    def start(self) -> None:
        """Bind the socket and accept in a daemon thread.

        Raises:
            OSError: the socket cannot be created (e.g. the run dir is missing).
        """
        self._listener = listen_unix(self.path, self._mode, 64)
        threading.Thread(target=self._accept_loop, name="inprocess-accept", daemon=True).start()

    def sessions(self) -> list[Session]:
        """The open sessions."""
        with self._lock:
            return list(self._sessions.values())

    def drop(self, session: Session, reason: DropReason | None) -> None:
        """Close ``session``; count ``reason`` (None: not for bad behaviour, not counted)."""
        if reason is not None and not session.closed.is_set():
            self.dropped[reason] += 1
            self._on_drop(reason)
        session.close()

    def close(self) -> None:
        """Stop accepting, close every session and remove the socket file; idempotent."""
        self._closed.set()
        listener, self._listener = self._listener, None
        close_unix(listener, self.path)
        for session in self.sessions():
            session.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            # Sends block at most SEND_TIMEOUT s (SO_SNDTIMEO; receives stay blocking).
            whole = int(SEND_TIMEOUT)
            timeval = struct.pack("ll", whole, int((SEND_TIMEOUT - whole) * 1e6))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            session = Session(self, conn, next(self._ids))
            with self._lock:
                full = len(self._sessions) >= MAX_SESSIONS
                if not full:
                    self._sessions[session.id] = session
            if full:
                log.error("more than %d in-process sessions; refusing one", MAX_SESSIONS)
                self.drop(session, DropReason.TOO_MANY)
                conn.close()
                continue
            threading.Thread(
                target=self._read_loop, args=(session, conn), name="inprocess-read", daemon=True
            ).start()

    def _read_loop(self, session: Session, conn: socket.socket) -> None:
        buf = bytearray()
        try:
            while not session.closed.is_set():
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while (end := buf.find(b"\n")) >= 0:
                    line = bytes(buf[:end])
                    del buf[: end + 1]
                    if not self._dispatch(session, line):
                        return
                if len(buf) >= MAX_LINE:
                    log.error("%r sent a line over %d bytes; dropping it", session, MAX_LINE)
                    self.drop(session, DropReason.OVERSIZED)
                    return
        except OSError:
            pass
        finally:
            session.close()
            conn.close()
            with self._lock:
                self._sessions.pop(session.id, None)
            if session.hello is not None and not self._closed.is_set():
                self._on_closed(session)

    def _dispatch(self, session: Session, line: bytes) -> bool:
        """Decode and hand over one line; False when the session was dropped."""
        session.heard = time.monotonic()
        if not line.strip():
            return True
        try:
            msg = parse_worker_message(line)
        except ProtocolError as exc:
            log.error("%r: malformed in-process message (%s); dropping it", session, exc)
            self.drop(session, DropReason.MALFORMED)
            return False
        if session.hello is None and not isinstance(msg, Hello):
            log.error("%r: %s before hello; dropping it", session, msg.type)
            self.drop(session, DropReason.NO_HELLO)
            return False
        if isinstance(msg, Hello):
            if session.hello is not None:
                log.error("%r: a second hello; dropping it", session)
                self.drop(session, DropReason.MALFORMED)
                return False
            session.hello = msg
            if session.peer_known and session.peer_pid != msg.pid:
                log.warning("%r says it is pid %d; the kernel's pid is the one killed if "
                            "need be", session, msg.pid)  # fmt: skip
        if isinstance(msg, Beat):  # stamped above; the coordinator is not bothered
            session.beating = True
            return True
        if not session._queued():
            log.error("%r: over %d messages pending (a flood); dropping it", session, MAX_PENDING)
            self.drop(session, DropReason.FLOOD)
            return False
        self._on_message(session, msg)
        return True
