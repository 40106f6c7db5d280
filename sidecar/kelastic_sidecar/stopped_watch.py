"""The stopped-worker watch: on the process path, a worker that stays stopped (process
state ``T``: ``SIGSTOP``, ``SIGTSTP``) past a timeout is killed as hung. A part of the
attempt monitor, polled about once a second from its rendezvous-watch thread.

Why: a worker stopped between two ``expires()`` blocks holds no timer, so the timer
server never reaps it, and when no peer waits for it in a collective (one worker, or
ranks that do not synchronise) nothing else notices: the job hangs with nothing said
(torch's timers have the same gap). With in-process restart on, the silence watch
(:mod:`~kelastic_sidecar.inprocess.silence`) covers it and this watch is off.

What it does: it remembers since when each of the attempt's workers has been seen
stopped (with the process's start time, so a pid reused by another process is never
taken for it); one stopped for ``timeout`` seconds has its stacks read
(:class:`~kelastic_sidecar.witness.EvidenceSource`, within the collector's budget), is
reported as a reap (:attr:`~kelastic_sidecar.timer.Reaper.STOPPED_WATCH`, state ``T``,
queued before the kill, as the hard timeout does, so its exit finds it) and SIGKILLed;
the round then fails as a hang naming it (:func:`~kelastic_sidecar.round_end.stopped_failure`).
A worker that runs again (``SIGCONT``) is forgotten. A tracer's stop (``t``: a debugger,
py-spy) is never acted on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping

from .timer import Reaper, ReapEvent, process_stat
from .witness import EvidenceSource

__all__ = ["StoppedWatch"]

log = logging.getLogger("kelastic_sidecar.stopped_watch")


class StoppedWatch:
    """Kills the workers that stay stopped past ``timeout`` (see the module doc).

    Args:
        timeout: seconds a worker may stay stopped (> 0; 0 or less: the watch is off).
        source: reads a worker's stacks before its kill.
        report: told the reap before the kill (the supervisor's queue); keep it quick.
        kill: how a pid is signalled (``os.kill``).
        stat: a pid's ``(state, start time)``
            (:func:`~kelastic_sidecar.timer.process_stat`).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        timeout: float,
        source: EvidenceSource,
        report: Callable[[ReapEvent], None],
        kill: Callable[[int, int], None] = os.kill,
        stat: Callable[[int], tuple[str, int] | None] = process_stat,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self._source = source
        self._report = report
        self._kill = kill
        self._stat = stat
        self._clock = clock
        self._since: dict[int, tuple[int, float]] = {}  # pid -> (start time, first seen)

    def poll(self, pids: Mapping[int, int]) -> list[int]:
        """Look at the workers ``pids`` (local rank -> pid) once; kill those stopped for
        the timeout. Returns the pids killed. Raises nothing."""
        if self.timeout <= 0:
            return []
        now = self._clock()
        seen: dict[int, tuple[int, float]] = {}
        killed: list[int] = []
        for pid in pids.values():
            stat = self._stat(pid)
            if stat is None or stat[0] != "T":
                continue
            started, first = self._since.get(pid, (stat[1], now))
            if started != stat[1]:  # another process under a reused pid
                started, first = stat[1], now
            if now - first < self.timeout:
                seen[pid] = (started, first)
            elif self._kill_stopped(pid, started, now - first):
                killed.append(pid)
        self._since = seen
        return killed

    def _kill_stopped(self, pid: int, started: int, stopped_for: float) -> bool:
        evidence = self._source.evidence([pid]).get(pid)
        if self._stat(pid) != ("T", started):  # resumed, gone or reused meanwhile
            return False
        wall = time.time()
        note = (f"stopped (process state T) for {stopped_for:.0f} s outside any timer "
                f"(timeout {self.timeout:g} s); killed by the sidecar")  # fmt: skip
        reap = ReapEvent(pid, "", signal.SIGKILL, wall - stopped_for, wall, "T",
                         by=Reaper.STOPPED_WATCH, note=note, evidence=evidence)  # fmt: skip
        log.error("pid %d: %s", pid, note)
        try:
            self._report(reap)  # first: its exit finds it
        except Exception:
            log.exception("reporting the kill of pid %d failed; killing it anyway", pid)
        try:
            self._kill(pid, signal.SIGKILL)
        except OSError as exc:
            log.error("killing pid %d failed: %s", pid, exc)
            return False
        return True
