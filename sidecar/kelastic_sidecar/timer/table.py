"""The timer server's table: timers by ``(pid, scope)``, their deadlines, the watched pids,
and the reaping of watched pids whose timers expired.

The semantics (torch's ``FileTimerServer`` and kelastic's differences) are
:mod:`kelastic_sidecar.timer.server`'s module doc; which requests are taken is
:mod:`~kelastic_sidecar.timer.admission`'s; reading the FIFO is
:mod:`~kelastic_sidecar.timer.reader`'s. Deadlines are a heap with lazy deletion: a
released or replaced timer's entry is skipped when it reaches the top (and the heap is
rebuilt when stale entries outnumber live ones).

A *grace* (seconds, 0 by default) delays the reap of a watched pid: at its deadline the
timer becomes *overdue* (logged, counted in ``expired``, a new heap entry at deadline +
grace); a release or a new acquire of its scope within the grace spares the worker
(counted in ``spared``); at deadline + grace it is reaped as usual, the
:class:`~kelastic_sidecar.timer.report.ReapEvent` saying by how much the grace delayed it.
With in-process restart on, the grace is ``hard_timeout - soft_timeout``: the ranks
blocked in a collective on a hung peer hold expired timers too, and leave in process
(their wrapper reports the expired timer as a soft timeout) within it; the hung rank,
which cannot, is reaped after it (NVIDIA's semantics: soft and hard timeouts both count
from the last progress).

One lock (:attr:`TimerTable.lock`) guards it all. :meth:`TimerTable.watch`,
:meth:`~TimerTable.forget`, :meth:`~TimerTable.forget_all`, :meth:`~TimerTable.snapshot`,
:meth:`~TimerTable.active`, :meth:`~TimerTable.next_deadline` and
:meth:`~TimerTable.expire` take it; the others expect it held. Kills happen under it, so
once :meth:`~TimerTable.forget` returns that pid is never signalled.

Over ~400 lines as one cohesive thing: every operation here reads or changes the same
state under the one lock (timers, their heap entries, the watched pids and the budgets),
and splitting it would spread those invariants over modules that each hold half of them.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple

from .admission import LOG_EVERY, Budgets, Watch, same_token
from .report import ReapEvent, TimerStats, process_state
from .wire import MAX_LINE, _BadRequest, _parse, _Request, _salvage

if TYPE_CHECKING:  # annotations only
    from ..hang_evidence import Evidence

__all__ = ["TimerTable"]

log = logging.getLogger("kelastic_sidecar.timer")

#: Most pids remembered as having had a line shed (then every pid counts as such).
_MAX_SHED_PIDS: Final = 65536
#: Reaps :meth:`TimerTable.reap_of` remembers (the newest; a node runs a few workers).
MAX_REAPS_KEPT: Final = 1024


class _Timer(NamedTuple):
    expiration_time: float
    signal: int
    seq: int  # identifies the heap entry that belongs to this timer
    token: str | None = None  # the token its request carried
    overdue: bool = False  # past its deadline, its reap deferred by the grace


class TimerTable:
    """The timers, their deadlines and the watched pids (see the module doc).

    Args:
        max_timers: most timers of unwatched pids held at once (a shared pool).
        max_timers_per_pid: most timers of one watched pid held at once.
        kill: sends a signal to a pid (``os.kill``; injectable for tests).
        grace: seconds (>= 0, finite) a watched pid's expired timer waits before its pid is
            reaped (see the module doc).
        observe: called with ``(pid, scope, release)`` for each admitted request of a
            watched pid, under the lock (step times: :mod:`kelastic_sidecar.steptime`);
            keep it quick.

    Raises:
        ValueError: ``grace`` is negative or not finite.

    Attributes:
        lock: guards everything.
        stats: the counters (live; :meth:`snapshot` copies them).
        last_acquire_time: ``time.time()`` of the last stored acquire, or None.
    """

    def __init__(
        self,
        max_timers: int,
        max_timers_per_pid: int,
        kill: Callable[[int, int], None] = os.kill,
        grace: float = 0.0,
        observe: Callable[[int, str, bool], None] | None = None,
    ) -> None:
        if not 0.0 <= grace < math.inf:
            raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace}")
        self.kill = kill
        self.grace: Final = float(grace)
        self.observe = observe
        self.lock = threading.Lock()
        self.stats = TimerStats()
        self.last_acquire_time: float | None = None
        self.timers: dict[tuple[int, str], _Timer] = {}
        self.heap: list[tuple[float, int, int, str]] = []  # (deadline, seq, pid, scope)
        self._budgets = Budgets(max_timers, max_timers_per_pid, self.stats)
        self._scopes: dict[int, set[str]] = {}  # pid -> scopes of its timers
        self._unwatched = 0  # timers of unwatched pids
        self._seq = 0
        self._watched: dict[int, Watch] = {}
        self._shed_pids: set[int] = set()
        self._shed_overflow = False  # too many to remember: every pid counts as shed
        self._bad_lines = 0
        self._unknown_logged = 0
        #: pid -> its reap, since the last :meth:`forget_all` (the newest MAX_REAPS_KEPT)
        self._reaps: dict[int, ReapEvent] = {}

    # ------------------------------------------------------- taking the lock itself

    def watch(self, pid: int, token: str | None) -> None:
        """Mark ``pid`` as a worker (see :meth:`TimerServer.watch_pid
        <kelastic_sidecar.timer.server.TimerServer.watch_pid>`)."""
        with self.lock:
            if pid in self._watched:
                self._watched[pid] = Watch(token)
                return
            self._watched[pid] = watch = Watch(token)
            self._unwatched -= len(self._scopes.get(pid, ()))
            if self._shed_overflow or pid in self._shed_pids:
                self._clear_pid(pid)
                return
            timers = [(s, self.timers[(pid, s)]) for s in self._scopes.get(pid, ())]
            if token is not None:
                for scope, timer in timers:
                    if timer.token is not None and not same_token(timer.token, token):
                        self._drop((pid, scope))
                        self.stats.forged += 1
                if any(self.timers[(pid, s)].token is not None for s in self._scopes.get(pid, ())):
                    self._prove(pid, watch)  # the worker already sent its token

    def forget(self, pid: int) -> None:
        """Drop ``pid``'s timers and stop watching it."""
        with self.lock:
            self._clear_pid(pid)
            self._watched.pop(pid, None)

    def forget_all(self) -> None:
        """Drop all timers and watched pids."""
        with self.lock:
            self._watched.clear()
            self.timers.clear()
            self._scopes.clear()
            self._unwatched = 0
            self.heap.clear()
            self._shed_pids.clear()
            self._shed_overflow = False
            self._reaps.clear()

    def reap_of(self, pid: int) -> ReapEvent | None:
        """The reap of ``pid`` since the last :meth:`forget_all`, or None. Under the lock
        the kill is sent under: an exit seen after the kill finds its reap here."""
        with self.lock:
            return self._reaps.get(pid)

    def snapshot(self) -> TimerStats:
        """A consistent snapshot of the counters."""
        with self.lock:
            overdue = sum(1 for t in self.timers.values() if t.overdue) if self.grace else 0
            return dataclasses.replace(
                self.stats, active=len(self.timers), overdue=overdue, grace=self.grace
            )

    def active(self) -> int:
        """Number of timers in the table now (any pid)."""
        with self.lock:
            return len(self.timers)

    def next_deadline(self) -> float | None:
        """The earliest live deadline (stale heap entries on top are removed); None if no
        timers."""
        with self.lock:
            while self.heap and not self._is_live(self.heap[0]):
                heapq.heappop(self.heap)
            return self.heap[0][0] if self.heap else None

    # ------------------------------------------------------------- with lock held

    def is_watched(self, pid: int | None) -> bool:
        return pid in self._watched

    def shed(self, pid: int | None) -> None:
        """A line (of ``pid``, when known) was dropped unread: count it, and remember the
        pid (its timers from before it is watched are dropped when it is)."""
        self.stats.shed += 1
        if pid is None:
            return
        if len(self._shed_pids) >= _MAX_SHED_PIDS:
            self._shed_overflow = True
        else:
            self._shed_pids.add(pid)

    def handle_line(self, line: bytes, oversized: bool) -> None:
        """Apply one line read from the FIFO (bad lines are counted and skipped; a valid
        request glued after a bad fragment is still applied)."""
        if oversized:
            self.stats.oversized += 1
            self._warn_bad(line, f"longer than {MAX_LINE} bytes")
        elif not line.strip():
            return  # blank line: nothing to do
        else:
            try:
                self.apply(_parse(line))
                return
            except _BadRequest as exc:
                self.stats.malformed += 1
                self._warn_bad(line, str(exc))
        request = _salvage(line)
        if request is not None:
            self.apply(request)

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

    def _authentic(self, request: _Request, watch: Watch) -> bool:
        """Whether a request naming the watched pid may act on its timers."""
        if not watch.admits(request.token):
            return False
        if watch.proven_by(request.token):
            self._prove(request.pid, watch)
        return True

    def _prove(self, pid: int, watch: Watch) -> None:
        """The worker sent its token: from now on only requests with it count; drop the
        timers that tokenless requests (anyone's) set for it."""
        watch.proven = True
        for scope in list(self._scopes.get(pid, ())):
            if self.timers[(pid, scope)].token is None:
                self._drop((pid, scope))

    def apply(self, request: _Request) -> None:
        """Apply one well-formed request: acquire (store or replace) or release a timer."""
        self.stats.requests += 1
        key = (request.pid, request.scope_id)
        watch = self._watched.get(request.pid)
        if watch is not None and not self._authentic(request, watch):
            self.stats.forged += 1
            if self.stats.forged % LOG_EVERY == 1:
                log.warning(
                    "timer server: refused a request naming watched pid %d without its "
                    "token (%d refused so far)",
                    request.pid,
                    self.stats.forged,
                )
            return
        if watch is not None and self.observe is not None:
            self.observe(request.pid, request.scope_id, request.expiration_time < 0)
        old = self.timers.get(key)
        if old is not None and old.overdue:
            self._spare(request.pid, request.scope_id, old, request.expiration_time < 0)
        if request.expiration_time < 0:  # negative expiration: release
            if key in self.timers:
                self._drop(key)
                self.stats.released += 1
            return
        if key not in self.timers:
            watched = watch is not None
            held = len(self._scopes.get(request.pid, ())) if watched else self._unwatched
            if not self._budgets.room_for(request.pid, watched, held):
                return
        self._seq += 1
        if key not in self.timers:
            self._scopes.setdefault(request.pid, set()).add(request.scope_id)
            if watch is None:
                self._unwatched += 1
        self.timers[key] = _Timer(request.expiration_time, request.signal, self._seq, request.token)
        heapq.heappush(self.heap, (request.expiration_time, self._seq, *key))
        self.stats.acquired += 1
        self.last_acquire_time = time.time()
        if len(self.heap) > 2 * len(self.timers) + 1024:
            self._compact()

    def _spare(self, pid: int, scope: str, timer: _Timer, release: bool) -> None:
        """An overdue timer was released or acquired again within the grace: its worker
        made progress (left its blocked collective) and is not reaped for it."""
        self.stats.spared += 1
        log.info(
            "timer server: pid %d %s timer %r %.2f s after its deadline, within the grace "
            "of %g s: not reaped",
            pid,
            "released" if release else "acquired again",
            scope,
            time.time() - timer.expiration_time,
            self.grace,
        )

    def _drop(self, key: tuple[int, str]) -> None:
        """Remove one timer (its heap entry is skipped when reached)."""
        if self.timers.pop(key, None) is None:
            return
        scopes = self._scopes.get(key[0])
        if scopes is not None:
            scopes.discard(key[1])
            if not scopes:
                del self._scopes[key[0]]
        if key[0] not in self._watched:
            self._unwatched -= 1

    def _is_live(self, entry: tuple[float, int, int, str]) -> bool:
        timer = self.timers.get((entry[2], entry[3]))
        return timer is not None and timer.seq == entry[1]

    def _compact(self) -> None:
        """Rebuild the heap from live timers (lazy deletion leaves stale entries)."""
        self.heap = [(t.expiration_time, t.seq, *key) for key, t in self.timers.items()]
        heapq.heapify(self.heap)

    def _clear_pid(self, pid: int) -> None:
        for scope in list(self._scopes.get(pid, ())):
            self._drop((pid, scope))

    # ------------------------------------------------------------------- reaping

    def due_reaps(self, now: float) -> list[int]:
        """The pids :meth:`expire` at ``now`` would signal, were nothing to change
        meanwhile (watched, a live timer with a signal > 0 past its deadline and its
        grace, if any: overdue, or expired longer ago than the grace); nothing is
        changed. Visits only the heap entries due at ``now`` (a subtree of the heap
        past ``now`` is skipped). The server reads these pids' stacks before
        :meth:`expire`."""
        pids: list[int] = []
        with self.lock:
            todo = [0]
            while todo:
                i = todo.pop()
                if i >= len(self.heap) or self.heap[i][0] > now:
                    continue
                todo += (2 * i + 1, 2 * i + 2)
                entry = self.heap[i]
                pid = entry[2]
                if not self._is_live(entry) or pid in pids or pid not in self._watched:
                    continue
                timer = self.timers[(pid, entry[3])]
                # deferred by the grace unless overdue, or past deadline + grace already
                late = timer.overdue or timer.expiration_time + self.grace <= now
                if timer.signal > 0 and late:
                    pids.append(pid)
        return pids

    def expire(self, now: float, evidence: dict[int, Evidence] | None = None) -> list[ReapEvent]:
        """Pop expired timers; signal watched pids (under the lock, so that a pid is
        never signalled after :meth:`forget` returned). Returns the reaps, each with
        its pid's ``evidence`` (collected beforehand, outside the lock) when given."""
        events: list[ReapEvent] = []
        with self.lock:
            expired: dict[int, list[tuple[str, _Timer]]] = {}
            while self.heap and self.heap[0][0] <= now:
                entry = heapq.heappop(self.heap)
                if self._is_live(entry):
                    key = (entry[2], entry[3])
                    timer = self.timers[key]
                    if not timer.overdue:
                        self.stats.expired += 1
                        if self._defer(key, timer):
                            continue
                    self._drop(key)
                    expired.setdefault(key[0], []).append((key[1], timer))
            for pid, timers in expired.items():  # each list is in deadline order
                event = self._reap(pid, timers, (evidence or {}).get(pid))
                if event is not None:
                    events.append(event)
        return events

    def _defer(self, key: tuple[int, str], timer: _Timer) -> bool:
        """At its deadline, make a watched pid's killing timer overdue for the grace
        (a new heap entry at deadline + grace); return whether it was."""
        if not self.grace or timer.signal <= 0 or key[0] not in self._watched:
            return False
        self._seq += 1
        self.timers[key] = timer._replace(seq=self._seq, overdue=True)
        heapq.heappush(self.heap, (timer.expiration_time + self.grace, self._seq, *key))
        log.info(
            "timer server: timer %r of pid %d expired; its reap waits for the grace of %g s "
            "(in-process restart: the rank may leave first)",
            key[1],
            key[0],
            self.grace,
        )
        return True

    def _reap(
        self, pid: int, timers: list[tuple[str, _Timer]], evidence: Evidence | None
    ) -> ReapEvent | None:
        scopes = [scope for scope, _ in timers]
        if pid not in self._watched:
            self.stats.unknown_pid += len(timers)
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
            self.kill(pid, timer.signal)  # first: logging can wait, the deadline cannot
        except ProcessLookupError:
            log.info("timer server: pid %d is already gone", pid)
            self._clear_pid(pid)
            self._watched.pop(pid, None)
        except Exception:
            log.exception("timer server: could not signal pid %d", pid)
            self.stats.kill_failed += 1
        else:
            self.stats.reaped += 1
            grace = self.grace if timer.overdue else 0.0
            if grace:
                self.stats.reaped_after_grace += 1
            log.warning(
                "timer server: reaped pid %d with signal %d (state %s); expired timers: %s%s",
                pid,
                timer.signal,
                state or "?",
                scopes,
                f" (after the grace of {grace:g} s)" if grace else "",
            )
            event = ReapEvent(
                pid, scope_id, timer.signal, timer.expiration_time, time.time(), state, grace,
                evidence=evidence,
            )  # fmt: skip
            self._reaps.pop(pid, None)  # re-inserted: the newest last
            self._reaps[pid] = event
            if len(self._reaps) > MAX_REAPS_KEPT:
                del self._reaps[next(iter(self._reaps))]
        self._clear_pid(pid)
        return event
