"""The silence watch: a rank whose worker stopped beating is faulted on its behalf. A part
of the :class:`~.machine.RestartMachine`.

A wrapped worker reports its own soft timeout (no progress, an expired ``expires()``
timer) from its monitor thread. A process stopped as a whole (SIGSTOP, a debugger, a
frozen cgroup) or whose interpreter does not run (a C call holding the GIL) cannot, and
when its peers do not wait on it in a collective, nobody else notices: between two
``expires()`` blocks it holds no timer for the timer server to reap. Its monitor
thread's :class:`~kelastic.inprocess_messages.Beat` lines stop, though. A rank of a
running iteration silent for the soft timeout is faulted here with cause
``soft_timeout``, naming it; the abort that follows reaches every rank, the silent one
cannot answer it, and the hard timeout kills it (its exit: the hybrid rung). NVIDIA's
in-process restart does the same from its monitor process, which reads the rank's
progress timestamp from outside the worker (soft timeout: restart; hard timeout: kill).

With a restart in flight the hard timeout ends a rank that does not answer its abort,
but the restart may be named after the wrong rank: the ranks blocked on a stopped peer
in a collective time out first and report it. A rank that has missed
:data:`CULPRIT_BEATS` beats without answering the abort is the stopped one, and its
silence began before their timeouts: it renames the restart after itself (the earliest
fault names a restart), charging nothing more.

Only a session that has sent one ``beat`` is watched (older workers send none). A watch that was not
looking cannot tell silence from its own absence: when its checks were more than half the
soft timeout apart (the sidecar itself stopped, or its loop starved), every clock starts
again from that moment, so a sidecar resumed after a SIGSTOP faults nobody.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kelastic.inprocess_messages import beat_interval
from kelastic.inprocess_record import RestartCause

from .phase import Phase

if TYPE_CHECKING:  # annotations only
    from .parts import Node
    from .server import Session

__all__ = ["SilenceWatch", "Silent"]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: Beats missed by a rank that has not answered the abort of a restart in flight before
#: it is taken for the stopped culprit (a live rank's monitor thread beats on while it
#: leaves the iteration).
CULPRIT_BEATS = 3
#: What a silence means, in every message that names one.
STOPPED = "its process is stopped or its interpreter does not run"


@dataclass(frozen=True)
class Silent:
    """A watched rank heard from last ``seconds`` ago (more than the soft timeout)."""

    local_rank: int
    session: Session
    seconds: float


class SilenceWatch:
    """When each watched session was last heard from, against the soft timeout.

    Args:
        soft_timeout: seconds of silence that make a rank hung (the job's
            ``softTimeoutSeconds``; a worker beats at least four times in it).
        clock: monotonic seconds; the same clock as
            :attr:`~.server.Session.heard` (``time.monotonic``).
    """

    def __init__(self, soft_timeout: float, clock: Callable[[], float]) -> None:
        self._soft = soft_timeout
        self._clock = clock
        self._looked = clock()  # the last check
        self._since = self._looked  # silence counts from here at the earliest
        self._finished: set[int] = set()  # sessions whose function returned
        #: session -> its ``heard`` when its silence was acted on (faulted, killed or
        #: named): not watched again until it is heard from after that (it recovered:
        #: a SIGCONT, a GIL-holding call that returned)
        self._acted: dict[int, float] = {}

    def _start(self, session: Session) -> float:
        return max(session.heard, self._since)

    def _watched(self, session: Session) -> bool:
        acted = self._acted.get(session.id)
        return (session.beating and session.id not in self._finished
                and (acted is None or session.heard > acted))  # fmt: skip

    def _candidates(self, m: Node) -> dict[int, Session]:
        """The sessions of ``m`` watched now: with a restart in flight, those that have
        not answered it (a ready rank's silence is its business)."""
        running = m.phase is Phase.RUNNING
        return {lr: s for lr, s in m.sessions.items()
                if self._watched(s) and (running or lr not in m.ready)}  # fmt: skip

    def deadlines(self, m: Node) -> list[float]:
        """When :meth:`check` must run next (monotonic seconds), while ``m`` has a session
        connected in a running iteration or a restart in flight: the first watched
        session's silence limit, and at least every beat interval (a session starts
        beating without waking the loop, and a gap in the checks must be seen as one);
        none otherwise."""
        limit = self._limit(m.phase)
        if limit is None or not m.sessions:
            return []
        starts = [self._start(s) + limit for s in self._candidates(m).values()]
        return [min([*starts, self._looked + beat_interval(self._soft)])]

    def _limit(self, phase: Phase) -> float | None:
        """Seconds of silence that count in ``phase`` (None: none is watched)."""
        if phase is Phase.RUNNING:
            return self._soft
        if phase in (Phase.ABORTING, Phase.BARRIER):
            return CULPRIT_BEATS * beat_interval(self._soft)
        return None

    def silent(self, sessions: Mapping[int, Session], limit: float) -> list[Silent]:
        """The ``sessions`` (local rank -> session) silent for more than ``limit`` seconds
        now, oldest silence first. A check more than half
        the soft timeout after the previous one restarts every clock instead and returns
        nothing."""
        now = self._clock()
        gap, self._looked = now - self._looked, now
        if gap > self._soft / 2:
            self._since = now
            return []
        found = [
            Silent(local_rank, session, now - self._start(session))
            for local_rank, session in sessions.items()
            if self._watched(session) and now - self._start(session) > limit
        ]
        return sorted(found, key=lambda s: -s.seconds)

    def finished(self, session: Session) -> None:
        """``session``'s function returned (``done``): its silence is its exit's."""
        self._finished.add(session.id)

    def check(self, m: Node, kill: Callable[[Session, int, str], object]) -> None:
        """In a running iteration, fault the longest-silent rank of ``m`` on its behalf
        (cause ``soft_timeout``, its global rank, how long it was silent; one fault is
        enough: its abort reaches every rank); when its restart cannot be recorded (the
        budget spent, etcd failing), ``kill(session, iteration, why)`` it
        (:meth:`.hard_timeout.HardTimeouts.kill`): its exit takes the process path, where
        a hang nobody ends would stay. With a restart in flight, name the culprit
        (:meth:`_name_culprit`). Raises nothing."""
        limit = self._limit(m.phase)
        if limit is None or m.ctx is None:
            return
        ids = {s.id for s in m.sessions.values()}  # the ended sessions forgotten
        self._finished &= ids
        self._acted = {i: h for i, h in self._acted.items() if i in ids}
        found = self.silent(self._candidates(m), limit)
        if not found or found[0].session.hello is None:
            return
        first = found[0]
        self._acted[first.session.id] = first.session.heard  # once, unless it recovers
        if m.phase is not Phase.RUNNING:
            self._name_culprit(m, first)
            return
        message = (f"{_who(first)} silent for {first.seconds:.1f} s (soft timeout "
                   f"{self._soft:g} s): {STOPPED}")  # fmt: skip
        log.warning("%s; faulting it in iteration %d", message, m.iteration)
        record, reason = m.advance(
            RestartCause.SOFT_TIMEOUT, rank=_rank(first), message=message, now=time.time(),
            why=f"local rank {first.local_rank}'s silence",
        )  # fmt: skip
        if record is None:
            kill(first.session, m.iteration, f"{message}; {reason}")

    def _name_culprit(self, m: Node, found: Silent) -> None:
        """A restart is in flight and ``found`` has been silent for
        :data:`CULPRIT_BEATS` beats without answering its abort: it stopped (or its
        interpreter did), and its peers probably timed out waiting on it in a
        collective, so the restart was named after one of them. Its silence began at
        its last beat, before their timers expired: a fault at that time renames the
        restart after it (the earliest fault names a restart:
        :func:`.record.advance_iteration`), nothing more charged, nobody aborted again.
        A restart whose fault came before the silence keeps its name."""
        began = time.time() - found.seconds
        message = (f"{_who(found)} silent since {found.seconds:.1f} s before this check, "
                   f"when the restart came: {STOPPED}")  # fmt: skip
        log.warning("%s; naming it the culprit of the restart into iteration %d, unless a "
                    "fault came first", message, m.iteration)  # fmt: skip
        m.advance(
            RestartCause.SOFT_TIMEOUT, rank=_rank(found), message=message, now=began,
            why=f"local rank {found.local_rank}'s silence", faulted=m.iteration - 1,
        )  # fmt: skip


def _who(found: Silent) -> str:
    hello = found.session.hello
    pid = found.session.peer_pid or (hello.pid if hello else "?")
    return f"local rank {found.local_rank} (pid {pid})"


def _rank(found: Silent) -> int:
    return found.session.hello.rank if found.session.hello else -1
