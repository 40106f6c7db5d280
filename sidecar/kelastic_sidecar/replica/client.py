"""The replication's two clients: :func:`send_slot` puts a committed slot on a peer's
server, :func:`fetch_slot` gets a (rank, step) back from one (the protocol: :mod:`.wire`).
Each opens one connection per call; every failure is a :class:`ReplicaError` that names
the peer, the rank, the step and why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import time
from pathlib import Path
from typing import BinaryIO, Final

from kelastic.checkpoint.scan import verified_step
from kelastic.checkpoint.slot_format import HEADER_SIZE, SlotFormatError

from .slots import commit_unchanged, read_header
from .stream import BUFFER_BYTES, SinkError, Stream, connect
from .wire import (
    MAX_LINE,
    Op,
    ReplicaWireError,
    Reply,
    Request,
    decode_reply,
    decode_trailer,
    encode_request,
    encode_trailer,
)

__all__ = ["ReplicaError", "fetch_slot", "send_slot", "sweep_fetches"]

#: Mode of a fetched slot file (the trainers' slots' mode: the sidecar reads them).
_FILE_MODE: Final = 0o644
#: The shortest paced chunk (a low rate sends smaller chunks, more evenly).
_MIN_PACED_CHUNK: Final = 64 * 1024
#: Seconds a client waits for a refusal the server sent before it reset the connection.
_LATE_REPLY_TIMEOUT: Final = 1.0
#: A fetch's temporary file (:func:`fetch_slot`; hidden: never a slot's name).
_FETCHING: Final = re.compile(r"\.rank-[0-9]+\.slot[0-9]\.fetch-[0-9a-f]{16}")


def sweep_fetches(folder: Path) -> list[str]:
    """Remove the temporary files of fetches cut by a sidecar's death from ``folder`` (a
    memory volume outlives a restarted sidecar: they would hold its memory). Call it
    before any fetch runs. Returns the names removed; a missing folder holds none.

    Raises:
        OSError: the folder cannot be listed.
    """
    if not folder.is_dir():
        return []
    removed = []
    for name in os.listdir(folder):
        if _FETCHING.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
                removed.append(name)
    return removed


class ReplicaError(RuntimeError):
    """A slot could not be sent to or fetched from a peer: refused (the server's reason
    quoted), the connection failed or timed out, or the slot was torn (rewritten while
    its bytes were read) or fails its checks. The message names the peer, rank and step.

    Attributes:
        address: the peer's ``(host, port)``.
        rank: the slot's global rank.
        step: its step (-1 when the slot's header could not be read).
    """

    def __init__(self, message: str, address: tuple[str, int], rank: int, step: int) -> None:
        super().__init__(message)
        self.address = address
        self.rank = rank
        self.step = step


def _where(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _late_refusal(stream: Stream) -> Reply | None:
    """A refusal the server sent before it closed a connection our send then broke on
    (it refuses a put before reading the bytes); None when there is none."""
    try:
        reply = decode_reply(stream.read_line(_LATE_REPLY_TIMEOUT, MAX_LINE))
    except (OSError, ValueError):
        return None
    return None if reply.ok else reply


def _send_paced(stream: Stream, file: BinaryIO, size: int, rate: float | None) -> None:
    """Send ``size`` bytes of ``file`` in chunks, keeping the average under ``rate``
    bytes per second (None: unlimited): a token bucket of one chunk, refilled at
    ``rate``."""
    chunk = BUFFER_BYTES
    if rate is not None:  # chunks of ~0.1 s: the rate holds over short spans too
        chunk = int(max(_MIN_PACED_CHUNK, min(BUFFER_BYTES, rate / 10)))
    started = time.monotonic()
    sent = 0
    while sent < size:
        count = min(chunk, size - sent)
        got = stream.send_file(file, sent, count)
        if got != count:
            raise SlotFormatError(f"the slot file ended after {sent + got} of {size} bytes")
        sent += got
        if rate is not None:
            delay = started + sent / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def send_slot(address: tuple[str, int], token: str, job: str, path: Path, *,
              rate_bytes_per_s: float | None = None, timeout: float = 30.0) -> int:  # fmt: skip
    """Put the committed slot file at ``path`` on the replica server at ``address``.

    Sends the slot's used bytes (its header's ``layout.file_size``, not the file's
    allocated size) with ``sendfile``, then the trailer: ``commit: true`` only if the
    slot's commit word is unchanged after they were read.

    Args:
        address: the peer's ``(host, port)``.
        token: the job's shared secret (the server's).
        job: the job's id; the slot must be of it.
        path: a slot file (``rank-<R>.slot<K>``), committed.
        rate_bytes_per_s: keep the average rate under this many bytes per second (None:
            unlimited), so replication leaves the training's traffic room.
        timeout: seconds the connection, each send and the acknowledgement may wait
            (the whole transfer has no deadline: a large slot at a low rate takes long).

    Returns:
        The step the peer acknowledged storing.

    Raises:
        ReplicaError: the slot is not a committed slot of ``job`` or cannot be read; the
            connection failed or timed out; the server refused (its error quoted); the
            slot was torn (a save began over it while it was sent).
        ValueError: a bad token or job (:class:`~.wire.ReplicaWireError`), a rate <= 0.
    """
    if rate_bytes_per_s is not None and not rate_bytes_per_s > 0:
        raise ValueError(f"rate_bytes_per_s must be > 0, got {rate_bytes_per_s}")
    where = _where(address)
    try:
        file = open(path, "rb")  # noqa: SIM115  (closed below)
    except OSError as exc:
        raise ReplicaError(f"cannot send {path} to {where}: {exc}", address, -1, -1) from exc
    with file:
        try:
            header = read_header(file.fileno())
        except (OSError, SlotFormatError) as exc:
            raise ReplicaError(f"cannot send {path} to {where}: {exc}", address, -1, -1) from exc
        rank, step, size = header.rank, header.step, header.layout.file_size
        what = f"rank {rank} step {step} ({path.name}, {size} bytes) to {where}"
        if not header.seq or header.job != job:
            raise ReplicaError(f"cannot send {what}: the slot is not committed or holds job "
                               f"{header.job!r}, not {job!r}", address, rank, step)  # fmt: skip
        request = encode_request(Request(Op.PUT, job, token, rank, step, size))
        try:
            sock = connect(address, timeout)
        except OSError as exc:
            raise ReplicaError(f"cannot send {what}: cannot connect: {exc}", address, rank,
                               step) from exc  # fmt: skip
        with sock:
            stream = Stream(sock, timeout)
            try:
                stream.send(request)
                _send_paced(stream, file, size, rate_bytes_per_s)
                commit = commit_unchanged(file.fileno(), header)
                stream.send(encode_trailer(commit))
                reply = decode_reply(stream.read_line(timeout, MAX_LINE))
            except (OSError, ValueError) as exc:  # wire, format, LineTooLong
                late = _late_refusal(stream)
                why = f"refused: {late.error}" if late is not None else f"failed: {exc}"
                raise ReplicaError(f"cannot send {what}: {why}", address, rank, step) from exc
    if not commit:
        raise ReplicaError(f"cannot send {what}: torn: the slot was rewritten while it was "
                           "sent (a save began over it)", address, rank, step)  # fmt: skip
    if not reply.ok:
        raise ReplicaError(f"cannot send {what}: refused: {reply.error}", address, rank, step)
    if reply.nbytes != size:
        raise ReplicaError(f"cannot send {what}: the peer acknowledged {reply.nbytes} bytes",
                           address, rank, step)  # fmt: skip
    return step


def _receive(stream: Stream, fd: int, size: int) -> None:
    """Receive ``size`` bytes into the file open at ``fd`` through one 4 MiB buffer
    (``recv_into``, then ``os.write``). Measured on loopback against ``recv_into`` a
    shared map of the file (allocated first, so that a full folder fails at once rather
    than with SIGBUS): the buffer was faster (100 MiB: 1.3 vs 1.0 GB/s), as the map's
    page faults and allocation cost more than the second copy."""
    stream.recv_to_fd(fd, size, bytearray(min(BUFFER_BYTES, size)))


def _check_room(folder: Path, size: int) -> None:
    """Refuse a slot ``folder`` has no room for before receiving it (a server that
    announces more than a slot is refused here, not once the folder is full).

    Raises:
        OSError: ``folder`` has fewer than ``size`` bytes free (``ENOSPC``).
    """
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise OSError(errno.ENOSPC, f"{folder} has {free} bytes free, the slot needs {size}")


def fetch_slot(address: tuple[str, int], token: str, job: str, rank: int, step: int,
               dest: Path, *, timeout: float = 60.0) -> int:  # fmt: skip
    """Get the committed slot of (``rank``, ``step``) of ``job`` from the replica server
    at ``address`` into the file ``dest``.

    The bytes go to a hidden temporary file beside ``dest`` (``.<name>.fetch-<random>``);
    the trailer must say ``commit: true``, and the file must pass every check of the
    slot format (:func:`kelastic.checkpoint.scan.verified_step`: header, table, manifest,
    every chunk's crc32) as a committed slot of ``rank`` of ``job`` holding ``step``;
    only then it replaces ``dest`` (mode 0644).

    Args:
        address: the peer's ``(host, port)``.
        token: the job's shared secret (the server's).
        job: the job's id.
        rank: the global rank whose slot to fetch.
        step: the step it must hold.
        dest: where the slot goes (e.g. ``<checkpoint folder>/rank-<R>.slot0``); its
            folder must exist.
        timeout: seconds the connection, the reply and each receive may wait.

    Returns:
        The bytes fetched (the slot's used bytes).

    Raises:
        ReplicaError: the connection failed or timed out; the server refused (its error
            quoted, e.g. it holds no such slot); the slot was torn; it fails its checks;
            ``dest``'s folder cannot hold it. The temporary file is removed and ``dest``
            left as it was.
        ValueError: a bad token, job, rank or step (:class:`~.wire.ReplicaWireError`).
    """
    request = encode_request(Request(Op.GET, job, token, rank, step))
    what = f"rank {rank} step {step} from {_where(address)}"
    tmp = dest.parent / f".{dest.name}.fetch-{secrets.token_hex(8)}"
    placed = False
    try:
        try:
            sock = connect(address, timeout)
        except OSError as exc:
            raise ReplicaError(f"cannot fetch {what}: cannot connect: {exc}", address, rank,
                               step) from exc  # fmt: skip
        with sock:
            stream = Stream(sock, timeout)
            try:
                stream.send(request)
                reply = decode_reply(stream.read_line(timeout, MAX_LINE))
                if not reply.ok:
                    raise ReplicaError(f"cannot fetch {what}: refused: {reply.error}", address,
                                       rank, step)  # fmt: skip
                if reply.nbytes < HEADER_SIZE:
                    raise ReplicaWireError(f"a slot of {reply.nbytes} bytes")
                _check_room(dest.parent, reply.nbytes)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
                try:
                    _receive(stream, fd, reply.nbytes)
                finally:
                    os.close(fd)
                trailer = decode_trailer(stream.read_line(timeout, MAX_LINE))
            except (OSError, ValueError, SinkError) as exc:  # wire, LineTooLong
                raise ReplicaError(f"cannot fetch {what}: failed: {exc}", address, rank,
                                   step) from exc  # fmt: skip
        if not trailer.commit:
            raise ReplicaError(f"cannot fetch {what}: torn: the slot was rewritten while it "
                               "was sent", address, rank, step)  # fmt: skip
        try:
            checked = verified_step(tmp, rank, job)
            os.chmod(tmp, _FILE_MODE)
            if checked is not None and checked[1] == step:
                os.replace(tmp, dest)
                placed = True
        except OSError as exc:
            raise ReplicaError(f"cannot fetch {what}: {exc}", address, rank, step) from exc
        if not placed:
            why = ("fails its checks (header, table, manifest or a chunk's crc32)"
                   if checked is None else f"holds step {checked[1]}")  # fmt: skip
            raise ReplicaError(f"cannot fetch {what}: the slot received {why}", address, rank,
                               step)  # fmt: skip
    finally:
        if not placed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return reply.nbytes
