"""The replication server: a sidecar's TCP port where peers put replicas of their ranks'
slots and fetch slots back (the protocol: :mod:`.wire`).

Each connection carries one request and is served on a thread of its own, at most
``max_connections`` at once (more are answered ``busy`` and closed). A request line must
come whole within ``request_timeout`` seconds; a bad token (compared in constant time),
another job or a malformed line is refused and the connection closed, counted by
:class:`RefuseReason`, nothing written.

- **put**: the announced bytes must lie in ``HEADER_SIZE..max_slot_bytes`` (else refused
  before they are read). They are received into a hidden temporary file in the replica
  folder (``.rank-<R>.incoming-<random>``: never a slot name) through a reusable 4 MiB
  buffer, then the trailer; the slot's header must decode and name the request's rank,
  step and this job, be committed, and end exactly at the bytes received, and the
  trailer must say ``commit: true``. Only then the file replaces one of the rank's two
  replica slots (:func:`.slots.replica_target`: never the newer of the two other steps)
  and the put is acknowledged. The payload's checksums are not verified here (a CPU of
  a training node per transfer); a replica is verified in full before it is used.
- **get**: a committed slot of (rank, step) of this job in the node's own slots, else in
  the replicas (headers and commit words only): its used bytes are sent with
  ``sendfile``, then the trailer (``commit: true`` only if its commit word is unchanged
  after they were sent).

A peer that dies, stops sending for ``request_timeout`` seconds mid-transfer, or sends
fewer bytes than it announced leaves nothing behind (the temporary file is removed);
every failure of a connection's thread is logged and counted, never raised.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import logging
import os
import re
import secrets
import socket
import threading
from pathlib import Path
from typing import Final

from kelastic.checkpoint.slot_format import HEADER_SIZE, SlotFormatError

from .slots import REPLICA_DIR_NAME, commit_unchanged, find_committed, read_header, replica_target
from .stream import BUFFER_BYTES, LineTooLong, SinkError, Stream
from .wire import (
    MAX_BYTES,
    MAX_JOB_CHARS,
    MAX_LINE,
    Op,
    ReplicaWireError,
    Reply,
    Request,
    check_token,
    decode_request,
    decode_trailer,
    encode_reply,
    encode_trailer,
    refusal,
)

__all__ = ["RefuseReason", "ReplicaServer"]

log = logging.getLogger("kelastic_sidecar.replica")

#: Mode of the replica folder and of the replica files (the trainers' slots' mode).
_DIR_MODE: Final = 0o755
_FILE_MODE: Final = 0o644
#: A replica being received (hidden: never a slot's name; removed if left at start).
_INCOMING: Final = re.compile(r"\.rank-[0-9]+\.incoming-[0-9a-f]{16}")
#: Seconds the accept thread waits to send ``busy``.
_BUSY_TIMEOUT: Final = 1.0


class RefuseReason(enum.StrEnum):
    """Why a connection was refused or cut (the keys of :attr:`ReplicaServer.refused`)."""

    #: More connections at once than ``max_connections``.
    BUSY = "busy"
    #: A request line, a trailer or the next raw bytes did not come in time.
    TIMEOUT = "timeout"
    #: The peer closed or reset the connection (or it failed) mid-message or mid-transfer.
    PEER_CLOSED = "peer_closed"
    #: A line that is no message of the protocol (or of another version).
    MALFORMED = "malformed"
    #: A request without this server's token.
    TOKEN = "token"
    #: A request for another job.
    JOB = "job"
    #: A put of fewer than a header's bytes or more than ``max_slot_bytes``.
    SIZE = "size"
    #: A put whose slot header does not decode, is not committed or is not the request's.
    HEADER = "header"
    #: The source slot was rewritten while its bytes were read (the trailer said so).
    TORN = "torn"
    #: A get of a (rank, step) this server holds no committed slot of.
    NOT_FOUND = "not_found"
    #: The replica could not be written (no space, an I/O error) or the slot served ended
    #: early.
    STORAGE = "storage"
    #: An unexpected failure of the connection's thread (logged with its traceback).
    ERROR = "error"


class _Refused(Exception):
    def __init__(self, reason: RefuseReason, text: str) -> None:
        super().__init__(text)
        self.reason = reason


class ReplicaServer:
    """Serves puts and gets of checkpoint slots (see the module doc).

    Args:
        directory: the node's checkpoint folder (its trainers' ``rank-<R>.slot<K>``);
            received replicas go in ``directory / "replicas"`` (created, mode 0755, by
            :meth:`start`), as ``rank-<R>.slot0`` and ``rank-<R>.slot1`` (mode 0644),
            so that :func:`kelastic.checkpoint.scan.verified_steps` reads them.
        job: the job's id; requests of another job are refused.
        token: the job's shared secret, 16..128 hex digits (:func:`~.new_token`).
        host: the address to listen on (IPv6 when it holds a ``:``).
        port: the port; 0 picks a free one (:attr:`address` says which).
        max_slot_bytes: the largest put accepted, bytes (a slot's used bytes).
        max_connections: connections served at once; more are answered ``busy``.
        request_timeout: seconds a request line may take to come whole, and the longest
            wait for the next raw bytes, the trailer or a send mid-transfer.

    Attributes:
        refused: connections refused or cut, by reason.
        received: replicas stored; ``received_bytes`` their bytes.
        served: slots sent whole to a get with their commit word unchanged after;
            ``served_bytes`` their bytes.

    Raises:
        ValueError: a bad token, job, size, count or timeout.
    """

    def __init__(self, directory: Path, job: str, token: str, *, host: str = "0.0.0.0",
                 port: int = 0, max_slot_bytes: int, max_connections: int = 4,
                 request_timeout: float = 5.0) -> None:  # fmt: skip
        check_token(token)
        if not 1 <= len(job) <= MAX_JOB_CHARS:
            raise ValueError(f"job must be 1..{MAX_JOB_CHARS} characters")
        if not HEADER_SIZE <= max_slot_bytes <= MAX_BYTES:
            raise ValueError(f"max_slot_bytes {max_slot_bytes} is outside {HEADER_SIZE}..2**40")
        if max_connections < 1 or not request_timeout > 0:
            raise ValueError("max_connections must be >= 1 and request_timeout > 0")
        self.directory = Path(directory)
        self.replica_dir = self.directory / REPLICA_DIR_NAME
        self.job = job
        self._token = token.encode("ascii")
        self._host, self._port = host, port
        self.max_slot_bytes = max_slot_bytes
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.refused: dict[RefuseReason, int] = dict.fromkeys(RefuseReason, 0)
        self.received = self.received_bytes = self.served = self.served_bytes = 0
        self._lock = threading.Lock()  # the counters
        self._placing = threading.Lock()  # a replica slot's choice and replacement
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._address: tuple[str, int] | None = None

    # ------------------------------------------------------------------ counters

    def _refuse(self, reason: RefuseReason) -> None:
        with self._lock:
            self.refused[reason] += 1

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on (the port bound, when 0 was asked).

        Raises:
            RuntimeError: not started.
        """
        if self._address is None:
            raise RuntimeError("the replica server is not started")
        return self._address

    def start(self) -> None:
        """Create the replica folder, listen, and accept on a daemon thread.

        Raises:
            OSError: the folder cannot be made or the address cannot be bound.
        """
        self.replica_dir.mkdir(mode=_DIR_MODE, exist_ok=True)
        os.chmod(self.replica_dir, _DIR_MODE)  # whatever the umask
        for name in os.listdir(self.replica_dir):  # a transfer cut by our last exit
            if _INCOMING.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.replica_dir / name)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, self._port))
            listener.listen(max(8, 2 * self.max_connections))
        except OSError:
            listener.close()
            raise
        name = listener.getsockname()
        self._address = (str(name[0]), int(name[1]))
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="replica-accept", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and close the listening socket (connections being served
        finish on their own threads); idempotent."""
        self._closed.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set() and (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("replica server: accept failed: %s", exc)
                self._closed.wait(0.1)  # EMFILE and the like: no busy loop
                continue
            if not self._slots.acquire(blocking=False):
                self._busy(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="replica-conn",
                                 daemon=True).start()  # fmt: skip
            except RuntimeError:  # no thread to be had
                self._slots.release()
                self._busy(conn)

    def _busy(self, conn: socket.socket) -> None:
        self._refuse(RefuseReason.BUSY)
        with contextlib.suppress(OSError), conn:
            _reply(Stream(conn, _BUSY_TIMEOUT), refusal("busy"))

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                with contextlib.suppress(OSError):  # the trailer and the reply go at once
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stream = Stream(conn, self.request_timeout)
                self._serve_one(stream)
        except Exception:  # never let a connection's thread die silently
            self._refuse(RefuseReason.ERROR)
            log.exception("replica server: a connection failed")
        finally:
            self._slots.release()

    def _serve_one(self, stream: Stream) -> None:
        try:
            self._handle(stream)
            return
        except _Refused as exc:
            reason, text = exc.reason, str(exc)
        except TimeoutError as exc:
            reason, text = RefuseReason.TIMEOUT, f"timed out: {exc}"
        except ConnectionError as exc:  # PeerClosed included
            reason, text = RefuseReason.PEER_CLOSED, f"connection lost: {exc}"
        except (ReplicaWireError, LineTooLong) as exc:
            reason, text = RefuseReason.MALFORMED, str(exc)
        except SinkError as exc:
            reason, text = RefuseReason.STORAGE, str(exc)
        except OSError as exc:  # the files' failures are refusals above: the socket's
            reason, text = RefuseReason.PEER_CLOSED, f"connection failed: {exc}"
        self._refuse(reason)
        log.warning("replica server: refused a connection from %s (%s): %s",
                    _peer(stream), reason.value, text)  # fmt: skip
        if not stream.answered and reason is not RefuseReason.PEER_CLOSED:
            with contextlib.suppress(OSError):
                _reply(stream, refusal(text))

    def _handle(self, stream: Stream) -> None:
        req = decode_request(stream.read_line(self.request_timeout, MAX_LINE))
        if not hmac.compare_digest(req.token.encode("ascii"), self._token):
            raise _Refused(RefuseReason.TOKEN, "bad token")
        if req.job != self.job:
            raise _Refused(RefuseReason.JOB, f"this server serves another job, not {req.job!r}")
        if req.op is Op.PUT:
            self._put(stream, req)
        else:
            self._get(stream, req)

    def _put(self, stream: Stream, req: Request) -> None:
        size = req.nbytes
        if not HEADER_SIZE <= size <= self.max_slot_bytes:
            why = f"{size} bytes is outside {HEADER_SIZE}..{self.max_slot_bytes}"
            raise _Refused(RefuseReason.SIZE, why)
        tmp = self.replica_dir / f".rank-{req.rank}.incoming-{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        except OSError as exc:
            raise _Refused(RefuseReason.STORAGE, f"cannot create a replica: {exc}") from None
        placed = False
        try:
            try:
                os.fchmod(fd, _FILE_MODE)
                os.posix_fallocate(fd, 0, size)  # no space: refused before the bytes
            except OSError as exc:
                raise _Refused(RefuseReason.STORAGE, f"cannot hold {size} bytes: {exc}") from None
            stream.recv_to_fd(fd, size, bytearray(min(BUFFER_BYTES, size)))
            trailer = decode_trailer(stream.read_line(self.request_timeout, MAX_LINE))
            if not trailer.commit:
                raise _Refused(RefuseReason.TORN, "the source slot was rewritten while it was sent")
            self._check_header(fd, req)
            with self._placing:
                target = replica_target(self.replica_dir, self.job, req.rank, req.step)
                try:
                    os.replace(tmp, target)
                except OSError as exc:
                    raise _Refused(RefuseReason.STORAGE, f"cannot place it: {exc}") from None
            placed = True
        finally:
            os.close(fd)
            if not placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        with self._lock:
            self.received += 1
            self.received_bytes += size
        log.info("replica server: stored rank %d step %d (%d bytes) as %s", req.rank, req.step,
                 size, target.name)  # fmt: skip
        _reply(stream, Reply(True, nbytes=size))

    def _check_header(self, fd: int, req: Request) -> None:
        try:
            h = read_header(fd)
        except (OSError, SlotFormatError) as exc:
            raise _Refused(RefuseReason.HEADER, f"the slot's header: {exc}") from None
        wrong = [f"{name} {got!r} (not {want!r})" for name, got, want in (
            ("rank", h.rank, req.rank), ("step", h.step, req.step), ("job", h.job, self.job),
            ("file size", h.layout.file_size, req.nbytes)) if got != want]  # fmt: skip
        if not h.seq:
            wrong.append("not committed")
        if wrong:
            raise _Refused(RefuseReason.HEADER, "the slot's header has " + ", ".join(wrong))

    def _get(self, stream: Stream, req: Request) -> None:
        found = find_committed((self.directory, self.replica_dir), self.job, req.rank, req.step)
        if found is None:
            raise _Refused(RefuseReason.NOT_FOUND,
                           f"no committed slot of rank {req.rank} step {req.step}")  # fmt: skip
        file, header = found
        with file:
            size = header.layout.file_size
            _reply(stream, Reply(True, nbytes=size))
            sent = stream.send_file(file, 0, size)
            if sent != size:
                raise _Refused(RefuseReason.STORAGE, f"the slot ended after {sent} of {size} bytes")
            commit = commit_unchanged(file.fileno(), header)
            if commit:
                with self._lock:
                    self.served += 1
                    self.served_bytes += size
                stream.send(encode_trailer(commit))
                return
            self._refuse(RefuseReason.TORN)  # one refusal per connection: this one
            log.warning("replica server: rank %d step %d was rewritten while it was sent",
                        req.rank, req.step)  # fmt: skip
            # the fetcher may have seen the rewrite in the bytes (sendfile sends the page
            # cache as it is when the bytes leave, not when it was called) and left
            # already: a trailer it does not read is no second refusal
            with contextlib.suppress(OSError):
                stream.send(encode_trailer(commit))


def _reply(stream: Stream, reply: Reply) -> None:
    """Send ``reply`` (the connection is :attr:`~.stream.Stream.answered` from then on).

    Raises:
        OSError: the connection failed or stalled.
    """
    stream.answered = True
    stream.send(encode_reply(reply))


def _peer(stream: Stream) -> str:
    try:
        host, port = stream.sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"
