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
- The reader holds a write end of its own FIFO, so it never sees end-of-file when
  writers come and go; writers that open the FIFO per request (torch's client) and
  writers that keep it open (kelastic's client) both work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import json
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

from kelastic.timer import MAX_SCOPE_LEN, WIRE_VERSION

from .memory_release import release_memory

__all__ = ["ReapEvent", "TimerServer", "TimerStats"]

log = logging.getLogger("kelastic_sidecar.timer")

#: Longest request line in bytes, newline excluded (torch's client checks the same bound).
MAX_LINE: Final = select.PIPE_BUF
#: Highest signal number accepted (Linux ``SIGRTMAX``).
MAX_SIGNAL: Final = 64
#: Upper bound of accepted pids (above Linux's largest ``pid_max``, 2**22).
MAX_PID: Final = 2**31 - 1
#: Longest single sleep of the server thread, seconds.
MAX_SLEEP: Final = 10.0
#: A deadline this close (seconds) after ``poll`` returns is slept to precisely.
FINE_SLEEP: Final = 0.002
#: One warning is logged per this many bad lines (and per this many unknown-pid expiries).
LOG_EVERY: Final = 1000
#: How many ``{"`` positions of a bad line are tried as the start of a glued request.
_SALVAGE_TRIES: Final = 8
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
        dropped_capacity: acquires dropped because ``max_timers`` timers were active.
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
    expired: int = 0
    reaped: int = 0
    active: int = 0
    kill_failed: int = 0


class _Request(NamedTuple):
    pid: int
    scope_id: str
    expiration_time: float
    signal: int


class _Timer(NamedTuple):
    expiration_time: float
    signal: int
    seq: int  # identifies the heap entry that belongs to this timer


class _BadRequest(ValueError):
    pass


def _joined(thread: threading.Thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


def _reject_constant(name: str) -> float:
    raise _BadRequest(f"{name} is not a valid number")


def _parse(line: bytes) -> _Request:
    """Decode and validate one request line (newline excluded).

    Raises:
        _BadRequest: (a ``ValueError``) with the reason.
    """
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise _BadRequest(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _BadRequest("not a JSON object")
    version, pid, scope_id = obj.get("version"), obj.get("pid"), obj.get("scope_id")
    expiration_time, signal = obj.get("expiration_time"), obj.get("signal")
    # type(x) is int: bool is a subclass of int and must not pass as one.
    if type(version) is not int or version != WIRE_VERSION:
        raise _BadRequest(f"unsupported version {version!r}")
    if type(pid) is not int or not 0 < pid <= MAX_PID:
        raise _BadRequest(f"bad pid {pid!r}")
    if not isinstance(scope_id, str) or len(scope_id) > MAX_SCOPE_LEN:
        raise _BadRequest(f"scope_id must be a string of at most {MAX_SCOPE_LEN} characters")
    if not isinstance(expiration_time, (int, float)) or isinstance(expiration_time, bool):
        raise _BadRequest(f"bad expiration_time {expiration_time!r}")
    try:
        deadline = float(expiration_time)  # an int may be too large for a float
    except OverflowError:
        raise _BadRequest("expiration_time out of range") from None
    if not math.isfinite(deadline):
        raise _BadRequest(f"expiration_time not finite: {deadline}")
    if type(signal) is not int or not 0 <= signal <= MAX_SIGNAL:
        raise _BadRequest(f"bad signal {signal!r}")
    return _Request(pid, scope_id, deadline, signal)


def _salvage(line: bytes) -> _Request | None:
    """Find a valid request glued after garbage (e.g. a partial line of a dead writer).

    A request written by ``json.dumps`` starts with ``{"`` and contains ``{"`` nowhere
    else that could start a valid object, so the candidates are tried from the right.
    """
    end = len(line)
    for _ in range(_SALVAGE_TRIES):
        start = line.rfind(b'{"', 1, end)
        if start < 0:
            return None
        try:
            return _parse(line[start:])
        except _BadRequest:
            end = start + 1
    return None


class _LineSplitter:
    """Splits the FIFO byte stream into lines, bounding memory at ``MAX_LINE`` bytes.

    A line over ``MAX_LINE`` bytes is reported as oversized with only its last
    ``MAX_LINE`` bytes, in which a request glued after the garbage can still be found.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._overflow = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """Add ``data``; return the completed ``(line, oversized)`` pairs, newline removed."""
        self._buf += data
        out: list[tuple[bytes, bool]] = []
        while (newline := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:newline])
            del self._buf[: newline + 1]
            oversized = self._overflow or len(line) > MAX_LINE
            self._overflow = False
            out.append((line[-MAX_LINE:], oversized))
        if len(self._buf) > MAX_LINE:  # discard until the next newline, keeping a tail
            self._overflow = True
            del self._buf[:-MAX_LINE]
        return out


class TimerServer:
    """Serves expiration timers over a FIFO and reaps watched workers whose timers expire.

    Semantics from ``torch.distributed.elastic.timer.FileTimerServer``, with the
    differences listed in this module's docstring. All methods are thread-safe.

    Args:
        fifo_path: where to create the FIFO (a stale file there is replaced).
        on_reap: called on the server thread, outside the lock, after each successful
            kill; keep it quick (requests wait meanwhile). Exceptions are logged.
        max_timers: most timers held at once; acquires of new timers beyond it are
            dropped and counted in ``dropped_capacity``.
        kill: sends a signal to a pid (``os.kill``; injectable for tests).
        release: after a SIGKILL, free the victim's memory from this thread
            (:func:`~kelastic_sidecar.memory_release.release_memory`), so it is gone
            sooner.

    Attributes:
        last_acquire_time: ``time.time()`` of the last stored acquire, or None; a
            "training progress" signal for the supervisor.

    Raises:
        ValueError: ``max_timers`` < 1.
    """

    def __init__(
        self,
        fifo_path: str | os.PathLike[str],
        *,
        on_reap: Callable[[ReapEvent], None] | None = None,
        max_timers: int = 65536,
        kill: Callable[[int, int], None] = os.kill,
        release: bool = True,
    ) -> None:
        if max_timers < 1:
            raise ValueError(f"max_timers must be >= 1, got {max_timers}")
        self.fifo_path: Final = Path(fifo_path)
        self.last_acquire_time: float | None = None
        self._on_reap = on_reap
        self._max_timers = max_timers
        self._kill = kill
        self._release = release
        self._lock = threading.Lock()  # guards everything below it
        self._timers: dict[tuple[int, str], _Timer] = {}
        self._heap: list[tuple[float, int, int, str]] = []  # (deadline, seq, pid, scope)
        self._seq = 0
        self._watched: set[int] = set()
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
            os.mkfifo(self.fifo_path)
            # Writable by any user of the Pod (the trainer may run as another user than
            # the sidecar; only the Pod's containers see the run volume). Not umask's.
            os.chmod(self.fifo_path, 0o622)
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
            log.info("timer server listening on %s", self.fifo_path)

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

    def watch_pid(self, pid: int) -> None:
        """Mark ``pid`` as a worker: it may be signalled when its timers expire.

        Raises:
            ValueError: ``pid`` <= 1 or this process's own pid.
        """
        if pid <= 1 or pid == os.getpid():
            raise ValueError(f"refusing to watch pid {pid}")
        with self._lock:
            self._watched.add(pid)

    def forget_pid(self, pid: int) -> None:
        """The worker ``pid`` is gone: drop its timers and stop watching it.

        Once this returns, ``pid`` is never signalled (until watched again).
        """
        with self._lock:
            self._watched.discard(pid)
            self._clear_pid(pid)

    def forget_all(self) -> None:
        """Drop all timers and watched pids (e.g. the worker group was stopped)."""
        with self._lock:
            self._watched.clear()
            self._timers.clear()
            self._heap.clear()

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
        lines = _LineSplitter()
        try:
            while not stopping.is_set():
                try:
                    self._step(poller, rfd, wake_r, lines)
                except Exception:
                    log.exception("timer server: unexpected error; continuing")
                    stopping.wait(0.1)
        finally:
            os.close(rfd)
            os.close(wfd)

    def _step(self, poller: select.poll, rfd: int, wake_r: int, lines: _LineSplitter) -> None:
        for fd, _events in poller.poll(self._sleep_ms()):
            if fd == rfd:
                with contextlib.suppress(BlockingIOError):
                    data = os.read(rfd, _READ_SIZE)
                    with self._lock:
                        for line, oversized in lines.feed(data):
                            self._handle_line(line, oversized)
            elif fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        self._sleep_to_deadline()
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

    def _apply(self, request: _Request) -> None:
        self._stats.requests += 1
        key = (request.pid, request.scope_id)
        if request.expiration_time < 0:  # negative expiration: release
            if self._timers.pop(key, None) is not None:
                self._stats.released += 1
            return
        if key not in self._timers and len(self._timers) >= self._max_timers:
            self._stats.dropped_capacity += 1
            if self._stats.dropped_capacity % LOG_EVERY == 1:
                log.warning(
                    "timer server: %d timers active, dropped an acquire from pid %d "
                    "(%d dropped so far)",
                    len(self._timers),
                    request.pid,
                    self._stats.dropped_capacity,
                )
            return
        self._seq += 1
        self._timers[key] = _Timer(request.expiration_time, request.signal, self._seq)
        heapq.heappush(self._heap, (request.expiration_time, self._seq, *key))
        self._stats.acquired += 1
        self.last_acquire_time = time.time()
        if len(self._heap) > 2 * len(self._timers) + 1024:
            self._compact()

    def _is_live(self, entry: tuple[float, int, int, str]) -> bool:
        timer = self._timers.get((entry[2], entry[3]))
        return timer is not None and timer.seq == entry[1]

    def _compact(self) -> None:
        """Rebuild the heap from live timers (lazy deletion leaves stale entries)."""
        self._heap = [(t.expiration_time, t.seq, *key) for key, t in self._timers.items()]
        heapq.heapify(self._heap)

    def _clear_pid(self, pid: int) -> None:
        for key in [key for key in self._timers if key[0] == pid]:
            del self._timers[key]

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
                    expired.setdefault(key[0], []).append((key[1], self._timers.pop(key)))
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
            self._watched.discard(pid)
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
