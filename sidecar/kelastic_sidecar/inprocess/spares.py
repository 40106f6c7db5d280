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
import logging
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, Final

from kelastic import contract
from kelastic.control_messages import MAX_PID
from kelastic.inprocess_messages import GiveUp, Go, Hello

from ..ipc import DropReason
from .round import go_env
from .verdict import Verdict

if TYPE_CHECKING:  # annotations only
    from .parts import Node
    from .record import ReadyRecord
    from .round import RoundContext
    from .server import Session

__all__ = [
    "SPARE_NOTE",
    "SpareHello",
    "SparePool",
    "SpareRung",
    "SpareVerdict",
    "pair_spares",
    "spare_hello_verdict",
]

log = logging.getLogger("kelastic_sidecar.inprocess")

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
            ``failed``: :class:`~kelastic_sidecar.inprocess.round.Phase`).
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


class SpareRung:
    """The spare ranks' part of a node's :class:`~.machine.RestartMachine`: the waiting
    spares (their ``hello``, their end) and, at a ``go``, their promotion into the
    places of dead ranks (called by the :class:`~.hybrid.RespawnRung`).

    A promotion is told through the machine's ``on_promote``.

    Attributes:
        promotions: dead local ranks replaced by a waiting spare, for ``/status``.
    """

    def __init__(self) -> None:
        self._pool = SparePool()
        self._promoted: set[int] = set()  # ids of the sessions of promoted spares
        self.promotions = 0

    def hello(self, m: Node, session: Session, msg: Hello) -> None:
        """A spare's ``hello``: keep it waiting, ``give_up`` or drop it."""
        ctx = m.ctx
        verdict = spare_hello_verdict(
            phase=m.phase, nproc=ctx.nproc if ctx is not None else 0,
            spares=m.settings.spare_ranks, slot=msg.local_rank, pid=msg.pid,
        )  # fmt: skip
        if verdict.kind is SpareHello.DROP:
            log.error("%r: %s; dropping it", session, verdict.reason)
            m.drop(session, DropReason.MALFORMED)
        elif verdict.kind is SpareHello.GIVE_UP:
            log.info("%r: spare not needed (%s)", session, verdict.reason)
            session.send(GiveUp(reason=f"spare not needed: {verdict.reason}"))
        else:
            if self._pool.add(msg.local_rank, session) is not None:
                log.warning("spare slot %d connected again; dropped its previous session",
                            msg.local_rank)  # fmt: skip
            log.info("%r: spare waiting (pid %d, slot %d)", session, msg.pid, msg.local_rank)
        m.metrics.inprocess_spares_waiting.set(len(self._pool))

    def closed(self, m: Node, session: Session) -> bool:
        """A session ended: True when it was a waiting spare's (only logged: no failure of
        the round, the launcher starts a new spare)."""
        slot = self._pool.discard(session)
        if slot is None:
            return False
        pid = session.hello.pid if session.hello is not None else "?"
        log.warning("the spare in slot %d (pid %s) went away while waiting; the launcher "
                    "starts a new one", slot, pid)  # fmt: skip
        m.metrics.inprocess_spares_waiting.set(len(self._pool))
        return True

    def note(self, dead: Collection[int]) -> str:
        """How a new dead rank comes back, as the record says it, when a waiting spare
        (one not promised to a rank that died before, ``dead``) takes it; else ``""``."""
        return SPARE_NOTE if len(self._pool) > len(dead) else ""

    def take_places(
        self,
        m: Node,
        ctx: RoundContext,
        dead: Collection[int],
        master: ReadyRecord,
        iteration: int,
    ) -> list[int]:
        """At the ``go`` of ``iteration``: a waiting spare enters it in place of each dead
        local rank it can; return those ranks."""
        paired = pair_spares(dead, list(self._pool))
        for local_rank, slot in paired.items():
            self._promote(m, ctx, local_rank, slot, master, iteration)
        return list(paired)

    def _promote(self, m: Node, ctx: RoundContext, local_rank: int, slot: int,
                 master: ReadyRecord, iteration: int) -> None:  # fmt: skip
        """The spare of ``slot`` enters ``iteration`` as the dead ``local_rank``."""
        session = self._pool.take(slot)
        env = go_env(ctx, local_rank, master, iteration)
        hello = session.hello
        pid = hello.pid if hello is not None else 0
        rank = env.get(contract.RANK, "")
        number = int(rank) if rank.isdigit() else 0
        session.hello = Hello(pid=pid, local_rank=local_rank, rank=number, iteration=iteration)
        m.sessions[local_rank] = session
        m.offset[session.id] = 0
        self._promoted.add(session.id)
        self.promotions += 1
        m.metrics.inprocess_spares_promoted.inc()
        m.metrics.inprocess_spares_waiting.set(len(self._pool))
        line = (f"local rank {local_rank} replaced by the spare of slot {slot} (pid {pid}, no "
                f"process start)")  # fmt: skip
        m.history.note("promoted", line)
        log.warning("%s in iteration %d (its peers restarted in process)", line, iteration)
        m.on_promote(ctx.round, slot, local_rank, pid)
        session.send(Go(iteration, env))

    def ended(self, m: Node, reason: str) -> None:
        """The round ended: ``give_up`` to the waiting spares (they exit 0)."""
        self._pool.give_up_all(f"round ended: {reason}")
        self._promoted.clear()
        m.metrics.inprocess_spares_waiting.set(0)

    def status(self, m: Node) -> dict[str, Any]:
        """``/status``'s ``spares``: ``configured`` (spare ranks per node), ``waiting``
        (their slots waiting now), ``promoted`` (dead ranks they replaced), ``pids``
        (global rank -> pid of each promoted spare serving now, whose process env still
        says its spare identity: ``kelastic run``'s faults find it by this)."""
        pids = {str(s.hello.rank): s.hello.pid for s in m.sessions.values()
                if s.id in self._promoted and s.hello is not None}  # fmt: skip
        return {"configured": m.settings.spare_ranks, "waiting": list(self._pool),
                "promoted": self.promotions, "pids": pids}  # fmt: skip
