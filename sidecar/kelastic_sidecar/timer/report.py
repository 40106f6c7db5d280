"""What the timer server reports: its reaps (:class:`ReapEvent`, with the victim's process
state) and its counters (:class:`TimerStats`). The in-process hard timeout's kill of a
hung worker is a reap too (:func:`hard_timeout_reap`, :attr:`Reaper.HARD_TIMEOUT`): the
supervisor's monitor holds every hang, whoever killed it.

Plain data, importable without the server's machinery (FIFO, thread, kills): the
supervisor's round-end classification and the metrics read these.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kelastic.procstat import process_stat

if TYPE_CHECKING:  # annotations only
    from ..hang_evidence import Evidence

__all__ = [
    "ReapEvent",
    "Reaper",
    "TimerStats",
    "hard_timeout_reap",
    "process_stat",
    "process_state",
]


class Reaper(enum.Enum):
    """Who killed a hung worker."""

    #: The timer server: an ``expires()`` timer of the worker expired (after the grace
    #: with in-process restart on).
    TIMER_SERVER = "the timer server"
    #: The in-process coordinator: the worker did not pass the termination barrier
    #: within the hard timeout after its ``abort``.
    HARD_TIMEOUT = "the in-process hard timeout"
    #: The sidecar's stopped-worker watch: the worker stayed stopped (``T``) past its
    #: timeout, holding no timer that would have expired
    #: (:mod:`~kelastic_sidecar.stopped_watch`).
    STOPPED_WATCH = "the stopped-worker watch"


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
        grace: seconds the reap waited past the deadline by the server's grace (0: reaped
            at expiry; see :mod:`~kelastic_sidecar.timer.table`).
        by: who killed it.
        note: for :attr:`Reaper.HARD_TIMEOUT` and :attr:`Reaper.STOPPED_WATCH`, what the
            killer says of the kill (its :attr:`why`).
        evidence: the worker's stacks, read just before the signal (where its main
            thread was; :mod:`~kelastic_sidecar.hang_evidence`); None when not collected.
    """

    pid: int
    scope_id: str
    signal: int
    expiration_time: float
    reaped_at: float
    state: str = ""
    grace: float = 0.0
    by: Reaper = Reaper.TIMER_SERVER
    note: str = ""
    evidence: Evidence | None = None

    @property
    def why(self) -> str:
        """Why and by whom it was killed, and where it was when its stacks were read, e.g.
        ``timer 'step' expired; reaped by the timer server; main thread at
        /w/train.py:42 in step (stacks in /run/hang-evidence/rank-1-pid-812.txt)``."""
        if self.by is Reaper.HARD_TIMEOUT:
            why = self.note or "no termination barrier in the hard timeout; killed by the sidecar"
        elif self.by is Reaper.STOPPED_WATCH:
            why = self.note or "stopped past its timeout; killed by the sidecar"
        else:
            why = f"timer {self.scope_id!r} expired; reaped by the timer server"
        return why if self.evidence is None else f"{why}; {self.evidence.line()}"


def hard_timeout_reap(pid: int, why: str, evidence: Evidence | None = None) -> ReapEvent:
    """The reap the in-process coordinator's hard-timeout kill of ``pid`` stands for
    (``why``: its words; ``evidence``: its stacks, read before), made just before the
    SIGKILL (its process state included)."""
    now = time.time()
    state = process_state(pid)
    return ReapEvent(
        pid, "", signal.SIGKILL, now, now, state, by=Reaper.HARD_TIMEOUT, note=why,
        evidence=evidence,
    )  # fmt: skip


def process_state(pid: int) -> str:
    """The state letter of ``pid`` from ``/proc/<pid>/stat`` (``""`` if unreadable)."""
    stat = process_stat(pid)
    return stat[0] if stat is not None else ""


@dataclass
class TimerStats:
    """Counters of a :class:`~kelastic_sidecar.timer.server.TimerServer` since construction
    (a snapshot).

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
        spared: expired timers of watched pids released or acquired again within the
            grace (their worker made progress: not reaped).
        reaped_after_grace: of ``reaped``, kills that waited for the grace.
        overdue: timers past their deadline now, their reap waiting for the grace.
        grace: the server's grace in seconds (0: a watched pid is reaped at expiry).
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
    spared: int = 0
    reaped_after_grace: int = 0
    overdue: int = 0
    grace: float = 0.0
