"""A TCP proxy in front of etcd that cuts the link of one client process only.

In local mode every node is given the same etcd endpoint, so cutting "the link to etcd
of one node" needs to know which process each connection comes from: the proxy asks
the kernel (``psutil.net_connections``) for the pid owning the client end of each
connection it accepts. :meth:`LinkCutter.cut` closes that pid's connections and refuses
its new ones (accepted, then closed at once: the client sees its connection reset), as
when its network goes away; :meth:`LinkCutter.restore` lets it connect again. The other
clients, and etcd, are not disturbed. (``tests/ship/tcpproxy.py`` cuts all clients.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

import psutil


def _client_pid(addr: tuple[str, int]) -> int | None:
    """The pid of the process whose TCP socket is bound to ``addr`` (the client end; gRPC
    connects from an IPv6 socket, where 127.0.0.1 reads ``::ffff:127.0.0.1``)."""
    ip, port = addr[0], addr[1]
    for conn in psutil.net_connections(kind="tcp"):
        local = conn.laddr
        if local and local.port == port and local.ip.removeprefix("::ffff:") == ip and conn.pid:
            return int(conn.pid)
    return None


class LinkCutter:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``host:port``), per client pid.

    Attributes:
        endpoint: ``127.0.0.1:<port>``, what the clients are given instead of ``target``.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host or "127.0.0.1", int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._cut: set[int] = set()
        self._conns: list[tuple[int | None, socket.socket, socket.socket]] = []
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def cut(self, pid: int) -> None:
        """Break the connections of process ``pid`` and refuse its new ones."""
        with self._lock:
            self._cut.add(pid)
            mine = [c for c in self._conns if c[0] == pid]
            self._conns = [c for c in self._conns if c[0] != pid]
        for _, a, b in mine:
            _close(a, b)

    def restore(self, pid: int) -> None:
        """Let process ``pid`` connect again."""
        with self._lock:
            self._cut.discard(pid)

    def close(self) -> None:
        """Stop accepting and close every connection; idempotent."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        self._listener.close()
        for _, a, b in conns:
            _close(a, b)

    def __enter__(self) -> LinkCutter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, addr = self._listener.accept()
            except OSError:
                return  # closed
            pid = _client_pid(addr)
            with self._lock:
                refused = self._closed or pid in self._cut
            if refused:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.append((pid, client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src, dst)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
