"""The replication's transport (:mod:`kelastic_sidecar.replica`) on real TCP sockets on
127.0.0.1 with real slot files (``kelastic.checkpoint.CheckpointStore``): puts and gets
round-trip into slots that load, a rank's replicas keep its newest two steps, every bad
request is refused and counted with nothing left in ``replicas/``, a flood gets ``busy``,
a torn or corrupted slot is never placed, and a rate limit holds."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.scan import committed_slots, verified_step, verified_steps
from kelastic.checkpoint.slot_format import COMMIT_OFFSET, HEADER_SIZE, decode_header
from kelastic_sidecar.replica import (
    REPLICA_DIR_NAME,
    RefuseReason,
    ReplicaError,
    ReplicaServer,
    fetch_slot,
    new_token,
    send_slot,
    snapshot,
    sweep_fetches,
)
from kelastic_sidecar.replica import client as client_module
from kelastic_sidecar.replica.stream import Stream
from kelastic_sidecar.replica.wire import (
    Op,
    Reply,
    Request,
    decode_reply,
    decode_trailer,
    encode_reply,
    encode_request,
    encode_trailer,
)
from tests.conftest import wait_for

JOB = "uid-1"
TOKEN = new_token()
MIB = 1 << 20


def _state(step: int, big: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        "model": {"w": torch.full((64, 8), float(step)), "b": torch.arange(8) + step},
        "step": step,
        "lr": [0.1, 0.01],
    }
    if big:  # several 4 MiB chunks
        state["big"] = torch.arange(2 * MIB, dtype=torch.float32) + step
    return state


def _save(folder: Path, rank: int, steps: list[int], *, job: str = JOB, big: bool = False) -> Path:
    """Save ``steps`` of ``rank`` in ``folder``; the slot file of the last one."""
    folder.mkdir(exist_ok=True)
    with CheckpointStore(folder, rank=rank, job=job, world_size=rank + 1) as store:
        for step in steps:
            store.save(step, _state(step, big), blocking=True)
    return _slot_of(folder, rank, steps[-1], job)


def _slot_of(folder: Path, rank: int, step: int, job: str = JOB) -> Path:
    (slot,) = [s for s in committed_slots(folder, job) if s.rank == rank and s.step == step]
    return folder / f"rank-{rank}.slot{slot.slot}"


def _used_bytes(path: Path) -> int:
    with open(path, "rb") as fh:
        return decode_header(fh.read(HEADER_SIZE), file_size=path.stat().st_size).layout.file_size


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.fixture
def node_a(tmp_path: Path) -> Path:
    """The sending node's checkpoint folder."""
    folder = tmp_path / "node-a"
    folder.mkdir()
    return folder


@pytest.fixture
def node_b(tmp_path: Path) -> Path:
    """The peer node's checkpoint folder (its server's)."""
    folder = tmp_path / "node-b"
    folder.mkdir()
    return folder


def _start(folder: Path, **kwargs: Any) -> ReplicaServer:
    options: dict[str, Any] = {"host": "127.0.0.1", "max_slot_bytes": 64 * MIB,
                               "request_timeout": 5.0, **kwargs}  # fmt: skip
    server = ReplicaServer(folder, JOB, TOKEN, **options)
    server.start()
    return server


@pytest.fixture
def server(node_b: Path) -> Iterator[ReplicaServer]:
    s = _start(node_b)
    yield s
    s.close()
    assert s.refused[RefuseReason.ERROR] == 0  # no connection's thread failed unexpectedly


def _refused(server: ReplicaServer, reason: RefuseReason, count: int = 1) -> None:
    wait_for(lambda: server.refused[reason] >= count, 10, what=f"{count} x {reason}")
    assert server.refused[reason] == count
    others = {r: n for r, n in server.refused.items() if n and r is not reason}
    assert not others, others


