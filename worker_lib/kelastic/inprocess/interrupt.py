"""Delivering an abort into the main thread, except inside ``atomic()`` (stdlib only).

The monitor thread cannot stop the main thread directly; CPython lets it schedule an
exception in it (``PyThreadState_SetAsyncExc``), raised at the main thread's next
bytecode boundary: a pure-Python loop stops at once, a thread blocked in C code (a gloo
collective, ``time.sleep``) only when that call returns, which is why the connections are
shut down first (:mod:`kelastic.inprocess.abort`). Semantics from NVIDIA's monitor thread
and ``CallWrapper.atomic()``: the termination procedure does not start while the main
thread is in an atomic section, and an atomic section does not start while it runs.

One lock orders the two threads. The invariants: an asynchronous exception is scheduled
only while the wrapped function runs and no atomic section is open (``depth == 0``), both
checked under the lock; the main thread changes ``depth`` only under the lock. So an
exception can be pending only outside atomic sections; ``enter()`` cancels one that is
pending (and raises :class:`RestartAbort` itself), so it cannot land inside the section;
``stop()`` cancels one still pending when the function has already left.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from kelastic.inprocess.errors import RestartAbort

__all__ = ["AbortGuard"]

_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


def _schedule(thread_id: int, exc: type[BaseException] | None) -> None:
    # The exception class is passed by address (it lives as long as this module) and
    # NULL cancels a pending one; CPython takes its own reference.
    _set_async_exc(thread_id, None if exc is None else id(exc))


class AbortGuard:
    """Who may interrupt the main thread, and when.

    Args:
        teardown: called (at most once per :meth:`start`) before the exception is
            scheduled, in whichever thread delivers: shuts down the connections so the
            main thread and the peers waiting on it return from blocked collectives.
    """

    def __init__(self, teardown: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._teardown = teardown
        self._thread_id = threading.get_ident()
        self._running = False
        self._depth = 0
        self._requested = False  # an abort was asked for this call of the function
        self._pending = False  # ... and waits for the atomic section to end
        self._in_flight = False  # ... and was scheduled or raised
        self._torn_down = False

    @property
    def requested(self) -> bool:
        """Whether an abort was asked since the last :meth:`start`."""
        return self._requested

    def start(self) -> None:
        """The main thread enters the wrapped function (call in the main thread)."""
        with self._lock:
            self._thread_id = threading.get_ident()
            self._running = True
            self._depth = 0
            self._requested = self._pending = self._in_flight = self._torn_down = False

    def stop(self) -> None:
        """The wrapped function has left (call in the main thread, idempotent): no abort is
        delivered from now on and one still pending is cancelled. If the pending one lands
        first, it is raised here; call again then."""
        with self._lock:
            self._running = False
            self._depth = 0
            self._pending = False
            if self._in_flight:
                _schedule(self._thread_id, None)

    def tear_down(self) -> None:
        """Run ``teardown`` unless it ran since :meth:`start` (any thread)."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._teardown()

    def request(self) -> bool:
        """Abort the running function (monitor thread): tear down and schedule
        :class:`RestartAbort` now, or when the open atomic section ends.

        Returns:
            False when the function is not running (nothing to interrupt).
        """
        with self._lock:
            if not self._running or self._requested:
                return self._running
            self._requested = True
            if self._depth > 0:
                self._pending = True
                return True
            self._in_flight = True
            if not self._torn_down:
                self._torn_down = True
                self._teardown()  # under the lock: no atomic section starts meanwhile
            _schedule(self._thread_id, RestartAbort)
        return True

    def enter(self) -> None:
        """Open an atomic section (main thread).

        Raises:
            RestartAbort: the termination procedure already started (the scheduled
                exception is cancelled and raised here instead, before the section).
        """
        with self._lock:
            if self._in_flight:
                _schedule(self._thread_id, None)
                raise RestartAbort("aborted before an atomic section")
            self._depth += 1

    def exit(self) -> None:
        """Close an atomic section (main thread).

        Raises:
            RestartAbort: an abort arrived during the section (after tearing down).
        """
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth or not self._pending:
                return
            self._pending = False
            self._in_flight = True
            teardown = not self._torn_down
            self._torn_down = True
        if teardown:
            self._teardown()
        raise RestartAbort("aborted after an atomic section")
