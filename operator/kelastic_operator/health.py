"""``/healthz`` of the operator process: what its liveness probe asks.

A replica is alive when the part that should be working is working:

- a follower (waiting for the leader-election Lease) while its elector thread campaigns;
- the leader while kopf's event loop turns: a task on that loop records a tick every
  second, and a tick older than ``stale_after`` seconds means the loop is stuck (a handler
  blocking it, a deadlock), which a restart cures — the same question kopf's own liveness
  endpoint answers, asked of a process that may not be running kopf yet.

Served by a small threaded HTTP server on its own port (``--health-port``), apart from
``/metrics``, whose answering says nothing about the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TICK_SECONDS = 1.0


class Health:
    """The liveness verdict.

    Args:
        campaigning: whether the leader-election thread is alive (a follower's duty).
        stale_after: seconds without an event-loop tick after which a leader is unhealthy.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        campaigning: Callable[[], bool] = lambda: True,
        stale_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.campaigning = campaigning
        self.stale_after = stale_after
        self._clock = clock
        self.last_tick: float | None = None

    def tick(self) -> None:
        """Record that the event loop ran (called on the loop)."""
        self.last_tick = self._clock()

    def verdict(self) -> tuple[bool, str]:
        """(healthy, why) now."""
        if self.last_tick is None:
            if self.campaigning():
                return True, "waiting to lead"
            return False, "the leader election stopped"
        age = self._clock() - self.last_tick
        if age > self.stale_after:
            return False, f"the event loop has not turned for {age:.0f} s"
        return True, "leading; the event loop turns"

    async def ticker(self) -> None:
        """Tick every :data:`TICK_SECONDS` on the running loop, until cancelled."""
        while True:
            self.tick()
            await asyncio.sleep(TICK_SECONDS)


def serve(health: Health, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve ``GET /healthz`` (200 or 503 with the reason) on ``host:port`` in a daemon
    thread; returns the server (``server.server_address`` has the bound port).

    Raises:
        OSError: the port cannot be bound.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/healthz":
                self.send_error(404)
                return
            ok, why = health.verdict()
            body = (why + "\n").encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server