def _raw(address: tuple[str, int], data: bytes, *, shut: bool = True) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes."""
    with socket.create_connection(address, timeout=15) as sock:
        try:
            sock.sendall(data)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # refused before reading it all: the reply may still be there
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


def _put_line(rank: int, step: int, nbytes: int, *, job: str = JOB, token: str = TOKEN) -> bytes:
    return encode_request(Request(Op.PUT, job, token, rank, step, nbytes))


def _reply(raw: bytes) -> Reply:
    return decode_reply(raw.split(b"\n", 1)[0])


# ------------------------------------------------------------------ round trips


def test_put_then_get_round_trip(node_a: Path, node_b: Path, server: ReplicaServer,
                                 tmp_path: Path) -> None:  # fmt: skip
    path = _save(node_a, 0, [5], big=True)
    size = _used_bytes(path)
    assert size < path.stat().st_size  # the slot's allocated capacity is not sent
    assert send_slot(server.address, TOKEN, JOB, path) == 5

    replicas = node_b / REPLICA_DIR_NAME
    assert stat.S_IMODE(replicas.stat().st_mode) == 0o755
    assert _listing(replicas) == ["rank-0.slot0"]
    assert stat.S_IMODE((replicas / "rank-0.slot0").stat().st_mode) == 0o644
    assert verified_steps(replicas, JOB) == {0: (5,)}
    assert (server.received, server.received_bytes) == (1, size)

    # node b's own slots lack rank 0: the get is served from its replicas
    node_c = tmp_path / "node-c"
    node_c.mkdir()
    dest = node_c / "rank-0.slot0"
    assert fetch_slot(server.address, TOKEN, JOB, 0, 5, dest) == size
    assert _listing(node_c) == ["rank-0.slot0"]  # no temporary file left
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644
    assert verified_step(dest, 0, JOB) is not None
    assert (server.served, server.served_bytes) == (1, size)
    with CheckpointStore(node_c, rank=0, job=JOB) as store:
        loaded = store.load(step=5)
    assert loaded is not None
    step, state = loaded
    expected = _state(5, big=True)
    assert step == 5 and state["step"] == 5 and state["lr"] == [0.1, 0.01]
    assert torch.equal(state["model"]["w"], expected["model"]["w"])
    assert torch.equal(state["model"]["b"], expected["model"]["b"])
    assert torch.equal(state["big"], expected["big"])


def test_a_get_is_served_from_the_nodes_own_slots_first(node_a: Path, tmp_path: Path) -> None:
    _save(node_a, 2, [3, 4, 5])
    server = _start(node_a)
    try:
        for step in (4, 5, 3):
            dest = tmp_path / f"rank-2.step{step}"
            fetch_slot(server.address, TOKEN, JOB, 2, step, dest)
            assert verified_step(dest, 2, JOB) == (step - 2, step)
        assert _listing(node_a / REPLICA_DIR_NAME) == []
        assert server.served == 3
    finally:
        server.close()


def test_a_ranks_replicas_keep_its_newest_two_steps(node_a: Path, node_b: Path,
                                                    server: ReplicaServer) -> None:  # fmt: skip
    with CheckpointStore(node_a, rank=1, job=JOB, world_size=2) as store:
        for step in (5, 6, 7):
            store.save(step, _state(step), blocking=True)
            assert send_slot(server.address, TOKEN, JOB, _slot_of(node_a, 1, step)) == step
            if step == 6:
                assert verified_steps(node_b / REPLICA_DIR_NAME, JOB) == {1: (6, 5)}
    assert verified_steps(node_b / REPLICA_DIR_NAME, JOB) == {1: (7, 6)}
    send_slot(server.address, TOKEN, JOB, _slot_of(node_a, 1, 7))  # again: replaces its 7
    assert verified_steps(node_b / REPLICA_DIR_NAME, JOB) == {1: (7, 6)}
    with CheckpointStore(node_a, rank=1, job=JOB, world_size=2) as store:
        store.save(8, _state(8), blocking=True)  # in the slot 5 was in: 6 and 7 stay
    send_slot(server.address, TOKEN, JOB, _slot_of(node_a, 1, 8))  # replaces 6 (slot 1)
    assert verified_steps(node_b / REPLICA_DIR_NAME, JOB) == {1: (8, 7)}
    assert _listing(node_b / REPLICA_DIR_NAME) == ["rank-1.slot0", "rank-1.slot1"]
    assert server.received == 5


# ------------------------------------------------------------------ refusals


def test_a_bad_token_is_refused(node_a: Path, node_b: Path, server: ReplicaServer) -> None:
    path = _save(node_a, 0, [5])
    with pytest.raises(ReplicaError, match=r"rank 0 step 5 .* refused: bad token") as info:
        send_slot(server.address, new_token(), JOB, path)
    assert info.value.address == server.address and (info.value.rank, info.value.step) == (0, 5)
    _refused(server, RefuseReason.TOKEN)
    assert _listing(node_b / REPLICA_DIR_NAME) == []
    with pytest.raises(ReplicaError, match="refused: bad token"):
        fetch_slot(server.address, new_token(), JOB, 0, 5, node_a / "x")
    _refused(server, RefuseReason.TOKEN, 2)


def test_another_job_is_refused(node_a: Path, node_b: Path, server: ReplicaServer) -> None:
    path = _save(node_a, 0, [5], job="other")
    size = _used_bytes(path)
    raw = _raw(server.address, _put_line(0, 5, size, job="other") + path.read_bytes()[:size]
               + encode_trailer(True))  # fmt: skip
    assert "another job" in _reply(raw).error
    _refused(server, RefuseReason.JOB)
    assert _listing(node_b / REPLICA_DIR_NAME) == []
    with pytest.raises(ReplicaError, match="holds job 'other'"):  # the client checks first
        send_slot(server.address, TOKEN, JOB, path)


@pytest.mark.parametrize(
    "line", [b"hello\n", b"{}\n", b'{"v":1,"op":"put"}\n', b"x" * 2000 + b"\n", b"\xff\xfe\n"]
)
def test_a_malformed_line_is_refused(node_b: Path, server: ReplicaServer, line: bytes) -> None:
    reply = _reply(_raw(server.address, line))
    assert not reply.ok and reply.error
    _refused(server, RefuseReason.MALFORMED)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_put_over_the_bound_is_refused_before_its_bytes(node_a: Path, node_b: Path) -> None:
    path = _save(node_a, 0, [5], big=True)
    server = _start(node_b, max_slot_bytes=MIB)
    try:
        with pytest.raises(ReplicaError, match=r"refused: \d+ bytes is outside 4096\.\.1048576"):
            send_slot(server.address, TOKEN, JOB, path)
        _refused(server, RefuseReason.SIZE)
        reply = _reply(_raw(server.address, _put_line(0, 5, HEADER_SIZE - 1)))
        assert "outside" in reply.error
        _refused(server, RefuseReason.SIZE, 2)
        assert _listing(node_b / REPLICA_DIR_NAME) == []
    finally:
        server.close()


@pytest.mark.parametrize(
    ("rank", "step", "job", "why"),
    [(1, 5, JOB, "rank 0 (not 1)"), (0, 6, JOB, "step 5 (not 6)"),
     (0, 5, "other", "job 'other' (not 'uid-1')")],
    ids=["rank", "step", "job"],
)  # fmt: skip
def test_a_header_that_is_not_the_requests_is_refused(
    node_a: Path, node_b: Path, server: ReplicaServer, rank: int, step: int, job: str, why: str
) -> None:
    path = _save(node_a, 0, [5], job=job)
    size = _used_bytes(path)
    raw = _raw(server.address, _put_line(rank, step, size) + path.read_bytes()[:size]
               + encode_trailer(True))  # fmt: skip
    assert why in _reply(raw).error
    _refused(server, RefuseReason.HEADER)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_put_of_bytes_that_are_no_slot_or_not_committed_is_refused(
    node_a: Path, node_b: Path, server: ReplicaServer
) -> None:
    path = _save(node_a, 0, [5])
    size = _used_bytes(path)
    body = bytearray(path.read_bytes()[:size])
    body[COMMIT_OFFSET : COMMIT_OFFSET + 16] = bytes(16)  # marked dirty
    raw = _raw(server.address, _put_line(0, 5, size) + bytes(body) + encode_trailer(True))
    assert "not committed" in _reply(raw).error
    raw = _raw(server.address, _put_line(0, 5, 8192) + os.urandom(8192) + encode_trailer(True))
    assert "header" in _reply(raw).error
    _refused(server, RefuseReason.HEADER, 2)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_trailer_that_says_torn_is_refused(node_a: Path, node_b: Path,
                                             server: ReplicaServer) -> None:  # fmt: skip
    path = _save(node_a, 0, [5])
    size = _used_bytes(path)
    raw = _raw(server.address, _put_line(0, 5, size) + path.read_bytes()[:size]
               + encode_trailer(False))  # fmt: skip
    assert "rewritten" in _reply(raw).error
    _refused(server, RefuseReason.TORN)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_client_that_sends_half_the_bytes_then_closes(node_a: Path, node_b: Path,
                                                        server: ReplicaServer) -> None:  # fmt: skip
    path = _save(node_a, 0, [5], big=True)
    size = _used_bytes(path)
    _raw(server.address, _put_line(0, 5, size) + path.read_bytes()[: size // 2])
    _refused(server, RefuseReason.PEER_CLOSED)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_transfer_cut_by_the_servers_exit_is_removed_at_its_start(node_b: Path) -> None:
    replicas = node_b / REPLICA_DIR_NAME
    replicas.mkdir()
    (replicas / ".rank-3.incoming-0123456789abcdef").write_bytes(b"x" * 100)
    (replicas / "rank-3.slot0").write_bytes(b"kept")
    server = _start(node_b)
    server.close()
    assert _listing(replicas) == ["rank-3.slot0"]


def test_a_fetch_cut_by_the_sidecars_death_is_swept_and_slots_are_kept(tmp_path: Path) -> None:
    (tmp_path / ".rank-3.slot0.fetch-0123456789abcdef").write_bytes(b"x" * 100)
    (tmp_path / ".rank-3.slot0.fetch-short").write_bytes(b"not ours")
    (tmp_path / "rank-3.slot0").write_bytes(b"kept")
    assert sweep_fetches(tmp_path) == [".rank-3.slot0.fetch-0123456789abcdef"]
    assert _listing(tmp_path) == [".rank-3.slot0.fetch-short", "rank-3.slot0"]
    assert sweep_fetches(tmp_path / "missing") == []


def test_a_silent_client_times_out(node_a: Path, node_b: Path) -> None:
    path = _save(node_a, 0, [5])
    size = _used_bytes(path)
    server = _start(node_b, request_timeout=0.5)
    try:
        with socket.create_connection(server.address, timeout=15) as sock:
            started = time.monotonic()
            reply = _reply(sock.recv(1024))  # nothing sent
            assert time.monotonic() - started >= 0.4
        assert "timed out" in reply.error
        _refused(server, RefuseReason.TIMEOUT)
        with socket.create_connection(server.address, timeout=15) as sock:  # half a line
            sock.sendall(b'{"v":1,"op":')
            assert "timed out" in _reply(sock.recv(1024)).error
        _refused(server, RefuseReason.TIMEOUT, 2)
        with socket.create_connection(server.address, timeout=15) as sock:  # stalls mid-slot
            sock.sendall(_put_line(0, 5, size) + path.read_bytes()[:HEADER_SIZE])
            _refused(server, RefuseReason.TIMEOUT, 3)
            assert _listing(node_b / REPLICA_DIR_NAME) == []
    finally:
        server.close()


def test_a_flood_beyond_max_connections_is_answered_busy(node_a: Path, node_b: Path) -> None:
    _save(node_a, 0, [5])
    server = _start(node_a, max_connections=2, request_timeout=30.0)
    held = [socket.create_connection(server.address, timeout=15) for _ in range(2)]
    try:
        for _ in range(3):
            reply = _reply(_raw(server.address, b""))
            assert reply == Reply(False, error="busy")
        _refused(server, RefuseReason.BUSY, 3)
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:  # the held connections' slots come free once they close
        try:
            fetch_slot(server.address, TOKEN, JOB, 0, 5, node_b / "rank-0.slot0")
        except ReplicaError as exc:
            assert "busy" in str(exc)
            return False
        return True

    try:
        wait_for(served, 15, what="a request served after the flood")
        assert server.served == 1 and server.refused[RefuseReason.ERROR] == 0
    finally:
        server.close()


def test_a_get_of_a_step_not_held(node_a: Path, server: ReplicaServer, tmp_path: Path) -> None:
    path = _save(node_a, 0, [5])
    send_slot(server.address, TOKEN, JOB, path)
    dest = tmp_path / "rank-0.slot0"
    with pytest.raises(ReplicaError, match="refused: no committed slot of rank 0 step 6"):
        fetch_slot(server.address, TOKEN, JOB, 0, 6, dest)
    with pytest.raises(ReplicaError, match="refused: no committed slot of rank 1 step 5"):
        fetch_slot(server.address, TOKEN, JOB, 1, 5, dest)
    assert not dest.exists()
    _refused(server, RefuseReason.NOT_FOUND, 2)


# ------------------------------------------------------------------ torn and corrupt


def test_a_slot_corrupted_after_its_commit_is_not_placed(node_a: Path, tmp_path: Path) -> None:
    path = _save(node_a, 0, [5], big=True)
    with open(path, "r+b") as fh:  # a payload byte, after the commit: the header still checks
        fh.seek(3 * MIB)
        byte = fh.read(1)
        fh.seek(3 * MIB)
        fh.write(bytes([byte[0] ^ 0xFF]))
    server = _start(node_a)
    dest_folder = tmp_path / "dest"
    dest_folder.mkdir()
    try:
        with pytest.raises(ReplicaError, match="fails its checks"):
            fetch_slot(server.address, TOKEN, JOB, 0, 5, dest_folder / "rank-0.slot0")
        assert _listing(dest_folder) == []
        # served as its header says: the client's check catches it, while it is received
        # (the client then closes: the server's send or its trailer may be cut)
        wait_for(lambda: server.served or server.refused[RefuseReason.PEER_CLOSED], 10,
                 what="the get served or cut")  # fmt: skip
        assert server.refused[RefuseReason.ERROR] == 0
    finally:
        server.close()


def _zero_commit_after_send(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Every ``sendfile`` of the transport is followed by a save's first write over
    ``path``: its commit word zeroed (the slot marked dirty)."""
    send_file = Stream.send_file

    def then_rewrite(self: Stream, file: Any, offset: int, count: int) -> int:
        sent = send_file(self, file, offset, count)
        with open(path, "r+b") as fh:
            fh.seek(COMMIT_OFFSET)
            fh.write(bytes(16))
        return sent

    monkeypatch.setattr(Stream, "send_file", then_rewrite)


