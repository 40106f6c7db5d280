"""The sidecar hears that its Pod is terminating, before its workers are stopped.

Kubernetes stops a Pod's containers with SIGTERM, the trainer first (the sidecar is a
native sidecar: it is stopped after the containers it serves). Without a word before, the
trainer's workers die first, their peers' collectives break, and the peers' sidecars see
a worker failure: a charge, even when the Pod is taken by a maintenance (``kubectl
drain``, a preemption) that the job's restart budget is not for.

So the operator gives the trainer a ``preStop`` hook, ``python -m kelastic.prestop``,
that the kubelet runs before that SIGTERM. It connects to this part's Unix socket on the
shared volume (:func:`kelastic.contract.prestop_socket_path`) and says ``terminating``;
the sidecar stops as on SIGTERM, but first waits up to
:data:`kelastic.contract.PRESTOP_NOTICE_SECONDS` for the operator's departure notice of its
node (posted for a Pod a disruption takes) and leaves the rendezvous with its reason
before it stops its workers, so the peers re-form before our workers go. The hook gets
``left <reason>`` back once the node has left (``not left: ...`` when it did not in
time), and returns; the kubelet's SIGTERM then finds the workers stopping.

The protocol is one line each way, at most :data:`MAX_LINE` bytes. A peer that says
anything else gets ``error: ...``; one that says nothing in :data:`READ_TIMEOUT` seconds
is dropped; at most :data:`MAX_CONCURRENT` are served at once (more get ``error: busy``).
A Unix socket, not an HTTP path: only a process of the Pod (the kubelet's hook, or one with
``exec`` rights on it) can stop the node, never one from the network. The socket's access
is the control socket's (:func:`~kelastic_sidecar.ipc.ipc_access`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kelastic.prestop import REQUEST, reply_left, reply_not_left
from kelastic.sockaddr import close_unix, listen_unix

from .ipc import ipc_access, socket_mode

__all__ = ["MAX_CONCURRENT", "MAX_LINE", "READ_TIMEOUT", "PodTermination", "PrestopServer"]

log = logging.getLogger("kelastic_sidecar.prestop")

#: Longest request line, bytes, its newline included.
MAX_LINE: Final = 64
#: Seconds a connection may take to send its request.
READ_TIMEOUT: Final = 2.0
#: Requests served at once (the hook runs once per Pod; more is a flood).
MAX_CONCURRENT: Final = 4


class PodTermination:
    """The Pod-is-terminating handshake between the hook's requests and the supervisor.

    The supervisor :meth:`arm`\\ s it while its signal handlers are installed (its main
    loop runs), calls :meth:`left` once its node has left the rendezvous (or found it has
    no round to leave), and :meth:`disarm`\\ s it as it returns. A request
    (:meth:`request`) marks the Pod terminating and interrupts the main loop as SIGTERM
    does, then waits for :meth:`left`.

    Args:
        interrupt: stops the armed main loop (the supervisor's: SIGTERM to its main
            thread); called at most once, from a server thread.
    """

    def __init__(self, interrupt: Callable[[], None] | None = None) -> None:
        self._interrupt = interrupt or _sigterm_main_thread
        self._lock = threading.Lock()
        self._terminating = threading.Event()
        self._left = threading.Event()
        self._reason = ""
        self._armed = False
        self._interrupted = False

    @property
    def terminating(self) -> bool:
        """True once a request said the Pod is terminating."""
        return self._terminating.is_set()

    def arm(self) -> None:
        """The main loop runs and can be interrupted (its handlers are installed)."""
        with self._lock:
            self._armed = True
            due = self._terminating.is_set() and not self._interrupted
            self._interrupted = self._interrupted or due
        if due:
            self._interrupt()

    def disarm(self) -> None:
        """The main loop is done; a request now only waits for :meth:`left`."""
        with self._lock:
            self._armed = False

    def left(self, reason: str) -> None:
        """The node left the rendezvous with departure ``reason`` (``""``: it had none to
        leave, or leaving failed); the first call stands."""
        with self._lock:
            if not self._left.is_set():
                self._reason = reason
                self._left.set()

    def request(self, timeout: float) -> str | None:
        """Mark the Pod terminating, stop the main loop, and wait up to ``timeout`` seconds
        for the node to leave: its departure reason, or None when it did not in time."""
        with self._lock:
            self._terminating.set()
            due = self._armed and not self._interrupted
            self._interrupted = self._interrupted or due
        if due:
            self._interrupt()
        if not self._left.wait(timeout):
            return None
        return self._reason


class PrestopServer:
    """Serves the ``preStop`` hook's requests on a Unix socket (see the module doc).

    Args:
        path: the socket path (replaced on :meth:`start`).
        termination: the handshake a request runs.
        timeout: seconds a request waits for the node to leave.
        access: who may connect (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.ipc.ipc_access`.

    Raises:
        ValueError: a bad ``access``.
    """

    def __init__(
        self, path: Path, termination: PodTermination, timeout: float, access: str | None = None
    ) -> None:
        self.path = path
        self.termination = termination
        self.timeout = timeout
        self._mode = socket_mode(access or ipc_access())
        self._listener: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._closed = threading.Event()
        #: Requests refused (malformed, too slow, too many at once): a flood shows here.
        self.refused = 0

    def start(self) -> None:
        """Bind the socket and accept in a daemon thread.

        Raises:
            OSError: the socket cannot be created (the run dir is missing).
        """
        self._listener = listen_unix(self.path, self._mode, MAX_CONCURRENT)
        threading.Thread(target=self._accept_loop, name="prestop-accept", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and remove the socket file; idempotent."""
        self._closed.set()
        listener, self._listener = self._listener, None
        close_unix(listener, self.path)

    def _accept_loop(self) -> None:
        while not self._closed.is_set() and (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, "busy")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="prestop", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                line = _read_line(conn)
                if line != REQUEST:
                    self._refuse(conn, "expected 'terminating'" if line is not None else _NO_LINE)
                    return
                log.warning("the Pod is terminating (preStop): leaving the rendezvous first")
                reason = self.termination.request(self.timeout)
                answer = reply_left(reason) if reason is not None else reply_not_left(self.timeout)
                with contextlib.suppress(OSError):
                    conn.sendall(answer)
        finally:
            self._slots.release()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        log.warning("prestop socket: refused a request (%s)", why)
        with contextlib.suppress(OSError), conn:
            conn.settimeout(READ_TIMEOUT)
            conn.sendall(f"error: {why}\n".encode())


_NO_LINE: Final = f"no request line within {MAX_LINE} bytes and {READ_TIMEOUT:g} s"


def _read_line(conn: socket.socket) -> bytes | None:
    """The request's line without its newline; None when none came within
    :data:`READ_TIMEOUT` s or :data:`MAX_LINE` bytes."""
    deadline = time.monotonic() + READ_TIMEOUT
    buf = b""
    while b"\n" not in buf and len(buf) < MAX_LINE:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(MAX_LINE - len(buf))
        except OSError:
            return None
        if not chunk:
            break
        buf += chunk
    if b"\n" not in buf:
        return None
    return buf.split(b"\n", 1)[0]


def _sigterm_main_thread() -> None:
    ident = threading.main_thread().ident
    if ident is not None:
        signal.pthread_kill(ident, signal.SIGTERM)
