"""The supervisor: one node's agent, in the sidecar.

It plays the role of torch's ``SimpleElasticAgent`` with the workers living in the
trainer container (started by :mod:`kelastic.launch` over the control socket):

1. rendezvous (:class:`~kelastic_sidecar.rendezvous.handler.EtcdRendezvousHandler`);
2. assignment: global ranks from the group rank and ``nproc_per_node``, MASTER_ADDR =
   group rank 0's pod IP, MASTER_PORT picked fresh each round by group rank 0 and
   published under ``rounds/<round>/master`` (a restarted round never meets a stale
   c10d store: pytorch/pytorch#135712);
3. monitor: worker exits (launcher), hung workers reaped (timer server), and rendezvous
   changes (etcd watch): nodes waiting (scale-up or a restarting peer), a participant
   lost (lease expired) or left, the rendezvous closed;
4. on a failure: stop the local worker group, charge the job's global restart budget
   (once per round, whichever node sees it first), and rejoin; scale events and peers'
   restarts cost nothing; when the budget is spent the node closes the rendezvous with
   the root cause, so every node stops and reports it;
5. when every local worker exits 0 the node leaves the rendezvous as ``succeeded``
   (which closes it as finished: :mod:`~kelastic_sidecar.rendezvous.finished`; the
   round's other nodes finish theirs, a node joining later succeeds with nothing left
   to train), reports success in etcd and exits 0.

All inputs arrive as events on one queue, handled by the main thread; no polling loop.

The parts are split as torch's agent is: the wiring (servers, clients, typed events) is
:mod:`~kelastic_sidecar.wiring`; the current attempt's workers and the event
loop of a round, :mod:`~kelastic_sidecar.attempt_monitor`; what ended a round, the pure
:mod:`~kelastic_sidecar.round_end`; the workers' environment,
:mod:`~kelastic_sidecar.assignment`; in-process restarts within a round,
:mod:`~kelastic_sidecar.inprocess.coordinator`.

Over ~400 lines as one cohesive thing: this module is the node's course through rounds
and how it ends (report, leave or close, tell the launcher), the helpers it writes etcd
with beside it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import time
from types import FrameType
from typing import Any

from kelastic import contract
from kelastic.control_messages import (
    Shutdown,
)
from kelastic.etcd_values import (
    MAX_SUMMARY,
    CorruptValueError,
    ReportOutcome,
    decode_departure,
    decode_master,
    encode_master,
    encode_report,
)
from kelastic.failure_policy import FailureAction
from kelastic.last_status import keep_last_status
from kelastic.sockaddr import free_port
from kelastic_etcd import EtcdClient, EtcdError, EtcdRefused

from . import failure_rules
from .assignment import build_assign
from .attempt_monitor import AttemptMonitor
from .config import SidecarConfig
from .failure import (
    CAUSE_PEER,
    CAUSE_SCALE,
    Failure,
    FailureCause,
    signal_name,
)
from .metrics import SidecarMetrics
from .netcheck import NetworkCheck
from .rendezvous import (
    EtcdRendezvousHandler,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    finished_in,
)
from .restart_budget import (
    RECENT_CHARGES,
    RestartBudget,
    RestartRecordError,
    charge_entry,
    recent_charges,
)
from .round_end import (
    RoundEndKind,
    closed_outcome,
    finished_summary,
)
from .vocabulary import DEPARTURE_PREFLIGHT, CheckOutcome
from .wiring import Hooks, build_parts

#: Extra variables of the round's workers (the agreed checkpoint step's), or none.
Env = dict[str, str] | None

log = logging.getLogger("kelastic_sidecar.supervisor")

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


class SidecarShutdown(Exception):
    """Raised in the main thread by SIGTERM/SIGINT: leave the rendezvous and stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class Phase(enum.StrEnum):
    """Where a node's supervisor is in its course (``/status``'s ``phase``)."""

    #: Servers starting.
    STARTING = "starting"
    #: Waiting for the launcher's ``hello``.
    WAITING_FOR_LAUNCHER = "waiting_for_launcher"
    #: In a rendezvous.
    RENDEZVOUS = "rendezvous"
    #: The round completed; the workers start.
    STARTING_WORKERS = "starting_workers"
    #: The workers run.
    RUNNING = "running"
    #: The workers are being stopped for a restart.
    STOPPING = "stopping"
    #: The job succeeded on this node.
    SUCCEEDED = "succeeded"
    #: The operator removed this node (scale-down, its Pod going away).
    REMOVED = "removed"
    #: The job failed on this node.
    FAILED = "failed"


