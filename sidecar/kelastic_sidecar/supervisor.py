"""The supervisor: one node's agent, in the sidecar.

It plays the role of torch's ``SimpleElasticAgent`` with the workers living in the
trainer container (started by :mod:`kelastic.launch` over the control socket):

1. rendezvous (:class:`~kelastic_sidecar.rendezvous.EtcdRendezvousHandler`);
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
5. when every local worker exits 0 the node leaves the rendezvous as ``succeeded``,
   reports success in etcd and exits 0.

All inputs arrive as events on one queue, handled by the main thread; no polling loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from kelastic import contract
from kelastic._safejson import UnsafeJSONError, loads_bounded

from .config import SidecarConfig
from .control import MSG_DISCONNECTED, ControlServer, Message
from .etcd_store import EtcdStore, EtcdUnavailableError
from .failure import (
    CAUSE_HANG,
    CAUSE_NODE_LOST,
    CAUSE_PEER,
    CAUSE_SCALE,
    CAUSE_START_FAILURE,
    CAUSE_WORKER_FAILURE,
    NOT_STARTED_EXIT_CODES,
    Failure,
    signal_name,
)
from .http import SidecarHttpServer
from .metrics import SidecarMetrics
from .rendezvous import (
    DEPARTURE_REJOIN,
    EtcdRendezvousHandler,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
)
from .restart_budget import RestartBudget, RestartRecordError
from .timer_server import ReapEvent, TimerServer

log = logging.getLogger("kelastic_sidecar.supervisor")

#: Departures that end a round without spending the restart budget: a scale-down, and a
#: peer exiting to re-rendezvous (its own failure, if any, was charged by that peer).
_PLANNED_DEPARTURES = frozenset({contract.DEPARTURE_SCALE_DOWN, DEPARTURE_REJOIN})

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


class SidecarShutdown(Exception):
    """Raised in the main thread by SIGTERM/SIGINT: leave the rendezvous and stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


@dataclass(frozen=True)
class _RoundEnd:
    """How monitoring one round ended."""

    kind: str  # "succeeded" | "failed" | "restart" | "closed" | "launcher_lost" | "removed"
    failure: Failure | None = None
    reason: str = ""


