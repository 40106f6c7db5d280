"""Spare ranks of in-process restart (``spec.inProcess.spareRanks``): decided
(pure: no etcd, no threads; the sessions are only held and sent to).

The launcher runs ``spareRanks`` extra processes of the worker command per node
(:mod:`kelastic._spares`); each waits in :class:`kelastic.inprocess.Wrapper`, warm, after a
``hello`` with ``spare: true`` whose ``local_rank`` is its *spare slot*
(``nproc .. nproc + spares - 1``). When the hybrid rung
(:mod:`~kelastic_sidecar.inprocess.hybrid`) restarts a dead local rank's peers in
process, the ``go`` that ends the termination barrier goes to a waiting spare too, with the
dead rank's env: the spare enters the iteration as that rank, and the launcher is told
(``promote``) so that it reports the process as that rank and starts a new spare in the
slot. No spare waiting: the dead rank is started again as a process, as without spares.

NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``) has spare ranks
too: with a ``rank_filter``, the ranks it leaves out of the active world run ``spare_fn``
(they wait, pinging, until a rank completes) and its ``rank_assignment`` moves them into
the world of the next iteration in place of terminated ranks. Here a spare is a process
per node that has never entered the function, a node's own ranks are only ever replaced by
its own spares (the world size and the other nodes' ranks stay), and the coordinator, not
a store on rank 0, pairs them.

:func:`spare_hello_verdict` says what to do with a spare's ``hello``;
:func:`pair_spares` pairs the dead local ranks of a restart with waiting spares;
:class:`SparePool` holds the waiting spares' sessions. Table-tested in
``tests/sidecar/test_inprocess_spares.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator
from typing import Final

from kelastic.control_messages import MAX_PID
from kelastic.inprocess_messages import GiveUp

from .server import Session
from .verdict import Verdict

__all__ = [
    "SPARE_NOTE",
    "SpareHello",
    "SparePool",
    "SpareVerdict",
    "pair_spares",
    "spare_hello_verdict",
]

#: What the iteration record's ``message`` adds to a death that a waiting spare takes
#: (instead of :data:`~kelastic_sidecar.inprocess.hybrid_verdicts.RESPAWN_NOTE`).
SPARE_NOTE: Final = "a waiting spare takes its place (no process start)"


class SpareHello(enum.Enum):
    """What a node's coordinator does with a spare's ``hello``."""

    #: Keep it waiting for a dead rank to replace.
    WAIT = "wait"
    #: Not needed (no round, or in-process restarts failed in it): ``give_up``, it exits 0.
    GIVE_UP = "give_up"
    #: Malformed (a slot outside the node's spare slots): drop the connection.
    DROP = "drop"


#: The outcome of :func:`spare_hello_verdict`.
SpareVerdict = Verdict[SpareHello]


def spare_hello_verdict(
    *, phase: str, nproc: int, spares: int, slot: int, pid: int = 1
) -> SpareVerdict:
    """What to do with the ``hello`` of a spare in ``slot`` (its ``local_rank``).

    Args:
        phase: the coordinator's phase (``idle``, ``running``, ``aborting``, ``barrier``,
            ``failed``: :mod:`~kelastic_sidecar.inprocess.machine`).
        nproc: local ranks of the round (0 when there is no round).
        spares: spare ranks this node runs (``spareRanks``).
        slot: the spare's slot.
        pid: the pid its ``hello`` claims (the launcher's view: a ``promote`` names it).

    A slot outside ``nproc .. nproc + spares - 1``, spares off, or a pid no launcher could
    have started (outside ``1 .. 2**31 - 1``: a ``promote`` could not name it) is malformed:
    :attr:`SpareHello.DROP`. No round, or in-process restarts failed in it:
    :attr:`SpareHello.GIVE_UP`. Otherwise :attr:`SpareHello.WAIT` (also during a restart:
    the spare may be the one its ``go`` needs).
    """
    if spares <= 0:
        return SpareVerdict(SpareHello.DROP, "a spare, but this node runs no spare ranks")
    if phase == "idle" or nproc <= 0:
        return SpareVerdict(SpareHello.GIVE_UP, "no round")
    if not 1 <= pid <= MAX_PID:
        return SpareVerdict(SpareHello.DROP, f"spare pid {pid} not in 1..{MAX_PID}")
    if not nproc <= slot < nproc + spares:
        return SpareVerdict(
            SpareHello.DROP, f"spare slot {slot} not in {nproc}..{nproc + spares - 1}"
        )
    if phase == "failed":
        return SpareVerdict(SpareHello.GIVE_UP, "in-process restarts failed in this round")
    return SpareVerdict(SpareHello.WAIT)


def pair_spares(dead: Collection[int], waiting: Collection[int]) -> dict[int, int]:
    """Which waiting spare replaces which dead local rank at a ``go``: the lowest dead
    ranks get the lowest waiting slots, one each; dead ranks left over start again as
    processes. Returns ``{local_rank: slot}``."""
    return dict(zip(sorted(dead), sorted(waiting), strict=False))


class SparePool:
    """The waiting spares of one node's round: slot -> its session (loop thread only)."""

    def __init__(self) -> None:
        self._waiting: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._waiting))

    def add(self, slot: int, session: Session) -> Session | None:
        """Keep ``session`` waiting in ``slot``; return the session it replaces (a newer
        connection of the same slot), already closed, if any."""
        old = self._waiting.get(slot)
        self._waiting[slot] = session
        if old is not None and old is not session:
            old.close()
            return old
        return None

    def take(self, slot: int) -> Session:
        """Remove and return the session waiting in ``slot``.

        Raises:
            KeyError: none waits there.
        """
        return self._waiting.pop(slot)

    def discard(self, session: Session) -> int | None:
        """Forget ``session`` (its connection ended); return its slot, None if it was not
        waiting here."""
        for slot, waiting in self._waiting.items():
            if waiting is session:
                del self._waiting[slot]
                return slot
        return None

    def give_up_all(self, reason: str) -> None:
        """``give_up`` to every waiting spare (each exits 0) and forget them."""
        for session in self._waiting.values():
            session.send(GiveUp(reason=reason))
            session.close()
        self._waiting.clear()
