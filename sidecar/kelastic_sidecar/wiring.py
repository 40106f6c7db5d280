"""The supervisor's parts, built in one place and connected to its event queue.

:func:`build_parts` constructs what one node's :class:`~kelastic_sidecar.supervisor.Supervisor`
runs with (etcd store, timer server, control server, ``/metrics`` HTTP server,
restart budget, metrics, in-process restart coordinator, step times) and connects their callbacks
to the supervisor's event queue as the typed events of :mod:`kelastic_sidecar.events`, so
that the supervisor holds no construction code.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kelastic
from kelastic import contract
from kelastic.checkpoint.persist import Persisted
from kelastic.etcd_values import CorruptValueError, encode_stragglers
from kelastic.etcd_values.checkpoints import Restore
from kelastic.hang_where import HangWhere
from kelastic_etcd import EtcdClient, EtcdError

from .checkpoint_loads import LoadReporter
from .checkpoints import RoundCheckpoints
from .config import SidecarConfig
from .control import ControlServer
from .etcd_publish import LatestPublisher
from .events import Event, FromLauncher, RespawnDue, SparePromoted, WorkerReaped
from .failure import Failure
from .hang_evidence import Collect, StackCollector
from .http import SidecarHttpServer
from .inprocess import InProcessCoordinator
from .metrics import SidecarMetrics
from .persister import Persister
from .prestop import PodTermination, PrestopServer
from .replication import Replication
from .restart_budget import RestartBudget, RestartRecordError
from .steptime import StepTimes, Straggler
from .timer import TimerServer, hard_timeout_reap
from .witness import publish

__all__ = [
    "EVIDENCE_DIR",
    "EtcdHealth",
    "HangReports",
    "Hooks",
    "Parts",
    "build_parts",
    "kill_reporter",
    "straggler_reporter",
]
log = logging.getLogger("kelastic_sidecar.supervisor")

#: The folder of the run dir (the run's volume) holding hung workers' stack files.
EVIDENCE_DIR = "hang-evidence"


class EtcdHealth:
    """Whether etcd answers, for ``/status``: every failed call of the store counts (the
    lease keep-alive's and the watches' included)."""

    def __init__(self, store: EtcdClient, metrics: SidecarMetrics) -> None:
        self._store = store
        self._metrics = metrics
        self._error: tuple[float, str] | None = None  # (monotonic time, message)

    def on_error(self, exc: EtcdError) -> None:
        """The store's ``on_error``."""
        self._metrics.etcd_errors.inc()
        self._error = (time.monotonic(), str(exc))

    def outage(self) -> str | None:
        """The last etcd error (it names the endpoint) while no call has succeeded since;
        None while etcd answers. The store keeps retrying meanwhile."""
        err = self._error
        if err is None or self._store.last_success > err[0]:
            return None
        return err[1]


@dataclass(frozen=True)
class Hooks:
    """What the parts call back into the supervisor for."""

    healthy: Callable[[], bool]
    ready: Callable[[], bool]
    status: Callable[[], dict[str, Any]]


@dataclass
class Parts:
    """One node's servers and clients (see :func:`build_parts`)."""

    store: EtcdClient
    keys: contract.Keys
    events: queue.Queue[Event]
    timer: TimerServer
    metrics: SidecarMetrics
    control: ControlServer
    http: SidecarHttpServer
    budget: RestartBudget
    etcd_health: EtcdHealth
    inprocess: InProcessCoordinator
    steps: StepTimes
    #: Where the attempt monitor's findings on a hung round go.
    hangs: HangReports
    #: The checkpoint slots' records before each round, and what each round restores.
    checkpoints: RoundCheckpoints
    #: The Pod-is-terminating handshake, and the socket its preStop hook tells it on.
    termination: PodTermination
    prestop: PrestopServer


