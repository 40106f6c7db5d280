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
- Hang evidence: with ``collect``, the pids due for a reap have their stacks read first
  (``py-spy``: :mod:`~kelastic_sidecar.hang_evidence`), in parallel and outside the lock,
  within the collector's budget; then the kill, its :class:`ReapEvent` naming where the
  main thread was. A pid forgotten or spared meanwhile is not reaped.
- With in-process restart on, a watched pid is reaped a *grace* after its timer expired
  (``hard_timeout - soft_timeout``), unless it releases or acquires the timer again
  meanwhile: the ranks blocked on a hung peer leave in process first (see
  :mod:`~kelastic_sidecar.timer.table`). Without it, reaps happen at expiry, as torch's.
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
  :func:`~.wire.pid_hint`, then parsed as usual; a pid with a line still queued
  waits behind it, so its requests keep their order) and queues the others, of which it
  applies at most :data:`LINES_PER_TURN` per turn. The queue holds at most
  :data:`MAX_BACKLOG` lines; beyond, lines of unwatched pids are shed (counted in
  ``shed``), so the pipe keeps draining and a watched worker's request is never stuck
  behind a flood. A pid whose line was shed loses the timers it acquired before it was
  watched, when it is watched (a shed release could otherwise leave a stale timer).
- Who may write: the FIFO is created with the mode of ``$KELASTIC_IPC_ACCESS``
  (:func:`~kelastic_sidecar.ipc.ipc_access`: the sidecar's user only locally, any user of the
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

The pieces: this module is the server (the FIFO, the thread and its loop, the API);
the table of timers, deadlines, watched pids and reaping is
:mod:`~kelastic_sidecar.timer.table`, what it reports (reaps, counters)
:mod:`~kelastic_sidecar.timer.report`; which requests it takes (tokens, budgets)
:mod:`~kelastic_sidecar.timer.admission`; reading the FIFO fairly
:mod:`~kelastic_sidecar.timer.reader`; the wire format and access modes
:mod:`~kelastic_sidecar.timer.wire`.

Over ~400 lines because of this docstring: the server's semantics and the reason for
each difference from torch's, in one place; the code itself is about 320 lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from signal import SIGKILL
from typing import Final

from ..hang_evidence import Collect, Evidence, collect_all
from ..ipc import fifo_mode, ipc_access
from .memory_release import release_memory
from .reader import FifoReader
from .report import ReapEvent, TimerStats
from .table import TimerTable

__all__ = ["ReapEvent", "TimerServer", "TimerStats"]

log = logging.getLogger("kelastic_sidecar.timer")

#: Longest single sleep of the server thread, seconds.
MAX_SLEEP: Final = 10.0
#: A deadline this close (seconds) after ``poll`` returns is slept to precisely.
FINE_SLEEP: Final = 0.002


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
            (:func:`~kelastic_sidecar.timer.memory_release.release_memory`), so it is gone
            sooner.
        access: who may write the FIFO (``owner``, ``group``, ``pod``); default
            :func:`~kelastic_sidecar.ipc.ipc_access` (``$KELASTIC_IPC_ACCESS``).
        grace: seconds a watched pid's expired timer waits before the pid is reaped
            (a release or new acquire meanwhile spares it; see
            :mod:`~kelastic_sidecar.timer.table`); 0: reaped at expiry, as torch.
        collect: reads a pid's stacks just before it is reaped (bounded in time, never
            raises: :class:`~kelastic_sidecar.hang_evidence.StackCollector`); None: no
            evidence.
        observe: ``(pid, scope, release)`` of each admitted request of a watched pid, on
            the server thread under the table's lock (step times); None: nothing observed.
        after_turn: called in each loop turn on the server thread, after the due reaps
            and outside the lock (the straggler verdict); keep it quick.

    Attributes:
        last_acquire_time: ``time.time()`` of the last stored acquire, or None; a
            "training progress" signal for the supervisor.

    Raises:
        ValueError: ``max_timers`` or ``max_timers_per_pid`` < 1, a bad ``access``, or
            ``grace`` negative or not finite.
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
        grace: float = 0.0,
        collect: Collect | None = None,
        observe: Callable[[int, str, bool], None] | None = None,
        after_turn: Callable[[], None] | None = None,
    ) -> None:
        if max_timers < 1 or max_timers_per_pid < 1:
            raise ValueError(
                f"max_timers and max_timers_per_pid must be >= 1, got {max_timers}, "
                f"{max_timers_per_pid}"
            )
        self.fifo_path: Final = Path(fifo_path)
        self._on_reap = on_reap
        self._release = release
        self._collect = collect
        self._after_turn = after_turn
        self._mode = fifo_mode(access or ipc_access())
        self._table = TimerTable(max_timers, max_timers_per_pid, kill, grace, observe)
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
        self._table.watch(pid, token)

    def forget_pid(self, pid: int) -> None:
        """The worker ``pid`` is gone: drop its timers and stop watching it.

        Once this returns, ``pid`` is never signalled (until watched again).
        """
        self._table.forget(pid)

    def forget_all(self) -> None:
        """Drop all timers and watched pids (e.g. the worker group was stopped)."""
        self._table.forget_all()

    def reap_of(self, pid: int) -> ReapEvent | None:
        """This server's reap of ``pid`` since the last :meth:`forget_all`, or None. The
        kill and the record happen under one lock, so an exit seen after the kill finds
        it here even when it overtook the ``on_reap`` callback (found in a loaded run: a
        reaped rank's exit was handled first and named ``worker_died``, not ``hang``)."""
        return self._table.reap_of(pid)

    def evidence(self, pids: Sequence[int]) -> dict[int, Evidence]:
        """pid -> the stacks of each of ``pids``, read with the server's collector (in
        parallel, each within its budget), as a reap reads them; ``{}`` without one. For a
        worker the server does not reap: stopped while holding no timer."""
        return collect_all(self._collect, pids) if self._collect and pids else {}

    def stats(self) -> TimerStats:
        """A consistent snapshot of the counters."""
        return self._table.snapshot()

    def active_timers(self) -> int:
        """Number of timers in the table now (any pid)."""
        return self._table.active()

    @property
    def last_acquire_time(self) -> float | None:
        """``time.time()`` of the last stored acquire, or None; a "training progress"
        signal for the supervisor."""
        return self._table.last_acquire_time

    # ----------------------------------------------------------------- the thread

    def _run(self, rfd: int, wfd: int, wake_r: int, stopping: threading.Event) -> None:
        poller = select.poll()
        poller.register(rfd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        reader = FifoReader(self._table)
        try:
            while not stopping.is_set():
                try:
                    self._step(poller, rfd, wake_r, reader)
                except Exception:
                    log.exception("timer server: unexpected error; continuing")
                    stopping.wait(0.1)
        finally:
            os.close(rfd)
            os.close(wfd)

    def _step(self, poller: select.poll, rfd: int, wake_r: int, reader: FifoReader) -> None:
        """One loop turn: act on due deadlines, then read and apply a bounded amount."""
        self._reap_due()
        if self._after_turn is not None:  # after the reaps; the poll's timeout is set after it
            self._after_turn()
        for fd, _events in poller.poll(0 if reader.pending() else self._sleep_ms()):
            if fd == rfd:
                reader.read(rfd)
            elif fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        if reader.pending():
            reader.drain()
        else:
            self._sleep_to_deadline()  # when a deadline is under FINE_SLEEP away

    def _reap_due(self) -> None:
        now = time.time()
        due = self._table.due_reaps(now) if self._collect else []
        evidence = collect_all(self._collect, due) if self._collect and due else None
        events = self._table.expire(now, evidence)
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
        deadline = self._table.next_deadline()
        if deadline is None:
            return None
        delay = min(deadline - time.time(), MAX_SLEEP)
        return max(0, math.floor(delay * 1000))

    def _sleep_to_deadline(self) -> None:
        """Sleep until the earliest deadline when it is at most :data:`FINE_SLEEP` s away."""
        deadline = self._table.next_deadline()
        gap = deadline - time.time() if deadline is not None else 0.0
        if 0.0 < gap <= FINE_SLEEP:
            time.sleep(gap)


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
