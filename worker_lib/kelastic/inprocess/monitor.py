"""The worker's monitor thread and progress clock (stdlib only).

Semantics from NVIDIA's ``MonitorThread`` and ``ProgressWatchdog``, with the decisions
moved to the sidecar: the thread reads the coordinator's messages, starts the abort of a
running iteration on ``abort`` (and ``give_up``), hands every message to the main thread,
and reports a *soft timeout* (``fault`` with cause ``soft_timeout``) when the iteration
made no progress for ``soft_timeout`` seconds, or at once when an
:func:`kelastic.timer.expires` timer the rank holds has expired (its peers blocked in a
collective on a hung rank hold expired timers too: they leave in process, while the
timer server's grace keeps it from reaping them). Progress is a ``CallWrapper.ping()`` or
a :func:`kelastic.timer.expires` acquire; the clock starts when the iteration is entered.
The thread also sends a :class:`~kelastic.inprocess_messages.Beat` every
:func:`~kelastic.inprocess_messages.beat_interval` seconds: a process stopped as a whole
(SIGSTOP) or whose interpreter does not run cannot report its own soft timeout, and the
sidecar faults a rank whose beats stopped for the soft timeout on its behalf.
The *hard timeout* is the sidecar's: it kills a rank that did not reach the termination
barrier within ``hard_timeout`` seconds of the abort; before that, a rank that has not
left an aborted iteration after a few seconds writes its threads' stacks to stderr
(:mod:`kelastic.inprocess.stuck`).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable

from kelastic.inprocess.client import Closed, Connection
from kelastic.inprocess.interrupt import AbortGuard
from kelastic.inprocess.stuck import LeaveWatch
from kelastic.inprocess_messages import (
    CAUSE_SOFT_TIMEOUT,
    Abort,
    Beat,
    CoordinatorMessage,
    Fault,
    GiveUp,
    Go,
    beat_interval,
)
from kelastic.timer import expired_timer

__all__ = ["Heartbeat", "Monitor"]

Inbox = queue.Queue[CoordinatorMessage | Closed]

#: Seconds between the monitor's checks (soft timeout; the teardown repeated while an
#: aborted function has not left yet), at most; a tenth of the soft timeout if shorter.
TICK = 0.2


class Heartbeat:
    """The current iteration's progress clock.

    Args:
        send_progress: called with the iteration at its first progress (sends
            :class:`~kelastic.inprocess_messages.Progress`).
    """

    def __init__(self, send_progress: Callable[[int], None]) -> None:
        self._lock = threading.Lock()
        self._send_progress = send_progress
        self.iteration = 0
        self.active = False
        self._last = time.monotonic()
        self._sent = True
        self._stall_reported = True

    def begin(self, iteration: int) -> None:
        """The iteration ``iteration`` is entered: the clock starts now."""
        with self._lock:
            self.iteration = iteration
            self._last = time.monotonic()
            self._sent = False
            self._stall_reported = False
            self.active = True

    def end(self) -> None:
        """The iteration was left: no progress is reported or timed until :meth:`begin`."""
        self.active = False

    def ping(self) -> None:
        """Record progress; the first of an iteration is reported. Never raises."""
        self._last = time.monotonic()
        if self._sent or not self.active:
            return
        with self._lock:
            if self._sent or not self.active:
                return
            self._sent = True
            iteration = self.iteration
        with contextlib.suppress(Exception):
            self._send_progress(iteration)

    def stalled(self, soft_timeout: float) -> int | None:
        """The iteration, once, when it made no progress for ``soft_timeout`` seconds."""
        with self._lock:
            if not self.active or self._stall_reported:
                return None
            if time.monotonic() - self._last < soft_timeout:
                return None
            self._stall_reported = True
            return self.iteration


class Monitor:
    """The thread reading the coordinator's messages.

    Args:
        conn: the connection (this thread is its only reader).
        guard: interrupts the main thread.
        heartbeat: the progress clock.
        soft_timeout: seconds without progress before a ``soft_timeout`` fault.
        local_rank: this worker's ``LOCAL_RANK`` (for the faults it sends).
    """

    def __init__(
        self,
        conn: Connection,
        guard: AbortGuard,
        heartbeat: Heartbeat,
        soft_timeout: float,
        local_rank: int,
    ) -> None:
        self.inbox: Inbox = queue.Queue()
        self._conn = conn
        self._guard = guard
        self._heartbeat = heartbeat
        self._soft_timeout = soft_timeout
        self._local_rank = local_rank
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._abort_target = -1
        self._ended = False  # give_up or closed
        self._give_up = False
        #: says where the main thread is when it does not leave an aborted iteration
        self.leave_watch = LeaveWatch(local_rank)
        self._thread = threading.Thread(target=self._run, name="kelastic-inprocess", daemon=True)

    @property
    def abort_target(self) -> int:
        """The highest iteration an ``abort`` named so far (-1 before any)."""
        return self._abort_target

    def set_local_rank(self, local_rank: int) -> None:
        """The rank this process is now (a promoted spare): its faults and dumps name it."""
        self._local_rank = self.leave_watch.local_rank = local_rank

    @property
    def gave_up(self) -> bool:
        """Whether ``give_up`` arrived."""
        return self._give_up

    def wait_for_abort(self, iteration: int, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for an ``abort`` past ``iteration`` (or a
        ``give_up``, or the end of the connection); return whether one came."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._abort_target <= iteration and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (at most ``timeout`` seconds)."""
        self._stop.set()
        self._conn.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        slow = min(TICK, max(0.01, self._soft_timeout / 10))
        every = beat_interval(self._soft_timeout)
        next_beat = time.monotonic()

        def tick() -> float:
            return 0.01 if self._guard.delivering else slow

        try:
            for item in self._conn.messages(tick, self._stop):
                if item is not None:
                    self._handle(item)
                    if isinstance(item, Closed):
                        return
                if (now := time.monotonic()) >= next_beat:  # the sidecar's proof of life
                    self._conn.send(Beat(local_rank=self._local_rank))
                    next_beat = now + every
                self._guard.poll()
                self._check_progress()
                self.leave_watch.check()
        except Exception as exc:  # a bug here must not leave the main thread waiting
            self.inbox.put(Closed(f"monitor thread failed: {exc!r}"))
            print(f"kelastic.inprocess: monitor thread failed: {exc!r}", file=sys.stderr)

    def _check_progress(self) -> None:
        """Send a ``soft_timeout`` fault, once an iteration, when it made no progress for
        the soft timeout or an :func:`~kelastic.timer.expires` timer of this rank expired
        (the timer server would reap the rank, and its peers blocked on it, soon)."""
        stalled = self._heartbeat.stalled(self._soft_timeout)
        message = f"no progress for {self._soft_timeout:g} s"
        if stalled is None and self._heartbeat.active:
            timer = expired_timer()
            if timer is not None:
                stalled = self._heartbeat.stalled(0.0)
                scope, deadline = timer
                message = (f"timer {scope[:200]!r} expired {time.time() - deadline:.1f} s ago "
                           "(expires() deadline)")  # fmt: skip
        if stalled is not None:
            self._conn.send(Fault(
                iteration=stalled, local_rank=self._local_rank, cause=CAUSE_SOFT_TIMEOUT,
                message=message,
            ))  # fmt: skip

    def _handle(self, item: CoordinatorMessage | Closed) -> None:
        if isinstance(item, Abort):
            with self._lock:
                self._abort_target = max(self._abort_target, item.iteration)
                self._lock.notify_all()
            if item.iteration > self._heartbeat.iteration:
                self._guard.request()
                self.leave_watch.aborted(self._heartbeat.iteration, item.iteration)
        elif isinstance(item, GiveUp):
            self._give_up = True
            self._guard.request()
        elif not isinstance(item, (Go, Closed)):
            return  # Unknown (a newer sidecar): ignored
        if isinstance(item, (GiveUp, Closed)):
            with self._lock:
                self._ended = True
                self._lock.notify_all()
        self.inbox.put(item)