@dataclass(frozen=True)
class HangReports:
    """The :class:`~kelastic_sidecar.witness.HangSink` of a node: the evidence to etcd for
    the operator (``hangs/<node>``), a stopped worker to the restart record (an amend of
    the round's charge); each on a daemon thread, failures logged."""

    store: EtcdClient
    key: str
    budget: RestartBudget

    def where(self, where: HangWhere) -> threading.Thread:
        """See :meth:`~kelastic_sidecar.witness.HangSink.where`."""
        return publish(self.store, self.key, where)

    def stopped(self, failure: Failure) -> threading.Thread:
        """See :meth:`~kelastic_sidecar.witness.HangSink.stopped`."""

        def amend() -> None:
            try:
                self.budget.amend(failure.round, failure.cause, failure.node, failure.as_dict())
            except (EtcdError, RestartRecordError) as exc:
                log.warning("cannot amend the charge of round %d: %s", failure.round, exc)

        thread = threading.Thread(target=amend, name="kelastic-amend-charge", daemon=True)
        thread.start()
        return thread


def straggler_reporter(
    node: str, pod_uid: str, publisher: LatestPublisher
) -> Callable[[int, list[Straggler]], None]:
    """:class:`~kelastic_sidecar.steptime.StepTimes`' ``on_change``: the node's stragglers
    now, by their value's codec (:mod:`kelastic.etcd_values.stragglers`), to ``publisher``
    (never blocking the timer server's thread); a verdict the codec refuses is logged."""

    def on_change(generation: int, found: list[Straggler]) -> None:
        try:
            value = encode_stragglers(node, pod_uid, time.time(), [s.as_dict() for s in found])
        except CorruptValueError as exc:
            log.warning("cannot report the stragglers: %s", exc)
            return
        publisher.put(generation, value)

    return on_change


def kill_reporter(collect: Collect, put: Callable[[Event], None]) -> Callable[[int, str], None]:
    """The in-process hard timeout's ``on_kill(pid, why)``, called just before it SIGKILLs
    ``pid``: the worker's stacks are read (``collect``, within its budget), then its reap
    (:func:`~kelastic_sidecar.timer.hard_timeout_reap`, carrying them) is ``put`` on the
    supervisor's queue, where the timer server's reaps go."""

    def on_kill(pid: int, why: str) -> None:
        put(WorkerReaped(hard_timeout_reap(pid, why, collect(pid))))

    return on_kill


def build_parts(config: SidecarConfig, store: EtcdClient | None, hooks: Hooks) -> Parts:
    """Construct the supervisor's parts; nothing is started (``Supervisor.run`` does).

    Args:
        config: the node's configuration.
        store: an etcd store; built from the config (endpoints, TLS, user and password)
            when None.
        hooks: the supervisor's callbacks.
    """
    keys = contract.Keys(config.prefix)
    store = store or config.etcd_client()  # endpoints, TLS, user and password
    events: queue.Queue[Event] = queue.Queue()
    # A hung worker's stacks, read before the timer server or the hard timeout kills it.
    collect = StackCollector(
        config.run_dir / EVIDENCE_DIR,
        budget=config.hang_evidence_budget,
        library_dirs=(str(Path(kelastic.__file__).parent),),  # kelastic's frames: not the user's
        on_outcome=lambda outcome: metrics.hang_evidence.labels(outcome=outcome.value).inc(),
        flight_dir=contract.flight_records_dir(config.run_dir),  # armed workers' records
        on_record=lambda outcome: metrics.flight_records.labels(outcome=outcome.value).inc(),
    )
    # Step times from the timer requests: the node's histogram, straggler episodes.
    stragglers = LatestPublisher(store, keys.straggler(config.node), "stragglers")
    steps = StepTimes(
        config.stragglers,
        on_straggler=lambda _s: metrics.stragglers.inc(),
        on_change=straggler_reporter(config.node, config.pod_uid, stragglers),  # the operator's
    )
    timer = TimerServer(
        contract.timer_fifo_path(config.run_dir),
        on_reap=lambda ev: events.put(WorkerReaped(ev)),
        grace=config.inprocess.timer_grace,
        collect=collect,
        observe=steps.observe,
        after_turn=steps.judge_if_due,
    )
    metrics = SidecarMetrics(timer.stats, steps.histogram)
    # Every failed etcd call counts, the lease keep-alive's and the watches' included.
    etcd_health = EtcdHealth(store, metrics)
    store.on_error = etcd_health.on_error
    metrics.budget_max.set(config.max_restarts)
    control = ControlServer(
        contract.control_socket_path(config.run_dir),
        on_message=lambda msg: events.put(FromLauncher(msg)),
    )
    http = SidecarHttpServer(
        config.http_host,
        config.http_port,
        metrics.registry,
        healthy=hooks.healthy,
        ready=hooks.ready,
        status=hooks.status,
    )
    budget = RestartBudget(
        store,
        keys,
        config.max_restarts,
        on_repair=metrics.corrupt_values.labels(source="restart_record").inc,
        host=config.host_node,
    )
    inprocess = InProcessCoordinator(
        config.inprocess, store, keys, config.node, metrics, config.run_dir, config.pod_ip,
        on_respawn=lambda round_, local_rank, env: events.put(RespawnDue(round_, local_rank, env)),
        on_promote=lambda round_, slot, local_rank, pid: events.put(
            SparePromoted(round_, local_rank, slot, pid)
        ),
        # the hard timeout's kill is a reap on the same queue as the timer server's
        on_kill=kill_reporter(collect, events.put),
    )  # fmt: skip
    checkpoints = RoundCheckpoints(
        store, keys, config, on_check=metrics.checkpoint.check.observe,
        on_restore=restore_reporter(metrics), persister=persister_of(config, metrics),
        replication=replication_of(config, metrics),
        loads=LoadReporter(store, keys.checkpoint_load(config.node), contract.checkpoint_dir()),
    )  # fmt: skip
    termination = PodTermination()
    prestop = PrestopServer(
        contract.prestop_socket_path(config.run_dir), termination, contract.PRESTOP_TIMEOUT_SECONDS
    )
    return Parts(
        store, keys, events, timer, metrics, control, http, budget, etcd_health, inprocess, steps,
        HangReports(store, keys.hang(config.node), budget), checkpoints, termination, prestop,
    )  # fmt: skip


