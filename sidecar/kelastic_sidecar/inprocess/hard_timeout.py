"""The in-process hard timeout: a rank sent an ``abort`` that has not answered ``ready``
within ``hard_timeout`` seconds is SIGKILLed by its pid, and its exit is the process
path's (NVIDIA's in-process restart kills it the same way). A part of the
:class:`~.machine.RestartMachine`.

The kill is reported (``on_kill``) before the signal is sent: the supervisor's monitor
records it as a reap, as it does the timer server's, so one place holds every hang and
the worker's exit, which can only follow the kill, always finds it there. Report and
kill run on a thread of their own per rank (``on_kill`` reads the worker's stacks within
a budget of seconds): ranks killed together are read together, and the coordinator's
loop never waits on them. At most one kill of a pid is in flight (a second kill of it
meanwhile is dropped), so there are never more kill threads than the node's workers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from ..metrics import SidecarMetrics
    from .parts import OnKill
    from .server import Session

__all__ = ["HardTimeouts", "victim_pid"]

log = logging.getLogger("kelastic_sidecar.inprocess")


def victim_pid(session: Session) -> int | None:
    """The pid to kill for ``session``'s rank: the kernel's peer pid (none when the peer
    is outside our pid namespace: its ``hello`` pid would name another process here);
    the one its ``hello`` claims only where the kernel cannot tell. Never 0, 1 or the
    sidecar's own."""
    claimed = session.hello.pid if session.hello else None
    pid = session.peer_pid if session.peer_known else claimed
    return pid if pid is not None and pid > 1 and pid != os.getpid() else None


class HardTimeouts:
    """Each aborted local rank's kill deadline (loop thread only).

    Args:
        hard_timeout: seconds a rank has to answer an ``abort``.
        clock: monotonic seconds.
        kill: how a pid is killed (``os.kill``).
        metrics: the sidecar's metrics (``kelastic_inprocess_workers_killed_total``).
        on_kill: told ``(pid, why)`` just before a pid is killed (the supervisor queues it
            as a reap of the hard timeout).
    """

    def __init__(
        self,
        hard_timeout: float,
        clock: Callable[[], float],
        kill: Callable[[int, int], None],
        metrics: SidecarMetrics,
        on_kill: OnKill,
    ) -> None:
        self._hard_timeout = hard_timeout
        self._on_kill = on_kill
        self._clock = clock
        self._kill = kill
        self._metrics = metrics
        self._at: dict[int, float] = {}  # local rank -> when it is SIGKILLed
        self._lock = threading.Lock()  # guards _killing (the kill threads end under it)
        self._killing: set[int] = set()  # pids whose kill is in flight

    def arm(self, local_rank: int) -> None:
        """``local_rank`` was sent an ``abort``: its deadline, unless one runs already."""
        self._at.setdefault(local_rank, self._clock() + self._hard_timeout)

    def rearm(self, local_rank: int) -> None:
        """``local_rank`` answered an earlier abort: alive; a new deadline for the newer
        one, when it has one."""
        if local_rank in self._at:
            self._at[local_rank] = self._clock() + self._hard_timeout

    def cancel(self, local_rank: int) -> None:
        """``local_rank`` is ready, or gone: no kill."""
        self._at.pop(local_rank, None)

    def clear(self) -> None:
        """No kill for anyone (a ``go``, a give-up, the round's end)."""
        self._at.clear()

    def deadlines(self) -> list[float]:
        """The kill deadlines (monotonic seconds)."""
        return list(self._at.values())

    def due(self, now: float) -> list[int]:
        """The local ranks past their deadline at ``now`` (forgotten here)."""
        late = [lr for lr, when in self._at.items() if when <= now]
        for local_rank in late:
            del self._at[local_rank]
        return late

    def expire(self, sessions: Mapping[int, Session], iteration: int, now: float) -> None:
        """Kill each rank of ``sessions`` (local rank -> session) past its deadline at
        ``now``, aborted into ``iteration``."""
        for local_rank in self.due(now):
            session = sessions.get(local_rank)
            if session is not None and session.hello is not None:
                self.kill(session, iteration)

    def kill(self, session: Session, iteration: int, why: str | None = None) -> int | None:
        """Start the SIGKILL of ``session``'s rank, which did not pass the termination
        barrier of ``iteration`` in time (or ``why``, another reason: a silent rank whose
        restart could not be recorded): ``on_kill``, then the signal, on a thread of its
        own; return its pid (None: none to kill, logged; its pid, doing nothing, while
        a kill of it is in flight). Raises nothing."""
        assert session.hello is not None
        local_rank = session.hello.local_rank
        pid = victim_pid(session)
        if pid is None:
            log.error("local rank %d is to be killed, but has no pid to kill", local_rank)
            return None
        if why is None:
            why = (f"no termination barrier of iteration {iteration} within the hard timeout "
                   f"({self._hard_timeout:g} s)")  # fmt: skip
        with self._lock:
            if pid in self._killing:
                log.info("local rank %d (pid %d): its kill is already under way", local_rank, pid)
                return pid
            self._killing.add(pid)
        log.error("local rank %d (pid %d): %s; killing it", local_rank, pid, why)
        threading.Thread(target=self._kill_now, args=(pid, why), name="inprocess-kill",
                         daemon=True).start()  # fmt: skip
        return pid

    def _kill_now(self, pid: int, why: str) -> None:
        """Report, then SIGKILL (its own thread: ``on_kill`` reads the worker's stacks
        within a budget of seconds, and several ranks past their hard timeout are read
        at once, never one after another on the coordinator's loop)."""
        try:
            self._on_kill(pid, f"{why}; killed by the sidecar")  # first: its exit finds it
        except Exception:
            log.exception("reporting the kill of pid %d failed; killing it anyway", pid)
        try:
            self._kill(pid, signal.SIGKILL)
            self._metrics.inprocess_killed.inc()
        except OSError as exc:
            log.error("killing pid %d failed: %s", pid, exc)
        finally:
            with self._lock:
                self._killing.discard(pid)
