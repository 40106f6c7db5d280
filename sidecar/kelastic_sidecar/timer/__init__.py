"""The timer server: torch's ``FileTimerServer`` protocol on a FIFO, reaping hung workers.

One public face: :class:`TimerServer` (the FIFO, its thread and API: :mod:`.server`), its
counters :class:`TimerStats` and its reaps :class:`ReapEvent` (:mod:`.report`). Inside:
timers, deadlines and reaping (:mod:`.table`), tokens and budgets (:mod:`.admission`),
fair reading under a flood (:mod:`.reader`), the FIFO's wire format (:mod:`.wire`), and
handing memory back after a flood (:mod:`.memory_release`).
"""

from .memory_release import release_memory
from .report import ReapEvent, TimerStats
from .server import TimerServer

__all__ = ["ReapEvent", "TimerServer", "TimerStats", "release_memory"]