def restore_reporter(metrics: SidecarMetrics) -> Callable[[Restore], None]:
    """What a round's :class:`~kelastic.etcd_values.checkpoints.Restore` does to the
    metrics: a restore counted by its tier (a fresh start, nothing held, is none), and the
    step restored."""

    def restored(restore: Restore) -> None:
        if restore.held or restore.step is not None:
            metrics.checkpoint.restores.labels(tier=restore.tier.value).inc()
        if restore.step is not None:
            metrics.checkpoint.step.set(restore.step)

    return restored


def replication_of(config: SidecarConfig, metrics: SidecarMetrics) -> Replication | None:
    """The node's :class:`~kelastic_sidecar.replication.Replication` when the job keeps
    replicas of its checkpoints (``spec.checkpoint.replicas``), its outcomes in ``metrics``
    (the lag sampled at each scrape)."""
    if config.replication is None:
        return None
    m = metrics.checkpoint

    def sent(_rank: int, step: int, nbytes: int, seconds: float) -> None:
        m.replicated_step.set(step)
        m.replicated_bytes.inc(nbytes)
        m.replicate.observe(seconds)

    replication = Replication(
        config.replication, config.job_uid, contract.checkpoint_dir(), config.pod_ip,
        on_sent=sent, on_failure=lambda _exc: m.replicate_failures.inc(),
    )  # fmt: skip
    m.replication_lag.set_function(replication.lag)
    return replication


def persister_of(config: SidecarConfig, metrics: SidecarMetrics) -> Persister | None:
    """The node's :class:`~kelastic_sidecar.persister.Persister` when the job persists
    its checkpoints (``spec.checkpoint.persist``), its outcomes counted in ``metrics``."""
    if config.persist is None:
        return None
    m = metrics.checkpoint

    def persisted(done: Persisted, seconds: float) -> None:
        if done.nbytes:
            m.persist.observe(seconds)

    return Persister(
        config.persist, config.job_uid, contract.checkpoint_dir(), on_persisted=persisted,
        on_failure=lambda _exc: m.persist_failures.inc(), on_step=m.persisted_step.set,
        replicated=config.layout is contract.StateLayout.REPLICATED,
    )  # fmt: skip
