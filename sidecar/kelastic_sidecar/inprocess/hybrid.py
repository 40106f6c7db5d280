"""The hybrid rung on one node: a dead worker's peers restart in process, it starts again.

:class:`HybridMachine` is the :class:`~kelastic_sidecar.inprocess.machine.RestartMachine`
plus worker deaths (the ladder's second rung; the decisions are the pure
:mod:`~kelastic_sidecar.inprocess.hybrid_verdicts`'s). The supervisor's monitor hands it a worker's
non-zero exit (:meth:`InProcessCoordinator.absorb_exit
<kelastic_sidecar.inprocess.coordinator.InProcessCoordinator.absorb_exit>`):

1. ``running`` in iteration ``n``: compare-and-set the record ``n -> n + 1`` (cause
   ``worker_died``, or ``hang`` for a reap or the hard-timeout kill; one in-process
   restart spent, the job's process-restart budget untouched); every node aborts its
   ranks as for a raise. A lost race (another node, or a survivor's "connection reset"
   fault, moved the record first) is as good: the dead rank joins that restart.
2. ``aborting``/``barrier``: the dead rank joins the restart in flight.
3. The dead rank counts as ready in the termination barrier (it left the function
   for good); at the ``go`` of iteration ``m`` the machine asks for it to be started
   again (``on_respawn(round, local_rank, env)``, ``env`` what its peers got with the
   ``go``: the round's env, the iteration's ``MASTER_ADDR``/``MASTER_PORT``,
   ``KELASTIC_INPROCESS_ITERATION=m`` and its timer token). Starting it at the ``go``
   rather than at the death is what lets an unchanged worker library enter ``m`` with
   the right store: its ``hello(m)`` is then a rank of the running iteration.
4. A restarted rank that does not say ``hello`` within the hard timeout makes the node
   give up (``give_up`` to every rank: the process path); one that dies again before
   its ``hello`` is refused (the process path).
5. Spare ranks (``spareRanks``, :mod:`~kelastic_sidecar.inprocess.spares`): a spare's
   ``hello`` keeps it waiting in the pool; at the ``go``, a waiting spare takes each dead
   rank's place instead of step 3's process start: it gets the ``go`` with the dead
   rank's env, its session becomes that rank's, and ``on_promote(round, slot,
   local_rank, pid)`` tells the launcher (``promote``), which starts a new spare in the
   slot (and reports the spare's exit as the rank's if it died meanwhile).
   Spares are not in the termination barrier, never aborted, and their own deaths (a
   closed session) are only logged. The round's end sends them ``give_up``.

Runs on the coordinator's loop thread only, like its base.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kelastic import contract
from kelastic.inprocess_messages import GiveUp, Go, Hello
from kelastic_etcd import EtcdError

from ..failure import Failure, signal_name
from ..ipc import DropReason
from .hybrid_verdicts import (
    RESPAWN_NOTE,
    Absorb,
    absorb_verdict,
    death_cause,
    death_message,
)
from .machine import ABORTING, BARRIER, RUNNING, RestartMachine, victim_pid
from .record import (
    Advance,
    IterationRecord,
    ReadyRecord,
    RestartCause,
    advance_iteration,
    encode_iteration_record,
)
from .round import RoundContext, barrier_verdict, go_env
from .server import Session
from .spares import (
    SPARE_NOTE,
    SpareHello,
    SparePool,
    pair_spares,
    spare_hello_verdict,
)

__all__ = ["HybridMachine", "OnPromote", "OnRespawn"]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: ``(round, local_rank, env)``: start that dead local rank of the round again with
#: ``env`` on top of its attempt's (the supervisor sends the launcher a ``respawn``).
OnRespawn = Callable[[int, int, dict[str, str]], None]


#: ``(round, spare_slot, local_rank, pid)``: the spare ``pid`` (its ``hello``'s: the
#: launcher's view) waiting in that slot was sent the ``go`` of that dead local rank (the
#: supervisor sends the launcher a ``promote``).
OnPromote = Callable[[int, int, int, int], None]


def _no_respawn(round_: int, local_rank: int, env: dict[str, str]) -> None:
    log.error("no one to start local rank %d again (round %d)", local_rank, round_)


def _no_promote(round_: int, slot: int, local_rank: int, pid: int) -> None:
    log.error("no one to tell that spare slot %d is local rank %d (round %d)", slot, local_rank,
              round_)  # fmt: skip


class HybridMachine(RestartMachine):
    """:class:`RestartMachine` that also takes worker deaths (see the module doc).

    Args:
        *args, **kwargs: :class:`RestartMachine`'s.
        on_respawn: called (on the loop thread; it must not block) when a dead local
            rank is to be started again.
        on_promote: called (on the loop thread; it must not block) when a waiting spare
            took a dead local rank's place.
    """

    def __init__(
        self,
        *args: Any,
        on_respawn: OnRespawn = _no_respawn,
        on_promote: OnPromote = _no_promote,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_respawn = on_respawn
        self.on_promote = on_promote
        self._spares = SparePool()
        self._promoted: set[int] = set()  # ids of the sessions of promoted spares
        #: Dead local ranks replaced by a waiting spare, for ``/status``.
        self.promotions = 0
        self._pending: dict[int, int | None] = {}  # dead local rank -> its pid, until the go
        self._starting: dict[int, float] = {}  # local rank -> deadline of its hello
        self._killed: set[int] = set()  # pids this node killed at their hard timeout
        #: Dead local ranks started again (the hybrid rung), for ``/status``.
        self.respawns = 0

    # ------------------------------------------------------------------ deaths

    def absorb(self, local_rank: int, pid: int | None, failure: Failure) -> bool:
        """A worker of the round exited non-zero (``failure``: how, from
        :func:`~kelastic_sidecar.round_end.classify_exit`): take it in process?

        Returns:
            True: its peers restart in process and it is started again at the ``go``
            (through ``on_respawn``); False: the caller takes the process path (the
            reason is logged). Raises nothing (etcd failures are a False).
        """
        ctx = self._ctx
        verdict = absorb_verdict(
            phase=self._phase, nproc=ctx.nproc if ctx is not None else 0,
            local_rank=local_rank, connected=self._sessions.keys(),
            pending=self._pending.keys(), starting=self._starting.keys(),
        )  # fmt: skip
        if verdict.kind is Absorb.REFUSE or ctx is None:
            log.warning("local rank %d died: no in-process restart (%s)", local_rank,
                        verdict.reason)  # fmt: skip
            return False
        killed = pid is not None and pid in self._killed
        cause, message = death_cause(failure, killed), death_message(failure, pid, killed)
        self._forget(local_rank)
        if verdict.kind is Absorb.ADVANCE and not self._advance(cause, failure, message):
            return False
        if self._phase not in (ABORTING, BARRIER):
            return False
        if verdict.kind is Absorb.JOIN:
            log.warning("%s during the in-process restart to iteration %d; it joins it",
                        message, self._iteration)  # fmt: skip
        if self._last is not None:  # /status names the death, also when it joined
            self._last.setdefault("died", []).append(message)
            if failure.signal is not None:
                self._last["signal"] = signal_name(failure.signal)
        self._pending[local_rank] = pid
        self._ready.add(local_rank)
        if self._phase == ABORTING and self._ready >= set(range(ctx.nproc)):
            self._publish_ready()
        return True

    def _forget(self, local_rank: int) -> None:
        """The dead rank's session (its connection may not have been seen to end yet)."""
        session = self._sessions.pop(local_rank, None)
        if session is not None:
            self._offset.pop(session.id, None)
            session.close()
        self._kill_at.pop(local_rank, None)
        self._progress.discard(local_rank)

    def _advance(self, cause: RestartCause, failure: Failure, message: str) -> bool:
        """Compare-and-set the record past the current iteration for the death; apply it."""
        ctx = self._ctx
        assert ctx is not None
        rank = failure.rank if failure.rank is not None else -1
        try:
            out = advance_iteration(
                self._store, self._keys.inprocess_iteration, self._iteration,
                self.settings.max_restarts, round_=ctx.round, cause=cause, node=self.node,
                rank=rank, message=f"{message}; {self._death_note()}", now=failure.time,
                known=self._known, known_restarts=self._restarts,
            )  # fmt: skip
        except (EtcdError, RuntimeError) as exc:
            log.error("%s: cannot record the in-process restart (%s)", message, exc)
            return False
        self.corrupt.replaced(out)
        if out.kind is Advance.CORRUPT:
            log.error("%s: %s", message, out.error)
            return False
        if out.kind is Advance.EXHAUSTED or out.record is None:
            log.warning("%s: in-process restart budget of %d spent", message,
                        self.settings.max_restarts)  # fmt: skip
            return False
        if out.kind is Advance.ADVANCED:
            self._known = (encode_iteration_record(out.record), out.revision)
        self._apply(out.record)
        return True

    def _death_note(self) -> str:
        """How the dead rank comes back, as the record says it: a waiting spare (one
        not promised to a rank that died before) or a process start."""
        return SPARE_NOTE if len(self._spares) > len(self._pending) else RESPAWN_NOTE

    # ------------------------------------------------------------------ spares

    def _spare_hello(self, session: Session, msg: Hello) -> None:
        """A spare's ``hello``: keep it waiting, ``give_up`` or drop it."""
        ctx = self._ctx
        verdict = spare_hello_verdict(
            phase=self._phase, nproc=ctx.nproc if ctx is not None else 0,
            spares=self.settings.spare_ranks, slot=msg.local_rank, pid=msg.pid,
        )  # fmt: skip
        if verdict.kind is SpareHello.DROP:
            log.error("%r: %s; dropping it", session, verdict.reason)
            self._drop(session, DropReason.MALFORMED)
        elif verdict.kind is SpareHello.GIVE_UP:
            log.info("%r: spare not needed (%s)", session, verdict.reason)
            session.send(GiveUp(reason=f"spare not needed: {verdict.reason}"))
        else:
            if self._spares.add(msg.local_rank, session) is not None:
                log.warning("spare slot %d connected again; dropped its previous session",
                            msg.local_rank)  # fmt: skip
            log.info("%r: spare waiting (pid %d, slot %d)", session, msg.pid, msg.local_rank)
        self._metrics.inprocess_spares_waiting.set(len(self._spares))

    def closed(self, session: Session) -> None:
        """A session ended; a waiting spare's is only logged (no failure of the round:
        the launcher starts a new spare)."""
        slot = self._spares.discard(session)
        if slot is None:
            super().closed(session)
            return
        pid = session.hello.pid if session.hello is not None else "?"
        log.warning("the spare in slot %d (pid %s) went away while waiting; the launcher "
                    "starts a new one", slot, pid)  # fmt: skip
        self._metrics.inprocess_spares_waiting.set(len(self._spares))

    def _promote(self, ctx: RoundContext, local_rank: int, slot: int, master: ReadyRecord,
                 iteration: int) -> None:  # fmt: skip
        """The spare of ``slot`` enters ``iteration`` as the dead ``local_rank``."""
        session = self._spares.take(slot)
        env = go_env(ctx, local_rank, master, iteration)
        hello = session.hello
        pid = hello.pid if hello is not None else 0
        rank = env.get(contract.RANK, "")
        number = int(rank) if rank.isdigit() else 0
        session.hello = Hello(pid=pid, local_rank=local_rank, rank=number, iteration=iteration)
        self._sessions[local_rank] = session
        self._offset[session.id] = 0
        self._promoted.add(session.id)
        self.promotions += 1
        self._metrics.inprocess_spares_promoted.inc()
        self._metrics.inprocess_spares_waiting.set(len(self._spares))
        line = (f"local rank {local_rank} replaced by the spare of slot {slot} (pid {pid}, no "
                f"process start)")  # fmt: skip
        if self._last is not None:
            self._last.setdefault("promoted", []).append(line)
        log.warning("%s in iteration %d (its peers restarted in process)", line, iteration)
        self.on_promote(ctx.round, slot, local_rank, pid)
        session.send(Go(iteration, env))

    # ------------------------------------------------------------------ hooks

    def _apply(self, record: IterationRecord) -> None:
        """A newer abort clears the ready set: the dead ranks stay ready."""
        super()._apply(record)
        self._ready.update(self._pending)

    def _check_barrier(self, values: Mapping[str, tuple[bytes, int]]) -> None:
        """At the ``go``, the dead ranks are started again with their ``go`` env."""
        ctx, before, iteration = self._ctx, self._phase, self._iteration
        super()._check_barrier(values)
        if ctx is None or before != BARRIER or self._phase != RUNNING or not self._pending:
            return
        master = barrier_verdict(values, self._keys.inprocess_ready_prefix(iteration), ctx).master
        assert master is not None  # the base went on it
        for local_rank, slot in pair_spares(self._pending, list(self._spares)).items():
            del self._pending[local_rank]
            self._promote(ctx, local_rank, slot, master, iteration)
        for local_rank in sorted(self._pending):
            self._starting[local_rank] = self._clock() + self.settings.hard_timeout
            self.respawns += 1
            log.warning("local rank %d starts again as a process in iteration %d (its peers "
                        "restarted in process)", local_rank, iteration)  # fmt: skip
            self.on_respawn(ctx.round, local_rank, go_env(ctx, local_rank, master, iteration))
        self._pending.clear()

    def _hello(self, session: Session, msg: Hello) -> None:
        if msg.spare:
            self._spare_hello(session, msg)
            return
        if self._starting.pop(msg.local_rank, None) is not None:
            log.info("local rank %d started again: hello (iteration %d)", msg.local_rank,
                     msg.iteration)  # fmt: skip
        super()._hello(session, msg)

    def _kill_rank(self, local_rank: int) -> None:
        session = self._sessions.get(local_rank)
        pid = victim_pid(session) if session is not None and session.hello else None
        if pid is not None:
            self._killed.add(pid)  # its exit is a hang, absorbed like a death
        super()._kill_rank(local_rank)

    def _give_up_all(self, reason: str) -> None:
        super()._give_up_all(reason)
        self._pending.clear()
        self._starting.clear()

    def end(self, reason: str) -> None:
        """The round ended: forget its dead and restarting ranks too; ``give_up`` to the
        waiting spares (they exit 0)."""
        super().end(reason)
        self._spares.give_up_all(f"round ended: {reason}")
        self._promoted.clear()
        self._metrics.inprocess_spares_waiting.set(0)
        self._pending.clear()
        self._starting.clear()
        self._killed.clear()

    def next_deadline(self) -> float | None:
        """The base's deadlines and the restarted ranks' ``hello`` deadlines."""
        base = super().next_deadline()
        return min([*self._starting.values(), *([] if base is None else [base])], default=None)

    def expire(self) -> None:
        """The base's timeouts; a restarted rank without ``hello`` in time gives up."""
        super().expire()
        now = self._clock()
        late = sorted(lr for lr, when in self._starting.items() if when <= now)
        if late:
            self._give_up_all(
                f"local rank(s) {', '.join(map(str, late))} started again but said no hello "
                f"within {self.settings.hard_timeout:.1f}s"
            )

    def status_doc(self) -> dict[str, Any]:
        """The base's document plus ``respawns`` and ``spares`` (``configured``: spare
        ranks per node, ``waiting``: their slots waiting now, ``promoted``: dead ranks
        they replaced, ``pids``: global rank -> pid of each promoted spare serving now,
        whose process env still says its spare identity: ``kelastic run``'s faults find
        it by this); ``last``'s ``died`` and ``promoted`` copied too."""
        doc = super().status_doc()
        for name in ("died", "promoted"):
            if doc["last"] and name in doc["last"]:
                doc["last"][name] = list(doc["last"][name])
        pids = {str(s.hello.rank): s.hello.pid for s in self._sessions.values()
                if s.id in self._promoted and s.hello is not None}  # fmt: skip
        spares = {"configured": self.settings.spare_ranks, "waiting": list(self._spares),
                  "promoted": self.promotions, "pids": pids}  # fmt: skip
        return {**doc, "respawns": self.respawns, "spares": spares}