#: The phases in which the node finishes with its real outcome (a signal waits for it).
_FINISHING = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.REMOVED})


class Supervisor:
    """Runs one node of an elastic job until it succeeds, fails or is told to stop.

    Args:
        config: the node's configuration (see :class:`~kelastic_sidecar.config.SidecarConfig`).
        store: an etcd store; built from ``config.etcd_endpoints`` when None.

    Call :meth:`run` from the main thread (it installs SIGTERM/SIGINT handlers); it returns
    the process exit code: 0 succeeded, 1 failed, 128+signum when stopped by a signal.
    """

    def __init__(self, config: SidecarConfig, store: EtcdClient | None = None) -> None:
        self.cfg = config
        hooks = Hooks(healthy=lambda: self._alive, ready=lambda: self._running, status=self.status)
        parts = build_parts(config, store, hooks)
        self.keys = parts.keys
        self.store = parts.store
        self.timer = parts.timer
        self.metrics = parts.metrics
        self.control = parts.control
        self.http = parts.http
        self.budget = parts.budget
        self.etcd_health = parts.etcd_health
        self.inprocess = parts.inprocess
        self.checkpoints = parts.checkpoints
        self.termination = parts.termination
        self.prestop = parts.prestop
        self.handler: EtcdRendezvousHandler | None = None
        self._alive = True
        self._running = False
        self._phase: Phase = Phase.STARTING
        started = time.time()
        self.metrics.last_progress.set_function(lambda: self.timer.last_acquire_time or started)
        self.metrics.rendezvous_in_progress.set_function(
            lambda: 1.0 if self._phase is Phase.RENDEZVOUS else 0.0
        )
        self._info: RendezvousInfo | None = None
        self._nproc = config.nproc_per_node
        self._carried = False  # the last round's workers run on (in-process carry)
        #: The current attempt's workers and the events about them.
        self.workers = AttemptMonitor(
            config.node, config.nproc_per_node, parts.events, self.control, self.timer,
            self.metrics, config.stop_grace, self.inprocess, parts.steps, config.failure_rules,
            0.0 if config.inprocess.enabled else config.stopped_timeout, parts.hangs,
        )  # fmt: skip
        seams = (self.control.send, self.workers.wait_checked, self.metrics.observe_netcheck,
                 self.workers.launcher_checks)  # fmt: skip
        self.netcheck = NetworkCheck(config.netcheck, config.node, *seams)  # a round's check
        self._down_since: float | None = None
        self._down_cause = CAUSE_SCALE
        self._last_failure: Failure | None = None
        #: the budget record's last charges (``charge_entry``s), as last read or written
        self._charges: list[dict[str, Any]] = []
        self._shutting_down = False  # a SidecarShutdown was raised
        self._spent = 0
        self._acquired_at_start = 0  # timer acquires before the current attempt

    @property
    def _running(self) -> bool:
        """Whether the workers run (what /readyz says; accrues goodput while true)."""
        return self.metrics.goodput.running

    @_running.setter
    def _running(self, value: bool) -> None:
        self.metrics.goodput.set_running(value)

    # ------------------------------------------------------------------ public surface

    def status(self) -> dict[str, Any]:
        """The ``/status`` document: phase, round, ranks, world size, restarts, progress."""
        info = self._info
        stats = self.timer.stats()
        last = self.timer.last_acquire_time
        return {
            "node": self.cfg.node,
            "phase": self._phase,
            "round": info.round if info else None,
            "group_rank": info.group_rank if info else None,
            "group_world_size": info.group_world_size if info else None,
            "world_size": info.group_world_size * self._nproc if info else None,
            "attempt": self.workers.attempt,
            "restarts_spent": self._spent,
            "max_restarts": self.cfg.max_restarts,
            "progress_count": stats.acquired,
            "attempt_progress_count": stats.acquired - self._acquired_at_start,
            "last_progress_age_s": (time.time() - last) if last else None,
            "timers_active": stats.active,
            "timers_overdue": stats.overdue,
            "timer_grace_s": stats.grace,
            "workers_warm": self.workers.warm,
            "last_failure": self._last_failure.as_dict() if self._last_failure else None,
            "charges": self._charges,
            "etcd_unreachable": self.etcd_health.outage(),
            "inprocess": self.inprocess.status(),
            "step_times": self.workers.steps.status(),
            "hang_evidence": self.workers.where.as_dict() if self.workers.where else None,
            "checkpoint": self.checkpoints.status(),
        }

    def run(self) -> int:
        """Supervise the node until the job ends for it; return the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.timer.start()
        self.control.start()
        self.prestop.start()
        self.inprocess.start()
        self.checkpoints.start()
        self.http.start()
        log.info("sidecar for %s/%s node %s: nodes %d..%d x %d workers, budget %d restarts, "
                 "http :%d", self.cfg.namespace, self.cfg.job_name, self.cfg.node,
                 self.cfg.min_nodes, self.cfg.max_nodes, self._nproc, self.cfg.max_restarts,
                 self.http.port)  # fmt: skip
        try:
            self.termination.arm()  # inside: a request already waiting interrupts at once
            return self._run()
        except SidecarShutdown as exc:
            # The Pod terminating (its preStop hook): the operator's notice may be on its way
            wait = contract.PRESTOP_NOTICE_SECONDS if self.termination.terminating else 0.0
            reason = departure_reason(self.store, self.keys.departing(self.cfg.node), wait)
            log.info("received %s: leaving the rendezvous (%s), stopping workers", exc, reason)
            self._leave(reason)  # first: the peers re-form before our workers go
            self._stop_workers("sidecar stopping")
            self.checkpoints.at_stop(contract.PERSIST_STOP_SECONDS)  # the slots hold still
            self._shutdown_launcher(128 + exc.signum, f"stopped by {exc}")
            return 128 + exc.signum
        finally:
            keep_last_status(self.cfg.run_dir, self.status)  # readable after the HTTP's end
            self.termination.disarm()
            self.termination.left("")  # a request waiting on a node that left nothing
            self._alive = self._running = False
            self.workers.watch_stop.set()
            for s, h in old.items():
                signal.signal(s, h)
            if self.handler is not None:
                with contextlib.suppress(Exception):
                    self.handler.shutdown()
            self.timer.stop()
            self.checkpoints.close()
            self.inprocess.close()
            self.control.close()
            self.prestop.close()
            self.http.stop()
            with contextlib.suppress(Exception):
                self.store.close()

    # ------------------------------------------------------------------------ main loop

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._phase in _FINISHING:
            # Finishing with the real outcome (leave, report, tell the launcher): the
            # kubelet stops a native sidecar as soon as the trainer exits; let it finish.
            log.info("received %s while finishing (%s)", signal_name(signum), self._phase)
            return
        if self._shutting_down:
            # A second SIGTERM (the kubelet's, then the runner's) must not interrupt the
            # orderly stop of the first: that would log SidecarShutdown twice.
            log.info("received %s while stopping; already stopping", signal_name(signum))
            return
        self._shutting_down = True
        raise SidecarShutdown(signum)

    def _run(self) -> int:
        self._phase = Phase.WAITING_FOR_LAUNCHER
        self.handler = EtcdRendezvousHandler(
            self.store,
            self.keys,
            self.cfg.node,
            self.cfg.rendezvous_settings(),
            on_corrupt=lambda exc: self.metrics.corrupt_values.labels(source="rdzv_state").inc(),
        )
        try:  # the etcd session (lease, watch) is ready before the trainer container is
            self.handler.open()
        except EtcdError as exc:
            if refused(exc):  # bad credentials, no permission: waiting cannot help
                return self._fail_fatal(f"etcd refused the sidecar's requests: {exc}")
            log.warning("etcd unavailable at start (%s); the rendezvous will retry", exc)
        hello = self.workers.wait_hello()
        if hello.preflight_error:  # its check failed: the node never joins, its Pod fails
            return self._fail_fatal(f"{contract.PREFLIGHT_FAILED_PREFIX}{self.cfg.node}: "
                                    f"{hello.preflight_error}")  # fmt: skip
        self._nproc = hello.nproc or self._nproc
        self.workers.nproc = self._nproc
        if self._nproc != self.cfg.nproc_per_node:
            log.warning(
                "launcher runs %d workers per node, the job says %d; using the launcher's",
                self._nproc, self.cfg.nproc_per_node,
            )  # fmt: skip
        while True:
            self.checkpoints.before_rendezvous(stopped=not self._carried)
            try:
                info = self._rendezvous()
            except RendezvousClosedError as exc:
                return self._finish_closed(exc.reason)
            except (RendezvousError, EtcdError) as exc:
                return self._fail_fatal(f"rendezvous failed: {exc}")
            try:  # the round's master address, and the checkpoint step every node agrees
                master = round_master(  # on (records not read: no agreement, no start)
                    self.store, self.keys.master(info.round), self.cfg.pod_ip,
                    publish=info.group_rank == 0, timeout=min(self.cfg.join_timeout, 60.0),
                )  # fmt: skip
                restore_env = self.checkpoints.worker_env(info, self._nproc, self._carried)
            except (TimeoutError, EtcdError, ValueError) as exc:
                if isinstance(exc, CorruptValueError):  # the codec refused the record
                    self.metrics.corrupt_values.labels(source="master_record").inc()
                log.warning("round %d: no master address or checkpoint records (%s); "
                            "re-rendezvous", info.round, exc)  # fmt: skip
                continue
            checked = self.netcheck.gate(info, master, self._carried)
            if checked and checked.outcome is CheckOutcome.PEERS_FAILED:
                continue  # they leave: the round forms again without them, nothing charged
            if checked and checked.outcome is CheckOutcome.SELF_FAILED:  # it never trains
                self._leave(DEPARTURE_PREFLIGHT)
                return self._fail_fatal(checked.text)
            self._start_workers(info, master, restore_env)
            end = self.workers.monitor(self.handler, info, self._on_started)
            self._running, self._carried = False, self.inprocess.carry(end)
            if self._carried:  # the workers wait in process for the next round's go
                continue
            self.inprocess.end_round(end.kind.value)  # the process path takes over
            if end.kind is RoundEndKind.SUCCEEDED:
                return self._finish_succeeded()
            if end.kind is RoundEndKind.CLOSED:
                self._stop_workers("rendezvous closed")
                return self._finish_closed(self.handler.closed_reason())
            if end.kind is RoundEndKind.REMOVED:
                return self._finish_removed(
                    end.reason or departure_reason(self.store, self.keys.departing(self.cfg.node))
                )
            if end.kind is RoundEndKind.LAUNCHER_LOST:
                self._leave("shutdown")
                self._report(ReportOutcome.FAILED, "trainer container (launcher) disconnected")
                return EXIT_FAILED
            self._down_since = time.time()
            stopped = self.workers.before_stop(info, end, self.budget.last_cause)
            self._last_failure = stopped or self._last_failure  # a peer restarted: ours stopped
            self._stop_workers(end.reason or (end.failure.summary() if end.failure else ""))
            if end.kind is RoundEndKind.FAILED:
                end = self.workers.explain_failure(self.handler, info, end)
            if end.kind is RoundEndKind.FAILED and end.failure is not None:
                failure = end.failure
                self._last_failure, self._down_cause = failure, failure.cause
                verdict = failure_rules.verdict(self.cfg.failure_rules, failure, self.cfg.node)
                if verdict.ends(verdict.charged and self._charge(failure, verdict.ignored)):
                    return self._finish_failed(verdict, failure)
            else:
                self._down_cause = FailureCause(end.reason or CAUSE_PEER)
                self.metrics.restarts.labels(level="process", cause=self._down_cause).inc()
                log.info("round %d: restarting the worker group (%s)", info.round, end.reason)

    def _rendezvous(self) -> RendezvousInfo:
        assert self.handler is not None
        self._phase = Phase.RENDEZVOUS
        started = time.monotonic()
        self._info = info = self.handler.next_rendezvous()
        observe_round(self.metrics, info, time.monotonic() - started, self._nproc)
        return info

    def _start_workers(self, info: RendezvousInfo, master: tuple[str, int], env: Env) -> None:
        """Send the round's ``assign`` (a new attempt, with ``env``: the agreed checkpoint
        step's variables), unless the workers were carried over."""
        self._acquired_at_start = self.timer.stats().acquired
        carried = self._carried
        tokens = self.workers.tokens if carried else self.workers.new_attempt()
        self._spent, self._charges = read_budget(self.budget, self._spent, self._charges)
        spent = self._spent
        self.metrics.budget_spent.set(spent)
        self._phase = Phase.STARTING_WORKERS
        assign = build_assign(
            attempt=self.workers.attempt,
            round_=info.round,
            group_rank=info.group_rank,
            group_world_size=info.group_world_size,
            nproc=self._nproc,
            master=master,
            run_id=self.cfg.job_uid,
            restart_count=spent,
            max_restarts=self.cfg.max_restarts,
            tokens=tokens,
            extra_env=env,
        )
        assign = self.inprocess.begin_round(assign, info, self.handler)
        if carried:
            self._on_started()
        else:
            self.control.send(assign)

    def _on_started(self) -> None:
        """The launcher reported the attempt's workers started."""
        self._running = True
        self._phase = Phase.RUNNING
        if self._down_since is not None:
            self.metrics.downtime.labels(cause=self._down_cause).inc(time.time() - self._down_since)
            self._down_since = None

    # --------------------------------------------------------------------- transitions

    def _charge(self, failure: Failure, ignored: bool = False) -> bool:
        """Spend one restart for the failed round (``ignored``: record it, uncharged, as
        an Ignore rule says, up to the budget's cap); True when the budget is exhausted."""
        try:
            charge = self.budget.charge(
                failure.round, failure.cause, failure.node, failure.as_dict(), ignored
            )
        except (EtcdError, RestartRecordError) as exc:
            if isinstance(exc, RestartRecordError):  # a corrupt record (failed calls count
                self.metrics.etcd_errors.inc()  # through the store's on_error)
            log.error("cannot record the restart in etcd: %s", exc)
            return False
        self._spent = charge.count
        self.metrics.budget_spent.set(charge.count)
        self.metrics.restarts.labels(level="process", cause=failure.cause).inc()
        if charge.charged:
            entry = charge_entry(charge.count, failure.round, failure.as_dict())
            self._charges = [*self._charges, entry][-RECENT_CHARGES:]
            log.warning("restart %d/%d (%s)", charge.count, self.cfg.max_restarts,
                        failure.summary())  # fmt: skip
        return charge.exhausted

    def _stop_workers(self, reason: str) -> None:
        """Ask the launcher to stop the current attempt's workers and wait for it."""
        if not self.workers.pids and self.workers.attempt == 0:
            return
        self._phase = Phase.STOPPING
        self.workers.stop_workers(reason)

    def _leave(self, reason: str) -> None:
        left = leave_rendezvous(self.handler, reason)
        self.termination.left(reason if left else "")

    def _report(self, outcome: ReportOutcome, summary: str, failure: Failure | None = None) -> None:
        write_report(self.store, self.keys, self.cfg.node, outcome, summary, failure)

    def _shutdown_launcher(self, exitcode: int, summary: str) -> None:
        self.control.send(Shutdown(exitcode=exitcode, summary=summary))

    def _finish_succeeded(self, summary: str = "") -> int:
        self._phase = Phase.SUCCEEDED
        info, n = self._info, self._nproc
        at = f" (round {info.round}, world size {info.group_world_size * n})" if info else ""
        summary = summary or f"succeeded: all {n} workers of {self.cfg.node} exited 0{at}"
        log.info(summary)
        self._leave("succeeded")
        self._report(ReportOutcome.SUCCEEDED, summary)
        self._shutdown_launcher(EXIT_SUCCEEDED, summary)
        return EXIT_SUCCEEDED

    def _finish_removed(self, reason: str) -> int:
        """This node was taken out of the job (by the operator): stop and report it."""
        planned = reason == contract.DEPARTURE_SCALE_DOWN
        summary = f"{self.cfg.node} removed from the job ({reason or 'no reason given'})"
        log.warning(summary)
        self._phase = Phase.REMOVED
        self._stop_workers(summary)
        self._leave(reason or "shutdown")
        self._report(ReportOutcome.REMOVED, summary)
        code = EXIT_SUCCEEDED if planned else EXIT_FAILED
        self._shutdown_launcher(code, summary)
        return code

    def _finish_failed(self, verdict: failure_rules.Verdict, failure: Failure) -> int:
        """Stop as ``verdict`` says: this node's Pod fails (RestartPod: the operator
        replaces it, its peers re-form without a charge), or the job does."""
        self._phase = Phase.FAILED
        if verdict.action is FailureAction.RESTART_POD:
            self._leave(failure_rules.POD_RESTART_DEPARTURE)
            self._report(ReportOutcome.FAILED, verdict.pod_summary(failure), failure)
            self._shutdown_launcher(EXIT_FAILED, verdict.pod_summary(failure))
            return EXIT_FAILED
        log.error("%s; failing the job: %s", verdict.why(self.cfg.max_restarts), failure.summary())
        return self._close_job(failure, *verdict.close_reason(self.cfg.max_restarts))

    def _close_job(self, failure: Failure, key: str, value: object) -> int:
        """Close the rendezvous with ``failure`` (plus ``key: value``) as the reason."""
        self._phase = Phase.FAILED
        assert self.handler is not None
        reason = failure.as_dict()
        reason[key] = value
        try:
            self.handler.close(reason)
        except (RendezvousError, EtcdError) as exc:
            log.error("closing the rendezvous failed: %s", exc)
        return self._finish_closed(reason)

    def _finish_closed(self, reason: dict[str, Any] | None) -> int:
        if (done := finished_in(reason)) is not None:  # the training is done: nothing failed
            return self._finish_succeeded(finished_summary(self.cfg.node, *done))
        self._phase = Phase.FAILED
        failure, text = closed_outcome(reason, self.cfg.max_restarts)
        self._last_failure = failure or self._last_failure
        self._report(ReportOutcome.FAILED, text, failure)
        self._shutdown_launcher(EXIT_FAILED, text)
        return EXIT_FAILED

    def _fail_fatal(self, text: str) -> int:
        self._phase = Phase.FAILED
        log.error(text)
        self._report(ReportOutcome.FAILED, text)
        self._shutdown_launcher(EXIT_FAILED, text)
        return EXIT_FAILED