def test_a_slot_rewritten_while_it_is_sent_is_torn(
    node_a: Path, node_b: Path, server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save(node_a, 0, [5])
    _zero_commit_after_send(monkeypatch, path)
    with pytest.raises(ReplicaError, match="torn: the slot was rewritten"):
        send_slot(server.address, TOKEN, JOB, path)
    _refused(server, RefuseReason.TORN)
    assert _listing(node_b / REPLICA_DIR_NAME) == []


def test_a_slot_rewritten_while_it_is_served_is_torn(
    node_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save(node_a, 0, [5])
    server = _start(node_a)
    try:
        _zero_commit_after_send(monkeypatch, path)
        dest = tmp_path / "rank-0.slot0"
        with pytest.raises(ReplicaError, match="torn"):
            fetch_slot(server.address, TOKEN, JOB, 0, 5, dest)
        assert _listing(tmp_path) == ["node-a"]
        _refused(server, RefuseReason.TORN)
        assert server.served == 0
    finally:
        server.close()


def test_a_crafted_trailer_and_reply_stream(node_a: Path, server: ReplicaServer) -> None:
    """The protocol by hand: a put's ack names the bytes stored; a get's reply, bytes and
    trailer arrive in that order on one connection."""
    path = _save(node_a, 0, [5])
    size = _used_bytes(path)
    body = path.read_bytes()[:size]
    reply = _reply(_raw(server.address, _put_line(0, 5, size) + body + encode_trailer(True)))
    assert reply == Reply(True, nbytes=size)
    get = encode_request(Request(Op.GET, JOB, TOKEN, 0, 5))
    raw = _raw(server.address, get)
    head, rest = raw.split(b"\n", 1)
    assert decode_reply(head) == Reply(True, nbytes=size)
    assert rest[:size] == body and decode_trailer(rest[size:]).commit


# ------------------------------------------------------------------ the client's own checks


def test_send_slot_refuses_an_uncommitted_slot_and_a_dead_peer(node_a: Path) -> None:
    path = _save(node_a, 0, [5])
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", int(probe.getsockname()[1]))
    with pytest.raises(ReplicaError, match="cannot connect"):
        send_slot(dead, TOKEN, JOB, path, timeout=5)
    with pytest.raises(ReplicaError, match="cannot connect"):
        fetch_slot(dead, TOKEN, JOB, 0, 5, node_a / "x", timeout=5)
    with open(path, "r+b") as fh:
        fh.seek(COMMIT_OFFSET)
        fh.write(bytes(16))
    with pytest.raises(ReplicaError, match="not committed"):
        send_slot(dead, TOKEN, JOB, path)
    with pytest.raises(ReplicaError, match=r"rank-0\.lock"):
        send_slot(dead, TOKEN, JOB, node_a / "rank-0.lock")


def test_send_slot_keeps_under_its_rate(node_a: Path, server: ReplicaServer) -> None:
    path = _save(node_a, 0, [5], big=True)
    size = _used_bytes(path)
    assert size > 8 * MIB
    started = time.monotonic()
    send_slot(server.address, TOKEN, JOB, path, rate_bytes_per_s=20e6)
    assert time.monotonic() - started >= 0.3  # 8.4 MB at 20 MB/s: 0.42 s at the least
    assert server.received_bytes == size


def test_the_server_survives_garbage_and_closes(node_a: Path, server: ReplicaServer) -> None:
    path = _save(node_a, 0, [5])
    for data in (b"\n", b"\x00" * 5000, b'{"v":1}\n' * 3, struct.pack("<Q", 2**63) + b"\n"):
        _raw(server.address, data)
    assert send_slot(server.address, TOKEN, JOB, path) == 5  # still serving
    address = server.address
    server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=5).close()


def test_a_snapshot_is_a_whole_copy_the_next_saves_do_not_touch(
    node_a: Path, tmp_path: Path
) -> None:
    path = _save(node_a, 0, [5], big=True)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    placed = snapshot(path, folder, JOB, 0, 5)
    assert placed is not None and placed.parent == folder
    assert placed.stat().st_size == _used_bytes(path)  # its used bytes, not its capacity
    _save(node_a, 0, [6, 7, 8, 9])  # the slot is overwritten since
    assert verified_step(placed, 0, JOB) is not None
    loaded = tmp_path / "loaded"  # as a node that fetched it: the slot is rank 0's own
    loaded.mkdir()
    shutil.copyfile(placed, loaded / "rank-0.slot0")
    with CheckpointStore(loaded, rank=0, job=JOB) as store:
        got = store.load(step=5)
    assert got is not None and bool(got[1]["big"].eq(torch.arange(2 * MIB) + 5).all())
    # the slot no longer holds step 5 (or is of another job): nothing copied
    assert snapshot(path, folder, JOB, 0, 5) is None
    assert snapshot(_slot_of(node_a, 0, 9), folder, "another-job", 0, 9) is None
    assert [n for n in _listing(folder) if n.startswith(".")] == []


def test_a_snapshot_of_a_slot_a_save_began_over_is_dropped(
    node_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer marks a slot dirty (commit word zero) before it writes its payload: a copy
    taken meanwhile is of no step and must not be placed."""
    from kelastic_sidecar.replica import slots as slots_module

    path = _save(node_a, 0, [5], big=True)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    real = slots_module._copy

    def copy_while_a_save_begins(src: int, dst: int, size: int) -> None:
        real(src, dst, size // 2)
        with open(path, "r+b") as fh:  # what CheckpointStore.save does first
            fh.seek(COMMIT_OFFSET)
            fh.write(bytes(16))
        real(src, dst, size)

    monkeypatch.setattr(slots_module, "_copy", copy_while_a_save_begins)
    assert snapshot(path, folder, JOB, 0, 5) is None
    assert _listing(folder) == []  # no replica, no temporary file


# ------------------------------------------------------------------ checks while receiving


def _layout(path: Path) -> Any:
    with open(path, "rb") as fh:
        return decode_header(fh.read(HEADER_SIZE), file_size=path.stat().st_size).layout


def _flip(path: Path, offset: int) -> None:
    """Invert the byte at ``offset`` of ``path`` (after its commit: the header checks)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _kelastic_threads() -> list[str]:
    """The fetch's own threads (its checker, ``kelastic-fetch-check``): other kelastic
    threads of the test session (an embedded etcd's, a store's commit) are not its."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kelastic-fetch"))


def _no_kelastic_threads() -> None:
    """Before a fetch: none left by what the test did before."""
    wait_for(lambda: not _kelastic_threads(), 10, what="no fetch thread")


@pytest.mark.parametrize("buffer", [4 * MIB, 1000, 4 * MIB - 1], ids=["4MiB", "1000B", "odd"])
@pytest.mark.parametrize(("chunk", "where"), [(0, "first"), (1, "middle"), (2, "last-short"),
                                              (2, "last-byte")])  # fmt: skip
def test_a_corrupt_chunk_anywhere_is_caught_and_leaves_nothing(
    node_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, where: str,
    buffer: int,
) -> None:  # fmt: skip
    """Three chunks (the last one short); a byte flipped in one of them fails the fetch,
    whatever the receive buffer's size (a buffer that straddles the chunks' ends)."""
    path = _save(node_a, 0, [5], big=True)
    lay = _layout(path)
    assert lay.chunk_count == 3 and 0 < lay.payload_len - 2 * lay.chunk_size < lay.chunk_size
    start = lay.payload_offset + chunk * lay.chunk_size
    end = min(start + lay.chunk_size, lay.payload_offset + lay.payload_len)
    _flip(path, end - 1 if where == "last-byte" else (start + end) // 2)
    monkeypatch.setattr(client_module, "BUFFER_BYTES", buffer)
    server = _start(node_a)
    dest_folder = tmp_path / "dest"
    dest_folder.mkdir()
    try:
        _no_kelastic_threads()
        with pytest.raises(
            ReplicaError, match=rf"fails its checks .*: payload chunk {chunk} "
        ) as info:
            fetch_slot(server.address, TOKEN, JOB, 0, 5, dest_folder / "rank-0.slot0")
        assert info.value.address == server.address and (info.value.rank, info.value.step) == (0, 5)
        assert _kelastic_threads() == []  # the checker thread is gone when the fetch raised
        assert _listing(dest_folder) == []  # no slot, no hidden temporary file
    finally:
        server.close()


def _slot_of_payload(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(exist_ok=True)
    with CheckpointStore(folder, rank=0, job=JOB, world_size=1) as store:
        store.save(5, tensors, blocking=True)
    return _slot_of(folder, 0, 5)


@pytest.mark.parametrize("shape", ["chunk-multiple", "under-one-chunk", "no-payload"])
def test_payloads_of_whole_chunks_and_under_one_chunk_round_trip(
    node_a: Path, tmp_path: Path, shape: str
) -> None:
    quarter = MIB // 4  # float32 elements of 1 MiB
    tensors = {
        "chunk-multiple": {"a": torch.arange(4 * quarter, dtype=torch.float32),
                           "b": torch.ones(4 * quarter, dtype=torch.float32)},
        "under-one-chunk": {"a": torch.arange(1000, dtype=torch.float32)},
        "no-payload": {"a": torch.zeros(0)},
    }[shape]  # fmt: skip
    path = _slot_of_payload(node_a, tensors)
    lay = _layout(path)
    expected = {"chunk-multiple": (2, 8 * MIB), "under-one-chunk": (1, 4000),
                "no-payload": (0, 0)}[shape]  # fmt: skip
    assert (lay.chunk_count, lay.payload_len) == expected
    server = _start(node_a)
    dest_folder = tmp_path / "dest"
    dest_folder.mkdir()
    try:
        dest = dest_folder / "rank-0.slot0"
        assert fetch_slot(server.address, TOKEN, JOB, 0, 5, dest) == _used_bytes(path)
        assert dest.read_bytes() == path.read_bytes()[: _used_bytes(path)]
        assert _listing(dest_folder) == ["rank-0.slot0"]
        if lay.chunk_count:  # and its last chunk is checked too
            _flip(path, lay.payload_offset + lay.payload_len - 1)
            with pytest.raises(ReplicaError, match=f"payload chunk {lay.chunk_count - 1} "):
                fetch_slot(server.address, TOKEN, JOB, 0, 5, dest_folder / "again")
            assert _listing(dest_folder) == ["rank-0.slot0"]
    finally:
        server.close()


@pytest.mark.parametrize(
    "buffer", [4096, 4097, 3 * 4096 + 5, 0], ids=["page", "page+1", "odd", "whole"]
)
def test_any_receive_buffer_checks_and_places_the_same_bytes(
    node_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffer: int
) -> None:
    """Buffers that end on and off the header's, the table's, the chunks' and the
    manifest's ends; ``whole``: one buffer of the slot's exact size."""
    path = _save(node_a, 0, [5], big=True)
    size = _used_bytes(path)
    monkeypatch.setattr(client_module, "BUFFER_BYTES", buffer or size)
    server = _start(node_a)
    try:
        dest = tmp_path / "rank-0.slot0"
        assert fetch_slot(server.address, TOKEN, JOB, 0, 5, dest) == size
        assert dest.read_bytes() == path.read_bytes()[:size]
        assert verified_step(dest, 0, JOB) is not None
    finally:
        server.close()


def test_a_failing_checker_thread_fails_the_fetch_and_leaves_nothing(
    node_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save(node_a, 0, [5], big=True)
    assert _used_bytes(path) > 2 * MIB
    monkeypatch.setattr(client_module, "BUFFER_BYTES", MIB)
    feed = client_module.SlotStreamCheck.feed
    threads: list[str] = []

    def fails_on_the_third(self: Any, data: memoryview) -> None:
        threads.append(threading.current_thread().name)
        if len(threads) == 3:
            raise RuntimeError("the checker broke")
        feed(self, data)

    monkeypatch.setattr(client_module.SlotStreamCheck, "feed", fails_on_the_third)
    server = _start(node_a)
    try:
        _no_kelastic_threads()
        with pytest.raises(ReplicaError, match="checking the slot failed: RuntimeError: "
                                               "the checker broke") as info:  # fmt: skip
            fetch_slot(server.address, TOKEN, JOB, 0, 5, tmp_path / "rank-0.slot0")
        assert (info.value.rank, info.value.step) == (0, 5)
        assert isinstance(info.value.__cause__.__cause__, RuntimeError)  # type: ignore[union-attr]
        # the header on the receiver's thread, the table and the payload behind it; none
        # fed after the failure
        assert threads[0] == threading.current_thread().name and len(threads) == 3
        assert all(name.startswith("kelastic-fetch-check") for name in threads[1:])
        assert _kelastic_threads() == []
        assert _listing(tmp_path) == ["node-a"]
    finally:
        server.close()


class _FakePeer:
    """A replica server by hand: answers one get with ``nbytes`` and sends ``body``, then
    holds the connection open, sending nothing more, until :meth:`close` (``hold``), or
    closes it at once."""

    def __init__(self, nbytes: int, body: bytes, *, hold: bool = True) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._release = threading.Event()
        if not hold:
            self._release.set()
        self._thread = threading.Thread(
            target=self._serve, args=(nbytes, body), name="fake-peer", daemon=True
        )
        self._thread.start()

    def _serve(self, nbytes: int, body: bytes) -> None:
        self._listener.settimeout(30)
        conn, _ = self._listener.accept()
        with conn:
            Stream(conn, 30).read_line(30, 4096)
            with contextlib.suppress(OSError):  # the client may close first
                conn.sendall(encode_reply(Reply(True, nbytes=nbytes)) + body)
            self._release.wait(60)

    def close(self) -> None:
        self._release.set()
        self._thread.join(30)
        self._listener.close()
        assert not self._thread.is_alive()


@pytest.mark.parametrize("stall", ["after-chunk-0", "before-chunk-1-ends"])
def test_a_corrupt_chunk_is_caught_while_the_peer_still_sends(
    node_a: Path, tmp_path: Path, stall: str
) -> None:
    """The peer sends a corrupt first chunk, then stops: the fetch fails on the chunk at
    once, not when the peer's silence times out (the check runs while receiving)."""
    path = _save(node_a, 0, [5], big=True)
    lay = _layout(path)
    size = _used_bytes(path)
    _flip(path, lay.payload_offset + 10)
    sent = lay.payload_offset + lay.chunk_size + (0 if stall == "after-chunk-0" else MIB)
    peer = _FakePeer(size, path.read_bytes()[:sent])
    try:
        _no_kelastic_threads()
        started = time.monotonic()
        with pytest.raises(ReplicaError, match="payload chunk 0 "):
            fetch_slot(peer.address, TOKEN, JOB, 0, 5, tmp_path / "rank-0.slot0", timeout=30)
        assert time.monotonic() - started < 15  # the peer's silence would take 30 s
        assert _kelastic_threads() == []
        assert _listing(tmp_path) == ["node-a"]
    finally:
        peer.close()


@pytest.mark.parametrize("cut", ["stalls", "closes"])
def test_a_peer_that_stops_sending_leaves_nothing(node_a: Path, tmp_path: Path, cut: str) -> None:
    path = _save(node_a, 0, [5], big=True)
    size = _used_bytes(path)
    body = path.read_bytes()[: size // 2]
    peer = _FakePeer(size, body, hold=cut == "stalls")
    try:
        _no_kelastic_threads()
        with pytest.raises(ReplicaError, match=r"rank 0 step 5 .*: failed: ") as info:
            fetch_slot(peer.address, TOKEN, JOB, 0, 5, tmp_path / "rank-0.slot0", timeout=1)
        assert info.value.address == peer.address
        why = "timed out" if cut == "stalls" else "closed"
        assert why in str(info.value)
        assert _kelastic_threads() == []
        assert _listing(tmp_path) == ["node-a"]
    finally:
        peer.close()
