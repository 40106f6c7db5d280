"""kelastic run's status polling: a sidecar's answer cut off mid-body is no answer."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace
from typing import Any, cast

from kelastic_operator.local.statuses import fetch_status


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


def test_a_crafted_status_answer_reads_as_no_answer() -> None:
    # Another process on the sidecar's port (or a broken one) answering deep nesting, a
    # 5000-digit number or an array: json.loads raised RecursionError past the old
    # except clause; the bounded decoder of the kept status reads every answer now.
    for body in (b"[" * 100_000, b'{"round": ' + b"9" * 5000 + b"}", b"[1]", b'{"r": NaN}'):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def answer(body: bytes = body, server: socket.socket = server) -> None:
            conn, _ = server.accept()
            conn.recv(4096)
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            conn.sendall(head + body)
            conn.close()

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            assert fetch_status(cast(Any, SimpleNamespace(http_port=port))) == {}, body[:20]
        finally:
            thread.join(5)
            server.close()
