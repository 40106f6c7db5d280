"""Tearing down a rank's process groups so that blocked collectives return.

torch is never imported here: it is used only when the training code imported it already
(``sys.modules``), and every call into it is guarded (a broken or half-destroyed process
group must not stop the restart).

Gloo (CPU): ``ProcessGroupGloo.abort()`` and ``shutdown()`` do not release a rank blocked
in a collective, neither this one nor its peers (measured, torch 2.13). Closing the
connections does: a ``shutdown(SHUT_RDWR)`` of gloo's TCP sockets makes this rank's
pending operation fail within milliseconds ("Connection closed by peer"), and the peers
waiting on this rank fail too. A peer is released only when the rank it waits on shuts
down, which is why every rank tears down its own connections on an abort. The sockets
are found by difference: :func:`snapshot` lists the process's socket inodes before the
iteration; :func:`shutdown_connections` shuts the TCP connections made since, except

- listening sockets (gloo's listener: shutting it down makes gloo abort the process with
  ``gloo::EnforceNotMet``),
- the ``TCPStore`` server's side of its connections (local port ``MASTER_PORT``): the
  server stays intact,
- anything not ``AF_INET``/``AF_INET6`` (the sidecar's unix socket, pipes).

The ``TCPStore`` *clients* (peer port ``MASTER_PORT``) are shut down: a rank blocked in
``init_process_group`` waiting for a rank that faulted before joining then fails at once
(``DistNetworkError``) instead of at the store's timeout (measured, torch 2.13: released
within milliseconds, the process unharmed).

Except inside the ``TCPStore`` constructor's connect, validate and ping: there a
``DistNetworkError`` (a refused connect, a connection shut down or closed) is *retried*
until the store's timeout (``init_process_group``'s, 30 minutes by default). So a rank
that is still connecting when the store's host (rank 0) leaves the iteration, its store
destroyed, retries a port nobody listens on for 30 minutes (seen with a round change
1 s after the ``go``, on Kubernetes: py-spy showed the main thread in
``SocketConnectOp::tryConnect`` under ``TCPStore::TCPStore`` under
``init_process_group``, the host already waiting for the next ``go``, until the sidecar's
hard timeout killed it). The host therefore keeps a store listening at the aborted
iteration's address (:func:`keep_store`) until the next ``go`` (every rank has left the
aborted iteration then): the connecting rank's retry succeeds, its
``init_process_group`` goes on to wait for keys that never come, on a connection this
teardown (repeated until the function left) shuts down: released at its next retry
(torch's backoff, a fraction of a second unless it was refused for long before; 20-30 ms
measured when the rank joined after the host had left). A rank connecting to a host
that is gone (its node lost) still waits for the store's timeout or the sidecar's hard
timeout.

Before the shutdown, a connection on which a peer's send to this rank is half written is
*drained* (:data:`DRAIN_LIMIT`), and this rank's own sends are waited for until the
peers have them (:data:`SEND_LIMIT`; a peer that sees this rank's shutdown while this rank's send to
it is half written closes the connection with bytes unread, and that send is the one
left waiting): gloo's ``Pair::signalException`` fails the operations a
pair has queued, but not an unbound-buffer send already in its write queue, so a peer
whose ring send to this rank waits for room when this rank's FIN (the shutdown) or RST
(the process group destroyed with bytes unread) arrives waits for that send until the
process group's timeout (30 minutes by default). Seen with two ranks raising at once
(1 run in 7 of the digits job; 1 in 6 of a 4-rank DDP loop): a third rank's collective
failed on a raiser's closed connection, gloo dropped its receive buffers and stopped
reading the connection from the fourth rank, whose ring send then filled the window;
the fourth rank stayed in ``loss.backward()`` (DDP's ``finalize_backward`` waiting on
that send) until the sidecar's hard timeout killed it. gloo never reads such a
connection again (its next read needs the dropped buffer), so bytes that stay unread
are safe to drop: they are read and dropped until the peer has been quiet for
:data:`DRAIN_QUIET` seconds, and its send completes. The store's connections are never
drained.

Caveat: TCP connections the training code itself opened during the iteration (a data
service, say) are shut down too.

NCCL (GPU): ``torch.distributed.distributed_c10d._abort_process_group()`` aborts the
communicators of all groups (NVIDIA's ``AbortTorchDistributed`` does the same).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import gc
import os
import select
import socket
import struct
import sys
import termios
import time
from typing import Any, Final

from kelastic import contract

__all__ = [
    "DRAIN_LIMIT",
    "DRAIN_QUIET",
    "SEND_LIMIT",
    "abort_nccl",
    "destroy_process_groups",
    "keep_store",
    "nccl_in_use",
    "shutdown_connections",
    "snapshot",
]

_FD_DIR: Final = "/proc/self/fd"
#: Seconds a teardown spends at most dropping what peers still send on connections gloo
#: stopped reading (module docstring).
DRAIN_LIMIT: Final = 3.0
#: Seconds without a byte from such a peer that end its drain: its send completed (a
#: peer's gloo thread, descheduled on a busy machine, may pause that long mid-send).
DRAIN_QUIET: Final = 0.2
#: Seconds a teardown waits at most for its own sends to reach their peers (a working
#: peer takes them in milliseconds; a stopped one's full window is not waited out).
SEND_LIMIT: Final = 0.5
#: Seconds between the two looks that tell a stopped reader (bytes still unread) from a
#: working one (it reads them within microseconds).
_DRAIN_LOOK: Final = 0.02


def snapshot() -> frozenset[str]:
    """The process's open sockets now, as ``/proc/self/fd`` link targets
    (``"socket:[<inode>]"``): inodes, unlike fd numbers, are not reused."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found.add(target)
    return frozenset(found)


