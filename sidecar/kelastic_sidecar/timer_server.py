"""The expiration-timer server: reads timer requests from a FIFO and reaps hung workers.

Semantics from ``torch.distributed.elastic.timer.FileTimerServer``: workers send
``{"version": 1, "pid", "scope_id", "expiration_time", "signal"}`` JSON lines (see
:mod:`kelastic.timer`); a timer is keyed by ``(pid, scope_id)``, a negative
``expiration_time`` releases it, and when timers of a pid have expired the server sends
that pid the signal of its earliest expired timer whose signal is > 0, then clears all
of that pid's timers. Expired timers whose signals are all 0 just expire (no kill).

Differences from torch, each for a reason:

- Event-driven: one thread polls the FIFO and a self-pipe, with a timeout that ends at
  the earliest deadline (a heap with lazy deletion); no polling interval. The sleep is
  capped at :data:`MAX_SLEEP` seconds so that a step of the wall clock (deadlines are
  ``time.time()`` values) is noticed. ``poll`` counts whole milliseconds, so it is
  asked to wake at or before the deadline and the last fraction of a millisecond is
  slept with ``time.sleep`` (nanosecond resolution): the kill leaves on time, not up
  to 1 ms late. The self-pipe only wakes the thread for
  :meth:`TimerServer.stop`: watch/forget never make a deadline earlier, so they need
  no wakeup (a forgotten timer's heap entry is skipped when reached).
- The server never kills itself after a reap and keeps serving.
- Only pids passed to :meth:`TimerServer.watch_pid` are ever signalled. Timers of other
  pids are accepted into the table (bounded by ``max_timers``), so a worker that
  acquires before the supervisor has watched its pid is covered as long as the pid is
  watched before the timer expires; an expired timer of an unwatched pid is dropped and
  counted in ``unknown_pid``. Kills happen under the table lock, so once
  :meth:`TimerServer.forget_pid` returns that pid is never signalled: the supervisor
  must forget a worker's pid as soon as it exits, before the pid can be reused.
- Timers of a pid whose expired timers all have signal 0 are not cleared (torch clears
  all of that pid's timers even when it does not kill).
- Hostile input is counted and skipped: malformed lines, lines over ``PIPE_BUF`` bytes,
  and partial lines left by a writer that closed mid-line. A valid request glued after
  such a fragment is still recovered. Warnings about bad lines are rate limited.
- Budgets: a watched pid has its own budget of ``max_timers_per_pid`` timers; timers of
  unwatched pids share a pool of ``max_timers``. A flood of requests naming other pids
  fills only the pool (acquires beyond it are dropped and counted in
  ``dropped_unwatched``): it can never crowd out a watched worker's timers.
- Fairness under a flood: each loop turn first acts on the deadlines that are due, then
  reads at most :data:`READ_PER_TURN` bytes; while it keeps up it applies lines in
  order, else it applies the lines of watched pids at once (found by
  :func:`~.timer_wire.pid_hint`, then parsed as usual; a pid with a line still queued
  waits behind it, so its requests keep their order) and queues the others, of which it
  applies at most :data:`LINES_PER_TURN` per turn. The queue holds at most
  :data:`MAX_BACKLOG` lines; beyond, lines of unwatched pids are shed (counted in
  ``shed``), so the pipe keeps draining and a watched worker's request is never stuck
  behind a flood. A pid whose line was shed loses the timers it acquired before it was
  watched, when it is watched (a shed release could otherwise leave a stale timer).
- Who may write: the FIFO is created with the mode of ``$KELASTIC_IPC_ACCESS``
  (:func:`~.timer_wire.ipc_access`: the sidecar's user only locally, any user of the
  Pod on Kubernetes). A FIFO tells the reader nothing about the writer (no
  ``SO_PEERCRED``), so what is checked beyond the mode is a *token*: the supervisor puts
  a random ``$KELASTIC_TIMER_TOKEN`` in each worker's env and passes it with the pid to
  :meth:`TimerServer.watch_pid`; kelastic's client sends it in each request. A request
  naming a watched pid with another token is refused (``forged``). A request without a
  token (torch's unmodified ``FileTimerClient``) is accepted for a watched pid until
  that pid has sent its token once; from then on tokenless requests naming it are
  refused and its tokenless timers dropped. What is *not* checked: a process that can
  read the worker's environment (same user: ``/proc/<pid>/environ``; or a descendant,
  which inherits it) can send valid requests for it, and so can anyone for a worker
  that only ever uses torch's client; such a process could signal the worker directly
  anyway. The token keeps out writers that do not share the worker's environment.
- The reader holds a write end of its own FIFO, so it never sees end-of-file when
  writers come and go; writers that open the FIFO per request (torch's client) and
  writers that keep it open (kelastic's client) both work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import hmac
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from signal import SIGKILL
from typing import Final, NamedTuple

from .memory_release import release_memory
from .timer_wire import MAX_LINE as MAX_LINE
from .timer_wire import MAX_PID as MAX_PID
from .timer_wire import MAX_SIGNAL as MAX_SIGNAL
from .timer_wire import Backlog, LineSplitter, _salvage, fifo_mode, ipc_access, pid_hint
from .timer_wire import _BadRequest as _BadRequest
from .timer_wire import _parse as _parse
from .timer_wire import _Request as _Request

__all__ = ["ReapEvent", "TimerServer", "TimerStats"]

log = logging.getLogger("kelastic_sidecar.timer")

#: Longest single sleep of the server thread, seconds.
MAX_SLEEP: Final = 10.0
#: A deadline this close (seconds) after ``poll`` returns is slept to precisely.
FINE_SLEEP: Final = 0.002
#: One warning is logged per this many bad lines (and per this many unknown-pid expiries).
LOG_EVERY: Final = 1000
#: Most bytes read from the FIFO per loop turn (a turn then acts on due deadlines).
READ_PER_TURN: Final = 128 * 1024
#: Most queued lines (of unwatched pids) applied per loop turn.
LINES_PER_TURN: Final = 256
#: Most lines of watched pids applied at once per loop turn (more are queued).
WATCHED_PER_TURN: Final = 1024
#: Most lines queued; beyond, lines of unwatched pids are shed.
MAX_BACKLOG: Final = 65536
#: Most pids remembered as having had a line shed (then every pid counts as such).
_MAX_SHED_PIDS: Final = 65536
_READ_SIZE: Final = 65536


@dataclass(frozen=True)
class ReapEvent:
    """A worker was signalled because its timer expired.

    Attributes:
        pid: the worker's pid.
        scope_id: the expired timer's scope (the earliest expired one with signal > 0).
        signal: the signal sent.
        expiration_time: the timer's deadline, seconds since the epoch.
        reaped_at: when the signal was sent, seconds since the epoch.
        state: the worker's process state just before the signal (``/proc/<pid>/stat``):
            ``T`` stopped, ``t`` stopped by a tracer, ``D`` uninterruptible sleep, ``S``
            sleeping (e.g. blocked in a collective on a hung peer), ``R`` running;
            empty when unknown. A stopped worker is the one that held its peers up.
    """

    pid: int
    scope_id: str
    signal: int
    expiration_time: float
    reaped_at: float
    state: str = ""


def process_state(pid: int) -> str:
    """The state letter of ``pid`` from ``/proc/<pid>/stat`` (``""`` if unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            stat = fp.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(b")") + 2 :].split(maxsplit=1)
    return fields[0].decode(errors="replace") if fields else ""