class Supervisor:
    """Runs one node of an elastic job until it succeeds, fails or is told to stop.

    Args:
        config: the node's configuration (see :class:`~kelastic_sidecar.config.SidecarConfig`).
        store: an etcd store; built from ``config.etcd_endpoints`` when None.

    Call :meth:`run` from the main thread (it installs SIGTERM/SIGINT handlers); it returns
    the process exit code: 0 succeeded, 1 failed, 128+signum when stopped by a signal.
    """

    def __init__(self, config: SidecarConfig, store: EtcdStore | None = None) -> None:
        self.cfg = config
        self.keys = contract.Keys(config.prefix)
        self.store = store or EtcdStore(config.etcd_endpoints, tls_dir=config.tls_dir)
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.timer = TimerServer(
            contract.timer_fifo_path(config.run_dir),
            on_reap=lambda ev: self._events.put(("reaped", ev)),
        )
        self.metrics = SidecarMetrics(self.timer.stats)
        # Every failed etcd call counts, the lease keep-alive's and the watches' included.
        self.store.on_error = self._on_etcd_error
        self._etcd_error: tuple[float, str] | None = None  # (monotonic time, message)
        self.metrics.budget_max.set(config.max_restarts)
        self.control = ControlServer(
            contract.control_socket_path(config.run_dir),
            on_message=lambda msg: self._events.put(("control", msg)),
        )
        self.http = SidecarHttpServer(
            config.http_host,
            config.http_port,
            self.metrics.registry,
            healthy=lambda: self._alive,
            ready=lambda: self._running,
            status=self.status,
        )
        self.handler: EtcdRendezvousHandler | None = None
        self.budget = RestartBudget(
            self.store,
            self.keys,
            config.max_restarts,
            on_repair=self.metrics.corrupt_values.labels(source="restart_record").inc,
        )
        self._alive = True
        self._running = False
        self._phase = "starting"
        started = time.time()
        self.metrics.last_progress.set_function(lambda: self.timer.last_acquire_time or started)
        self.metrics.rendezvous_in_progress.set_function(
            lambda: 1.0 if self._phase == "rendezvous" else 0.0
        )
        self._info: RendezvousInfo | None = None
        self._attempt = 0
        self._nproc = config.nproc_per_node
        self._pids: dict[int, int] = {}  # local rank -> pid
        # local rank -> its timer token this attempt (see kelastic_sidecar.timer_server)
        self._tokens: dict[int, str] = {}
        self._warm = 0  # workers of the attempt forked by the launcher's warm-start zygote
        self._reaped: dict[int, ReapEvent] = {}  # pid -> reap of the current attempt
        self._down_since: float | None = None
        self._down_cause = CAUSE_SCALE
        self._watch_stop = threading.Event()
        self._rdzv_queued = threading.Event()  # an ("rdzv", None) event waits in the queue
        self._last_failure: Failure | None = None
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
            "attempt": self._attempt,
            "restarts_spent": self._spent,
            "max_restarts": self.cfg.max_restarts,
            "progress_count": stats.acquired,
            "attempt_progress_count": stats.acquired - self._acquired_at_start,
            "last_progress_age_s": (time.time() - last) if last else None,
            "timers_active": stats.active,
            "workers_warm": self._warm,
            "last_failure": self._last_failure.as_dict() if self._last_failure else None,
            "etcd_unreachable": self._etcd_outage(),
        }

    def _on_etcd_error(self, exc: EtcdUnavailableError) -> None:
        self.metrics.etcd_errors.inc()
        self._etcd_error = (time.monotonic(), str(exc))

    def _etcd_outage(self) -> str | None:
        """The last etcd error (it names the endpoint) while no call has succeeded since;
        None while etcd answers. The store keeps retrying meanwhile."""
        err = self._etcd_error
        if err is None or self.store.last_success > err[0]:
            return None
        return err[1]

    def run(self) -> int:
        """Supervise the node until the job ends for it; return the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.timer.start()
        self.control.start()
        self.http.start()
        log.info(
            "sidecar for %s/%s node %s: nodes %d..%d x %d workers, budget %d restarts, "
            "http :%d",
            self.cfg.namespace, self.cfg.job_name, self.cfg.node, self.cfg.min_nodes,
            self.cfg.max_nodes, self._nproc, self.cfg.max_restarts, self.http.port,
        )  # fmt: skip
        try:
            return self._run()
        except SidecarShutdown as exc:
            reason = self._departure_reason()
            log.info("received %s: stopping workers, leaving the rendezvous (%s)", exc, reason)
            self._stop_workers("sidecar stopping")
            self._leave(reason)
            self._shutdown_launcher(128 + exc.signum, f"stopped by {exc}")
            return 128 + exc.signum
        finally:
            self._alive = False
            self._running = False
            self._watch_stop.set()
            for s, h in old.items():
                signal.signal(s, h)
            if self.handler is not None:
                with contextlib.suppress(Exception):
                    self.handler.shutdown()
            self.timer.stop()
            self.control.close()
            self.http.stop()
            with contextlib.suppress(Exception):
                self.store.close()

    # ------------------------------------------------------------------------ main loop

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._phase in ("succeeded", "failed", "removed"):
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
        self._phase = "waiting_for_launcher"
        settings = RendezvousSettings(
            run_id=self.cfg.job_uid,
            min_nodes=self.cfg.min_nodes,
            max_nodes=self.cfg.max_nodes,
            join_timeout=self.cfg.join_timeout,
            last_call_timeout=self.cfg.last_call_timeout,
            close_timeout=self.cfg.close_timeout,
            lease_ttl=self.cfg.lease_ttl,
        )
        self.handler = EtcdRendezvousHandler(
            self.store,
            self.keys,
            self.cfg.node,
            settings,
            on_corrupt=lambda exc: self.metrics.corrupt_values.labels(source="rdzv_state").inc(),
        )
        try:  # the etcd session (lease, watch) is ready before the trainer container is
            self.handler.open()
        except EtcdUnavailableError as exc:
            log.warning("etcd unavailable at start (%s); the rendezvous will retry", exc)
        hello = self._wait_control("hello")
        self._nproc = int(hello.get("nproc") or self._nproc)
        if self._nproc != self.cfg.nproc_per_node:
            log.warning(
                "launcher runs %d workers per node, the job says %d; using the launcher's",
                self._nproc, self.cfg.nproc_per_node,
            )  # fmt: skip
        while True:
            try:
                info = self._rendezvous()
            except RendezvousClosedError as exc:
                return self._finish_closed(exc.reason)
            except (RendezvousError, EtcdUnavailableError) as exc:
                return self._fail_fatal(f"rendezvous failed: {exc}")
            try:
                master = self._master(info)
            except (TimeoutError, EtcdUnavailableError, ValueError) as exc:
                if type(exc) is ValueError:  # decode_master refused the record
                    self.metrics.corrupt_values.labels(source="master_record").inc()
                log.warning("round %d: no master address (%s); re-rendezvous", info.round, exc)
                continue
            self._start_workers(info, master)
            end = self._monitor(info)
            self._running = False
            if end.kind == "succeeded":
                return self._finish_succeeded()
            if end.kind == "closed":
                self._stop_workers("rendezvous closed")
                return self._finish_closed(self.handler.closed_reason())
            if end.kind == "removed":
                return self._finish_removed(end.reason or self._departure_reason())
            if end.kind == "launcher_lost":
                self._leave("shutdown")
                self._report("failed", "trainer container (launcher) disconnected")
                return EXIT_FAILED
            self._down_since = time.time()
            pids = dict(self._pids)  # _stop_workers forgets them; a stopped one is named below
            self._stop_workers(end.reason or (end.failure.summary() if end.failure else ""))
            if end.kind == "failed" and end.failure is not None:
                end = _RoundEnd("failed", self._blame_lost_peer(info, end.failure))
                assert end.failure is not None
                self._last_failure = end.failure
                self._down_cause = end.failure.cause
                if end.failure.cause == CAUSE_START_FAILURE:
                    return self._finish_not_started(end.failure)
                if self._charge(end.failure):
                    return self._finish_exhausted(end.failure)
            else:
                self._down_cause = end.reason or CAUSE_PEER
                self.metrics.restarts.labels(cause=self._down_cause).inc()
                log.info("round %d: restarting the worker group (%s)", info.round, end.reason)
                stopped = self._stopped_failure(info, pids)
                if stopped is not None:  # a peer restarted first, but it was waiting on ours
                    self._last_failure = stopped
                    log.error("round %d: %s", info.round, stopped.summary())

    def _wait_control(self, msg_type: str) -> Message:
        """Block until the launcher sends ``msg_type``; other events are dropped."""
        while True:
            kind, payload = self._next_event()
            if kind == "control" and payload.get("type") == msg_type:
                return dict(payload)

    def _rendezvous(self) -> RendezvousInfo:
        assert self.handler is not None
        self._phase = "rendezvous"
        started = time.monotonic()
        info = self.handler.next_rendezvous()
        took = time.monotonic() - started
        self._info = info
        self.metrics.rounds.inc()
        self.metrics.rendezvous_duration.observe(took)
        self.metrics.round.set(info.round)
        self.metrics.group_world_size.set(info.group_world_size)
        self.metrics.world_size.set(info.group_world_size * self._nproc)
        log.info(
            "round %d complete in %.3fs: group rank %d of %d, world size %d",
            info.round, took, info.group_rank, info.group_world_size,
            info.group_world_size * self._nproc,
        )  # fmt: skip
        return info

    def _master(self, info: RendezvousInfo) -> tuple[str, int]:
        """Publish (group rank 0) or look up the round's MASTER_ADDR/PORT."""
        key = self.keys.master(info.round)
        if info.group_rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((self.cfg.pod_ip, 0))
                port = int(sock.getsockname()[1])
            self.store.put(key, json.dumps({"addr": self.cfg.pod_ip, "port": port}).encode())
            return self.cfg.pod_ip, port
        raw = self.store.wait_value(key, timeout=min(self.cfg.join_timeout, 60.0))
        return decode_master(raw, key)

    def _start_workers(self, info: RendezvousInfo, master: tuple[str, int]) -> None:
        self._attempt += 1
        self._acquired_at_start = self.timer.stats().acquired
        self._pids.clear()
        self._reaped.clear()
        self.timer.forget_all()
        try:
            self._spent = self.budget.read().count
        except (EtcdUnavailableError, RestartRecordError) as exc:
            log.error("cannot read the restart budget: %s", exc)
        spent = self._spent
        self.metrics.budget_spent.set(spent)
        world = info.group_world_size * self._nproc
        workers = []
        self._tokens = {r: secrets.token_hex(16) for r in range(self._nproc)}
        for local_rank in range(self._nproc):
            rank = info.group_rank * self._nproc + local_rank
            env = {
                contract.RANK: rank,
                contract.LOCAL_RANK: local_rank,
                contract.WORLD_SIZE: world,
                contract.LOCAL_WORLD_SIZE: self._nproc,
                contract.GROUP_RANK: info.group_rank,
                contract.GROUP_WORLD_SIZE: info.group_world_size,
                contract.ROLE_RANK: rank,
                contract.ROLE_WORLD_SIZE: world,
                contract.ROLE_NAME: contract.DEFAULT_ROLE,
                contract.MASTER_ADDR: master[0],
                contract.MASTER_PORT: master[1],
                contract.TORCHELASTIC_RUN_ID: self.cfg.job_uid,
                contract.TORCHELASTIC_RESTART_COUNT: spent,
                contract.TORCHELASTIC_MAX_RESTARTS: self.cfg.max_restarts,
                contract.KELASTIC_ROUND: info.round,
                contract.KELASTIC_TIMER_TOKEN: self._tokens[local_rank],
                # The c10d store is created by rank 0 from MASTER_ADDR/PORT, not by us.
                "TORCHELASTIC_USE_AGENT_STORE": "False",
            }
            workers.append({"local_rank": local_rank, "env": {k: str(v) for k, v in env.items()}})
        self._phase = "starting_workers"
        self.control.send(
            {
                "type": contract.MSG_ASSIGN,
                "attempt": self._attempt,
                "round": info.round,
                "workers": workers,
            }
        )

    def _monitor(self, info: RendezvousInfo) -> _RoundEnd:
        """Handle events until the round ends for this node."""
        assert self.handler is not None
        handler = self.handler
        succeeded: set[int] = set()
        self._watch_stop.clear()
        watcher = threading.Thread(target=self._watch_rendezvous, name="rdzv-watch", daemon=True)
        watcher.start()
        # A change may have happened between the round completing and the watch starting.
        self._queue_check()
        try:
            while True:
                kind, payload = self._next_event()
                if kind == "reaped":
                    self._on_reaped(payload)
                elif kind == "rdzv":
                    end = self._check_round(handler, info)
                    if end is not None:
                        return end
                elif kind == "control":
                    end = self._on_control(payload, info, succeeded)
                    if end is not None:
                        return end
        finally:
            self._watch_stop.set()

    def _watch_rendezvous(self) -> None:
        handler = self.handler
        assert handler is not None
        while not self._watch_stop.is_set():
            try:
                changed = handler.wait_for_change(1.0)
            except (RendezvousError, EtcdUnavailableError) as exc:
                log.warning("watching the rendezvous failed: %s", exc)
                self._watch_stop.wait(0.5)
                changed = True
            recheck = handler.take_recheck()  # a grace after an etcd outage is over
            if (changed or handler.lease_lost or recheck) and not self._watch_stop.is_set():
                self._queue_check()

    def _queue_check(self) -> None:
        """Queue a rendezvous check unless one already waits: a check reads the current
        state, so a second one adds nothing, and while etcd is down (each check then takes
        the store's whole timeout, and the watch fails faster) the repeats would bury the
        workers' exits behind them."""
        if not self._rdzv_queued.is_set():
            self._rdzv_queued.set()
            self._events.put(("rdzv", None))

    def _next_event(self, timeout: float | None = None) -> tuple[str, Any]:
        """The next event (``queue.Empty`` after ``timeout`` s); a rendezvous check taken
        off the queue lets the next change queue another."""
        kind, payload = self._events.get(timeout=timeout)
        if kind == "rdzv":
            self._rdzv_queued.clear()
        return kind, payload

    def _check_round(
        self, handler: EtcdRendezvousHandler, info: RendezvousInfo
    ) -> _RoundEnd | None:
        try:
            check = handler.check_round(info)
        except (RendezvousError, EtcdUnavailableError) as exc:
            log.warning("checking round %d failed: %s", info.round, exc)
            return None
        if check.healthy:
            return None
        nodes = ", ".join(check.nodes)
        if check.reason == "closed":
            return _RoundEnd("closed")
        if self.cfg.node in check.nodes and check.reason in (
            "participant_left",
            "participant_lost",
        ):
            # The operator removed this node from the round (scale-down, or its Pod is
            # going away): stop here instead of rejoining.
            return _RoundEnd("removed", reason=dict(check.departures).get(self.cfg.node, ""))
        if check.reason == "participant_lost":
            return _RoundEnd(
                "failed",
                Failure(
                    cause=CAUSE_NODE_LOST,
                    node=nodes,
                    round=info.round,
                    message="its liveness key is gone (lease expired or node removed)",
                ),
            )
        if check.reason == "participant_left":
            departures = dict(check.departures)
            unplanned = {
                n: departures.get(n, "?")
                for n in check.nodes
                if departures.get(n) not in _PLANNED_DEPARTURES
            }
            if unplanned:
                # A node stopped in mid-round without being scaled down (Pod deleted,
                # preempted, drained): a disruption, charged like a lost node.
                return _RoundEnd(
                    "failed",
                    Failure(
                        cause=CAUSE_NODE_LOST,
                        node=", ".join(sorted(unplanned)),
                        round=info.round,
                        message="left the round: "
                        + ", ".join(f"{n} ({r})" for n, r in sorted(unplanned.items())),
                    ),
                )
        reason = {
            "nodes_waiting": CAUSE_SCALE,
            "participant_left": CAUSE_SCALE,
        }.get(check.reason, CAUSE_PEER)
        log.info("round %d: %s (%s)", info.round, check.reason, nodes)
        return _RoundEnd("restart", reason=reason)

    def _blame_lost_peer(self, info: RendezvousInfo, failure: Failure) -> Failure:
        """The root cause of a worker failure: a peer node lost in the same round when
        there is one (its workers' connections reset, so ours fail first; the operator or
        ``kelastic run`` takes a dead Pod's node out at once), else ``failure`` itself.
        Checked after our workers stopped, so that the loss had time to show."""
        if failure.cause != CAUSE_WORKER_FAILURE or self.handler is None:
            return failure
        end = self._check_round(self.handler, info)
        lost = end.failure if end is not None and end.kind == "failed" else None
        if lost is None or lost.cause != CAUSE_NODE_LOST:
            return failure
        log.warning("round %d: %s; it explains %s", info.round, lost.summary(), failure.summary())
        return replace(lost, message=f"{lost.message}; then {failure.summary()}")

    def _stopped_failure(
        self, info: RendezvousInfo, pids: dict[int, int] | None = None
    ) -> Failure | None:
        """The hang of a worker of this attempt that was reaped while stopped, if any.

        Its peers' timers expire too while they wait for it in a collective, so it is
        the root cause of the round's hangs, whichever exit is reported first.

        Args:
            info: the round.
            pids: local rank -> pid of the attempt's workers (default: the current ones;
                a peer's restart can stop ours before their exits are reported).
        """
        for local_rank, pid in sorted((self._pids if pids is None else pids).items()):
            reap = self._reaped.get(pid)
            if reap is not None and reap.state in ("T", "t"):
                return Failure(
                    cause=CAUSE_HANG,
                    node=self.cfg.node,
                    round=info.round,
                    rank=info.group_rank * self._nproc + local_rank,
                    local_rank=local_rank,
                    signal=reap.signal,
                    message=f"timer {reap.scope_id!r} expired; reaped by the timer server "
                    "(it was stopped, not waiting on a peer)",
                    stopped=True,
                )
        return None

    def _on_reaped(self, ev: ReapEvent) -> None:
        self._reaped[ev.pid] = ev
        log.warning(
            "worker pid %d hung: timer %r expired %.3fs ago; killed with %s",
            ev.pid, ev.scope_id, ev.reaped_at - ev.expiration_time, signal_name(ev.signal),
        )  # fmt: skip

    def _on_control(
        self, msg: Message, info: RendezvousInfo, succeeded: set[int]
    ) -> _RoundEnd | None:
        mtype = msg.get("type")
        if mtype == MSG_DISCONNECTED:
            return _RoundEnd("launcher_lost")
        if msg.get("attempt") != self._attempt:
            return None  # late news from an earlier attempt
        if mtype == contract.MSG_STARTED:
            pids = msg.get("pids") or {}
            warm = msg.get("warm")
            self._warm = min(warm, len(pids)) if isinstance(warm, int) and warm > 0 else 0
            self.metrics.worker_starts.labels(start="warm").inc(self._warm)
            self.metrics.worker_starts.labels(start="cold").inc(len(pids) - self._warm)
            for local_rank, pid in pids.items():
                self._pids[int(local_rank)] = int(pid)
                try:
                    self.timer.watch_pid(int(pid), self._tokens.get(int(local_rank)))
                except ValueError as exc:  # pid <= 1 or our own: never reapable
                    log.error("not watching worker pid %s: %s", pid, exc)
            self._running = True
            self._phase = "running"
            if self._down_since is not None:
                self.metrics.downtime.labels(cause=self._down_cause).inc(
                    time.time() - self._down_since
                )
                self._down_since = None
            return None
        if mtype != contract.MSG_EXITED:
            return None
        local_rank = int(msg.get("local_rank", -1))
        pid = msg.get("pid")  # None when the worker could not even be started
        if isinstance(pid, int):
            self.timer.forget_pid(pid)
        exitcode, sig = msg.get("exitcode"), msg.get("signal")
        code_label = signal_name(int(sig)) if sig is not None else str(exitcode)
        self.metrics.worker_exits.labels(code=code_label).inc()
        if exitcode == 0:
            succeeded.add(local_rank)
            if len(succeeded) >= self._nproc:
                return _RoundEnd("succeeded")
            return None
        reap = self._reaped.get(pid) if isinstance(pid, int) else None
        error = msg.get("error") or {}
        message = str(error.get("message") or "") if isinstance(error, dict) else ""
        tail = tuple(str(x) for x in msg.get("tail") or ())
        if reap is not None:
            # Workers blocked in a collective on a stopped peer are reaped with it: name
            # the stopped one of this node, whichever exit was reported first.
            culprit = self._stopped_failure(info)
            if culprit is not None:
                log.error("round %d failed: %s", info.round, culprit.summary())
                return _RoundEnd("failed", culprit)
            message = f"timer {reap.scope_id!r} expired; reaped by the timer server"
        cause = CAUSE_HANG if reap is not None else CAUSE_WORKER_FAILURE
        if reap is None and (pid is None or exitcode in NOT_STARTED_EXIT_CODES):
            cause = CAUSE_START_FAILURE  # exec failed, or the command is not there
        failure = Failure(
            cause=cause,
            node=self.cfg.node,
            round=info.round,
            rank=info.group_rank * self._nproc + local_rank,
            local_rank=local_rank,
            exitcode=int(exitcode) if exitcode is not None else None,
            signal=int(sig) if sig is not None else None,
            message=message,
            tail=tail,
        )
        log.error("round %d failed: %s", info.round, failure.summary())
        return _RoundEnd("failed", failure)

    # --------------------------------------------------------------------- transitions

    def _charge(self, failure: Failure) -> bool:
        """Spend one restart for the failed round; True when the budget is exhausted."""
        try:
            charge = self.budget.charge(
                failure.round, failure.cause, failure.node, failure.as_dict()
            )
        except (EtcdUnavailableError, RestartRecordError) as exc:
            if isinstance(exc, RestartRecordError):  # a corrupt record (failed calls count
                self.metrics.etcd_errors.inc()  # through the store's on_error)
            log.error("cannot record the restart in etcd: %s", exc)
            return False
        self._spent = charge.count
        self.metrics.budget_spent.set(charge.count)
        self.metrics.restarts.labels(cause=failure.cause).inc()
        if charge.charged:
            log.warning(
                "restart %d/%d (%s)", charge.count, self.cfg.max_restarts, failure.summary()
            )
        return charge.exhausted

    def _stop_workers(self, reason: str) -> None:
        """Ask the launcher to stop the current attempt's workers and wait for it."""
        if not self._pids and self._attempt == 0:
            return
        self._phase = "stopping"
        if not self.control.send(
            {"type": contract.MSG_STOP, "attempt": self._attempt, "reason": reason}
        ):
            return
        deadline = time.monotonic() + self.cfg.stop_grace + 10.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, payload = self._next_event(timeout=left)
            except queue.Empty:
                break
            if kind == "control" and payload.get("type") == MSG_DISCONNECTED:
                break
            if (
                kind == "control"
                and payload.get("type") == contract.MSG_STOPPED
                and payload.get("attempt") == self._attempt
            ):
                break
            if kind == "reaped":
                self._on_reaped(payload)
        else:
            log.warning("the launcher did not confirm the stop of attempt %d", self._attempt)
        self.timer.forget_all()
        self._pids.clear()

    def _departure_reason(self) -> str:
        """``scale_down`` when the operator posted a departure notice for this node (it is
        being removed on purpose, and the peers owe no restart); else ``shutdown``."""
        try:
            got = self.store.get(self.keys.departing(self.cfg.node))
        except EtcdUnavailableError:
            got = None
        return got[0].decode(errors="replace") if got else "shutdown"

    def _leave(self, reason: str) -> None:
        if self.handler is None:
            return
        try:
            self.handler.leave(reason)
        except (RendezvousError, EtcdUnavailableError) as exc:
            log.warning("leaving the rendezvous failed: %s", exc)

    def _report(self, outcome: str, summary: str, failure: Failure | None = None) -> None:
        doc = node_report(outcome, self.cfg.node, summary, failure)
        try:
            self.store.put(self.keys.report(self.cfg.node), doc)
        except EtcdUnavailableError as exc:
            log.error("cannot write the node report to etcd: %s", exc)

    def _shutdown_launcher(self, exitcode: int, summary: str) -> None:
        self.control.send({"type": contract.MSG_SHUTDOWN, "exitcode": exitcode, "summary": summary})

    def _finish_succeeded(self) -> int:
        self._phase = "succeeded"
        info = self._info
        summary = f"succeeded: all {self._nproc} workers of {self.cfg.node} exited 0"
        if info is not None:
            summary += f" (round {info.round}, world size {info.group_world_size * self._nproc})"
        log.info(summary)
        self._leave("succeeded")
        self._report("succeeded", summary)
        self._shutdown_launcher(EXIT_SUCCEEDED, summary)
        return EXIT_SUCCEEDED

    def _finish_removed(self, reason: str) -> int:
        """This node was taken out of the job (by the operator): stop and report it."""
        planned = reason == contract.DEPARTURE_SCALE_DOWN
        summary = f"{self.cfg.node} removed from the job ({reason or 'no reason given'})"
        log.warning(summary)
        self._phase = "removed"
        self._stop_workers(summary)
        self._leave(reason or "shutdown")
        self._report("removed", summary)
        code = EXIT_SUCCEEDED if planned else EXIT_FAILED
        self._shutdown_launcher(code, summary)
        return code

    def _finish_exhausted(self, failure: Failure) -> int:
        self._phase = "failed"
        assert self.handler is not None
        reason = failure.as_dict()
        reason["max_restarts"] = self.cfg.max_restarts
        log.error(
            "restart budget of %d spent; failing the job: %s",
            self.cfg.max_restarts, failure.summary(),
        )  # fmt: skip
        try:
            self.handler.close(reason)
        except (RendezvousError, EtcdUnavailableError) as exc:
            log.error("closing the rendezvous failed: %s", exc)
        return self._finish_closed(reason)

    def _finish_not_started(self, failure: Failure) -> int:
        """A worker could not be started: fail the job at once (a restart would run the
        same command again), closing the rendezvous so that every node stops."""
        self._phase = "failed"
        assert self.handler is not None
        reason = failure.as_dict()
        reason["not_retried"] = True
        log.error("a worker could not be started; failing the job: %s", failure.summary())
        try:
            self.handler.close(reason)
        except (RendezvousError, EtcdUnavailableError) as exc:
            log.error("closing the rendezvous failed: %s", exc)
        return self._finish_closed(reason)

    def _finish_closed(self, reason: dict[str, Any] | None) -> int:
        self._phase = "failed"
        failure = None
        if reason:
            with contextlib.suppress(KeyError, TypeError):
                failure = Failure.from_dict(reason)
        if failure is not None and reason and reason.get("not_retried"):
            text = (
                f"{contract.JOB_FAILED_PREFIX}: a worker could not be started (not retried); "
                f"root cause: {failure.details()}"
            )
        elif failure is not None:
            text = (
                f"{contract.JOB_FAILED_PREFIX} after {self.cfg.max_restarts} restarts "
                "(budget spent); "
                f"root cause: {failure.details()}"
            )
        else:
            text = f"{contract.JOB_FAILED_PREFIX}: the rendezvous was closed" + (
                f" ({reason})" if reason else ""
            )
        self._last_failure = failure or self._last_failure
        self._report("failed", text, failure)
        self._shutdown_launcher(EXIT_FAILED, text)
        return EXIT_FAILED

    def _fail_fatal(self, text: str) -> int:
        self._phase = "failed"
        log.error(text)
        self._report("failed", text)
        self._shutdown_launcher(EXIT_FAILED, text)
        return EXIT_FAILED