def observe_round(metrics: SidecarMetrics, info: RendezvousInfo, took: float, nproc: int) -> None:
    """Log and count a completed round (``took``: seconds in the rendezvous)."""
    metrics.rounds.inc()
    metrics.rendezvous_duration.observe(took)
    metrics.round.set(info.round)
    metrics.group_world_size.set(info.group_world_size)
    metrics.world_size.set(info.group_world_size * nproc)
    log.info("round %d complete in %.3fs: group rank %d of %d, world size %d", info.round,
             took, info.group_rank, info.group_world_size,
             info.group_world_size * nproc)  # fmt: skip


def refused(exc: BaseException) -> bool:
    """Whether etcd refused (:class:`~kelastic_etcd.EtcdRefused`: credentials, permission,
    a bad request), directly or as the cause of a rendezvous error: an error to surface
    at once, which retrying cannot cure (``kelastic_etcd``'s rule)."""
    return isinstance(exc, EtcdRefused) or isinstance(exc.__cause__, EtcdRefused)


def write_report(
    store: EtcdClient,
    keys: contract.Keys,
    node: str,
    outcome: ReportOutcome,
    summary: str,
    failure: Failure | None = None,
) -> None:
    """Write ``node``'s final report (:func:`node_report`) at its key; a report etcd does
    not take, or that the codec refuses, is logged (the node ends either way)."""
    try:
        store.put(keys.report(node), node_report(outcome, node, summary, failure))
    except (EtcdError, CorruptValueError) as exc:
        log.error("cannot write the node report to etcd: %s", exc)


