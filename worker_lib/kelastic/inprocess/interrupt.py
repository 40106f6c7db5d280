"""Delivering an abort into the main thread, except inside ``atomic()`` (stdlib only).

The monitor thread cannot stop the main thread directly; CPython lets it schedule an
exception in it (``PyThreadState_SetAsyncExc``), raised at the main thread's next
bytecode boundary: a pure-Python loop stops at once, a thread blocked in C code (a gloo
collective, ``time.sleep``) only when that call returns, which is why the connections are
shut down first (:mod:`kelastic.inprocess.abort`). Semantics from NVIDIA's monitor thread
and ``CallWrapper.atomic()``: the termination procedure does not start while the main
thread is in an atomic section, and an atomic section does not start while it runs.

An asynchronous exception is a blunt tool: raised inside Python code that C++ called
(a module being imported, a callback without an error path), it ends the process
(``terminate called after throwing an instance of 'python_error'``: measured with torch's
import). So it is the last resort: the teardown comes first and usually makes the main
thread leave by itself (its collective fails); only if it has not left
:data:`DELIVERY_GRACE` seconds later, and is not importing a module, is
:class:`RestartAbort` scheduled (the monitor retries each tick until it is safe).

One lock orders the two threads. The invariants: an asynchronous exception is scheduled
only while the wrapped function runs and no atomic section is open (``depth == 0``), both
checked under the lock; the main thread changes ``depth`` only under the lock. So an
exception can be pending only outside atomic sections; ``enter()`` cancels one that is
pending (and raises :class:`RestartAbort` itself), so it cannot land inside the section;
``stop()`` cancels one still pending when the function has already left.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from typing import Final

from kelastic.inprocess.errors import RestartAbort

__all__ = ["DELIVERY_GRACE", "AbortGuard"]

#: Seconds between the teardown and the asynchronous :class:`RestartAbort`: time for a
#: main thread released from a collective to leave with the collective's own error.
DELIVERY_GRACE: Final = 0.05

_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


def _schedule(thread_id: int, exc: type[BaseException] | None) -> None:
    # The exception class is passed by address (it lives as long as this module) and
    # NULL cancels a pending one; CPython takes its own reference.
    _set_async_exc(thread_id, None if exc is None else id(exc))


def _importing(thread_id: int) -> bool:
    """Whether the thread is executing an import (its stack has importlib's frames)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class AbortGuard:
    """Who may interrupt the main thread, and when.

    Args:
        teardown: shuts down the connections so the main thread and the peers waiting
            on it return from blocked collectives; called when the abort is requested
            (or when the atomic section it waited for ends), and again on each
            :meth:`poll` until the function has left.
        grace: seconds between the teardown and the asynchronous exception.
    """

    def __init__(self, teardown: Callable[[], None], grace: float = DELIVERY_GRACE) -> None:
        self._lock = threading.Lock()
        self._teardown = teardown
        self._grace = grace
        self._thread_id = threading.get_ident()
        self._running = False
        self._depth = 0
        self._requested = False  # an abort was asked for this call of the function
        self._pending = False  # ... and waits for the atomic section to end
        self._deliver_at: float | None = None  # ... and will be scheduled then
        self._in_flight = False  # ... and was scheduled or raised
        self._torn_down = False

    @property
    def requested(self) -> bool:
        """Whether an abort was asked since the last :meth:`start`."""
        return self._requested

    @property
    def delivering(self) -> bool:
        """Whether an asynchronous exception waits to be scheduled (poll soon)."""
        return self._deliver_at is not None

    def start(self) -> None:
        """The main thread enters the wrapped function (call in the main thread)."""
        with self._lock:
            self._thread_id = threading.get_ident()
            self._running = True
            self._depth = 0
            self._requested = self._pending = self._in_flight = self._torn_down = False
            self._deliver_at = None

    def stop(self) -> None:
        """The wrapped function has left (call in the main thread, idempotent): no abort is
        delivered from now on and one still pending is cancelled. If the pending one lands
        first, it is raised here; call again then."""
        with self._lock:
            self._running = False
            self._depth = 0
            self._pending = False
            self._deliver_at = None
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
        """Abort the running function (monitor thread): tear down now and schedule
        :class:`RestartAbort` after the grace, or do both when the open atomic section
        ends.

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
            self._start_delivery()
        return True

    def poll(self) -> None:
        """Monitor thread, each tick: schedule a due exception when it is safe; while an
        aborted function has not left, tear down again (connections made meanwhile)."""
        with self._lock:
            if not self._running:
                return
            if self._deliver_at is not None and time.monotonic() >= self._deliver_at:
                if not _importing(self._thread_id):
                    self._deliver_at = None
                    self._in_flight = True
                    _schedule(self._thread_id, RestartAbort)
            elif self._in_flight or self._deliver_at is not None:
                self._teardown()

    def _start_delivery(self) -> None:
        # Under the lock: no atomic section starts during the teardown.
        if not self._torn_down:
            self._torn_down = True
            self._teardown()
        self._deliver_at = time.monotonic() + self._grace

    def enter(self) -> None:
        """Open an atomic section (main thread).

        Raises:
            RestartAbort: the termination procedure already started (a scheduled
                exception is cancelled and raised here instead, before the section).
        """
        with self._lock:
            if self._in_flight or self._deliver_at is not None:
                if self._in_flight:
                    _schedule(self._thread_id, None)
                self._deliver_at = None
                self._in_flight = True
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
