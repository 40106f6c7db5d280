"""kelastic run's status polling: a sidecar's answer cut off mid-body is no answer."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace
from typing import Any, cast

from kelastic_operator.local.progress import fetch_status


def test_a_status_cut_off_mid_body_reads_as_no_answer() -> None:
    # A sidecar exiting while it answers /status: the body ends before its length
    # (http.client.IncompleteRead, no OSError) crashed kelastic run with a traceback.
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 1116\r\n\r\n{"phase": ')
        conn.close()

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        assert fetch_status(cast(Any, SimpleNamespace(http_port=port))) == {}
    finally:
        thread.join(5)
        server.close()
