"""The in-process restart state machine of one node (see
:mod:`~kelastic_sidecar.inprocess.coordinator` for the protocol it runs).

:class:`RestartMachine` holds the node's view of the job's iteration and the round's
restart in flight, and handles the coordinator's events one at a time: a worker's
message, a session's end, a read of the etcd record and barrier keys, a deadline. It is
only ever called from the coordinator's loop thread (no locks); it writes etcd (the
record's compare-and-set, the ready key) and sends to the sessions itself.

Phases of a round: ``running`` (the ranks run the current iteration) -> ``aborting``
(``abort(m)`` sent, waiting for every local ``ready(m)``) -> ``barrier`` (our ready key
written, waiting for the other nodes') -> ``running`` (``go(m)`` sent). ``failed``: gave
up for the round (every fault then goes to the process path); ``idle``: no round.
Semantics from NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``):
iteration, abort, termination barrier, hard timeout.

Over ~400 lines as one cohesive thing: every transition of one node's in-process restart
(round, worker messages, etcd reads, deadlines) works on the same private state, which a
split would have to share between modules; the pure parts live in
:mod:`~kelastic_sidecar.inprocess.round` and :mod:`~kelastic_sidecar.inprocess.record`.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final

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
from kelastic_etcd import EtcdClient, EtcdError, EtcdLeaseNotFound

from ..config import InProcessSettings
from ..ipc import DropReason
from ..metrics import SidecarMetrics
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
    encode_ready,
)
from .round import (
    RoundContext,
    barrier_verdict,
    cause_label,
    go_env,
    restart_log_line,
)
from .server import Session

__all__ = ["ABORTING", "BARRIER", "FAILED", "IDLE", "RUNNING", "Phase", "RestartMachine"]

log = logging.getLogger("kelastic_sidecar.inprocess")


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


IDLE: Final = Phase.IDLE
RUNNING: Final = Phase.RUNNING
ABORTING: Final = Phase.ABORTING
BARRIER: Final = Phase.BARRIER
FAILED: Final = Phase.FAILED
#: Restarts described in ``/status`` before the latest (``earlier``), so that a reader
#: polling slower than restarts happen still learns each one's cause.
EARLIER_KEPT: Final = 8


def pick_port(ip: str) -> int:
    """A TCP port free on ``ip`` now (the c10d store of the next iteration binds it).

    Raises:
        OSError: ``ip`` is not an address of this host.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def abort_reason(last: Mapping[str, Any] | None) -> str:
    """The ``reason`` of an ``abort``: the fault that caused it (``last`` of the status)."""
    last = last or {}
    return (f"node {last.get('node')} rank {last.get('rank')}: {last.get('cause')}: "
            f"{last.get('message')}")  # fmt: skip


