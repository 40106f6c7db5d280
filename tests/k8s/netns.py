"""Network namespaces for the test node: run a function inside one from a thread of this
process, so that a socket it creates lives there (``setns(2)`` moves only the calling
thread; a socket stays in the namespace it was created in).

Python 3.11 has no ``os.setns``: this calls libc's through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(path: str, fn: Callable[[], T]) -> T:
    """``fn()`` called in a fresh thread that has entered the network namespace ``path``
    (e.g. ``/proc/<pid>/ns/net``); returns its result or raises its exception.

    Raises:
        OSError: the namespace cannot be entered (not root, gone).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    # the thread ends after fn: its namespace goes with it, nothing else is moved
    thread = threading.Thread(target=run, name="in-netns", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
