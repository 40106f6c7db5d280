"""One node's workers, attempt by attempt: the supervisor's event loop while a round runs.

The :class:`~kelastic_sidecar.supervisor.Supervisor` decides the node's course (join a
round, charge the budget, finish); :class:`AttemptMonitor` keeps the current attempt's
workers (their pids, timer tokens and reaps) and turns the events on the supervisor's
queue (:mod:`kelastic_sidecar.wiring`) into how the round ended
(:class:`~kelastic_sidecar.round_end.RoundEnd`, classified by the pure
:mod:`kelastic_sidecar.round_end`). The rendezvous is watched from a thread that only
queues a :class:`RendezvousChanged` (at most one waits), so every input is handled by
the main thread.

With in-process restart on, a worker's non-zero exit is first offered to the in-process
coordinator (:meth:`~kelastic_sidecar.inprocess.coordinator.InProcessCoordinator.absorb_exit`,
the hybrid rung): taken, the round goes on (its peers restart in process) and
the coordinator's :class:`RespawnDue` becomes a ``respawn`` for the launcher, whose
``started`` adds the new pid; refused, the round ends as without it.

Over ~400 lines because it is one event loop: the attempt's state (pids, timer tokens,
reaps, what was read of the workers) and every event that changes it; its decisions are
the pure functions of :mod:`~kelastic_sidecar.round_end` and :mod:`~kelastic_sidecar.witness`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kelastic.control_messages import (
    Checked,
    Exited,
    Hello,
    Promote,
    Respawn,
    Started,
    Stop,
    Stopped,
)
from kelastic.failure_policy import FailureRule
from kelastic.hang_where import HangWhere
from kelastic_etcd import EtcdError

from .control import ControlServer, Disconnected, Message
from .events import (
    Event,
    FromLauncher,
    RendezvousChanged,
    RespawnDue,
    SparePromoted,
    WorkerReaped,
    take_reaps,
)
from .failure import CAUSE_HANG, CAUSE_START_FAILURE, CAUSE_WORKER_FAILURE, Failure, signal_name
from .failure_rules import in_process_allowed
from .inprocess import respawn_failure
from .rendezvous import RendezvousError
from .round_end import (
    LiveStates,
    RoundEnd,
    RoundEndKind,
    RoundOf,
    classify_check,
    classify_exit,
    explain_worker_failure,
    stopped_failure,
)
from .steptime import StepTimes
from .stopped_watch import StoppedWatch
from .witness import NO_HANG_SINK, HangSink, observe, where_ranks_were

if TYPE_CHECKING:  # annotations only
    from .inprocess import InProcessCoordinator
    from .metrics import SidecarMetrics
    from .rendezvous import EtcdRendezvousHandler, RendezvousInfo
    from .timer import ReapEvent, TimerServer

__all__ = ["AttemptMonitor", "late_reap"]

log = logging.getLogger("kelastic_sidecar.supervisor")


def late_reap(
    timer: TimerServer, reaped: dict[int, ReapEvent], pid: int | None
) -> ReapEvent | None:
    """The timer server's reap of the exited worker ``pid`` when ``reaped`` (the reaps
    handled so far, from the queue) lacks it: its exit overtook the reap's event (the
    kill comes first, the ``on_reap`` callback after; a loaded run named such a rank
    ``worker_died``, not ``hang``). None when it is known, or no reap of it exists."""
    return timer.reap_of(pid) if pid is not None and pid not in reaped else None


class AttemptMonitor:
    """The current attempt's workers and the events about them.

    Args:
        node: this node's name.
        nproc: workers per node (the launcher's ``hello`` may change :attr:`nproc`).
        events: the supervisor's queue.
        control: the launcher's connection.
        timer: the timer server (watches the workers' pids).
        metrics: the sidecar's metrics.
        stop_grace: how long the launcher waits for workers to stop (``stop`` waits 10 s
            more for its confirmation).
        inprocess: the in-process coordinator (offered a worker's non-zero exit first);
            None: every such exit ends the round.
        steps: step times per local rank (told which pid is which local rank); None: a
            private one that nobody reads.
        rules: ``spec.failurePolicy.rules``: an exit whose rule says ``FailJob`` or
            ``RestartPod`` is not offered to ``inprocess``
            (:func:`~.failure_rules.in_process_allowed`).
        stopped_timeout: seconds a worker may stay stopped before it is killed as hung
            (:mod:`~.stopped_watch`); 0: never (in-process restart's silence watch).
        hangs: where the findings on a hung round go: :attr:`where` each time it is
            read (for the operator), a stopped worker of a round a peer restarted (the
            round's charge should name it); None: nowhere but the log.
    """

    def __init__(
        self,
        node: str,
        nproc: int,
        events: queue.Queue[Event],
        control: ControlServer,
        timer: TimerServer,
        metrics: SidecarMetrics,
        stop_grace: float,
        inprocess: InProcessCoordinator | None = None,
        steps: StepTimes | None = None,
        rules: Sequence[FailureRule] = (),
        stopped_timeout: float = 0.0,
        hangs: HangSink | None = None,
    ) -> None:
        self.node = node
        self.nproc = nproc
        self._events = events
        self._hello: Hello | None = None  # the launcher's, once it connected
        self._control = control
        self._timer = timer
        self._metrics = metrics
        self._stop_grace = stop_grace
        self._inprocess = inprocess
        self.steps = steps or StepTimes()
        self._rules = tuple(rules)
        # a worker stopped past it is killed as hung (polled by the rendezvous watch)
        self._stopped = StoppedWatch(stopped_timeout, timer,
                                     lambda reap: events.put(WorkerReaped(reap)))  # fmt: skip
        self.attempt = 0
        self.pids: dict[int, int] = {}  # local rank -> pid
        self.tokens: dict[int, str] = {}  # local rank -> its timer token this attempt
        self.warm = 0  # workers of the attempt forked by the launcher's warm-start zygote
        self.reaped: dict[int, ReapEvent] = {}  # pid -> reap of the current attempt
        #: What was read of the attempt's workers while they lived (:meth:`_observe`).
        self.seen = LiveStates()
        self.respawned: set[int] = set()  # local ranks started again this attempt
        self.promoted: set[int] = set()  # local ranks a spare took over, until its started
        #: Where each worker was when the latest hung round ended (:meth:`before_stop`);
        #: None before any hang.
        self.where: HangWhere | None = None
        self._hangs = hangs or NO_HANG_SINK
        self.watch_stop = threading.Event()
        self._rdzv_queued = threading.Event()  # a RendezvousChanged waits in the queue

    # ------------------------------------------------------------------- attempts

    def new_attempt(self) -> dict[int, str]:
        """Start the next attempt: forget the last one's workers; return the new timer
        tokens (local rank -> token)."""
        self.attempt += 1
        self.pids.clear()
        self.reaped.clear()
        self.seen = LiveStates()
        self.warm = 0
        self.respawned.clear()
        self.promoted.clear()
        self._timer.forget_all()
        self.steps.clear()  # a new world: its step times start afresh
        self.tokens = {r: secrets.token_hex(16) for r in range(self.nproc)}
        return self.tokens

    def stop_workers(self, reason: str) -> None:
        """Ask the launcher to stop the current attempt's workers and wait for it (the
        caller checked there is an attempt)."""
        if not self._control.send(Stop(attempt=self.attempt, reason=reason)):
            return
        deadline = time.monotonic() + self._stop_grace + 10.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.next_event(timeout=left)
            except queue.Empty:
                break
            if isinstance(event, FromLauncher):
                msg = event.message
                if isinstance(msg, Disconnected):
                    break
                if isinstance(msg, Stopped) and msg.attempt == self.attempt:
                    break
            if isinstance(event, WorkerReaped):
                self.on_reaped(event.reap)
        else:
            log.warning("the launcher did not confirm the stop of attempt %d", self.attempt)
        self._timer.forget_all()
        self.pids.clear()

    # --------------------------------------------------------------------- events

    def wait_hello(self) -> Hello:
        """Block until the launcher sends ``hello`` (kept: :meth:`launcher_checks`); other
        events are dropped."""
        while True:
            event = self.next_event()
            if isinstance(event, FromLauncher) and isinstance(event.message, Hello):
                self._hello = event.message
                return event.message

    def launcher_checks(self) -> bool:
        """Whether the launcher said it answers ``check`` (an older one does not)."""
        return self._hello is not None and self._hello.netcheck

    def wait_checked(self, round_: int, timeout: float) -> Checked | Disconnected | None:
        """Wait up to ``timeout`` seconds for the launcher's ``checked`` of ``round_``
        (:mod:`~kelastic_sidecar.netcheck`): it, the launcher's disconnection (put back
        for the round to see), or None at the timeout. Other events are kept, in order, for
        :meth:`monitor`; a ``checked`` of another round is dropped."""
        deadline = time.monotonic() + timeout
        kept: list[Event] = []
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = self._events.get(timeout=left)
                except queue.Empty:
                    return None
                message = event.message if isinstance(event, FromLauncher) else None
                if isinstance(message, Checked) and message.round == round_:
                    return message
                if isinstance(message, Disconnected):
                    kept.append(event)
                    return message
                if not isinstance(message, Checked):
                    kept.append(event)
            return None
        finally:
            for event in kept:
                self._events.put(event)

    def next_event(self, timeout: float | None = None) -> Event:
        """The next event (``queue.Empty`` after ``timeout`` s); a rendezvous check taken
        off the queue lets the next change queue another."""
        event = self._events.get(timeout=timeout)
        if isinstance(event, RendezvousChanged):
            self._rdzv_queued.clear()
        return event

    def queue_check(self) -> None:
        """Queue a rendezvous check unless one already waits: a check reads the current
        state, so a second one adds nothing, and while etcd is down (each check then takes
        the store's whole timeout, and the watch fails faster) the repeats would bury the
        workers' exits behind them."""
        if not self._rdzv_queued.is_set():
            self._rdzv_queued.set()
            self._events.put(RendezvousChanged())

    def monitor(
        self,
        handler: EtcdRendezvousHandler,
        info: RendezvousInfo,
        on_started: Callable[[], None],
    ) -> RoundEnd:
        """Handle events until the round ends for this node.

        Args:
            handler: the rendezvous (watched from a thread meanwhile).
            info: the round.
            on_started: called when the launcher reports the attempt's workers started.
        """
        succeeded: set[int] = set()
        self.watch_stop.clear()
        watcher = threading.Thread(
            target=self._watch_rendezvous, args=(handler,), name="rdzv-watch", daemon=True
        )
        watcher.start()
        # A change may have happened between the round completing and the watch starting.
        self.queue_check()
        try:
            while True:
                event = self.next_event()
                if isinstance(event, WorkerReaped):
                    self.on_reaped(event.reap)
                elif isinstance(event, RendezvousChanged):
                    end = self.check_round(handler, info)
                    if end is not None:
                        return end
                elif isinstance(event, SparePromoted):
                    if event.round == info.round:  # else a late one of an earlier round
                        self.promoted.add(event.local_rank)
                        self._control.send(
                            Promote(self.attempt, event.slot, event.local_rank, event.pid)
                        )
                elif isinstance(event, RespawnDue):
                    if event.round == info.round:  # else a late one of an earlier round
                        self.respawned.add(event.local_rank)
                        self._control.send(Respawn(self.attempt, event.local_rank, event.env))
                else:
                    end = self._on_control(event.message, info, succeeded, on_started)
                    if end is not None:
                        return end
        finally:
            self.watch_stop.set()

    def _watch_rendezvous(self, handler: EtcdRendezvousHandler) -> None:
        while not self.watch_stop.is_set():
            try:
                changed = handler.wait_for_change(1.0)
            except (RendezvousError, EtcdError) as exc:
                log.warning("watching the rendezvous failed: %s", exc)
                self.watch_stop.wait(0.5)
                changed = True
            try:  # about once a second; nothing it does may end the rendezvous watch
                self._stopped.poll(dict(self.pids))
            except Exception:
                log.exception("the stopped-worker watch failed; the rendezvous watch goes on")
            recheck = handler.take_recheck()  # a grace after an etcd outage is over
            if (changed or handler.lease_lost or recheck) and not self.watch_stop.is_set():
                self.queue_check()

    # -------------------------------------------------------------- classification

    def round_of(self, info: RendezvousInfo) -> RoundOf:
        """The round as :mod:`~kelastic_sidecar.round_end` reads it."""
        return RoundOf(self.node, info.round, info.group_rank, self.nproc)

    def check_round(self, handler: EtcdRendezvousHandler, info: RendezvousInfo) -> RoundEnd | None:
        """What the rendezvous says of the round now (None: healthy, or etcd failed)."""
        try:
            check = handler.check_round(info)
        except (RendezvousError, EtcdError) as exc:
            log.warning("checking round %d failed: %s", info.round, exc)
            return None
        end = classify_check(check, self.node, info.round)
        if end is not None and end.kind is RoundEndKind.RESTART:
            log.info("round %d: %s (%s)", info.round, check.reason, ", ".join(check.nodes))
        return end

    def explain_failure(
        self, handler: EtcdRendezvousHandler | None, info: RendezvousInfo, end: RoundEnd
    ) -> RoundEnd:
        """How a failed round ends (:func:`~.round_end.explain_worker_failure`: a peer lost
        is the root cause, a peer that left on purpose charges nothing), from a rendezvous
        check taken after our workers stopped, so that the peer's leaving had time to show
        (the operator or ``kelastic run`` takes a dead Pod's node out at once)."""
        failure = end.failure
        if failure is None or failure.cause != CAUSE_WORKER_FAILURE or handler is None:
            return end
        explained = explain_worker_failure(failure, self.check_round(handler, info))
        if explained.kind is RoundEndKind.RESTART:
            log.info("round %d: %s left the round on purpose; it explains %s", info.round,
                     ", ".join(explained.departed), failure.summary())  # fmt: skip
        elif explained.failure is not failure and explained.failure is not None:
            log.warning("round %d: %s; it explains %s", info.round,
                        explained.failure.summary(), failure.summary())  # fmt: skip
        return explained

    def before_stop(
        self, info: RendezvousInfo, end: RoundEnd, peers_cause: Callable[[int], str | None]
    ) -> Failure | None:
        """What is read of the workers as the round ends, before they are stopped (the
        stop ends a stopped worker, and what it was doing with it; :mod:`.witness`).

        For a round a peer restarted, whose workers may have waited on ours: the hang of
        a worker of ours reaped while stopped or stopped now
        (:func:`~.round_end.stopped_failure`), logged and returned. For a hung round,
        ours (``end``'s failure) or a peer's (``peers_cause(round)``: the restart
        record's cause of the round, asked only then): where each of our workers was,
        into :attr:`where` and the log, from the reaps (those still queued taken
        first) and from what was read of each worker while it lived (:attr:`seen`)."""
        self._take_queued_reaps()
        failed = end.kind is RoundEndKind.FAILED
        round_ = self.round_of(info)
        stopped, live = None, None
        if not failed:
            live = self._observe()
            stopped = stopped_failure(round_, self.pids, self.reaped, live)
            if stopped is not None:
                log.error("round %d: %s", info.round, stopped.summary())
                self._hangs.stopped(stopped)
        failure = end.failure if failed else stopped
        if (failure is not None and failure.cause == CAUSE_HANG) or (
            not failed and peers_cause(info.round) == CAUSE_HANG
        ):
            self.where = where_ranks_were(self._timer, round_, self.pids, self.reaped, self.seen)
            log.warning("round %d hung; where each worker was: %s", info.round, self.where.line())
            self._hangs.where(self.where)
        return stopped

    def _take_queued_reaps(self) -> None:
        """Take the reaps queued since the round's end was decided (the timer server
        reaps on its own thread: a stopped worker's own timer may expire just after its
        peer's exit ended the round), so that the round's evidence has them, with the
        stacks read before each kill; every other event stays queued, in order."""
        for event in take_reaps(self._events):
            self.on_reaped(event.reap)

    def _observe(self) -> LiveStates:
        """:func:`~.witness.observe` the workers now, kept in :attr:`seen` too."""
        live = observe(self._timer, self.pids, self.reaped)
        self.seen = self.seen.then(live)
        return live

    def on_reaped(self, ev: ReapEvent) -> None:
        """A hung worker was killed: by the timer server, the stopped-worker watch or the
        in-process hard timeout (queued just before its kill). Every hang of the attempt
        is held here. A pid's first reap stands: a later one (its timer expiring after
        the watch killed it) found it dead, with no stacks to read."""
        first = self.reaped.get(ev.pid)
        if first is not None:  # (the same event: its exit overtook it, see late_reap)
            if first is not ev:
                log.info("worker pid %d: reaped again (%s; state %s) after its reap by %s; "
                         "the first stands", ev.pid, ev.why, ev.state, first.by.value)  # fmt: skip
            return
        self.reaped[ev.pid] = ev
        late = f" {ev.reaped_at - ev.expiration_time:.3f}s after expiry" if ev.scope_id else ""
        log.warning("worker pid %d hung: %s%s; killed with %s", ev.pid, ev.why, late,
                    signal_name(ev.signal))  # fmt: skip

    def _on_control(
        self,
        msg: Message,
        info: RendezvousInfo,
        succeeded: set[int],
        on_started: Callable[[], None],
    ) -> RoundEnd | None:
        if isinstance(msg, Disconnected):
            return RoundEnd(RoundEndKind.LAUNCHER_LOST)
        if isinstance(msg, Started) and msg.attempt == self.attempt:
            self._on_started(msg)
            on_started()
        elif isinstance(msg, Exited) and msg.attempt == self.attempt:
            return self._on_exited(msg, info, succeeded)
        return None  # another type, or late news from an earlier attempt

    def _on_started(self, msg: Started) -> None:
        """The attempt's workers started, or (a partial ``started``) one started again."""
        pids = msg.pids
        warm = min(msg.warm, len(pids)) if msg.warm > 0 else 0
        promoted = bool(self.promoted) and pids.keys() <= self.promoted  # a spare took over
        self.promoted -= pids.keys()
        if promoted:
            log.info("local rank(s) %s: the spare pid(s) %s took over (no process start)",
                     ", ".join(map(str, pids)), ", ".join(map(str, pids.values())))  # fmt: skip
        elif self.respawned and pids.keys() <= self.respawned:  # a respawn's (the hybrid rung)
            log.info("local rank(s) %s started again: pid(s) %s (%s)", ", ".join(map(str, pids)),
                     ", ".join(map(str, pids.values())), "warm" if warm else "cold")  # fmt: skip
        if not promoted:  # a promotion started no process
            self.warm += warm  # a respawn's adds to the attempt's
            self._metrics.worker_starts.labels(start="warm").inc(warm)
            self._metrics.worker_starts.labels(start="cold").inc(len(pids) - warm)
        for local_rank, pid in pids.items():
            self.pids[local_rank] = pid
            self.steps.bind(pid, local_rank)
            try:
                self._timer.watch_pid(pid, self.tokens.get(local_rank))
            except ValueError as exc:  # pid <= 1 or our own: never reapable
                log.error("not watching worker pid %s: %s", pid, exc)

    def _on_exited(self, msg: Exited, info: RendezvousInfo, succeeded: set[int]) -> RoundEnd | None:
        if msg.pid is not None:
            self._timer.forget_pid(msg.pid)
            self.steps.unbind(msg.pid)
        code_label = signal_name(msg.signal) if msg.signal is not None else str(msg.exitcode)
        self._metrics.worker_exits.labels(code=code_label).inc()
        if msg.exitcode == 0:
            succeeded.add(msg.local_rank)
            if len(succeeded) >= self.nproc:
                return RoundEnd(RoundEndKind.SUCCEEDED)
            return None
        if (late := late_reap(self._timer, self.reaped, msg.pid)) is not None:
            self.on_reaped(late)
        hung = msg.pid is not None and msg.pid in self.reaped  # then a stopped peer is named
        live = self._observe() if hung else None
        failure = classify_exit(self.round_of(info), msg, self.pids, self.reaped, live)
        if msg.local_rank in self.respawned:
            failure = respawn_failure(failure)
        coordinator = self._inprocess if failure.cause != CAUSE_START_FAILURE else None
        if not in_process_allowed(self._rules, failure):  # its rule ends the attempt
            coordinator = None
        if coordinator is not None and coordinator.absorb_exit(msg.local_rank, msg.pid, failure):
            log.warning("round %d: %s; its peers restart in process, it starts again",
                        info.round, failure.summary())  # fmt: skip
            self.pids.pop(msg.local_rank, None)
            return None
        log.error("round %d failed: %s", info.round, failure.summary())
        return RoundEnd(RoundEndKind.FAILED, failure)
