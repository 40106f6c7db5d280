"""Which timer requests the timer table takes: a watched worker's token, and the budgets.

The rules are :mod:`kelastic_sidecar.timer.server`'s (its module doc, "Budgets" and "Who may
write"); this module only decides, it holds no timers and does no I/O:

- a watched pid is checked against its token (:class:`Watch`): once the worker sent its
  token, requests naming it without that token are refused; a request without a token
  (torch's unmodified client) is accepted until then;
- a new timer must fit a budget (:class:`Budgets`): a watched pid's own
  ``max_timers_per_pid``, or the pool of ``max_timers`` shared by unwatched pids.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = ["LOG_EVERY", "Budgets", "Watch", "same_token"]

log = logging.getLogger("kelastic_sidecar.timer")

#: One warning is logged per this many bad lines (and per this many unknown-pid expiries).
LOG_EVERY: Final = 1000


def same_token(a: str, b: str) -> bool:
    """Constant-time comparison (``compare_digest`` refuses non-ASCII ``str``)."""
    return hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    )


@dataclass
class Watch:
    """A watched worker: its token, and whether it has sent it yet."""

    token: str | None  # the worker's token; None: not checked
    proven: bool = False  # the worker sent its token: tokenless requests are refused

    def admits(self, token: str | None) -> bool:
        """Whether a request carrying ``token`` may act on this worker's timers."""
        if token is None:
            return not self.proven  # torch's client: until the worker sent its token
        if self.token is None:
            return True  # watched without a token: nothing to check
        return same_token(token, self.token)

    def proven_by(self, token: str | None) -> bool:
        """Whether an admitted request carrying ``token`` proves the worker for the first
        time (from then on only requests with its token count)."""
        return token is not None and self.token is not None and not self.proven


class _DropCounters(Protocol):
    dropped_capacity: int
    dropped_unwatched: int


class Budgets:
    """The most timers held at once: per watched pid, and for all unwatched pids together.

    Args:
        max_timers: the pool shared by unwatched pids.
        max_per_pid: each watched pid's own budget.
        counters: where refused acquires are counted (``dropped_capacity``, and
            ``dropped_unwatched`` for the pool).
    """

    def __init__(self, max_timers: int, max_per_pid: int, counters: _DropCounters) -> None:
        self.max_timers = max_timers
        self.max_per_pid = max_per_pid
        self._counters = counters

    def room_for(self, pid: int, watched: bool, held: int) -> bool:
        """Whether a new timer of ``pid`` fits its budget (``held``: the timers its budget
        holds now); counts the drop if not."""
        if held < (self.max_per_pid if watched else self.max_timers):
            return True
        counters = self._counters
        counters.dropped_capacity += 1
        if not watched:
            counters.dropped_unwatched += 1
        if counters.dropped_capacity % LOG_EVERY == 1:
            log.warning(
                "timer server: %s full, dropped an acquire from pid %d (%d dropped so far)",
                f"budget of watched pid {pid}" if watched else "pool of unwatched pids",
                pid,
                counters.dropped_capacity,
            )
        return False
