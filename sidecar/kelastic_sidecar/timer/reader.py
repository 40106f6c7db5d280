"""Reading the timer FIFO in bounded turns, fairly under a flood.

:mod:`kelastic_sidecar.timer.server`'s module doc ("Fairness under a flood") states the
rule; this is its mechanics. A turn reads at most :data:`READ_PER_TURN` bytes, split into
lines (:class:`~kelastic_sidecar.timer.wire.LineSplitter`). While nothing is queued, lines
are applied to the :class:`~kelastic_sidecar.timer.table.TimerTable` in order; once the
reader falls behind, the lines of watched pids are applied at once (unless a line of the
same pid is still queued: a pid's requests keep their order) and the others queue
(:class:`~kelastic_sidecar.timer.wire.Backlog`), :data:`LINES_PER_TURN` of them applied
per turn; beyond :data:`MAX_BACKLOG` queued lines, unwatched pids' lines are shed.
"""

from __future__ import annotations

import logging
import os
from typing import Final

from .admission import LOG_EVERY
from .table import TimerTable
from .wire import Backlog, LineSplitter, pid_hint

__all__ = ["LINES_PER_TURN", "MAX_BACKLOG", "READ_PER_TURN", "WATCHED_PER_TURN", "FifoReader"]

log = logging.getLogger("kelastic_sidecar.timer")

#: Most bytes read from the FIFO per loop turn (a turn then acts on due deadlines).
READ_PER_TURN: Final = 128 * 1024
#: Most queued lines (of unwatched pids) applied per loop turn.
LINES_PER_TURN: Final = 256
#: Most lines of watched pids applied at once per loop turn (more are queued).
WATCHED_PER_TURN: Final = 1024
#: Most lines queued; beyond, lines of unwatched pids are shed.
MAX_BACKLOG: Final = 65536
_READ_SIZE: Final = 65536


class FifoReader:
    """Reads the FIFO's lines into ``table`` (see the module doc); used by the server
    thread only.

    Args:
        table: where the lines are applied (under its lock).
    """

    def __init__(self, table: TimerTable) -> None:
        self.table = table
        self._lines = LineSplitter()
        self._backlog = Backlog()

    def pending(self) -> bool:
        """Whether lines are queued (the next turn must not sleep)."""
        return bool(self._backlog)

    def read(self, rfd: int) -> None:
        """Read up to :data:`READ_PER_TURN` bytes. While nothing is queued, apply up to
        :data:`LINES_PER_TURN` lines in order; then apply watched pids' lines at once
        (up to :data:`WATCHED_PER_TURN` while the queue has room, all when it is full)
        unless an earlier line of the same pid is queued (the order of a pid's requests
        is kept), and queue the others; shed unwatched pids' lines when the queue is full."""
        table, backlog = self.table, self._backlog
        watched_budget, direct_budget = WATCHED_PER_TURN, LINES_PER_TURN
        for _ in range(READ_PER_TURN // _READ_SIZE):
            try:
                data = os.read(rfd, _READ_SIZE)
            except BlockingIOError:
                return
            with table.lock:
                for line, oversized in self._lines.feed(data):
                    if direct_budget > 0 and not backlog:  # keeping up: no reordering
                        direct_budget -= 1
                        table.handle_line(line, oversized)
                        continue
                    pid = None if oversized else pid_hint(line)
                    full = len(backlog) >= MAX_BACKLOG
                    fast = watched_budget > 0 or full
                    if table.is_watched(pid) and fast and not backlog.holds(pid):
                        watched_budget -= 1
                        table.handle_line(line, oversized)
                        continue
                    if not full or table.is_watched(pid):
                        backlog.push(line, oversized, pid)
                    else:
                        self._shed(pid)
            if len(data) < _READ_SIZE:
                return

    def drain(self) -> None:
        """Apply up to :data:`LINES_PER_TURN` queued lines."""
        with self.table.lock:
            for _ in range(min(LINES_PER_TURN, len(self._backlog))):
                self.table.handle_line(*self._backlog.pop())

    def _shed(self, pid: int | None) -> None:
        self.table.shed(pid)
        shed = self.table.stats.shed
        if pid is not None and shed % LOG_EVERY == 1:
            log.warning(
                "timer server: %d requests queued; shed a line of unwatched pid %d "
                "(%d shed so far)",
                MAX_BACKLOG,
                pid,
                shed,
            )
