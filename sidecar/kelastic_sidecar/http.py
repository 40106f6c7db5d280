"""The sidecar's HTTP endpoints on one port: ``/metrics``, ``/healthz``, ``/readyz``, ``/status``.

``/healthz`` is 200 while the supervisor loop is alive; ``/readyz`` is 200 while workers of
a completed round are running; ``/status`` is a small JSON document (round, world size,
restarts, progress) that local mode uses for its progress line.

``/metrics`` answers as ``prometheus_client``'s own server does: in OpenMetrics when the
``Accept`` header asks for ``application/openmetrics-text`` (as Prometheus does), else in
the Prometheus text format.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kelastic.last_status import LastStatusError, encode_last_status


class SidecarHttpServer:
    """Serves the endpoints from a daemon thread.

    Args:
        host, port: where to listen (port 0 picks a free port; see :attr:`port`).
        registry: the metrics registry to expose.
        healthy, ready: callables answering the probes.
        status: callable returning the ``/status`` JSON document.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        healthy: Callable[[], bool],
        ready: Callable[[], bool],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        def metrics(accept: str) -> tuple[int, str, bytes]:
            encode, content_type = choose_encoder(accept)
            return 200, content_type, encode(registry)

        routes: dict[str, Callable[[str], tuple[int, str, bytes]]] = {
            "/metrics": metrics,
            "/healthz": lambda _: _probe(healthy()),
            "/readyz": lambda _: _probe(ready()),
            "/status": lambda _: _status_answer(status),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                accept = self.headers.get("Accept") or ""
                code, ctype, body = route(accept) if route else (404, "text/plain", b"not found\n")
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sidecar-http", daemon=True
        )

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()


def _status_answer(status: Callable[[], dict[str, Any]]) -> tuple[int, str, bytes]:
    """``/status`` by the document's one codec (:func:`kelastic.last_status.encode_last_status`,
    the one its readers decode): a document it refuses (a non-finite number, too big) is a
    500 that says why, never JSON a reader refuses."""
    try:
        return 200, "application/json", encode_last_status(status())
    except LastStatusError as exc:
        return 500, "text/plain", f"/status: {exc}\n".encode()


def _probe(ok: bool) -> tuple[int, str, bytes]:
    return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", b"not ready\n")
