"""The timer server: torch's ``FileTimerServer`` protocol on a FIFO, reaping hung workers.

One public face: :class:`TimerServer` (the FIFO, its thread and API: :mod:`.server`), its
counters :class:`TimerStats` and its reaps :class:`ReapEvent` (:mod:`.report`; who reaped:
:class:`Reaper`, the in-process hard timeout's kill as a reap: :func:`hard_timeout_reap`;
a worker's process state: :func:`process_state`). Inside:
timers, deadlines and reaping (:mod:`.table`), tokens and budgets (:mod:`.admission`),
fair reading under a flood (:mod:`.reader`), the FIFO's wire format (:mod:`.wire`), and
handing memory back after a flood (:mod:`.memory_release`).
"""

from .memory_release import release_memory
from .report import (
    Reaper,
    ReapEvent,
    TimerStats,
    hard_timeout_reap,
    process_stat,
    process_state,
)
from .server import TimerServer

__all__ = [
    "ReapEvent",
    "Reaper",
    "TimerServer",
    "TimerStats",
    "hard_timeout_reap",
    "process_stat",
    "process_state",
    "release_memory",
]
