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
2. :meth:`CarryMachine.carry` (the supervisor, when the round's monitor returned): every
   local rank connected (or dead and waiting for the ``go``: the hybrid rung), the
   record moves ``n -> n + 1`` by compare-and-set (cause ``node_lost`` or
   :data:`CAUSE_MEMBERSHIP`; a lost race, or a restart already in flight, is as good) and
   every rank aborts. The barrier is held: no ready key and no ``go`` in the ended round.
3. :meth:`CarryMachine.begin` of the next round: the held ranks' ready key is written
   for the new round, naming the round's ``MASTER_PORT`` (published by its group rank 0,
   in every ``assign``: a new node's workers start with it at once), and the ``go`` gives
   each rank the new round's env. A node whose workers start fresh in a round whose
   record is past 0 writes its ready key at once too (:meth:`CarryMachine.begin`):
   its workers are in the iteration already, and the held nodes wait for every node of
   the round.

Refused (the caller stops the workers: the process path): in-process restart off, no
round running in process, a local rank that never said ``hello``, etcd failing, or the
in-process budget spent, even for a change that would spend nothing: once the budget is
spent every round change starts the workers again (from the rendezvous a peer's process
restart and a node joining look the same: the peer leaves and waits to join again).
Runs on the coordinator's loop thread only, like its bases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from kelastic import contract
from kelastic_etcd import EtcdError, EtcdLeaseNotFound

from ..failure import CAUSE_NODE_LOST, CAUSE_PEER
from ..round_end import RoundEnd, RoundEndKind
from .hybrid import HybridMachine
from .machine import ABORTING, BARRIER, RUNNING
from .record import (
    MAX_TEXT,
    Advance,
    IterationRecord,
    IterationRecordError,
    ReadyRecord,
    RestartCause,
    advance_iteration,
    decode_iteration_record,
    encode_iteration_record,
    encode_ready,
)
from .round import RoundContext

__all__ = ["CAUSE_MEMBERSHIP", "CarryMachine", "CarryRequest", "carry_request", "with_master"]

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


class CarryMachine(HybridMachine):
    """:class:`~kelastic_sidecar.inprocess.hybrid.HybridMachine` whose workers may
    outlive their round (see the module doc).

    Args:
        *args, **kwargs: :class:`HybridMachine`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holding = False  # between rounds: the ranks wait for the next one's go
        self._carried: int | None = None  # the iteration carried into the current round
        #: Round ends whose workers stayed (for ``/status``).
        self.carried = 0

    def carry(self, request: CarryRequest) -> bool:
        """The round ended (``request``, from :func:`carry_request`): abort every local
        rank into the next iteration and hold them for the next round.

        Returns:
            True: the workers stay (the supervisor sends no ``stop``, and no ``assign`` in
            the next round); False: the process path (the reason is logged). Raises
            nothing (etcd failures are a False).
        """
        ctx = self._ctx
        if ctx is None or self._phase not in (RUNNING, ABORTING, BARRIER):
            log.info("the round ended: no in-process restart (%s)", "phase " + self._phase)
            return False
        silent = sorted(set(range(ctx.nproc)) - set(self._sessions) - set(self._pending))
        if silent:
            log.warning("the round ended: local rank(s) %s never said hello; the workers "
                        "start again", ", ".join(map(str, silent)))  # fmt: skip
            return False
        if self._phase == RUNNING:  # a new restart, even a free one, within the budget
            if self._restarts >= self.settings.max_restarts:
                log.warning("the round ended: in-process restart budget of %d spent; the "
                            "workers start again", self.settings.max_restarts)  # fmt: skip
                return False
            if not self._advance_for(request, ctx):
                return False
        elif request.charge and not self._charge_in_flight(request):  # joins the one in flight
            return False
        self._holding = True
        self._barrier_until = None  # the next rendezvous may wait for nodes; begin re-arms it
        self.carried += 1
        log.warning("iteration %d: %s; every local rank waits for the next round's go",
                    self._iteration, request.message)  # fmt: skip
        return True

    def _advance_for(self, request: CarryRequest, ctx: RoundContext) -> bool:
        """Compare-and-set the record past the current iteration; apply it."""
        try:
            out = advance_iteration(
                self._store, self._keys.inprocess_iteration, self._iteration,
                self.settings.max_restarts, round_=ctx.round, cause=request.cause,
                node=self.node, rank=-1, message=request.message, now=time.time(),
                known=self._known, charge=request.charge, known_restarts=self._restarts,
            )  # fmt: skip
        except (EtcdError, RuntimeError) as exc:
            log.error("the round ended: cannot record the in-process restart (%s)", exc)
            return False
        self.corrupt.replaced(out)
        if out.kind is Advance.CORRUPT:
            log.error("the round ended: %s", out.error)
            return False
        if out.kind is Advance.EXHAUSTED or out.record is None:
            log.warning("the round ended: in-process restart budget of %d spent",
                        self.settings.max_restarts)  # fmt: skip
            return False
        record: IterationRecord | None = out.record
        revision = out.revision
        if out.kind is Advance.SUPERSEDED and request.charge:
            record, revision = self._charge_superseded(
                request, out.record, revision, self._iteration + 1
            )
        if record is None:
            return False
        if out.kind is Advance.ADVANCED or revision != out.revision:
            self._known = (encode_iteration_record(record), revision)
        self._apply(record)
        return True

    def _charge_in_flight(self, request: CarryRequest) -> bool:
        """A lost node while a restart is in flight: charge it when that restart spent
        nothing (see :meth:`_charge_superseded`); False when the budget is spent."""
        raw, revision = self._known or (None, 0)
        try:
            record = decode_iteration_record(raw, self._keys.inprocess_iteration) if raw else None
        except IterationRecordError:
            return True  # counted where it was read; the restart goes on as it is
        if record is None:
            return True
        charged, revision = self._charge_superseded(request, record, revision, self._iteration)
        if charged is not None and charged is not record:
            self._known = (encode_iteration_record(charged), revision)
            self._restarts = max(self._restarts, charged.restarts)
        return charged is not None

    def _charge_superseded(
        self, request: CarryRequest, record: IterationRecord, revision: int, target: int
    ) -> tuple[IterationRecord | None, int]:
        """Another node moved the record first, into this very restart (``target``), as
        a change that spends nothing (the lost node's own sidecar sees its lease lost
        before it gets SIGTERM, and may win the race): the lost node is the cause, and it
        spends one restart; compare-and-set once, the iteration unchanged (nobody aborts
        again). Returns the record and revision to apply; ``(None, 0)`` when the budget
        is spent (the process path)."""
        if record.iteration != target or record.cause != CAUSE_MEMBERSHIP:
            return record, revision
        if record.restarts >= self.settings.max_restarts:
            log.warning("the round ended: in-process restart budget of %d spent",
                        self.settings.max_restarts)  # fmt: skip
            return None, 0
        charged = replace(record, restarts=record.restarts + 1, cause=request.cause,
                          node=self.node, message=request.message[:MAX_TEXT])  # fmt: skip
        key = self._keys.inprocess_iteration
        try:
            ok, _, new_revision = self._store.cas(key, encode_iteration_record(charged), revision)
        except EtcdError as exc:  # the record as it is: the restart goes on uncharged
            log.error("cannot charge the in-process restart to %s: %s", request.message, exc)
            return record, revision
        return (charged, new_revision) if ok else (record, revision)

    def begin(self, ctx: RoundContext, record: IterationRecord) -> int:
        """The next round: held ranks enter its barrier (their ready key written for it,
        naming the round's master port); a fresh round's workers start in the record's
        iteration, and when that is past 0 this node's ready key says so at once."""
        if not self._holding:
            base = super().begin(ctx, record)
            if base > 0:
                self._announce(ctx, base)
            return base
        self._holding = False
        self._ctx = ctx
        self._restarts = max(self._restarts, record.restarts)
        if record.iteration > self._iteration:  # another restart meanwhile: abort into it
            self._apply(record)
        elif self._phase == BARRIER:  # our ready key named the ended round
            self._phase = ABORTING
        self._carried = self._iteration
        self._base = self._iteration
        self._barrier_until = self._clock() + self.settings.barrier_timeout
        log.info("round %d: in-process iteration %d carried over (group rank %d of %d)",
                 ctx.round, self._iteration, ctx.group_rank, ctx.group_world_size)  # fmt: skip
        if self._phase == ABORTING and self._ready >= set(range(ctx.nproc)):
            self._publish_ready()
        return self._iteration

    def _announce(self, ctx: RoundContext, iteration: int) -> None:
        """Fresh workers in ``iteration``: write our ready key of it now (nodes carrying
        their ranks into this round wait for every node's)."""
        if ctx.master is None:
            return
        key = self._keys.inprocess_ready(iteration, self.node)
        value = encode_ready(ReadyRecord(ctx.group_rank, ctx.pod_ip, ctx.master[1], ctx.round))
        try:
            try:
                self._store.put(key, value, ctx.lease_id())
            except EtcdLeaseNotFound:
                self._store.put(key, value)
        except EtcdError as exc:  # held nodes then give up their barrier: the process path
            log.error("cannot write the ready key of iteration %d: %s", iteration, exc)
            return
        self._published.append(key)

    def _ready_port(self, ctx: RoundContext) -> int:
        """The round's master port for a carried iteration (a new node's workers use it
        already); else a free one."""
        if self._carried == self._iteration and ctx.master is not None:
            return ctx.master[1]
        return super()._ready_port(ctx)

    def _publish_ready(self) -> None:
        """Not while held between rounds: the next round's :meth:`begin` writes it."""
        if not self._holding:
            super()._publish_ready()

    def _check_barrier(self, values: Mapping[str, tuple[bytes, int]]) -> None:
        """No ``go`` while held: the ended round's barrier may still complete (a lost
        node's key written before it died), but its ranks and world are gone."""
        if not self._holding:
            super()._check_barrier(values)

    def _apply(self, record: IterationRecord) -> None:
        """A newer abort while held: the barrier stays unarmed until the next round."""
        super()._apply(record)
        if self._holding:
            self._barrier_until = None

    def end(self, reason: str) -> None:
        """The round ended without carrying (or the job did): nothing is held."""
        super().end(reason)
        self._holding = False
        self._carried = None

    def status_doc(self) -> dict[str, Any]:
        """The bases' document plus ``carried`` (round ends the workers outlived) and
        ``held`` (waiting for the next round now)."""
        return {**super().status_doc(), "carried": self.carried, "held": self._holding}


def with_master(ctx: RoundContext, env: Mapping[str, str]) -> RoundContext:
    """``ctx`` with :attr:`RoundContext.master` from an ``assign`` env (unchanged when the
    env lacks ``MASTER_ADDR``/``MASTER_PORT`` or the port is not an integer)."""
    addr, port = env.get(contract.MASTER_ADDR), env.get(contract.MASTER_PORT, "")
    if not addr or not port.isdigit():
        return ctx
    return replace(ctx, master=(addr, int(port)))
