"""Say where a rank is stuck when it does not leave an aborted iteration (stdlib only).

Leaving takes milliseconds: the abort shuts the iteration's connections down, a collective
fails, :class:`~kelastic.inprocess.errors.RestartAbort` lands at the next bytecode, the
process groups are destroyed, and the rank says ``ready``. A rank that has not said
``ready`` :data:`STUCK_AFTER` seconds after its ``abort`` is blocked somewhere the abort
cannot reach (a C++ call that no connection shutdown ends, an ``atomic()`` section that
does not end), and the sidecar will kill it at the hard timeout (or the timer server
after its grace): the rank is lost to the in-process restart and the reason with it. So
the monitor thread writes every Python thread's stack to the rank's stderr, once per
abort, before that happens:

    kelastic.inprocess: local rank 0 has not left iteration 0 5.0s after its abort
    (to iteration 1); its threads' stacks (innermost last):
    --- thread 'MainThread':
      File "train.py", line 217, in _epochs
        loss.backward()
    ...

The innermost Python frame is the one that called into the blocking C/C++ code (a
``faulthandler``-like dump, without its single global watchdog that a training script
may use for itself).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Final, TextIO

__all__ = ["STUCK_AFTER", "LeaveWatch"]

#: Seconds after an ``abort`` without ``ready`` before the stacks are written.
STUCK_AFTER: Final = 5.0


class LeaveWatch:
    """Writes the threads' stacks once when an aborted iteration is not left in time.

    Args:
        local_rank: this worker's ``LOCAL_RANK`` (named in the dump).
        after: seconds from the ``abort`` to the dump.
        out: where to write (default: ``sys.stderr`` at the time of the dump).
        clock: monotonic seconds.

    Thread-safe: :meth:`aborted` and :meth:`check` are called by the monitor thread,
    :meth:`left` by the main thread.
    """

    def __init__(
        self,
        local_rank: int,
        after: float = STUCK_AFTER,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: named in the dump (a promoted spare takes the rank it replaces)
        self.local_rank = local_rank
        self._after = after
        self._out = out
        self._clock = clock
        self._lock = threading.Lock()
        self._left = -1  # the highest iteration this rank said ready for
        self._target = -1  # the highest iteration an abort named
        self._since: float | None = None  # when the pending abort arrived
        self._from = 0  # the iteration being left
        self._dumped = False
        #: Dumps written (for tests and the status).
        self.dumps = 0

    def aborted(self, iteration: int, target: int) -> None:
        """An ``abort`` of ``iteration`` into ``target`` arrived."""
        with self._lock:
            if target <= max(self._left, self._target):
                return
            if self._since is None:
                self._since, self._from, self._dumped = self._clock(), iteration, False
            self._target = target

    def left(self, target: int) -> None:
        """This rank said ``ready`` for ``target``: it left the aborted iteration."""
        with self._lock:
            self._left = max(self._left, target)
            if self._left >= self._target:
                self._since = None

    def check(self) -> bool:
        """Write the dump if it is due; True when it was written now."""
        with self._lock:
            since = self._since
            if since is None or self._dumped:
                return False
            waited = self._clock() - since
            if waited < self._after:
                return False
            self._dumped = True
            head = (f"kelastic.inprocess: local rank {self.local_rank} has not left iteration "
                    f"{self._from} {waited:.1f}s after its abort (to iteration {self._target}); "
                    "its threads' stacks (innermost last):")  # fmt: skip
        out = self._out if self._out is not None else sys.stderr
        try:
            out.write(head + "\n" + thread_stacks(skip=threading.get_ident()))
            out.flush()
        except (OSError, ValueError):  # stderr closed: nothing to say it with
            return False
        self.dumps += 1
        return True


def thread_stacks(skip: int | None = None) -> str:
    """Every Python thread's stack now, each under ``--- thread 'NAME':``, but the thread
    whose ident is ``skip`` (the one writing the dump)."""
    frames = sys._current_frames()
    parts: list[str] = []
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == skip:
            continue
        frame = frames.get(thread.ident)
        if frame is None:
            continue
        parts.append(f"--- thread {thread.name!r}:\n")
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)