def victim_pid(session: Session) -> int | None:
    """The pid to kill for ``session``'s rank: the kernel's peer pid (none when the peer
    is outside our pid namespace: its ``hello`` pid would name another process here);
    the one its ``hello`` claims only where the kernel cannot tell. Never 0, 1 or the
    sidecar's own."""
    claimed = session.hello.pid if session.hello else None
    pid = session.peer_pid if session.peer_known else claimed
    return pid if pid is not None and pid > 1 and pid != os.getpid() else None


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
        kill: how a rank is killed (``os.kill``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        settings: InProcessSettings,
        store: EtcdClient,
        keys: contract.Keys,
        node: str,
        metrics: SidecarMetrics,
        drop: Callable[[Session, DropReason | None], None],
        kill: Callable[[int, int], None] = os.kill,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._store = store
        self._keys = keys
        self.node = node
        self._metrics = metrics
        self._drop = drop
        self._kill = kill
        self._clock = clock
        self._ctx: RoundContext | None = None
        self._phase: Phase = IDLE
        self._iteration = 0  # the job's iteration as this node knows it (only grows)
        self._base = 0  # the iteration this round's workers started in
        self._restarts = 0
        self._sessions: dict[int, Session] = {}  # local rank -> its session
        self._offset: dict[int, int] = {}  # session id -> added to its iterations
        self._ready: set[int] = set()
        self._progress: set[int] = set()
        self._abort_at: float | None = None  # first abort of the restart in flight
        self._kill_at: dict[int, float] = {}  # local rank -> when it is SIGKILLed
        self._barrier_until: float | None = None
        self._published: list[str] = []  # our ready keys, oldest first
        self._known: tuple[bytes | None, int] | None = None  # the record as last read
        self.corrupt = CorruptRecords(metrics)  #: the corrupt records met
        self._last: dict[str, Any] | None = None
        #: The restarts before ``_last``, oldest first (``/status``'s ``earlier``).
        self._earlier: deque[dict[str, Any]] = deque(maxlen=EARLIER_KEPT)
        #: Stale faults ignored (of an iteration already left).
        self.stale_faults = 0

    @property
    def iteration(self) -> int:
        """The job's iteration as this node knows it (only grows)."""
        return self._iteration

    @property
    def restarts(self) -> int:
        """In-process restarts the job spent, as this node knows it."""
        return self._restarts

    def has_session(self, local_rank: int) -> bool:
        """Whether ``local_rank`` is connected (said ``hello``)."""
        return local_rank in self._sessions

    def next_deadline(self) -> float | None:
        """The earliest hard-timeout or barrier deadline (monotonic seconds), if any."""
        deadlines = [*self._kill_at.values()]
        if self._barrier_until is not None:
            deadlines.append(self._barrier_until)
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ loop: round

    def begin(self, ctx: RoundContext, record: IterationRecord) -> int:
        """Start coordinating the round ``ctx`` (``record`` read now); return the
        iteration its workers start in."""
        self.end("a new round")
        self._ctx = ctx
        self._iteration = max(self._iteration, record.iteration)
        self._restarts = max(self._restarts, record.restarts)
        self._base = self._iteration
        self._phase = RUNNING
        log.info("round %d: in-process iteration %d, %d of %d restarts spent", ctx.round,
                 self._base, self._restarts, self.settings.max_restarts)  # fmt: skip
        return self._base

    def end(self, reason: str) -> None:
        """The round ended: ``give_up`` to every connected rank; forget the round."""
        for session in list(self._sessions.values()):
            session.send(GiveUp(reason=f"round ended: {reason}"))
            session.close()
        self._sessions.clear()
        self._offset.clear()
        self._ready.clear()
        self._progress.clear()
        self._kill_at.clear()
        self._abort_at = self._barrier_until = None
        self._ctx = None
        self._phase = IDLE

    def _give_up_all(self, reason: str) -> None:
        """No in-process restart in this round any more: every rank falls back."""
        log.error("in-process iteration %d: %s; falling back to a process restart",
                  self._iteration, reason)  # fmt: skip
        for session in self._sessions.values():
            session.send(GiveUp(reason=reason))
        self._phase = FAILED
        self._kill_at.clear()
        self._barrier_until = None

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
            if self._sessions.get(local_rank) is not session:
                return  # replaced by a newer connection of the same rank, or refused
            if isinstance(msg, Fault | Progress | Ready | Done):
                iteration = msg.iteration + self._offset.get(session.id, 0)
                handlers: dict[type, Callable[[Session, int, Any], None]] = {
                    Fault: self._fault, Progress: self._progressed, Ready: self._readied,
                    Done: self._done,
                }  # fmt: skip
                handlers[type(msg)](session, iteration, msg)
        finally:
            session.handled()

    def _hello(self, session: Session, msg: Hello) -> None:
        ctx = self._ctx
        if ctx is not None and msg.local_rank >= ctx.nproc:
            log.error("%r: local rank %d, but this node runs %d; dropping it",
                      session, msg.local_rank, ctx.nproc)  # fmt: skip
            self._drop(session, DropReason.MALFORMED)
            return
        old = self._sessions.get(msg.local_rank)
        if old is not None and old is not session:
            log.warning("local rank %d connected again; dropping its previous session",
                        msg.local_rank)  # fmt: skip
            old.close()
        self._sessions[msg.local_rank] = session
        offset = self._base if msg.iteration == 0 and self._base > 0 else 0
        self._offset[session.id] = offset
        log.info("%r: hello (rank %d, iteration %d)", session, msg.rank, msg.iteration + offset)
        if self._phase == FAILED:
            session.send(GiveUp(reason="in-process restarts failed in this round"))
        elif ctx is not None and msg.iteration + offset < self._iteration:
            self._abort_one(session, msg.local_rank)

    def closed(self, session: Session) -> None:
        """A session that said ``hello`` ended."""
        if session.hello is None:
            return
        rank = session.hello.local_rank
        if self._sessions.get(rank) is session:
            del self._sessions[rank]
            self._kill_at.pop(rank, None)
        self._offset.pop(session.id, None)

    def _fault(self, session: Session, iteration: int, msg: Fault) -> None:
        ctx = self._ctx
        if ctx is None or self._phase == FAILED:
            session.send(GiveUp(reason="no in-process restart now (no round, or it failed)"))
            return
        if iteration == self._iteration and self._phase in (ABORTING, BARRIER):
            # its abort, finalize or health check failed: it exits (the process path)
            log.error("local rank %d could not leave for iteration %d (%s: %s); its exit "
                      "restarts the worker processes", msg.local_rank, iteration, msg.cause,
                      msg.message)  # fmt: skip
            session.send(GiveUp(reason=f"{msg.cause}: no in-process restart for this rank"))
            return
        if iteration < self._iteration or self._phase != RUNNING:
            self.stale_faults += 1
            log.info("stale fault of iteration %d from local rank %d ignored (now %d)",
                     iteration, msg.local_rank, self._iteration)  # fmt: skip
            return
        if iteration > self._iteration:
            log.warning("fault of iteration %d from local rank %d, ahead of %d; ignored",
                        iteration, msg.local_rank, self._iteration)  # fmt: skip
            return
        assert session.hello is not None
        log.warning("local rank %d faulted in iteration %d: %s: %s",
                    msg.local_rank, iteration, msg.cause, msg.message)  # fmt: skip
        try:
            out = advance_iteration(
                self._store, self._keys.inprocess_iteration, iteration,
                self.settings.max_restarts, round_=ctx.round, cause=RestartCause(msg.cause),
                node=self.node, rank=session.hello.rank, message=msg.message, now=time.time(),
                known=self._known, known_restarts=self._restarts,
            )  # fmt: skip
        except (EtcdError, RuntimeError) as exc:
            session.send(GiveUp(reason=f"cannot record the in-process restart: {exc}"))
            return
        self.corrupt.replaced(out)
        if out.kind is Advance.CORRUPT:
            log.error("%s; this fault restarts the processes", out.error)
            session.send(GiveUp(reason=f"no in-process restart: {out.error}"))
        elif out.kind is Advance.EXHAUSTED:
            budget = self.settings.max_restarts
            session.send(GiveUp(reason=f"in-process restart budget of {budget} spent"))
        elif out.record is not None:
            self._known = (encode_iteration_record(out.record), out.revision)
            self._apply(out.record)

    def _readied(self, session: Session, iteration: int, msg: Ready) -> None:
        if iteration != self._iteration or self._phase != ABORTING:
            if iteration < self._iteration and msg.local_rank in self._kill_at:
                # answered an earlier abort: alive; the newer abort is on its way
                self._kill_at[msg.local_rank] = self._clock() + self.settings.hard_timeout
            return
        self._ready.add(msg.local_rank)
        self._kill_at.pop(msg.local_rank, None)
        assert self._ctx is not None
        if self._ready >= set(range(self._ctx.nproc)):
            self._publish_ready()

    def _progressed(self, session: Session, iteration: int, msg: Progress) -> None:
        if iteration != self._iteration or self._phase != RUNNING or self._abort_at is None:
            return
        self._progress.add(msg.local_rank)
        assert self._ctx is not None
        if self._progress >= set(range(self._ctx.nproc)):
            took = self._clock() - self._abort_at
            self._abort_at = None
            self._metrics.inprocess_restart.observe(took)
            if self._last is not None:
                self._last["resumed_s"] = round(took, 6)
            log.info("in-process restart to iteration %d: every local rank progressed "
                     "%.3fs after the abort", self._iteration, took)  # fmt: skip

    def _done(self, session: Session, iteration: int, msg: Done) -> None:
        log.info("local rank %d finished in iteration %d", msg.local_rank, iteration)

    # ------------------------------------------------------------------ loop: etcd

    def view(
        self,
        raw: tuple[bytes, int] | None,
        iteration: int,
        ready: Mapping[str, tuple[bytes, int]],
    ) -> None:
        """A read of the record (``raw``: value and revision, None when missing) and of
        ``iteration``'s barrier keys."""
        if raw is None or self._known is None or raw[1] >= self._known[1]:
            self._known = raw if raw is not None else (None, 0)
        if raw is not None:
            try:
                record = decode_iteration_record(raw[0], self._keys.inprocess_iteration)
            except IterationRecordError as exc:
                first = self.corrupt.seen(raw[1], str(exc), "; the next fault replaces it")
                if first and self._phase in (ABORTING, BARRIER):
                    self._give_up_all("the in-process record is corrupt")
                return
            self._apply(record)
        if iteration == self._iteration and self._phase == BARRIER:
            self._check_barrier(ready)

    def _apply(self, record: IterationRecord) -> None:
        """The record says ``record.iteration``: abort into it when it is new."""
        self._restarts = max(self._restarts, record.restarts)
        if record.iteration <= self._iteration:
            return
        self._iteration = record.iteration
        ctx = self._ctx
        if ctx is None or self._phase == FAILED:
            return
        now = self._clock()
        self._metrics.restarts.labels(level="inprocess", cause=cause_label(record.cause)).inc()
        if self._last is not None:
            self._earlier.append(self._last)
        self._last = {
            "iteration": record.iteration, "restarts": record.restarts, "cause": record.cause,
            "rank": record.rank,
            "node": record.node, "message": record.message, "resumed_s": None,
        }  # fmt: skip
        self._phase = ABORTING
        self._ready.clear()
        self._progress.clear()
        if self._abort_at is None:  # the first abort of this restart
            self._abort_at = now
            self._metrics.goodput.set_running(False)  # productive again at the go
        if self._barrier_until is None:
            self._barrier_until = now + self.settings.barrier_timeout
        log.warning("%s; aborting every local rank",
                    restart_log_line(record, self.settings.max_restarts))  # fmt: skip
        for local_rank, session in list(self._sessions.items()):
            self._abort_one(session, local_rank)

    def _abort_one(self, session: Session, local_rank: int) -> None:
        self._offset[session.id] = 0  # the rank takes the abort's iteration as it is
        if session.send(Abort(iteration=self._iteration, reason=abort_reason(self._last))):
            self._kill_at.setdefault(local_rank, self._clock() + self.settings.hard_timeout)

    def _publish_ready(self) -> None:
        """Every local rank passed the termination barrier: write our ready key."""
        ctx = self._ctx
        assert ctx is not None
        key = self._keys.inprocess_ready(self._iteration, self.node)
        prefix = self._keys.inprocess_ready_prefix(self._iteration)
        try:
            port = self._ready_port(ctx)
            value = encode_ready(ReadyRecord(ctx.group_rank, ctx.pod_ip, port, ctx.round))
            try:
                snap = self._store.put_read({key: value}, [prefix], ctx.lease_id())
            except EtcdLeaseNotFound:
                snap = self._store.put_read({key: value}, [prefix])
            for old in set(self._published) - {key}:
                self._store.delete(old)
        except (EtcdError, OSError) as exc:
            self._give_up_all(f"cannot write the termination barrier key: {exc}")
            return
        self._published = [key]
        self._phase = BARRIER
        log.info("iteration %d: ready; waiting for %d nodes", self._iteration, ctx.group_world_size)
        self._check_barrier(snap.values)

    def _ready_port(self, ctx: RoundContext) -> int:
        """The port our ready key names (group rank 0's is the next ``MASTER_PORT``)."""
        return pick_port(ctx.pod_ip)

    def _check_barrier(self, values: Mapping[str, tuple[bytes, int]]) -> None:
        """Go when every node of the round wrote its ready key of the iteration."""
        ctx = self._ctx
        assert ctx is not None
        verdict = barrier_verdict(values, self._keys.inprocess_ready_prefix(self._iteration), ctx)
        for error in verdict.corrupt:
            self._metrics.corrupt_values.labels(source="inprocess_ready").inc()
            log.error("%s", error)
        master = verdict.master
        if master is None:
            return
        if self._abort_at is not None:  # the time no rank ran the function: downtime
            cause = cause_label((self._last or {}).get("cause", ""))
            self._metrics.downtime.labels(cause=cause).inc(self._clock() - self._abort_at)
            self._metrics.goodput.set_running(True)
        for local_rank, session in self._sessions.items():
            session.send(Go(self._iteration, go_env(ctx, local_rank, master, self._iteration)))
            self._offset[session.id] = 0
        self._phase, self._barrier_until = RUNNING, None
        self._kill_at.clear()
        log.info("iteration %d: every node ready; go (master %s:%d)",
                 self._iteration, master.addr, master.port)  # fmt: skip

    # ------------------------------------------------------------------ loop: timeouts

    def expire(self) -> None:
        """Kill the ranks past their hard timeout; give up a barrier past its timeout."""
        now = self._clock()
        for local_rank, when in list(self._kill_at.items()):
            if when <= now:
                del self._kill_at[local_rank]
                self._kill_rank(local_rank)
        if self._barrier_until is not None and self._barrier_until <= now:
            self._give_up_all(
                f"termination barrier of iteration {self._iteration} not passed within "
                f"{self.settings.barrier_timeout:.1f}s"
            )

    def _kill_rank(self, local_rank: int) -> None:
        """SIGKILL a rank that did not pass the termination barrier in time: its exit
        is then the process path's (the launcher reports it)."""
        session = self._sessions.get(local_rank)
        if session is None or session.hello is None:
            return
        pid = victim_pid(session)
        if pid is None:
            log.error("local rank %d missed the hard timeout, but has no pid to kill", local_rank)
            return
        log.error(
            "local rank %d (pid %d) did not pass the termination barrier of iteration %d "
            "within %.1fs; killing it", local_rank, pid, self._iteration,
            self.settings.hard_timeout,
        )  # fmt: skip
        try:
            self._kill(pid, signal.SIGKILL)
            self._metrics.inprocess_killed.inc()
        except OSError as exc:
            log.error("killing pid %d failed: %s", pid, exc)

    def status_doc(self) -> dict[str, Any]:
        """The ``inprocess`` part of ``/status`` (see :meth:`InProcessCoordinator.status`)."""
        return {
            "enabled": True,
            "iteration": self._iteration,
            "restarts": self._restarts,
            "max_restarts": self.settings.max_restarts,
            "phase": self._phase,
            "last": dict(self._last) if self._last else None,
            "earlier": [dict(x) for x in self._earlier],
            "corrupt": self.corrupt.doc(),
        }