def decode_master(raw: bytes, key: str) -> tuple[str, int]:
    """Parse a round's master record ``{"addr": str, "port": int}`` (bounded, see
    :func:`kelastic._safejson.loads_bounded`).

    Returns:
        ``(MASTER_ADDR, MASTER_PORT)``.

    Raises:
        ValueError: the record is corrupt (not bounded JSON, an address that is not a
            string of 1..255 characters, a port outside 1..65535); never another error.
    """
    try:
        doc = loads_bounded(raw, max_bytes=4096)
    except UnsafeJSONError as exc:
        raise ValueError(f"corrupt master record at {key} ({exc}): {raw[:200]!r}") from None
    addr = doc.get("addr") if isinstance(doc, dict) else None
    port = doc.get("port") if isinstance(doc, dict) else None
    if not isinstance(addr, str) or not 0 < len(addr) <= 255:
        raise ValueError(f"corrupt master record at {key}: bad addr: {raw[:200]!r}")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"corrupt master record at {key}: bad port: {raw[:200]!r}")
    return addr, port


def node_report(outcome: str, node: str, summary: str, failure: Failure | None = None) -> bytes:
    """The node's final report, as stored at :meth:`kelastic.contract.Keys.report`.

    A JSON object: ``outcome`` (``"succeeded"``, ``"failed"`` or ``"removed"``), ``node``,
    ``summary`` (one line; a failed *job* starts with
    :data:`kelastic.contract.JOB_FAILED_PREFIX`), ``failure`` (:meth:`Failure.as_dict`
    or null) and ``time`` (``time.time()``). The operator reads ``outcome`` and
    ``summary`` (``kelastic_operator.rendezvous_store.view_from_keys``).
    """
    doc = {
        "outcome": outcome,
        "node": node,
        "summary": summary,
        "failure": failure.as_dict() if failure else None,
        "time": time.time(),
    }
    return json.dumps(doc).encode()
