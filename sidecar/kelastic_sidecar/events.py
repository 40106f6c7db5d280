"""The events the supervisor's main thread takes off its queue, typed.

Its parts put them there from their own threads (:func:`kelastic_sidecar.wiring.build_parts`
connects the callbacks): the timer server a reap (:class:`WorkerReaped`), the control
server a launcher message (:class:`FromLauncher`), the rendezvous watch a possible change
(:class:`RendezvousChanged`), the in-process coordinator a dead rank to start again
(:class:`RespawnDue`), a spare that took its place (:class:`SparePromoted`) or its hard
timeout's kill of a hung worker (a :class:`WorkerReaped`, as the timer server's). Plain
data (and :func:`take_reaps`): this module builds and starts nothing.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from .control import Message
    from .timer import ReapEvent

__all__ = [
    "Event",
    "FromLauncher",
    "RendezvousChanged",
    "RespawnDue",
    "SparePromoted",
    "WorkerReaped",
    "take_reaps",
]


@dataclass(frozen=True)
class WorkerReaped:
    """A hung worker was killed: by the timer server, or by the in-process hard timeout
    (queued before its kill; ``reap.by`` says which)."""

    reap: ReapEvent


@dataclass(frozen=True)
class FromLauncher:
    """A message from the launcher, or its disconnection."""

    message: Message


@dataclass(frozen=True)
class RespawnDue:
    """The in-process coordinator wants a dead local rank started again (the hybrid
    rung): ``env`` on top of its attempt's, for the round ``round``."""

    round: int
    local_rank: int
    env: dict[str, str]


@dataclass(frozen=True)
class SparePromoted:
    """The spare waiting in slot ``slot`` (its ``hello``'s pid ``pid``) took the dead
    local rank ``local_rank``'s place in round ``round`` (spare ranks): the launcher gets
    a ``promote`` and starts no process for that rank."""

    round: int
    local_rank: int
    slot: int
    pid: int


@dataclass(frozen=True)
class RendezvousChanged:
    """The rendezvous may have changed: check the round (at most one waits queued)."""


#: What the supervisor's main thread takes off its queue.
Event = WorkerReaped | FromLauncher | RendezvousChanged | RespawnDue | SparePromoted


def take_reaps(events: queue.Queue[Event]) -> list[WorkerReaped]:
    """Take the :class:`WorkerReaped` events out of ``events`` now, oldest first; every
    other event stays queued, in order (under the queue's own lock: no put or get runs
    meanwhile). For a reap that must not wait behind the events queued before it."""
    with events.mutex:
        reaps = [e for e in events.queue if isinstance(e, WorkerReaped)]
        for event in reaps:
            events.queue.remove(event)
    return reaps