def _new_socket_fds(before: frozenset[str]) -> list[int]:
    fds: list[int] = []
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:") and target not in before:
                    fds.append(int(name))
    return fds


def _store_port() -> int | None:
    with contextlib.suppress(ValueError):
        return int(os.environ.get(contract.MASTER_PORT, ""))
    return None


def shutdown_connections(
    before: frozenset[str], store_port: int | None = None, store_clients: bool = True
) -> int:
    """Shut down (``SHUT_RDWR``) the TCP connections opened since ``before`` was taken,
    after draining those whose peer is sending into a connection gloo stopped reading
    (module docstring; at most :data:`DRAIN_LIMIT` seconds).

    The descriptors stay open (their owner, gloo, closes them when the process group is
    destroyed): each one is duplicated, the duplicate shut down and closed. Safe to call
    from any thread and more than once. Never raises.

    Args:
        before: :func:`snapshot` taken before the process groups were made.
        store_port: the ``TCPStore``'s port (its server side is left alone); default
            ``$MASTER_PORT``.
        store_clients: shut down the connections to the store too.

    Returns:
        How many connections were shut down.
    """
    port = store_port if store_port is not None else _store_port()
    targets: list[socket.socket] = []
    drainable: list[socket.socket] = []
    try:
        for fd in _new_socket_fds(before):
            sock = _connection(fd, port, store_clients)
            if sock is not None:
                targets.append(sock)
                if port is None or sock.getpeername()[1] != port:
                    drainable.append(sock)  # never the store's: its client reads late
        _drain_stopped(drainable)
        _await_sent(drainable)
        count = 0
        for sock in targets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        return count
    except OSError:
        return 0
    finally:
        for sock in targets:
            sock.close()  # closes the duplicate only


def _connection(fd: int, port: int | None, store_clients: bool) -> socket.socket | None:
    """A duplicate of ``fd`` when it is a connected TCP socket to shut down (not a
    listener, not the store's server side, not a store client unless ``store_clients``),
    else None (nothing left open)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None  # closed meanwhile, or not a socket after all
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(
            socket.SOL_SOCKET,
            socket.SO_ACCEPTCONN,  # a listener: gloo aborts if it fails
        ):
            local, peer = sock.getsockname()[1], sock.getpeername()[1]
            if port is None or not (local == port or (peer == port and not store_clients)):
                return sock
    except OSError:
        pass  # not connected (yet, or any more)
    sock.close()
    return None


def _unread(sock: socket.socket) -> int:
    """Bytes received on ``sock`` and not read yet (0 when that cannot be told)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", raw)[0])