@dataclass
class TimerStats:
    """Counters of a :class:`TimerServer` since construction (a snapshot).

    Attributes:
        requests: well-formed requests read (acquires and releases).
        acquired: acquires stored in the table (new or replacing a timer).
        released: releases that removed an active timer.
        malformed: lines skipped as malformed (bad JSON, bad fields, partial lines).
        oversized: lines skipped for exceeding ``PIPE_BUF`` bytes.
        unknown_pid: expired timers dropped because their pid was not watched.
        dropped_capacity: acquires dropped because a budget was full (the pid's own, or
            the pool of unwatched pids).
        dropped_unwatched: of those, acquires of unwatched pids (the pool was full).
        forged: requests naming a watched pid refused for a wrong or missing token.
        shed: lines of unwatched pids dropped unread because the queue was full.
        expired: timers that reached their deadline (watched pid or not).
        reaped: successful kills.
        active: timers in the table now.
        kill_failed: kills that failed other than with ``ProcessLookupError``
            (e.g. ``PermissionError``); the pid's timers are cleared anyway.
    """

    requests: int = 0
    acquired: int = 0
    released: int = 0
    malformed: int = 0
    oversized: int = 0
    unknown_pid: int = 0
    dropped_capacity: int = 0
    dropped_unwatched: int = 0
    forged: int = 0
    shed: int = 0
    expired: int = 0
    reaped: int = 0
    active: int = 0
    kill_failed: int = 0


