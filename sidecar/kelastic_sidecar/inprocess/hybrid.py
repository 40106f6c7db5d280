"""The hybrid rung on one node: a dead worker's peers restart in process, it starts again.

:class:`RespawnRung` is a part of the :class:`~kelastic_sidecar.inprocess.machine.RestartMachine`
that takes worker deaths (the ladder's second rung; the decisions are the pure
:mod:`~kelastic_sidecar.inprocess.hybrid_verdicts`'s). The supervisor's monitor hands it a
worker's non-zero exit (:meth:`InProcessCoordinator.absorb_exit
<kelastic_sidecar.inprocess.coordinator.InProcessCoordinator.absorb_exit>`):

1. ``running`` in iteration ``n``: compare-and-set the record ``n -> n + 1`` (cause
   ``worker_died``, or ``hang`` for a reap: the timer server's or the hard timeout's,
   which the monitor holds and classifies, one place for every hang; one in-process
   restart spent, the job's process-restart budget untouched); every node aborts its
   ranks as for a raise. A lost race (another node, or a survivor's "connection reset"
   fault, moved the record first) is as good: the dead rank joins that restart.
2. ``aborting``/``barrier``: the dead rank joins the restart in flight.
3. The dead rank counts as ready in the termination barrier (it left the function
   for good) and is started again at once, its *early respawn*
   (``on_respawn(round, local_rank, env)``, ``env`` the round's env with
   ``KELASTIC_INPROCESS_ITERATION=m`` and ``KELASTIC_INPROCESS_AWAIT_GO=1``): its
   Wrapper says ``hello(m)`` and waits in the termination barrier like its peers, so its
   process start (a fork from the zygote, or a cold start) overlaps their abort and
   barrier instead of following the ``go``. At the ``go`` it gets the iteration's
   ``MASTER_ADDR``/``MASTER_PORT`` with the others; not connected by then, it gets the
   ``go`` at its ``hello``. A worker library without the early wait would enter at once
   with the wrong store: the job's workers all come from one image, the sidecar's
   ``assign`` and the Wrapper ship together.
4. A restarted rank that does not say ``hello`` within the hard timeout makes the node
   give up (``give_up`` to every rank: the process path); one that dies again before
   its ``hello`` is refused (the process path).
5. Spare ranks (``spareRanks``, :class:`~kelastic_sidecar.inprocess.spares.SpareRung`):
   a dead rank that a waiting spare can take is not started again: at the ``go`` the
   spare takes its place instead of step 3's process start.

The machine calls it at named points: :meth:`RespawnRung.absorb` (a death),
:meth:`~RespawnRung.aborted` (a newer abort), :meth:`~RespawnRung.went` (the ``go``),
:meth:`~RespawnRung.hello`, :meth:`~RespawnRung.expire`,
:meth:`~RespawnRung.gave_up` and :meth:`~RespawnRung.ended`. Runs on the coordinator's
loop thread only, like the machine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kelastic import contract
from kelastic.inprocess_messages import Go, Hello

from ..failure import Failure, signal_name
from .hybrid_verdicts import RESPAWN_NOTE, Absorb, absorb_verdict, death_cause, death_message
from .round import Phase, go_env

if TYPE_CHECKING:  # annotations only
    from .parts import Node
    from .record import ReadyRecord
    from .round import RoundContext
    from .server import Session
    from .spares import SpareRung

__all__ = ["RespawnRung"]

log = logging.getLogger("kelastic_sidecar.inprocess")


class RespawnRung:
    """The hybrid rung's part of a node (see the module doc).

    Args:
        spares: the spare rung, which may take a dead rank's place at the ``go``; the
            others are started again through the machine's ``on_respawn``.

    Attributes:
        respawns: dead local ranks started again, for ``/status``.
    """

    def __init__(self, spares: SpareRung) -> None:
        self.spares = spares
        self._pending: dict[int, int | None] = {}  # dead local rank -> its pid, until the go
        self._starting: dict[int, float] = {}  # local rank -> deadline of its hello
        self._early: set[int] = set()  # pending ranks started again at their death
        self._late: dict[int, Go] = {}  # early ones not connected at the go: their go
        self.respawns = 0

    def absorb(self, m: Node, local_rank: int, pid: int | None, failure: Failure) -> bool:
        """A worker of the round exited non-zero (``failure``: how, from
        :func:`~kelastic_sidecar.round_end.classify_exit`): take it in process?

        Returns:
            True: its peers restart in process and it is started again at the ``go``
            (through the machine's ``on_respawn``); False: the caller takes the process path (the
            reason is logged). Raises nothing (etcd failures are a False).
        """
        ctx = m.ctx
        verdict = absorb_verdict(
            phase=m.phase, nproc=ctx.nproc if ctx is not None else 0,
            local_rank=local_rank, connected=m.sessions.keys(),
            pending=self._pending.keys(), starting=self._starting.keys() | self._early,
        )  # fmt: skip
        if verdict.kind is Absorb.REFUSE or ctx is None:
            log.warning("local rank %d died: no in-process restart (%s)", local_rank,
                        verdict.reason)  # fmt: skip
            return False
        cause, message = death_cause(failure), death_message(failure, pid)
        m.forget(local_rank)
        promised = self._pending.keys() - self._early  # to waiting spares, at the go
        spare = self.spares.note(promised)  # a waiting spare is left to take it
        if verdict.kind is Absorb.ADVANCE:
            note = spare or RESPAWN_NOTE
            record, _ = m.advance(
                cause, rank=failure.rank if failure.rank is not None else -1,
                message=f"{message}; {note}", now=failure.time, why=message,
            )  # fmt: skip
            if record is None:
                return False
        if m.phase not in (Phase.ABORTING, Phase.BARRIER):
            return False
        if verdict.kind is Absorb.JOIN:
            log.warning("%s during the in-process restart to iteration %d; it joins it",
                        message, m.iteration)  # fmt: skip
        m.history.note("died", message)  # /status names the death, also when it joined
        if failure.signal is not None:
            m.history.set("signal", signal_name(failure.signal))
        self._pending[local_rank] = pid
        if not spare:  # no spare waits for it: start it now
            self._start_early(m, ctx, local_rank)
        m.ready.add(local_rank)
        m.ready_if_all()
        return True

    def _start_early(self, m: Node, ctx: RoundContext, local_rank: int) -> None:
        """Start the dead ``local_rank`` again now, to wait in the barrier of the
        iteration being restarted into (the module doc's step 3)."""
        env = dict(ctx.envs.get(local_rank, {}))
        env[contract.ENV_INPROCESS_ITERATION] = str(m.iteration)
        env[contract.ENV_INPROCESS_AWAIT_GO] = "1"
        self._early.add(local_rank)
        self._starting[local_rank] = m.clock() + m.settings.hard_timeout
        self.respawns += 1
        log.warning("local rank %d starts again as a process now, to enter iteration %d with "
                    "its peers (they restart in process)", local_rank, m.iteration)  # fmt: skip
        m.on_respawn(ctx.round, local_rank, contract.without_restore(env))

    def aborted(self, m: Node) -> None:
        """A newer abort cleared the ready set: the dead ranks stay ready; an early one
        not connected yet is aborted into it at its ``hello`` (the machine's rule for a
        ``hello`` of an older iteration), not sent the older ``go``."""
        m.ready.update(self._pending)
        self._late.clear()

    def went(self, m: Node, ctx: RoundContext, master: ReadyRecord, iteration: int) -> None:
        """At the ``go``, the dead ranks come back: an early one connected got the
        ``go`` with its peers (it is a session), one still starting gets it at its
        ``hello``; a waiting spare takes each other one it can, the rest are started
        again with their ``go`` env (a death the rung took while a spare was expected)."""
        if not self._pending:
            return
        for local_rank in sorted(self._early & self._pending.keys()):
            del self._pending[local_rank]
            if local_rank not in m.sessions:
                self._late[local_rank] = Go(iteration, go_env(ctx, local_rank, master, iteration))
        self._early.clear()
        for local_rank in self.spares.take_places(m, ctx, self._pending, master, iteration):
            del self._pending[local_rank]
        for local_rank in sorted(self._pending):
            self._starting[local_rank] = m.clock() + m.settings.hard_timeout
            self.respawns += 1
            log.warning("local rank %d starts again as a process in iteration %d (its peers "
                        "restarted in process)", local_rank, iteration)  # fmt: skip
            env = go_env(ctx, local_rank, master, iteration)
            env[contract.ENV_INPROCESS_AWAIT_GO] = "0"  # the launcher keeps an early one's
            m.on_respawn(ctx.round, local_rank, env)
        self._pending.clear()

    def hello(self, session: Session, msg: Hello) -> None:
        """A rank's ``hello``: one started again has come back; an early one after its
        iteration's ``go`` gets that ``go`` now."""
        if self._starting.pop(msg.local_rank, None) is not None:
            log.info("local rank %d started again: hello (iteration %d)", msg.local_rank,
                     msg.iteration)  # fmt: skip
        go = self._late.pop(msg.local_rank, None)
        if go is not None and msg.iteration == go.iteration:
            session.send(go)

    def dead(self) -> set[int]:
        """The dead local ranks waiting for the ``go`` (they count as connected)."""
        return set(self._pending)

    def deadlines(self) -> list[float]:
        """The restarted ranks' ``hello`` deadlines (monotonic seconds)."""
        return list(self._starting.values())

    def expire(self, m: Node, now: float) -> None:
        """A restarted rank without ``hello`` in time gives the round up."""
        late = sorted(lr for lr, when in self._starting.items() if when <= now)
        if late:
            m.give_up_all(
                f"local rank(s) {', '.join(map(str, late))} started again but said no hello "
                f"within {m.settings.hard_timeout:.1f}s"
            )

    def gave_up(self) -> None:
        """The round gave up in-process restarts: nothing comes back."""
        self._pending.clear()
        self._starting.clear()
        self._early.clear()
        self._late.clear()

    def ended(self) -> None:
        """The round ended: forget its dead and restarting ranks."""
        self.gave_up()
