"""The worker's connection to the in-process coordinator: socket paths past sun_path."""

from __future__ import annotations

import socket
import sys
import threading
import types
from collections.abc import Callable
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
    from kelastic.inprocess.store_wait import wait_for_store

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    probes: list[bool] = []  # each probe of the store: whether it connected
    connect = socket.create_connection

    def recorded(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        # only this port's: the patch is process-wide, and a thread another test left
        # running may connect elsewhere meanwhile (CI once saw one such connection first)
        if address[1] != port:
            return connect(address, *args, **kwargs)
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
    wait_for_store(timeout=60.0)
    assert probes == []
    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))
    # rank 0 is still leaving its last iteration: the first probes are refused
    up = _store_listens_after(port, lambda: len(probes) >= 3)
    assert up, "returned before the store listened"
    # it returned because a probe connected, not at its deadline
    assert probes[:3] == [False] * 3 and probes[-1] is True, probes
    assert probes.count(True) == 1
    probes.clear()
    monkeypatch.setenv(contract.RANK, "0")  # rank 0 hosts the store: it never waits
    wait_for_store(timeout=60.0)
    assert probes == []


def test_a_probe_connected_to_itself_is_not_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # MASTER_PORT is often an ephemeral port; a probe of 127.0.0.1:P whose kernel-chosen
    # source port is P itself connects to itself (TCP simultaneous open) while nothing
    # listens. That is no store: the wait goes on (and the self-connection does not hold P
    # against rank 0's bind).
    from kelastic import contract

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    selves: list[bool] = []  # each forced self-connection: whether it connected to itself
    connect = socket.create_connection

    def to_itself(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        if address[1] != port or selves:  # one: the closed one leaves P in TIME_WAIT
            return connect(address, *args, **kwargs)
        conn = connect(address, *args, **{**kwargs, "source_address": ("127.0.0.1", port)})
        selves.append(conn.getsockname() == conn.getpeername())
        return conn

    monkeypatch.setattr(socket, "create_connection", to_itself)
    monkeypatch.setenv(contract.RANK, "1")
    monkeypatch.setenv(contract.MASTER_ADDR, "127.0.0.1")
    monkeypatch.setenv(contract.MASTER_PORT, str(port))
    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))
    up = _store_listens_after(port, lambda: bool(selves))
    assert selves == [True], selves
    assert up, "a connection to itself was taken for the store"


def _store_listens_after(port: int, when: Callable[[], bool]) -> bool:
    """Rank 0's store: it listens on ``port`` once ``when()`` holds (and the port can be
    bound), while this thread waits for it (``wait_for_store``). Whether it listened
    before the wait returned."""
    from kelastic.inprocess.store_wait import wait_for_store

    listening = threading.Event()
    servers: list[socket.socket] = []

    def bound() -> bool:  # a probe's self-connection may hold the port a moment
        try:
            servers.append(socket.create_server(("127.0.0.1", port)))
        except OSError:
            return False
        return True

    def serve() -> None:
        wait_for(when, 30, interval=0.001, what="the probes before the store")
        wait_for(bound, 30, interval=0.001, what="the store's port free")
        listening.set()
        conn, _ = servers[0].accept()
        conn.close()
        servers[0].close()

    thread = threading.Thread(target=serve)
    thread.start()
    wait_for_store(timeout=60.0)
    up = listening.is_set()
    thread.join(30)
    return up