def departure_reason(store: EtcdClient, key: str, wait: float = 0.0) -> str:
    """The reason of this node's departure notice at ``key`` (the operator posts
    ``scale_down`` before it removes the node on purpose, ``disruption`` for a Pod an
    eviction or a preemption takes: the peers owe no restart), read by the value's one
    codec (:func:`kelastic.etcd_values.decode_departure`); ``shutdown`` when there is
    none after ``wait`` seconds (read every :data:`NOTICE_POLL` s) or etcd does not
    answer. Never raises."""
    deadline = time.monotonic() + wait
    while True:
        got: tuple[bytes, int] | None = None
        with contextlib.suppress(EtcdError):
            got = store.get(key)
        if got:
            return decode_departure(got[0])
        if time.monotonic() >= deadline:
            return "shutdown"
        time.sleep(min(NOTICE_POLL, max(0.0, deadline - time.monotonic())))


#: Seconds between two reads of a departure notice a terminating Pod waits for.
NOTICE_POLL = 0.2


def leave_rendezvous(handler: EtcdRendezvousHandler | None, reason: str) -> bool:
    """Leave the rendezvous with departure ``reason``; False when there was no handler or
    leaving failed (logged: the peers then see the node lost when its lease ends)."""
    if handler is None:
        return False
    try:
        handler.leave(reason)
    except (RendezvousError, EtcdError) as exc:
        log.warning("leaving the rendezvous failed: %s", exc)
        return False
    return True


