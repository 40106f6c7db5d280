"""The worker's connection to the in-process coordinator: socket paths past sun_path."""

from __future__ import annotations

import socket
from pathlib import Path

from kelastic.inprocess.client import Connection
from kelastic.inprocess_messages import Hello, encode
from kelastic.sockaddr import unix_address


def test_connects_to_a_socket_path_longer_than_sun_path(tmp_path: Path) -> None:
    # kelastic run's volumes live deep under the work dir: the socket path of a job with a
    # long name passes the 108 bytes of sun_path (this failed with "AF_UNIX path too long").
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "inprocess.sock"
    assert len(str(path)) > 108
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        server.bind(address)
    server.listen(1)
    try:
        conn = Connection.connect(path, timeout=5.0)
        peer, _ = server.accept()
        assert conn.send(Hello(pid=1234, local_rank=0, rank=0, iteration=0))
        assert peer.recv(4096) == encode(Hello(pid=1234, local_rank=0, rank=0, iteration=0))
        peer.close()
        conn.close()
    finally:
        server.close()