class _Timer(NamedTuple):
    expiration_time: float
    signal: int
    seq: int  # identifies the heap entry that belongs to this timer
    token: str | None = None  # the token its request carried


@dataclass
class _Watch:
    token: str | None  # the worker's token; None: not checked
    proven: bool = False  # the worker sent its token: tokenless requests are refused


def _same_token(a: str, b: str) -> bool:
    """Constant-time comparison (``compare_digest`` refuses non-ASCII ``str``)."""
    return hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    )


def _joined(thread: threading.Thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


class TimerServer:
    """Serves expiration timers over a FIFO and reaps watched workers whose timers expire.

    Semantics from ``torch.distributed.elastic.timer.FileTimerServer``, with the
    differences listed in this module's docstring. All methods are thread-safe.

    Args:
        fifo_path: where to create the FIFO (a stale file there is replaced).
        on_reap: called on the server thread, outside the lock, after each successful
            kill; keep it quick (requests wait meanwhile). Exceptions are logged.
        max_timers: most timers of unwatched pids held at once (a shared pool); acquires
            of new timers beyond it are dropped and counted in ``dropped_unwatched``.
        max_timers_per_pid: most timers of one watched pid held at once; acquires of new
            timers beyond it are dropped and counted in ``dropped_capacity``.
        kill: sends a signal to a pid (``os.kill``; injectable for tests).
        release: after a SIGKILL, free the victim's memory from this thread
            (:func:`~kelastic_sidecar.memory_release.release_memory`), so it is gone
            sooner.
        access: who may write the FIFO (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.timer_wire.ipc_access` (``$KELASTIC_IPC_ACCESS``).

    Attributes:
        last_acquire_time: ``time.time()`` of the last stored acquire, or None; a
            "training progress" signal for the supervisor.

    Raises:
        ValueError: ``max_timers`` or ``max_timers_per_pid`` < 1, or a bad ``access``.
    """

    def __init__(
        self,
        fifo_path: str | os.PathLike[str],
        *,
        on_reap: Callable[[ReapEvent], None] | None = None,
        max_timers: int = 65536,
        max_timers_per_pid: int = 1024,
        kill: Callable[[int, int], None] = os.kill,
        release: bool = True,
        access: str | None = None,
    ) -> None:
        if max_timers < 1 or max_timers_per_pid < 1:
            raise ValueError(
                f"max_timers and max_timers_per_pid must be >= 1, got {max_timers}, "
                f"{max_timers_per_pid}"
            )
        self.fifo_path: Final = Path(fifo_path)
        self.last_acquire_time: float | None = None
        self._on_reap = on_reap
        self._max_timers = max_timers
        self._max_per_pid = max_timers_per_pid
        self._kill = kill
        self._release = release
        self._mode = fifo_mode(access or ipc_access())
        self._lock = threading.Lock()  # guards everything below it
        self._timers: dict[tuple[int, str], _Timer] = {}
        self._scopes: dict[int, set[str]] = {}  # pid -> scopes of its timers
        self._unwatched = 0  # timers of unwatched pids
        self._heap: list[tuple[float, int, int, str]] = []  # (deadline, seq, pid, scope)
        self._seq = 0
        self._watched: dict[int, _Watch] = {}
        self._shed_pids: set[int] = set()
        self._shed_overflow = False  # too many to remember: every pid counts as shed
        self._stats = TimerStats()
        self._bad_lines = 0
        self._unknown_logged = 0
        # Lifecycle, guarded by _lifecycle.
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_w = -1
        self._wake_r = -1
        self._fifo_id: tuple[int, int] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create the FIFO (replacing a stale file) and start the server thread.

        Requests can be written as soon as this returns.

        Raises:
            RuntimeError: already started.
            OSError: the FIFO cannot be created or opened.
        """
        with self._lifecycle:
            if self._thread is not None:
                raise RuntimeError("TimerServer already started")
            with contextlib.suppress(FileNotFoundError):
                self.fifo_path.unlink()
            os.mkfifo(self.fifo_path, 0o600)
            # The access mode, not umask's (see the module doc).
            os.chmod(self.fifo_path, self._mode)
            fds: list[int] = []
            try:
                fds.append(os.open(self.fifo_path, os.O_RDONLY | os.O_NONBLOCK))
                # Our own writer: the reader never sees EOF when all clients close.
                fds.append(os.open(self.fifo_path, os.O_WRONLY | os.O_NONBLOCK))
                fds.extend(os.pipe())
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            rfd, wfd, self._wake_r, self._wake_w = fds
            _grow_pipe(rfd)
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            st = os.fstat(rfd)
            self._fifo_id = (st.st_dev, st.st_ino)
            self._stopping = threading.Event()  # per thread: an old one may linger
            self._thread = threading.Thread(
                target=self._run,
                args=(rfd, wfd, self._wake_r, self._stopping),
                name="kelastic-timer-server",
                daemon=True,
            )
            self._thread.start()
            log.info("timer server listening on %s (mode %o)", self.fifo_path, self._mode)

    def stop(self) -> None:
        """Stop the server thread promptly and remove the FIFO. Idempotent.

        Timers and watched pids are kept (a later :meth:`start` serves them again).
        """
        with self._lifecycle:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._stopping.set()
            self._wake()
            if thread is threading.current_thread():
                pass  # stop() from on_reap: the loop ends when the callback returns
            elif not _joined(thread, 5.0):
                log.warning("timer server thread did not stop within 5 s (slow on_reap?)")
            else:
                os.close(self._wake_r)
                os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
            self._remove_fifo()
            log.info("timer server on %s stopped", self.fifo_path)

    def _remove_fifo(self) -> None:
        # Only remove the FIFO we created, not one a newer server put at the same path.
        try:
            st = os.stat(self.fifo_path)
            if (st.st_dev, st.st_ino) == self._fifo_id:
                self.fifo_path.unlink()
        except FileNotFoundError:
            pass

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wakeup is pending anyway
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------- supervisor API

    def watch_pid(self, pid: int, token: str | None = None) -> None:
        """Mark ``pid`` as a worker: it may be signalled when its timers expire.

        Its timers move from the shared pool to its own budget. With ``token``, requests
        naming ``pid`` must carry it once they carry any (see the module doc); timers it
        already holds from requests with another token are dropped, and so are those it
        acquired before now if a line naming it was shed.

        Args:
            pid: the worker's pid.
            token: the worker's ``$KELASTIC_TIMER_TOKEN``; None: tokens are not checked.

        Raises:
            ValueError: ``pid`` <= 1 or this process's own pid.
        """
        if pid <= 1 or pid == os.getpid():
            raise ValueError(f"refusing to watch pid {pid}")
        with self._lock:
            if pid in self._watched:
                self._watched[pid] = _Watch(token)
                return
            self._watched[pid] = watch = _Watch(token)
            self._unwatched -= len(self._scopes.get(pid, ()))
            if self._shed_overflow or pid in self._shed_pids:
                self._clear_pid(pid)
                return
            timers = [(s, self._timers[(pid, s)]) for s in self._scopes.get(pid, ())]
            if token is not None:
                for scope, timer in timers:
                    if timer.token is not None and not _same_token(timer.token, token):
                        self._drop((pid, scope))
                        self._stats.forged += 1
                if any(self._timers[(pid, s)].token is not None for s in self._scopes.get(pid, ())):
                    self._prove(pid, watch)  # the worker already sent its token

    def forget_pid(self, pid: int) -> None:
        """The worker ``pid`` is gone: drop its timers and stop watching it.

        Once this returns, ``pid`` is never signalled (until watched again).
        """
        with self._lock:
            self._clear_pid(pid)
            self._watched.pop(pid, None)

    def forget_all(self) -> None:
        """Drop all timers and watched pids (e.g. the worker group was stopped)."""
        with self._lock:
            self._watched.clear()
            self._timers.clear()
            self._scopes.clear()
            self._unwatched = 0
            self._heap.clear()
            self._shed_pids.clear()
            self._shed_overflow = False

    def stats(self) -> TimerStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats, active=len(self._timers))

    def active_timers(self) -> int:
        """Number of timers in the table now (any pid)."""
        with self._lock:
            return len(self._timers)

    # ----------------------------------------------------------------- the thread

    def _run(self, rfd: int, wfd: int, wake_r: int, stopping: threading.Event) -> None:
        poller = select.poll()
        poller.register(rfd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        lines = LineSplitter()
        backlog = Backlog()
        try:
            while not stopping.is_set():
                try:
                    self._step(poller, rfd, wake_r, lines, backlog)
                except Exception:
                    log.exception("timer server: unexpected error; continuing")
                    stopping.wait(0.1)
        finally:
            os.close(rfd)
            os.close(wfd)

    def _step(
        self,
        poller: select.poll,
        rfd: int,
        wake_r: int,
        lines: LineSplitter,
        backlog: Backlog,
    ) -> None:
        """One loop turn: act on due deadlines, then read and apply a bounded amount."""
        self._reap_due()
        for fd, _events in poller.poll(0 if backlog else self._sleep_ms()):
            if fd == rfd:
                self._read(rfd, lines, backlog)
            elif fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        if backlog:
            with self._lock:
                for _ in range(min(LINES_PER_TURN, len(backlog))):
                    self._handle_line(*backlog.pop())
        else:
            self._sleep_to_deadline()  # when a deadline is under FINE_SLEEP away

    def _read(self, rfd: int, lines: LineSplitter, backlog: Backlog) -> None:
        """Read up to :data:`READ_PER_TURN` bytes. While nothing is queued, apply up to
        :data:`LINES_PER_TURN` lines in order; then apply watched pids' lines at once
        (up to :data:`WATCHED_PER_TURN` while the queue has room, all when it is full)
        unless an earlier line of the same pid is queued (the order of a pid's requests
        is kept), and queue the others; shed unwatched pids' lines when the queue is full."""
        watched_budget, direct_budget = WATCHED_PER_TURN, LINES_PER_TURN
        for _ in range(READ_PER_TURN // _READ_SIZE):
            try:
                data = os.read(rfd, _READ_SIZE)
            except BlockingIOError:
                return
            with self._lock:
                for line, oversized in lines.feed(data):
                    if direct_budget > 0 and not backlog:  # keeping up: no reordering
                        direct_budget -= 1
                        self._handle_line(line, oversized)
                        continue
                    pid = None if oversized else pid_hint(line)
                    full = len(backlog) >= MAX_BACKLOG
                    fast = watched_budget > 0 or full
                    if pid in self._watched and fast and not backlog.holds(pid):
                        watched_budget -= 1
                        self._handle_line(line, oversized)
                        continue
                    if not full or pid in self._watched:
                        backlog.push(line, oversized, pid)
                    else:
                        self._shed(pid)
            if len(data) < _READ_SIZE:
                return

    def _shed(self, pid: int | None) -> None:
        self._stats.shed += 1
        if pid is None:
            return
        if len(self._shed_pids) >= _MAX_SHED_PIDS:
            self._shed_overflow = True
        else:
            self._shed_pids.add(pid)
        if self._stats.shed % LOG_EVERY == 1:
            log.warning(
                "timer server: %d requests queued; shed a line of unwatched pid %d "
                "(%d shed so far)",
                MAX_BACKLOG,
                pid,
                self._stats.shed,
            )

    def _reap_due(self) -> None:
        events = self._expire(time.time())
        for event in events:  # first, so the reaps are known before the exits arrive
            if self._on_reap is None:
                continue
            try:
                self._on_reap(event)
            except Exception:
                log.exception("timer server: on_reap callback failed for %s", event)
        if self._release:
            for event in events:  # every kill of the batch was sent: now free the memory
                if event.signal == SIGKILL:
                    release_memory(event.pid)

    def _sleep_ms(self) -> int | None:
        """Whole milliseconds until the earliest live deadline, rounded down (capped at
        :data:`MAX_SLEEP`); None if no timers. :meth:`_sleep_to_deadline` sleeps the rest."""
        with self._lock:
            while self._heap and not self._is_live(self._heap[0]):
                heapq.heappop(self._heap)
            if not self._heap:
                return None
            delay = min(self._heap[0][0] - time.time(), MAX_SLEEP)
        return max(0, math.floor(delay * 1000))

    def _sleep_to_deadline(self) -> None:
        """Sleep until the earliest deadline when it is at most :data:`FINE_SLEEP` s away."""
        with self._lock:
            gap = self._heap[0][0] - time.time() if self._heap else 0.0
        if 0.0 < gap <= FINE_SLEEP:
            time.sleep(gap)

    # ------------------------------------------------- table (all with _lock held)

    def _handle_line(self, line: bytes, oversized: bool) -> None:
        if oversized:
            self._stats.oversized += 1
            self._warn_bad(line, f"longer than {MAX_LINE} bytes")
        elif not line.strip():
            return  # blank line: nothing to do
        else:
            try:
                self._apply(_parse(line))
                return
            except _BadRequest as exc:
                self._stats.malformed += 1
                self._warn_bad(line, str(exc))
        request = _salvage(line)
        if request is not None:
            self._apply(request)

    def _warn_bad(self, line: bytes, reason: str) -> None:
        self._bad_lines += 1
        if self._bad_lines % LOG_EVERY == 1:
            log.warning(
                "timer FIFO: skipped a bad line (%s): %r... (%d bad lines so far; "
                "logging one in %d)",
                reason,
                line[:80],
                self._bad_lines,
                LOG_EVERY,
            )

    def _authentic(self, request: _Request, watch: _Watch) -> bool:
        """Whether a request naming the watched pid may act on its timers."""
        if request.token is None:
            return not watch.proven  # torch's client: until the worker sent its token
        if watch.token is None:
            return True  # watched without a token: nothing to check
        if not _same_token(request.token, watch.token):
            return False
        if not watch.proven:
            self._prove(request.pid, watch)
        return True

    def _prove(self, pid: int, watch: _Watch) -> None:
        """The worker sent its token: from now on only requests with it count; drop the
        timers that tokenless requests (anyone's) set for it."""
        watch.proven = True
        for scope in list(self._scopes.get(pid, ())):
            if self._timers[(pid, scope)].token is None:
                self._drop((pid, scope))

    def _apply(self, request: _Request) -> None:
        self._stats.requests += 1
        key = (request.pid, request.scope_id)
        watch = self._watched.get(request.pid)
        if watch is not None and not self._authentic(request, watch):
            self._stats.forged += 1
            if self._stats.forged % LOG_EVERY == 1:
                log.warning(
                    "timer server: refused a request naming watched pid %d without its "
                    "token (%d refused so far)",
                    request.pid,
                    self._stats.forged,
                )
            return
        if request.expiration_time < 0:  # negative expiration: release
            if key in self._timers:
                self._drop(key)
                self._stats.released += 1
            return
        if key not in self._timers and not self._room_for(request.pid, watch is not None):
            return
        self._seq += 1
        if key not in self._timers:
            self._scopes.setdefault(request.pid, set()).add(request.scope_id)
            if watch is None:
                self._unwatched += 1
        self._timers[key] = _Timer(
            request.expiration_time, request.signal, self._seq, request.token
        )
        heapq.heappush(self._heap, (request.expiration_time, self._seq, *key))
        self._stats.acquired += 1
        self.last_acquire_time = time.time()
        if len(self._heap) > 2 * len(self._timers) + 1024:
            self._compact()

    def _room_for(self, pid: int, watched: bool) -> bool:
        """Whether a new timer of ``pid`` fits its budget; counts the drop if not."""
        held = len(self._scopes.get(pid, ())) if watched else self._unwatched
        if held < (self._max_per_pid if watched else self._max_timers):
            return True
        self._stats.dropped_capacity += 1
        if not watched:
            self._stats.dropped_unwatched += 1
        if self._stats.dropped_capacity % LOG_EVERY == 1:
            log.warning(
                "timer server: %s full, dropped an acquire from pid %d (%d dropped so far)",
                f"budget of watched pid {pid}" if watched else "pool of unwatched pids",
                pid,
                self._stats.dropped_capacity,
            )
        return False

    def _drop(self, key: tuple[int, str]) -> None:
        """Remove one timer (its heap entry is skipped when reached)."""
        if self._timers.pop(key, None) is None:
            return
        scopes = self._scopes.get(key[0])
        if scopes is not None:
            scopes.discard(key[1])
            if not scopes:
                del self._scopes[key[0]]
        if key[0] not in self._watched:
            self._unwatched -= 1

    def _is_live(self, entry: tuple[float, int, int, str]) -> bool:
        timer = self._timers.get((entry[2], entry[3]))
        return timer is not None and timer.seq == entry[1]

    def _compact(self) -> None:
        """Rebuild the heap from live timers (lazy deletion leaves stale entries)."""
        self._heap = [(t.expiration_time, t.seq, *key) for key, t in self._timers.items()]
        heapq.heapify(self._heap)

    def _clear_pid(self, pid: int) -> None:
        for scope in list(self._scopes.get(pid, ())):
            self._drop((pid, scope))

    def _expire(self, now: float) -> list[ReapEvent]:
        """Pop expired timers; signal watched pids (under the lock, so that a pid is
        never signalled after :meth:`forget_pid` returned). Returns the reaps."""
        events: list[ReapEvent] = []
        with self._lock:
            expired: dict[int, list[tuple[str, _Timer]]] = {}
            while self._heap and self._heap[0][0] <= now:
                entry = heapq.heappop(self._heap)
                if self._is_live(entry):
                    key = (entry[2], entry[3])
                    timer = self._timers[key]
                    self._drop(key)
                    expired.setdefault(key[0], []).append((key[1], timer))
                    self._stats.expired += 1
            for pid, timers in expired.items():  # each list is in deadline order
                event = self._reap(pid, timers)
                if event is not None:
                    events.append(event)
        return events

    def _reap(self, pid: int, timers: list[tuple[str, _Timer]]) -> ReapEvent | None:
        scopes = [scope for scope, _ in timers]
        if pid not in self._watched:
            self._stats.unknown_pid += len(timers)
            self._unknown_logged += 1
            if self._unknown_logged % LOG_EVERY == 1:
                log.warning(
                    "timer server: timers %s of unwatched pid %d expired; dropped, "
                    "not signalled (%d such pids so far)",
                    scopes,
                    pid,
                    self._unknown_logged,
                )
            return None
        chosen = next(((s, t) for s, t in timers if t.signal > 0), None)
        if chosen is None:
            log.info("timer server: timers %s of pid %d expired with signal 0", scopes, pid)
            return None
        scope_id, timer = chosen
        event: ReapEvent | None = None
        state = process_state(pid)  # before the signal changes it
        try:
            self._kill(pid, timer.signal)  # first: logging can wait, the deadline cannot
        except ProcessLookupError:
            log.info("timer server: pid %d is already gone", pid)
            self._clear_pid(pid)
            self._watched.pop(pid, None)
        except Exception:
            log.exception("timer server: could not signal pid %d", pid)
            self._stats.kill_failed += 1
        else:
            self._stats.reaped += 1
            log.warning(
                "timer server: reaped pid %d with signal %d (state %s); expired timers: %s",
                pid,
                timer.signal,
                state or "?",
                scopes,
            )
            event = ReapEvent(
                pid, scope_id, timer.signal, timer.expiration_time, time.time(), state
            )
        self._clear_pid(pid)
        return event


#: Pipe capacity asked for the FIFO, bytes. torch's FileTimerClient writes non-blocking
#: and fails with BlockingIOError once the pipe is full; a larger pipe absorbs bursts of
#: many workers (the kernel default is 64 KiB).
FIFO_PIPE_SIZE = 1 << 20


def _grow_pipe(fd: int) -> int:
    """Raise the FIFO's capacity towards :data:`FIFO_PIPE_SIZE` (capped by
    ``/proc/sys/fs/pipe-max-size``); returns the capacity in bytes it ended with."""
    want = FIFO_PIPE_SIZE
    with contextlib.suppress(OSError, ValueError):
        want = min(want, int(Path("/proc/sys/fs/pipe-max-size").read_text()))
    try:
        return int(fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, want))
    except OSError:
        return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
