"""Unix socket addresses for paths longer than ``sun_path`` allows (108 bytes on Linux).

Run dirs can be deep (local mode under ``$TMPDIR``, test temp dirs), so the control
socket's path may not fit in a ``sockaddr_un``. :func:`unix_address` then goes through
``/proc/self/fd/<dirfd>/<name>``, which Linux resolves for ``bind`` and ``connect`` while
the directory fd is open; the socket file itself stays where the contract says.
:func:`free_port` picks a free TCP port (the one picker of the sidecar and the operator).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

#: Longest path that fits in ``sockaddr_un.sun_path`` with its NUL terminator (Linux).
MAX_UNIX_PATH = 107


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """Yield an address for ``bind``/``connect`` that reaches ``path``.

    Args:
        path: the socket file's path; its parent directory must exist.

    Raises:
        OSError: the parent directory cannot be opened (e.g. it does not exist).
    """
    text = os.fspath(path)
    if len(os.fsencode(text)) <= MAX_UNIX_PATH:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def listen_unix(path: Path, mode: int, backlog: int) -> socket.socket:
    """A listening unix stream socket at ``path``, replacing a stale socket file, with
    access ``mode`` (chmod, not umask's) and ``backlog`` pending connections.

    Raises:
        OSError: the socket cannot be created or bound (e.g. the directory is missing).
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(path) as address:
            listener.bind(address)
        os.chmod(path, mode)
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


def close_unix(listener: socket.socket | None, path: Path) -> None:
    """Close a listening socket of :func:`listen_unix` (None: none) and remove its file at
    ``path`` (already gone: fine); a thread blocked in its ``accept`` wakes. Never raises
    ``OSError``."""
    if listener is not None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago: bound to port 0, then released.

    The one port picker of the product: a round's c10d store (group rank 0's sidecar,
    fresh each round so that a restarted round never meets a stale store,
    pytorch/pytorch#135712), the next in-process iteration's store, local mode's etcd
    and HTTP ports. Another process may take the port before it is bound again.

    Args:
        host: an address of this host (IPv4, or IPv6 when it holds a ``:``).

    Raises:
        OSError: ``host`` is not an address of this host.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