def _unsent(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that its peer has not acknowledged yet (0 when that
    cannot be told)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", raw)[0])


def _await_sent(socks: list[socket.socket]) -> None:
    """Wait (at most :data:`SEND_LIMIT` seconds) until what this rank writes on
    ``socks`` has reached the peers: nothing unacknowledged at two looks 5 ms apart
    (between them gloo writes what waited in its queue for room). A send of this rank
    still half written when the peer sees the shutdown is the peer's reset away: the
    peer's gloo closes the connection with our bytes unread, and that send never ends
    here (module docstring). Nothing to wait for without connections: the monitor's
    teardown, repeated each tick while the function has not left, holds the lock the
    main thread's leaving takes (it cost 5 ms a tick)."""
    if not socks:
        return
    deadline = time.monotonic() + SEND_LIMIT
    quiet = 0
    while time.monotonic() < deadline:
        quiet = quiet + 1 if not any(_unsent(s) for s in socks) else 0
        if quiet == 2:
            return
        time.sleep(0.005)


def _drain_stopped(socks: list[socket.socket]) -> int:
    """Read and drop what peers send on the connections among ``socks`` whose reader
    stopped: bytes unread at two looks a few milliseconds apart (a working gloo reads
    them within microseconds). They are read until every such peer was quiet for
    :data:`DRAIN_QUIET` seconds or closed, or :data:`DRAIN_LIMIT` passed.

    Returns:
        The bytes dropped.
    """
    first = {sock: _unread(sock) for sock in socks}
    if not any(first.values()):
        return 0
    time.sleep(_DRAIN_LOOK)
    stopped = {s.fileno(): s for s in socks if first[s] and _unread(s) >= first[s]}
    poller = select.poll()
    for fd in stopped:
        poller.register(fd, select.POLLIN)
    dropped = 0
    deadline = time.monotonic() + DRAIN_LIMIT
    while stopped and time.monotonic() < deadline:
        for fd, sock in list(stopped.items()):
            while True:
                try:
                    data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:  # the peer closed (or reset) it: nothing more to drop
                    poller.unregister(fd)
                    del stopped[fd]
                    break
                dropped += len(data)
        if stopped and not poller.poll(DRAIN_QUIET * 1000):
            break  # quiet: the peers' sends completed
    return dropped


def _dist() -> Any:
    """``torch.distributed`` if the training code imported it, else None. Never imports
    (from the monitor thread, an import racing the main thread's import of torch ends
    in a crash) and never returns a module still being imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or "torch.distributed.distributed_c10d" not in sys.modules:
        return None
    spec = getattr(dist, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    try:
        return dist if dist.is_available() else None
    except Exception:
        return None


def nccl_in_use(dist: Any = None) -> bool:
    """Whether the default process group has a NCCL backend (False when torch is not
    imported, not initialized, or the question fails)."""
    dist = dist if dist is not None else _dist()
    if dist is None:
        return False
    try:
        if not dist.is_initialized():
            return False
        return "nccl" in str(dist.get_backend()).lower()
    except Exception:
        return False


def abort_nccl(dist: Any = None) -> bool:
    """Abort all NCCL communicators (``_abort_process_group()``), when NCCL is in use and
    torch has that function. Returns whether it was called; never raises."""
    dist = dist if dist is not None else _dist()
    if dist is None or not nccl_in_use(dist):
        return False
    c10d = getattr(dist, "distributed_c10d", None)
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return False
    with contextlib.suppress(Exception):
        abort()
    return True


def destroy_process_groups(dist: Any = None, full_gc: bool = False) -> BaseException | None:
    """``torch.distributed.destroy_process_group()`` when a default group exists, then a
    garbage collection of the young generations (``full_gc``: of everything, until
    nothing is left, as NVIDIA's wrapper does; with torch loaded that takes 0.3-0.4 s
    per restart on this machine, and the sidecar gives each iteration a fresh
    ``MASTER_PORT``, so a ``TCPStore`` server left for the collector frees no port the
    next iteration needs).

    Without a default group, c10d's group counter is reset as destroying would reset it:
    an ``init_process_group`` that failed (released by the teardown) has counted its group
    already, and a rank whose counter is ahead names its next default group differently
    (``default_pg/1`` instead of ``0``): its peers then wait for each other's gloo keys
    for ever (measured, torch 2.13).

    Returns:
        The exception destroying raised (for a ``abort_failed`` fault), or None.
    """
    dist = dist if dist is not None else _dist()
    error: BaseException | None = None
    if dist is not None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            else:
                world: Any = getattr(dist.distributed_c10d, "_world", None)
                if isinstance(getattr(world, "group_count", None), int):
                    world.group_count = 0
        except Exception as exc:
            error = exc
    if full_gc:
        while gc.collect():
            pass
    else:
        gc.collect(1)
    return error


def keep_store(dist: Any = None) -> Any:
    """On the store's host (``RANK`` 0): a ``TCPStore`` server listening at
    ``MASTER_ADDR:MASTER_PORT`` again, for the ranks still connecting to the aborted
    iteration's store (see the module docstring). Call it after
    :func:`destroy_process_groups`; keep the result until every rank left the iteration
    (the next ``go``), then drop it (its server stops).

    Returns:
        The store, or None: not the host, torch not in use, the port taken (the
        iteration's own store is still alive: nothing to replace) or any failure.
        Never raises.
    """
    dist = dist if dist is not None else _dist()
    if dist is None or os.environ.get(contract.RANK, "0") != "0":
        return None
    port, host = _store_port(), os.environ.get(contract.MASTER_ADDR)
    if port is None or not host:
        return None
    try:
        return dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=30),
                             wait_for_workers=False)  # fmt: skip
    except Exception:
        return None
