"""The node-change rung: a round ends for its membership, the workers stay.

The restart ladder: a node lost (lease expired, Pod deleted) or joining (a node
waiting, a planned scale-down) ends the rendezvous round, and without in-process restart
every node stops its workers and starts new ones in the next round. With it, the
survivors keep their processes: they abort the running iteration in process, wait in the
termination barrier while the supervisor runs the next round's rendezvous, and re-enter
the function with the new round's ranks and world size (a new process group); only a new
node's workers start as processes. NVIDIA's in-process restart
(``nvidia_resiliency_ext.inprocess``) has no such rung: there the world only
shrinks (inactive ranks), and a new rank means a new job.

1. :func:`carry_request` (pure) says which round ends carry: a lost node (a fault: one
   in-process restart spent, the job's process-restart budget untouched) and the
   restarts that are not faults (nodes waiting, planned departures, a peer's restart:
   nothing spent); never this node's own failure, removal, the job's end or close.
2. :meth:`CarryRung.carry` (the supervisor, when the round's monitor returned): every
   local rank connected (or dead and waiting for the ``go``: the hybrid rung), the
   record moves ``n -> n + 1`` by compare-and-set (cause ``node_lost`` or
   :data:`CAUSE_MEMBERSHIP`; a lost race, or a restart already in flight, is as good) and
   every rank aborts. The barrier is held: no ready key and no ``go`` in the ended round.
3. :meth:`CarryRung.resume` of the next round: the held ranks' ready key is written
   for the new round, naming the round's ``MASTER_PORT`` (published by its group rank 0,
   in every ``assign``: a new node's workers start with it at once), and the ``go`` gives
   each rank the new round's env. A node whose workers start fresh in a round whose
   record is past 0 writes its ready key at once too (:meth:`CarryRung.announce`):
   its workers are in the iteration already, and the held nodes wait for every node of
   the round.

Refused (the caller stops the workers: the process path): in-process restart off, no
round running in process, a local rank that never said ``hello``, etcd failing, or the
in-process budget spent, even for a change that would spend nothing: once the budget is
spent every round change starts the workers again (from the rendezvous a peer's process
restart and a node joining look the same: the peer leaves and waits to join again).
Runs on the coordinator's loop thread only, like the machine it is a part of.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from kelastic import contract
from kelastic_etcd import EtcdError, EtcdLeaseNotFound

from ..failure import CAUSE_NODE_LOST, CAUSE_PEER
from ..round_end import RoundEnd, RoundEndKind
from .record import ReadyRecord, RestartCause, encode_ready
from .round import Phase, RoundContext

if TYPE_CHECKING:  # annotations only
    from .parts import Node
    from .record import IterationRecord

__all__ = ["CAUSE_MEMBERSHIP", "CarryRequest", "CarryRung", "carry_request", "with_master"]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: The iteration record's ``cause`` for a round change that is not a fault (nodes
#: joining, a planned departure, another node's process restart): no restart is spent.
CAUSE_MEMBERSHIP: Final = RestartCause.MEMBERSHIP


@dataclass(frozen=True)
class CarryRequest:
    """A round end the workers may outlive (see :func:`carry_request`).

    Attributes:
        cause: the record's ``cause``: ``node_lost`` or :data:`CAUSE_MEMBERSHIP`.
        message: one line for the record, ``/status`` and the log.
        charge: whether it spends an in-process restart (a lost node does).
    """

    cause: RestartCause
    message: str
    charge: bool


def carry_request(end: RoundEnd) -> CarryRequest | None:
    """Whether the round end ``end`` (from the supervisor's monitor) may keep the
    workers into the next round: a lost node (``FAILED`` with cause ``node_lost``, from
    the rendezvous check, never from a worker's exit) spends a restart; a ``RESTART``
    (nodes waiting or leaving on purpose, ``scale``; a peer's restart) spends none.
    None for everything else: a worker failure the hybrid rung refused, this node removed,
    the job succeeded or closed, the launcher lost."""
    if end.kind is RoundEndKind.RESTART:
        why = end.reason or CAUSE_PEER
        return CarryRequest(CAUSE_MEMBERSHIP, f"the round ended ({why})", charge=False)
    failure = end.failure
    if end.kind is RoundEndKind.FAILED and failure and failure.cause == CAUSE_NODE_LOST:
        text = f"node {failure.node} lost" + (f": {failure.message}" if failure.message else "")
        return CarryRequest(RestartCause.NODE_LOST, text, charge=True)
    return None


class CarryRung:
    """The node-change rung's part of a node's
    :class:`~kelastic_sidecar.inprocess.machine.RestartMachine`: workers that may
    outlive their round (see the module doc). The machine calls it at named points:
    :meth:`carry` (the round ended), :meth:`resume` and :meth:`announce` (the next
    round), :meth:`aborted`, :meth:`master_port` and :meth:`ended`; while it
    :attr:`holding`, the machine writes no ready key and sends no ``go``.

    Attributes:
        holding: between rounds: the ranks wait for the next one's ``go``.
        carried: round ends whose workers stayed (for ``/status``).
    """

    def __init__(self) -> None:
        self.holding = False
        self._carried: int | None = None  # the iteration carried into the current round
        self.carried = 0

    def carry(self, m: Node, request: CarryRequest, dead: set[int]) -> bool:
        """The round ended (``request``, from :func:`carry_request`): abort every local
        rank into the next iteration and hold them for the next round (``dead``: the
        local ranks dead and waiting for the ``go``, which count as connected).

        Returns:
            True: the workers stay (the supervisor sends no ``stop``, and no ``assign`` in
            the next round); False: the process path (the reason is logged). Raises
            nothing (etcd failures are a False).
        """
        ctx = m.ctx
        if ctx is None or m.phase not in (Phase.RUNNING, Phase.ABORTING, Phase.BARRIER):
            log.info("the round ended: no in-process restart (%s)", "phase " + m.phase)
            return False
        silent = sorted(set(range(ctx.nproc)) - set(m.sessions) - dead)
        if silent:
            log.warning("the round ended: local rank(s) %s never said hello; the workers "
                        "start again", ", ".join(map(str, silent)))  # fmt: skip
            return False
        why = "the round ended"
        if m.phase == Phase.RUNNING:  # a new restart, even a free one, within the budget
            if m.restarts >= m.settings.max_restarts:
                log.warning("the round ended: in-process restart budget of %d spent; the "
                            "workers start again", m.settings.max_restarts)  # fmt: skip
                return False
            record, _ = m.advance(
                request.cause, rank=-1, message=request.message, now=time.time(), why=why,
                charge=request.charge, take_over=request.charge,
            )  # fmt: skip
            if record is None:
                return False
        elif request.charge:  # a lost node joins the restart in flight, and is charged
            record, _ = m.advance(
                request.cause, rank=-1, message=request.message, now=time.time(), why=why,
                faulted=m.iteration - 1, take_over=True,
            )  # fmt: skip
            if record is None:
                return False
        self.holding = True
        m.barrier_until = None  # the next rendezvous may wait for nodes; resume re-arms it
        self.carried += 1
        log.warning("iteration %d: %s; every local rank waits for the next round's go",
                    m.iteration, request.message)  # fmt: skip
        return True

    def resume(self, m: Node, ctx: RoundContext, record: IterationRecord) -> int | None:
        """The next round, when ranks are held: they enter its barrier (their ready key
        written for it, naming the round's master port); return the iteration they are
        in. None when nothing is held (the machine begins afresh)."""
        if not self.holding:
            return None
        self.holding = False
        m.ctx = ctx
        m.restarts = max(m.restarts, record.restarts)
        if record.iteration > m.iteration:  # another restart meanwhile: abort into it
            m.apply(record)
        elif m.phase == Phase.BARRIER:  # our ready key named the ended round
            m.phase = Phase.ABORTING
        self._carried = m.iteration
        m.base = m.iteration
        m.barrier_until = m.clock() + m.settings.barrier_timeout
        log.info("round %d: in-process iteration %d carried over (group rank %d of %d)",
                 ctx.round, m.iteration, ctx.group_rank, ctx.group_world_size)  # fmt: skip
        m.ready_if_all()
        return m.iteration

    def announce(self, m: Node, ctx: RoundContext, iteration: int) -> str | None:
        """Fresh workers in ``iteration`` (past 0): write our ready key of it now (nodes
        carrying their ranks into this round wait for every node's); return the key
        (None: none written)."""
        if ctx.master is None:
            return None
        key = m.keys.inprocess_ready(iteration, m.node)
        value = encode_ready(ReadyRecord(ctx.group_rank, ctx.pod_ip, ctx.master[1], ctx.round))
        try:
            try:
                m.store.put(key, value, ctx.lease_id())
            except EtcdLeaseNotFound:
                m.store.put(key, value)
        except EtcdError as exc:  # held nodes then give up their barrier: the process path
            log.error("cannot write the ready key of iteration %d: %s", iteration, exc)
            return None
        return key

    def master_port(self, m: Node, ctx: RoundContext) -> int | None:
        """The port our ready key names for a carried iteration: the round's master
        port (a new node's workers use it already); None: a free one."""
        if self._carried == m.iteration and ctx.master is not None:
            return ctx.master[1]
        return None

    def aborted(self, m: Node) -> None:
        """A newer abort while held: the barrier stays unarmed until the next round."""
        if self.holding:
            m.barrier_until = None

    def ended(self) -> None:
        """The round ended without carrying (or the job did): nothing is held."""
        self.holding = False
        self._carried = None

    def status(self) -> dict[str, Any]:
        """``/status``'s ``carried`` (round ends the workers outlived) and ``held``
        (waiting for the next round now)."""
        return {"carried": self.carried, "held": self.holding}


def with_master(ctx: RoundContext, env: Mapping[str, str]) -> RoundContext:
    """``ctx`` with :attr:`RoundContext.master` from an ``assign`` env (unchanged when the
    env lacks ``MASTER_ADDR``/``MASTER_PORT`` or the port is not an integer)."""
    addr, port = env.get(contract.MASTER_ADDR), env.get(contract.MASTER_PORT, "")
    if not addr or not port.isdigit():
        return ctx
    return replace(ctx, master=(addr, int(port)))
