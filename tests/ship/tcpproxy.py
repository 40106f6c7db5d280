"""A small TCP proxy on loopback that a test can cut, to take a real service away from one
client only (a sidecar's etcd, the operator's Kubernetes API) while the service itself, and
everyone else using it, stays up.

:meth:`TcpProxy.cut` closes every forwarded connection and the listening socket: the client's
open connections break at once and new ones are refused, as when the network to the
service goes away. One thread runs a selector loop; :meth:`TcpProxy.close` stops it.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards ``<listen host>:<port>`` to ``target`` (``host:port``) until cut.

    Args:
        target: where connections go, ``host:port``, reached from this process's own
            network namespace.
        listen: the address to listen on (port 0: a free one); ``127.0.0.1`` by default.
        netns: a network namespace (``/proc/<pid>/ns/net``) to listen in instead of this
            process's own: a relay from a test's node namespace to a service on this
            machine's loopback (:mod:`tests.k8s.netns`).

    Attributes:
        port: the proxy's own port; ``endpoint`` is ``<listen host>:<port>``.
        accepted: connections forwarded so far.
    """

    def __init__(
        self, target: str, listen: tuple[str, int] = ("127.0.0.1", 0), netns: str | None = None
    ) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.strip("[]") or "127.0.0.1", int(port))
        self.listen_host = listen[0]
        if netns is None:
            self._listener = socket.create_server(listen)
        else:
            from tests.k8s.netns import in_netns

            self._listener = in_netns(netns, lambda: socket.create_server(listen))
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self.accepted = 0
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._cut = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"tcpproxy-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """``<listen host>:<port>``: what the client is given instead of the target."""
        return f"{self.listen_host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        """Whether :meth:`cut` has taken effect."""
        return self._cut.is_set()

    def cut(self, timeout: float = 10.0) -> None:
        """Drop every connection and stop listening (new connections are refused)."""
        self._command(b"c")
        if not self._cut.wait(timeout):
            raise TimeoutError(f"proxy :{self.port} did not cut within {timeout}s")

    def close(self) -> None:
        """Cut, stop the thread and release everything; idempotent."""
        if self._done.is_set():
            return
        self._command(b"q")
        self._thread.join(10)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()
        self._done.set()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------- the loop

    def _command(self, cmd: bytes) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(cmd)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            s.close()

    def _do_cut(self) -> None:
        if self._cut.is_set():
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        self._listener.close()
        for sock in list(self._peers):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            self._drop(sock)
        self._cut.set()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(True)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[client], self._peers[upstream] = upstream, client
        self._sel.register(client, selectors.EVENT_READ, None)
        self._sel.register(upstream, selectors.EVENT_READ, None)
        self.accepted += 1

    def _forward(self, sock: socket.socket) -> None:
        peer = self._peers.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _loop(self) -> None:
        try:
            while True:
                for key, _ in self._sel.select():
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_r:
                        for cmd in sock.recv(64):
                            self._do_cut()
                            if cmd == ord("q"):
                                return
                    elif sock is self._listener:
                        self._accept()
                    else:
                        self._forward(sock)
        finally:
            self._do_cut()
