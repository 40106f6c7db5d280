"""The in-process restart state machine of one node (see
:mod:`~kelastic_sidecar.inprocess.coordinator` for the protocol it runs).

:class:`RestartMachine` holds the node's view of the job's iteration and the round's
restart in flight (its attributes, listed in its doc), and handles the coordinator's
events one at a time: a worker's message, a session's end, a read of the etcd record and
barrier keys, a deadline. It is only ever called from the coordinator's loop thread (no
locks); it writes etcd (the record's compare-and-set, in :meth:`RestartMachine.advance`
alone, and the ready key) and sends to the sessions itself.

The rungs of the restart ladder are parts, each with its own state, called by the
machine at named points (as NVIDIA's wrapper calls its hooks): :class:`~.hybrid.RespawnRung`
(a dead worker process starts again at the ``go``), :class:`~.spares.SpareRung` (a waiting
spare takes a dead rank's place) and :class:`~.carry.CarryRung` (the workers outlive
their round). A new rung is a new part.

Phases of a round: ``running`` (the ranks run the current iteration) -> ``aborting``
(``abort(m)`` sent, waiting for every local ``ready(m)``) -> ``barrier`` (our ready key
written, waiting for the other nodes') -> ``running`` (``go(m)`` sent). ``failed``: gave
up for the round (every fault then goes to the process path); ``idle``: no round.
Semantics from NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``):
iteration, abort, termination barrier, hard timeout.

Over ~400 lines as one cohesive thing: every transition of one node's in-process restart
(round, worker messages, etcd reads, deadlines) works on the same state, which a split
would have to share between modules; the pure parts live in
:mod:`~kelastic_sidecar.inprocess.round` and :mod:`~kelastic_sidecar.inprocess.record`,
the rungs in their own modules.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from kelastic import contract
from kelastic.inprocess_messages import (
    Abort,
    Done,
    Fault,
    GiveUp,
    Go,
    Hello,
    Progress,
    Ready,
    WorkerMessage,
)
from kelastic_etcd import EtcdError

from ..ipc import DropReason
from .hard_timeout import HardTimeouts
from .history import Downtime, RestartHistory
from .record import (
    Advance,
    AdvanceOutcome,
    IterationRecord,
    IterationRecordError,
    ReadyRecord,
    RestartCause,
    advance_iteration,
    decode_iteration_record,
    encode_iteration_record,
)
from .round import (
    Phase,
    RoundContext,
    cause_label,
    go_env,
    restart_log_line,
)
from .silence import SilenceWatch
from .unanswered import UnansweredConnects

if TYPE_CHECKING:  # annotations only: the machine imports none of its collaborators
    from kelastic_etcd import EtcdClient

    from ..config import InProcessSettings
    from ..failure import Failure
    from ..metrics import SidecarMetrics
    from .barrier import TerminationBarrier
    from .carry import CarryRequest, CarryRung
    from .hybrid import RespawnRung
    from .parts import OnKill, OnPromote, OnRespawn
    from .server import Session
    from .spares import SpareRung

__all__ = ["ABORTING", "BARRIER", "FAILED", "IDLE", "RUNNING", "Phase", "RestartMachine"]

log = logging.getLogger("kelastic_sidecar.inprocess")


IDLE: Final = Phase.IDLE
RUNNING: Final = Phase.RUNNING
ABORTING: Final = Phase.ABORTING
BARRIER: Final = Phase.BARRIER
FAILED: Final = Phase.FAILED


class CorruptRecords:
    """The corrupt in-process records a node met: each counted in
    ``kelastic_corrupt_values_total{source="inprocess_record"}`` and logged once per etcd
    revision; the latest kept for ``/status`` (``inprocess.corrupt``: ``revision``,
    ``error``, ``replaced_by``: the iteration written over it, once one was)."""

    def __init__(self, metrics: SidecarMetrics) -> None:
        self._metrics = metrics
        self._revision = -1
        self._latest: dict[str, Any] | None = None

    def seen(self, revision: int, error: str, then: str) -> bool:
        """A corrupt record at ``revision`` (``then``: what happens to it, for the log);
        True the first time."""
        if revision == self._revision:
            return False
        self._revision = revision
        self._metrics.corrupt_values.labels(source="inprocess_record").inc()
        log.error("corrupt in-process record refused: %s%s", error, then)
        self._latest = {"revision": revision, "error": error[:500]}
        return True

    def replaced(self, out: AdvanceOutcome) -> None:
        """``out`` (of :func:`~.record.advance_iteration`) replaced a corrupt
        record: say so once, and what replaced it."""
        if out.replaced and out.record is not None:
            self.seen(out.replaced_revision, out.replaced,
                      f"; replaced by iteration {out.record.iteration}")  # fmt: skip
            if self._latest is not None:
                self._latest["replaced_by"] = out.record.iteration

    def doc(self) -> dict[str, Any] | None:
        """The latest corrupt record, for ``/status`` (None: none met)."""
        return dict(self._latest) if self._latest else None


class RestartMachine:
    """One node's in-process restart state (see the module doc).

    Args:
        settings: the knobs (budget, hard and barrier timeouts).
        store: the etcd client.
        keys: the job's key layout.
        node: this node's name.
        metrics: the sidecar's metrics.
        drop: drops a misbehaving session (``InProcessServer.drop``).
        respawn, spares, carry: the rungs (their own state; called at named points).
        barrier: the termination barrier.
        on_respawn, on_promote: how the supervisor is told to start a dead rank again, or
            that a spare took its place (called on the loop thread; they must not block).
        kill: how a rank is killed (``os.kill``); ``on_kill`` is told first (the
            supervisor records the kill as a reap: see :mod:`.hard_timeout`).
        clock: monotonic seconds.

    Its state is :class:`~.parts.Node`'s attributes (documented there: what the rungs
    see), plus ``known`` (the record as last read, for the next compare-and-set),
    ``corrupt`` (the corrupt records met) and ``stale_faults`` (faults of an iteration
    already left, ignored).
    """

    def __init__(
        self,
        settings: InProcessSettings,
        store: EtcdClient,
        keys: contract.Keys,
        node: str,
        metrics: SidecarMetrics,
        drop: Callable[[Session, DropReason | None], None],
        *,
        respawn: RespawnRung,
        spares: SpareRung,
        carry: CarryRung,
        barrier: TerminationBarrier,
        on_respawn: OnRespawn,
        on_promote: OnPromote,
        on_kill: OnKill,
        kill: Callable[[int, int], None] = os.kill,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.store, self.keys, self.node = settings, store, keys, node
        self.metrics, self.drop, self.clock = metrics, drop, clock
        self.respawn, self.spares, self.carry_rung, self._barrier = respawn, spares, carry, barrier
        self.on_respawn, self.on_promote = on_respawn, on_promote
        self.ctx: RoundContext | None = None
        self.phase: Phase = IDLE
        self.iteration = self.base = self.restarts = 0
        self.sessions: dict[int, Session] = {}
        self.offset: dict[int, int] = {}
        self.ready: set[int] = set()
        self._hard = HardTimeouts(settings.hard_timeout, clock, kill, metrics, on_kill)
        self._silence = SilenceWatch(settings.soft_timeout, clock)
        self._unanswered = UnansweredConnects(self._hard)
        self.barrier_until: float | None = None
        self.known: tuple[bytes | None, int] | None = None
        self.corrupt = CorruptRecords(metrics)
        self.history = RestartHistory()
        self._downtime = Downtime(metrics, clock, self.history)
        self.stale_faults = 0

    def has_session(self, local_rank: int) -> bool:
        """Whether ``local_rank`` is connected (said ``hello``)."""
        return local_rank in self.sessions

    def next_deadline(self) -> float | None:
        """The earliest hard-timeout, silence, barrier or rung deadline (monotonic s)."""
        until = () if self.barrier_until is None else (self.barrier_until,)
        return min((*self._hard.deadlines(), *self.respawn.deadlines(), *until,
                    *self._silence.deadlines(self), *self._unanswered.deadlines(self)),
                   default=None)  # fmt: skip

    # ------------------------------------------------------------------ loop: round

    def begin(self, ctx: RoundContext, record: IterationRecord) -> int:
        """Start coordinating the round ``ctx`` (``record`` read now); return the
        iteration its workers start in (a held iteration: the carry rung's)."""
        held = self.carry_rung.resume(self, ctx, record)
        if held is not None:
            return held
        self.end("a new round")
        self.ctx = ctx
        self.iteration = max(self.iteration, record.iteration)
        self.restarts = max(self.restarts, record.restarts)
        self.base, self.phase = self.iteration, RUNNING
        log.info("round %d: in-process iteration %d, %d of %d restarts spent", ctx.round,
                 self.base, self.restarts, self.settings.max_restarts)  # fmt: skip
        if self.base > 0 and (key := self.carry_rung.announce(self, ctx, self.base)):
            self._barrier.published.append(key)
        return self.base

    def end(self, reason: str) -> None:
        """The round ended: ``give_up`` to every connected rank and waiting spare; forget
        the round and every rung's part of it."""
        for session in list(self.sessions.values()):
            session.send(GiveUp(reason=f"round ended: {reason}"))
            session.close()
        self.sessions.clear()
        self.offset.clear()
        self.ready.clear()
        self._downtime.clear()
        self._hard.clear()
        self.barrier_until, self.ctx, self.phase = None, None, IDLE
        self.respawn.ended()
        self.spares.ended(self, reason)
        self.carry_rung.ended()

    def carry(self, request: CarryRequest) -> bool:
        """The round ended: keep the workers for the next one (:meth:`.carry.CarryRung.carry`)."""
        return self.carry_rung.carry(self, request, self.respawn.dead())

    def absorb(self, local_rank: int, pid: int | None, failure: Failure) -> bool:
        """A worker exited non-zero: take it in process (:meth:`.hybrid.RespawnRung.absorb`)."""
        return self.respawn.absorb(self, local_rank, pid, failure)

    def give_up_all(self, reason: str) -> None:
        """No in-process restart in this round any more: every rank falls back."""
        log.error("in-process iteration %d: %s; falling back to a process restart",
                  self.iteration, reason)  # fmt: skip
        for session in self.sessions.values():
            session.send(GiveUp(reason=reason))
        self.phase = FAILED
        self._hard.clear()
        self.barrier_until = None
        self.respawn.gave_up()

    def forget(self, local_rank: int) -> None:
        """A dead rank's session (its connection may not have been seen to end yet)."""
        session = self.sessions.pop(local_rank, None)
        if session is not None:
            self.offset.pop(session.id, None)
            session.close()
        self._hard.cancel(local_rank)
        self._downtime.forget(local_rank)

    # ------------------------------------------------------------------ the record

    def advance(
        self,
        cause: RestartCause,
        *,
        rank: int,
        message: str,
        now: float,
        why: str,
        charge: bool = True,
        faulted: int | None = None,
        take_over: bool = False,
    ) -> tuple[IterationRecord | None, str]:
        """Compare-and-set the record from ``faulted`` (default: the current iteration) to
        the next (:func:`~.record.advance_iteration`; the only write of the record; see
        :meth:`.parts.Node.advance` for the arguments) and apply what it says now.

        Returns:
            ``(record, "")``: the record as stored now, applied (a won or lost race
            alike); ``(None, reason)``: no in-process restart (etcd failing, the record
            corrupt for good, the budget spent; logged). Raises nothing.
        """
        ctx = self.ctx
        assert ctx is not None
        try:
            out = advance_iteration(
                self.store, self.keys.inprocess_iteration,
                self.iteration if faulted is None else faulted, self.settings.max_restarts,
                round_=ctx.round, cause=cause, node=self.node, rank=rank, message=message,
                now=now, known=self.known, charge=charge, known_restarts=self.restarts,
                take_over=take_over,
            )  # fmt: skip
        except (EtcdError, RuntimeError) as exc:
            log.error("%s: cannot record the in-process restart (%s)", why, exc)
            return None, f"cannot record the in-process restart: {exc}"
        self.corrupt.replaced(out)
        if out.kind is Advance.CORRUPT or out.record is None:
            log.error("%s: %s; the processes restart", why, out.error)
            return None, f"no in-process restart: {out.error}"
        if out.kind is Advance.EXHAUSTED:
            spent = f"in-process restart budget of {self.settings.max_restarts} spent"
            log.warning("%s: %s", why, spent)
            return None, spent
        if out.error:  # the take-over's write failed: the restart goes on uncharged
            log.error("%s: cannot charge the in-process restart: %s", why, out.error)
        self.known = (encode_iteration_record(out.record), out.revision)
        self.apply(out.record)
        return out.record, ""

    def apply(self, record: IterationRecord) -> None:
        """The record says ``record.iteration``: abort into it when it is new."""
        self.restarts = max(self.restarts, record.restarts)
        if record.iteration <= self.iteration:
            if record.iteration == self.iteration:  # renamed to an earlier fault of it?
                self.history.revised(record)
            return
        self.iteration = record.iteration
        ctx = self.ctx
        if ctx is None or self.phase == FAILED:
            return
        now = self.clock()
        self.metrics.restarts.labels(level="inprocess", cause=cause_label(record.cause)).inc()
        self.history.began(record)
        self.phase = ABORTING
        self.ready.clear()
        self._downtime.aborted()
        if self.barrier_until is None:
            self.barrier_until = now + self.settings.barrier_timeout
        log.warning("%s; aborting every local rank",
                    restart_log_line(record, self.settings.max_restarts))  # fmt: skip
        for local_rank, session in list(self.sessions.items()):
            self._abort_one(session, local_rank)
        self.respawn.aborted(self)  # the dead ranks stay ready
        self.carry_rung.aborted(self)  # held: the barrier stays unarmed

    def _abort_one(self, session: Session, local_rank: int) -> None:
        self.offset[session.id] = 0  # the rank takes the abort's iteration as it is
        if session.send(Abort(iteration=self.iteration, reason=self.history.abort_reason())):
            self._hard.arm(local_rank)

    # ------------------------------------------------------------------ loop: workers

    def message(self, session: Session, msg: WorkerMessage) -> None:
        """One message of a session (``hello`` first)."""
        try:
            if session.closed.is_set():
                return
            if isinstance(msg, Hello):
                self._hello(session, msg)
                return
            local_rank = session.hello.local_rank if session.hello else -1
            if self.sessions.get(local_rank) is not session:
                return  # replaced by a newer connection of the same rank, or refused
            if isinstance(msg, Fault | Progress | Ready | Done):
                iteration = msg.iteration + self.offset.get(session.id, 0)
                handlers: dict[type, Callable[[Session, int, Any], None]] = {
                    Fault: self._fault, Progress: self._progressed, Ready: self._readied,
                    Done: self._done,
                }  # fmt: skip
                handlers[type(msg)](session, iteration, msg)
        finally:
            session.handled()

    def _hello(self, session: Session, msg: Hello) -> None:
        if msg.spare:
            self.spares.hello(self, session, msg)
            return
        self.respawn.hello(session, msg)
        ctx = self.ctx
        if ctx is not None and msg.local_rank >= ctx.nproc:
            log.error("%r: local rank %d, but this node runs %d; dropping it",
                      session, msg.local_rank, ctx.nproc)  # fmt: skip
            self.drop(session, DropReason.MALFORMED)
            return
        old = self.sessions.get(msg.local_rank)
        if old is not None and old is not session:
            log.warning("local rank %d connected again; dropping its previous session",
                        msg.local_rank)  # fmt: skip
            old.close()
        self.sessions[msg.local_rank] = session
        offset = self.base if msg.iteration == 0 and self.base > 0 else 0
        self.offset[session.id] = offset
        log.info("%r: hello (rank %d, iteration %d)", session, msg.rank, msg.iteration + offset)
        if self.phase == FAILED:
            session.send(GiveUp(reason="in-process restarts failed in this round"))
        elif ctx is not None and msg.iteration + offset < self.iteration:
            self._abort_one(session, msg.local_rank)

    def closed(self, session: Session) -> None:
        """A session that said ``hello`` ended (a waiting spare's: the spare rung's)."""
        if session.hello is None or self.spares.closed(self, session):
            return
        rank = session.hello.local_rank
        if self.sessions.get(rank) is session:
            del self.sessions[rank]
            self._hard.cancel(rank)
        self.offset.pop(session.id, None)

    def _fault(self, session: Session, iteration: int, msg: Fault) -> None:
        ctx = self.ctx
        if ctx is None or self.phase == FAILED:
            session.send(GiveUp(reason="no in-process restart now (no round, or it failed)"))
            return
        if iteration == self.iteration and self.phase in (ABORTING, BARRIER):
            # its abort, finalize or health check failed: it exits (the process path)
            log.error("local rank %d could not leave for iteration %d (%s: %s); its exit "
                      "restarts the worker processes", msg.local_rank, iteration, msg.cause,
                      msg.message)  # fmt: skip
            session.send(GiveUp(reason=f"{msg.cause}: no in-process restart for this rank"))
            return
        if iteration < self.iteration or self.phase != RUNNING:
            self.stale_faults += 1
            log.info("stale fault of iteration %d from local rank %d ignored (now %d)",
                     iteration, msg.local_rank, self.iteration)  # fmt: skip
            return
        if iteration > self.iteration:
            log.warning("fault of iteration %d from local rank %d, ahead of %d; ignored",
                        iteration, msg.local_rank, self.iteration)  # fmt: skip
            return
        assert session.hello is not None
        log.warning("local rank %d faulted in iteration %d: %s: %s",
                    msg.local_rank, iteration, msg.cause, msg.message)  # fmt: skip
        record, reason = self.advance(
            RestartCause(msg.cause), rank=session.hello.rank, message=msg.message,
            now=time.time(), why=f"local rank {msg.local_rank}'s fault",
        )  # fmt: skip
        if record is None:
            session.send(GiveUp(reason=reason))

    def _readied(self, session: Session, iteration: int, msg: Ready) -> None:
        if iteration != self.iteration or self.phase != ABORTING:
            if iteration < self.iteration:  # answered an earlier abort: alive
                self._hard.rearm(msg.local_rank)  # the newer abort is on its way
            return
        self.ready.add(msg.local_rank)
        self._hard.cancel(msg.local_rank)
        self.ready_if_all()

    def ready_if_all(self) -> None:
        """Every local rank ready in the restart in flight: write our ready key."""
        assert self.ctx is not None
        if self.phase == ABORTING and self.ready >= set(range(self.ctx.nproc)):
            self._barrier.publish(self)

    def _progressed(self, session: Session, iteration: int, msg: Progress) -> None:
        if iteration == self.iteration and self.phase == RUNNING and self.ctx is not None:
            self._downtime.progressed(msg.local_rank, self.ctx.nproc, iteration)

    def _done(self, session: Session, iteration: int, msg: Done) -> None:
        log.info("local rank %d finished in iteration %d", msg.local_rank, iteration)
        self._silence.finished(session)

    # ------------------------------------------------------------------ loop: etcd

    def view(
        self,
        raw: tuple[bytes, int] | None,
        iteration: int,
        ready: Mapping[str, tuple[bytes, int]],
    ) -> None:
        """A read of the record (``raw``: value and revision, None when missing) and of
        ``iteration``'s barrier keys (its ``go`` key; for group rank 0, its ready keys)."""
        if raw is None or self.known is None or raw[1] >= self.known[1]:
            self.known = raw if raw is not None else (None, 0)
        if raw is not None:
            try:
                record = decode_iteration_record(raw[0], self.keys.inprocess_iteration)
            except IterationRecordError as exc:
                first = self.corrupt.seen(raw[1], str(exc), "; the next fault replaces it")
                if first and self.phase in (ABORTING, BARRIER):
                    self.give_up_all("the in-process record is corrupt")
                return
            self.apply(record)
        if iteration == self.iteration and self.phase in (BARRIER, RUNNING):
            self._barrier.check(self, ready)

    def go(self, ctx: RoundContext, master: ReadyRecord) -> None:
        """Every node of the round is ready (the barrier's verdict): ``go`` to every local
        rank into the iteration; the dead ranks come back (the respawn rung)."""
        iteration = self.iteration
        self._downtime.went(cause_label(self.history.cause()))
        for local_rank, session in self.sessions.items():
            session.send(Go(iteration, go_env(ctx, local_rank, master, iteration)))
            self.offset[session.id] = 0
        self.phase, self.barrier_until = RUNNING, None
        self._hard.clear()
        log.info("iteration %d: every node ready; go (master %s:%d)",
                 iteration, master.addr, master.port)  # fmt: skip
        self.respawn.went(self, ctx, master, iteration)

    # ------------------------------------------------------------------ loop: timeouts

    def expire(self) -> None:
        """Kill the ranks past their hard timeout, or connecting to a host that does not
        answer (:mod:`.unanswered`); fault a silent rank (:mod:`.silence`); give up a
        barrier past its timeout; the rungs' deadlines."""
        now = self.clock()
        self._silence.check(self, self._hard.kill)
        self._unanswered.check(self, now)
        self._hard.expire(self.sessions, self.iteration, now)  # its exit: a reap (a hang)
        if self.barrier_until is not None and self.barrier_until <= now:
            self.give_up_all(
                f"termination barrier of iteration {self.iteration} not passed within "
                f"{self.settings.barrier_timeout:.1f}s"
            )
        self.respawn.expire(self, now)

    def status_doc(self) -> dict[str, Any]:
        """The ``inprocess`` part of ``/status`` (see :meth:`InProcessCoordinator.status`),
        each rung's part included."""
        return {
            "enabled": True,
            "iteration": self.iteration,
            "restarts": self.restarts,
            "max_restarts": self.settings.max_restarts,
            "phase": self.phase,
            **self.history.doc(),
            "corrupt": self.corrupt.doc(),
            "respawns": self.respawn.respawns,
            "spares": self.spares.status(self),
            **self.carry_rung.status(),
        }
