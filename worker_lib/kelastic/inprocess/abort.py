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

Caveat: TCP connections the training code itself opened during the iteration (a data
service, say) are shut down too.

NCCL (GPU): ``torch.distributed.distributed_c10d._abort_process_group()`` aborts the
communicators of all groups (NVIDIA's ``AbortTorchDistributed`` does the same).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
from typing import Any, Final

from kelastic import contract

__all__ = [
    "abort_nccl",
    "destroy_process_groups",
    "keep_store",
    "nccl_in_use",
    "shutdown_connections",
    "snapshot",
]

_FD_DIR: Final = "/proc/self/fd"


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
    """Shut down (``SHUT_RDWR``) the TCP connections opened since ``before`` was taken.

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
    count = 0
    for fd in _new_socket_fds(before):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not a socket after all
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # a listener: gloo aborts the process if it fails
            local = sock.getsockname()[1]
            try:
                peer = sock.getpeername()[1]
            except OSError:
                continue  # not connected (yet, or any more)
            if port is not None and (local == port or (peer == port and not store_clients)):
                continue  # the TCPStore's server (or its clients, when asked)
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.close()  # closes the duplicate only
    return count


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
