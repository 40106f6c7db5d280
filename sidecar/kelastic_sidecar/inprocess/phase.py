"""The phases of one node's in-process restart (a leaf: the machine, its parts and
``/status`` name them)."""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(enum.StrEnum):
    """Where a node's ranks are in the current iteration (``/status``'s ``phase``)."""

    #: No round runs in process.
    IDLE = "idle"
    #: The ranks run the wrapped function.
    RUNNING = "running"
    #: An abort was sent; the ranks leave the iteration.
    ABORTING = "aborting"
    #: Every local rank is ready; the node waits at the termination barrier.
    BARRIER = "barrier"
    #: In-process restart gave up for this round (the process path takes over).
    FAILED = "failed"
