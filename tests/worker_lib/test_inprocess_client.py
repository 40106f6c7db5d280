"""The worker's connection to the in-process coordinator: socket paths past sun_path."""

from __future__ import annotations

import socket
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from kelastic.inprocess.client import Connection
from kelastic.inprocess_messages import Hello, encode
from kelastic.sockaddr import unix_address
from tests.conftest import wait_for


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


def test_a_peer_waits_until_the_next_iterations_store_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank that connects to the next iteration's store before rank 0 created it is
    # refused, and torch's store client backs off for up to a second: the session probes
    # the port every few ms instead, and returns as soon as it listens.
    from kelastic import contract
    from kelastic.inprocess.session import _wait_for_store

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    probes: list[bool] = []  # each probe of the store: whether it connected
    connect = socket.create_connection

    def recorded(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        try:
            conn = connect(address, *args, **kwargs)
        except OSError:
            probes.append(False)
            raise
        probes.append(True)
        return conn

    monkeypatch.setattr(socket, "create_connection", recorded)
    monkeypatch.setenv(contract.RANK, "1")
    monkeypatch.setenv(contract.MASTER_ADDR, "127.0.0.1")
    monkeypatch.setenv(contract.MASTER_PORT, str(port))
    # a function that never imported torch.distributed has no store to wait for
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    _wait_for_store(timeout=60.0)
    assert probes == []
    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))
    listening = threading.Event()

    def serve() -> None:
        # rank 0 is still leaving its last iteration: the first probes are refused
        wait_for(lambda: len(probes) >= 3, 30, interval=0.001, what="3 refused probes")
        server = socket.create_server(("127.0.0.1", port))
        listening.set()
        conn, _ = server.accept()
        conn.close()
        server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    _wait_for_store(timeout=60.0)
    up = listening.is_set()
    thread.join(30)
    assert up, "returned before the store listened"
    # it returned because a probe connected, not at its deadline
    assert probes[:3] == [False] * 3 and probes[-1] is True, probes
    assert probes.count(True) == 1
    probes.clear()
    monkeypatch.setenv(contract.RANK, "0")  # rank 0 hosts the store: it never waits
    _wait_for_store(timeout=60.0)
    assert probes == []