def read_budget(
    budget: RestartBudget, spent: int, charges: list[dict[str, Any]]
) -> tuple[int, list[dict[str, Any]]]:
    """The restarts spent and the last charges (:func:`~.restart_budget.recent_charges`),
    read from ``budget``'s record; ``(spent, charges)`` as they were when it cannot be
    read (logged)."""
    try:
        record = budget.read()
    except (EtcdError, RestartRecordError) as exc:
        log.error("cannot read the restart budget: %s", exc)
        return spent, charges
    return record.count, recent_charges(record)


def round_master(
    store: EtcdClient, key: str, pod_ip: str, *, publish: bool, timeout: float
) -> tuple[str, int]:
    """Publish (group rank 0: ``publish``) or look up a round's MASTER_ADDR/PORT at ``key``.

    Group rank 0 picks a free port on ``pod_ip`` fresh each round, so that a restarted
    round never meets a stale c10d store (pytorch/pytorch#135712).

    Raises:
        TimeoutError: the record did not appear within ``timeout`` s.
        EtcdError: etcd did not answer, or refused the request.
        kelastic.etcd_values.CorruptValueError: the record is corrupt, or ``pod_ip``
            cannot be written as one (the one codec of the value,
            :mod:`kelastic.etcd_values.rounds`).
        OSError: ``pod_ip`` is not an address of this host (:func:`kelastic.sockaddr.free_port`).
    """
    if publish:
        port = free_port(pod_ip)
        store.put(key, encode_master(pod_ip, port))
        return pod_ip, port
    raw = store.wait_value(key, timeout=timeout)
    return decode_master(raw, key)


def node_report(
    outcome: ReportOutcome | str, node: str, summary: str, failure: Failure | None = None
) -> bytes:
    """The node's final report, as stored at :meth:`kelastic.contract.Keys.report`, by the
    one codec of the value (:func:`kelastic.etcd_values.encode_report`).

    A JSON object: ``outcome`` (a :class:`~kelastic.etcd_values.ReportOutcome`:
    ``"succeeded"``, ``"failed"`` or ``"removed"``), ``node``, ``summary`` (one line,
    cut to :data:`~kelastic.etcd_values.MAX_SUMMARY` characters; a failed *job* starts
    with :data:`kelastic.contract.JOB_FAILED_PREFIX`), ``failure``
    (:meth:`Failure.as_dict` or null) and ``time`` (``time.time()``). The operator reads
    ``outcome`` and ``summary`` (``kelastic_operator.etcd_view.view_from_keys``).

    Raises:
        ValueError: ``outcome`` is no :class:`~kelastic.etcd_values.ReportOutcome`.
        kelastic.etcd_values.CorruptValueError: the report is outside the codec's bounds
            (a node name that is empty or over 1024 characters).
    """
    return encode_report(
        {
            "outcome": ReportOutcome(outcome),
            "node": node,
            "summary": summary[:MAX_SUMMARY],
            "failure": failure.as_dict() if failure else None,
            "time": time.time(),
        }
    )
