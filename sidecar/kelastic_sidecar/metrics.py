"""The sidecar's Prometheus metrics (prometheus-client, one registry per sidecar).

Names follow Prometheus conventions: ``kelastic_`` prefix, base units in the name,
``_total`` for counters. No series carries a label naming its job (least of all ``job``,
Prometheus' own target label): the scrape config adds the Pod's ``namespace``, ``pod`` and
``elasticjob`` (the chart's PodMonitor). ``kelastic_build_info`` is 1, labelled with the
kelastic ``version`` and the ``python_version``.

Over ~400 lines because it is the sidecar's whole metric vocabulary in one place: every
family's name, help and labels (the chart README's table is checked against them), and
the collectors that read the servers' counters at scrape time.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import kelastic
from kelastic.etcd_values.checkpoints import RestoreTier

from .failure import (
    CAUSE_HANG,
    CAUSE_NODE_LOST,
    CAUSE_OOM,
    CAUSE_PEER,
    CAUSE_SCALE,
    CAUSE_WORKER_FAILURE,
)
from .hang_evidence import Outcome
from .ipc import DROP_REASONS
from .vocabulary import CheckOutcome

#: The ``cause`` label values of the restart and downtime counters.
CAUSES = (CAUSE_WORKER_FAILURE, CAUSE_HANG, CAUSE_OOM, CAUSE_NODE_LOST, CAUSE_SCALE, CAUSE_PEER)
#: The ``level`` label values of ``kelastic_restarts_total``: ``process`` (the worker
#: group's processes restarted), ``inprocess`` (the ranks re-entered the wrapped function
#: in the same processes: :mod:`~kelastic_sidecar.inprocess.coordinator`).
LEVELS = ("process", "inprocess")
#: The ``source`` label values of ``kelastic_corrupt_values_total``.
CORRUPT_SOURCES = (
    "rdzv_state", "restart_record", "master_record", "inprocess_record", "inprocess_ready",
    "inprocess_go",
)  # fmt: skip


class TimerCounts(Protocol):
    """What :class:`TimerCollector` reads of the timer server's counters (its
    :class:`~kelastic_sidecar.timer.TimerStats` has them): this module measures the
    servers without importing them."""

    active: int
    overdue: int
    requests: int
    acquired: int
    expired: int
    reaped: int
    reaped_after_grace: int
    spared: int
    malformed: int
    oversized: int
    dropped_unwatched: int
    dropped_capacity: int
    forged: int
    shed: int


class TimerCollector(Collector):
    """Exports the timer server's counters at scrape time (no double bookkeeping).

    Args:
        stats: returns the timer server's counters now (:class:`TimerCounts`).
    """

    def __init__(self, stats: Callable[[], TimerCounts]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        """Yield the timer metric families."""
        s = self._stats()
        yield GaugeMetricFamily(
            "kelastic_timers_active", "Expiration timers currently held by workers", s.active
        )
        yield GaugeMetricFamily(
            "kelastic_timers_overdue",
            "Expired timers whose reap waits for the grace (in-process restart: "
            "hard - soft timeout)",
            s.overdue,
        )
        for name, doc, value in (
            ("kelastic_timer_requests", "Well-formed requests read from the timer FIFO",
             s.requests),
            ("kelastic_timer_acquires",
             "Expiration timers acquired by workers (training progress)", s.acquired),
            ("kelastic_timers_expired", "Expiration timers that expired", s.expired),
            ("kelastic_workers_reaped", "Hung workers killed by the timer server", s.reaped),
            ("kelastic_workers_reaped_after_grace",
             "Of the reaped workers, those whose reap waited for the grace", s.reaped_after_grace),
            ("kelastic_timers_spared",
             "Expired timers released or acquired again within the grace (not reaped)",
             s.spared),
            ("kelastic_timer_bad_requests",
             "Malformed or oversized lines on the timer FIFO (skipped)",
             s.malformed + s.oversized),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
        dropped = CounterMetricFamily(
            "kelastic_timer_requests_dropped",
            "Timer requests dropped, by reason: unwatched (the pool of timers of unwatched "
            "pids was full), capacity (a watched worker's own budget was full), forged "
            "(naming a watched worker without its token), shed (queue full under a flood)",
            labels=["reason"],
        )
        for reason, value in (
            ("unwatched", s.dropped_unwatched),
            ("capacity", s.dropped_capacity - s.dropped_unwatched),
            ("forged", s.forged),
            ("shed", s.shed),
        ):
            dropped.add_metric([reason], value)
        yield dropped


class GoodputClock:
    """Productive time (workers running) against wall time since the clock was made.

    Args:
        clock: a monotonic clock in seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._productive = 0.0
        self._since: float | None = None

    @property
    def running(self) -> bool:
        """Whether the workers are running now (productive time is accruing)."""
        return self._since is not None

    def set_running(self, running: bool) -> None:
        """Start or stop accruing productive time (repeating a state is a no-op)."""
        now = self._clock()
        if running and self._since is None:
            self._since = now
        elif not running and self._since is not None:
            self._productive += now - self._since
            self._since = None

    def productive_seconds(self) -> float:
        """Seconds with running workers so far."""
        extra = self._clock() - self._since if self._since is not None else 0.0
        return self._productive + extra

    def wall_seconds(self) -> float:
        """Seconds since the clock was made."""
        return self._clock() - self._start

    def ratio(self) -> float:
        """Goodput: productive over wall time, 0 before any time has passed."""
        wall = self.wall_seconds()
        return min(1.0, self.productive_seconds() / wall) if wall > 0 else 0.0


class GoodputCollector(Collector):
    """Exports a :class:`GoodputClock` at scrape time."""

    def __init__(self, clock: GoodputClock) -> None:
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        """Yield the goodput metric families."""
        c = self._clock
        yield CounterMetricFamily(
            "kelastic_productive_seconds",
            "Seconds this node's workers were running (productive time)",
            value=c.productive_seconds(),
        )
        yield CounterMetricFamily(
            "kelastic_wall_seconds",
            "Seconds since this node's sidecar started (wall time)",
            value=c.wall_seconds(),
        )
        yield GaugeMetricFamily(
            "kelastic_goodput_ratio",
            "Productive time over wall time since the sidecar started (0..1)",
            value=c.ratio(),
        )


def _spare_metrics(registry: CollectorRegistry) -> tuple[Counter, Gauge]:
    """In-process restart's spare ranks: ``kelastic_inprocess_spares_promoted_total`` (dead
    workers a waiting spare replaced) and ``kelastic_inprocess_spares_waiting`` (spares of
    the node waiting now)."""
    promoted = Counter(
        "kelastic_inprocess_spares_promoted_total",
        "Dead workers replaced by a waiting spare worker (spec.inProcess.spareRanks): "
        "their peers restarted in process and no process was started",
        registry=registry,
    )
    waiting = Gauge(
        "kelastic_inprocess_spares_waiting",
        "Spare workers of this node waiting, warm, to replace a dead worker",
        registry=registry,
    )
    return promoted, waiting


class CheckpointMetrics(NamedTuple):
    """The checkpoint slots' metrics (:mod:`kelastic_sidecar.checkpoints`)."""

    #: Seconds each check of the node's slots took.
    check: Histogram
    #: Restores by tier.
    restores: Counter
    #: The step restored last.
    step: Gauge
    #: Seconds each rank's persistence of a step took.
    persist: Histogram
    #: The newest step this node persisted.
    persisted_step: Gauge
    #: Persistence failures (a slot rewritten meanwhile, a full disk, ...).
    persist_failures: Counter
    #: The newest step the peer acknowledged a replica of, for some rank of this node.
    replicated_step: Gauge
    #: Bytes of replicas sent and acknowledged.
    replicated_bytes: Counter
    #: Seconds each replica took to send (rate limit included).
    replicate: Histogram
    #: Replicas not sent (the peer gone, refused, a slot rewritten meanwhile).
    replicate_failures: Counter
    #: Steps the peer's replicas are behind this node's newest committed step (sampled).
    replication_lag: Gauge


def _checkpoint_metrics(r: CollectorRegistry) -> CheckpointMetrics:
    """The :class:`CheckpointMetrics`, registered in ``r``."""
    check = Histogram(
        "kelastic_checkpoint_check_seconds",
        "Seconds to verify this node's committed checkpoint slots (headers, manifests, "
        "every chunk's crc32) before a rendezvous",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        registry=r,
    )
    restores = Counter(
        "kelastic_checkpoint_restores_total",
        "Worker starts that restored a checkpoint step, by tier: memory (every rank from "
        "its node's slots), peer (the ranks whose node holds it not from a node that does: "
        "a replica, a former node), disk (the persistence volume) or none (some rank held a "
        "step, but no step every rank holds; the workers start without one). A fresh start "
        "is not counted",
        ["tier"],
        registry=r,
    )
    for tier in RestoreTier:
        restores.labels(tier=tier.value)
    step = Gauge(
        "kelastic_checkpoint_restored_step",
        "The checkpoint step this node's workers last restored",
        registry=r,
    )
    persist = Histogram(
        "kelastic_checkpoint_persist_seconds",
        "Seconds to write one rank's committed checkpoint step to the persistence volume in "
        "torch DCP's format (spec.checkpoint.persist), its checks included",
        buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
        registry=r,
    )
    persisted_step = Gauge(
        "kelastic_checkpoint_persisted_step",
        "The newest checkpoint step this node persisted to the persistence volume",
        registry=r,
    )
    persist_failures = Counter(
        "kelastic_checkpoint_persist_failures_total",
        "Checkpoint steps of a rank that could not be persisted (the slot rewritten while it "
        "was written, a corrupt slot, the volume full or unwritable)",
        registry=r,
    )
    replicated_step = Gauge(
        "kelastic_checkpoint_replicated_step",
        "The newest checkpoint step of this node's ranks that the peer node acknowledged a "
        "replica of (spec.checkpoint.replicas): safe from the loss of this node",
        registry=r,
    )
    replicated_bytes = Counter(
        "kelastic_checkpoint_replicated_bytes_total",
        "Bytes of checkpoint replicas sent to the peer node and acknowledged",
        registry=r,
    )
    replicate = Histogram(
        "kelastic_checkpoint_replicate_seconds",
        "Seconds to send one rank's committed checkpoint slot to the peer node, its rate "
        "limit included",
        buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
        registry=r,
    )
    replicate_failures = Counter(
        "kelastic_checkpoint_replicate_failures_total",
        "Checkpoint replicas not sent (the peer unreachable or refusing, the slot rewritten "
        "while it was sent); retried with the newest step",
        registry=r,
    )
    replication_lag = Gauge(
        "kelastic_checkpoint_replication_lag_steps",
        "Steps between this node's newest committed checkpoint step and the newest one its "
        "peer acknowledged, the largest over its ranks (0 without a peer)",
        registry=r,
    )
    return CheckpointMetrics(check, restores, step, persist, persisted_step, persist_failures,
                             replicated_step, replicated_bytes, replicate, replicate_failures,
                             replication_lag)  # fmt: skip


def _hang_evidence_metrics(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """``kelastic_hang_evidence_total{outcome}``: hung workers whose stacks the sidecar
    tried to read before killing them, and ``kelastic_flight_records_total{outcome}``:
    armed workers asked for their flight record (:mod:`~kelastic_sidecar.hang_evidence`),
    every outcome's series present from the start."""
    stacks = Counter(
        "kelastic_hang_evidence_total",
        "Hung workers whose stacks were read (py-spy) before the sidecar killed them, "
        "by outcome (collected; unavailable: py-spy missing, failed or over its "
        "budget, the process gone)",
        ["outcome"],
        registry=registry,
    )
    records = Counter(
        "kelastic_flight_records_total",
        "Hung workers armed with torch's flight recorder asked for their record, by "
        "outcome (collected; unavailable: not written within the budget, or not a record)",
        ["outcome"],
        registry=registry,
    )
    for outcome in Outcome:
        stacks.labels(outcome=outcome.value)
        records.labels(outcome=outcome.value)
    return stacks, records


def _netcheck_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    """``kelastic_network_checks_total{outcome}`` and ``kelastic_network_check_seconds``:
    the rounds' network preflight checks (:mod:`~kelastic_sidecar.netcheck`), every
    outcome's series present from the start."""
    checks = Counter(
        "kelastic_network_checks_total",
        "Network preflight checks of a round, by outcome (passed; self_failed: this node "
        "was judged bad and left; peers_failed: others were, the round forms again; "
        "inconclusive: no node could be judged, the workers started)",
        ["outcome"],
        registry=registry,
    )
    for outcome in CheckOutcome:
        checks.labels(outcome=outcome.value)
    seconds = Histogram(
        "kelastic_network_check_seconds",
        "Seconds a round's network preflight check added before the workers started",
        buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0),
        registry=registry,
    )
    return checks, seconds


class SidecarMetrics:
    """All metrics of one sidecar, registered in :attr:`registry`.

    Args:
        timer_stats: source of the timer server's counters (see :class:`TimerCollector`).
        step_times: source of the node's step-time histogram (see :class:`StepCollector`);
            None: exported empty.
    """

    def __init__(
        self, timer_stats: Callable[[], TimerCounts], step_times: StepRead | None = None
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.build_info = Info(
            "kelastic_build",
            "1, labelled with the kelastic version and the Python version running it",
            registry=r,
        )
        self.build_info.info(
            {"version": kelastic.__version__, "python_version": platform.python_version()}
        )
        r.register(TimerCollector(timer_stats))
        self.goodput = GoodputClock()
        r.register(GoodputCollector(self.goodput))
        self.rounds = Counter(
            "kelastic_rendezvous_rounds_total", "Rendezvous rounds this node completed", registry=r
        )
        self.rendezvous_duration = Histogram(
            "kelastic_rendezvous_duration_seconds",
            "Time from starting a rendezvous to its round completing",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.rendezvous_in_progress = Gauge(
            "kelastic_rendezvous_in_progress",
            "1 while this node waits in a rendezvous, else 0",
            registry=r,
        )
        self.round = Gauge("kelastic_rendezvous_round", "Current rendezvous round", registry=r)
        self.world_size = Gauge(
            "kelastic_world_size", "Workers in the current round (all nodes)", registry=r
        )
        self.group_world_size = Gauge(
            "kelastic_group_world_size", "Nodes in the current round", registry=r
        )
        self.restarts = Counter(
            "kelastic_restarts_total",
            "Restarts this node took part in, by level (process: the worker group's "
            "processes; inprocess: the ranks re-entered the function) and cause",
            ["level", "cause"],
            registry=r,
        )
        self.inprocess_restart = Histogram(
            "kelastic_inprocess_restart_seconds",
            "In-process restarts: from the abort sent to this node's ranks until every one "
            "of them reported progress in the new iteration",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.inprocess_dropped = Counter(
            "kelastic_inprocess_sessions_dropped_total",
            "Worker connections to the in-process socket dropped for bad behaviour, by "
            "reason: malformed, no_hello, oversized, flood, send_timeout, too_many",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:
            self.inprocess_dropped.labels(reason=reason)
        self.inprocess_killed = Counter(
            "kelastic_inprocess_workers_killed_total",
            "Ranks killed (SIGKILL) for not passing the termination barrier within the "
            "in-process hard timeout",
            registry=r,
        )
        self.hang_evidence, self.flight_records = _hang_evidence_metrics(r)
        self.netchecks, self.netcheck_seconds = _netcheck_metrics(r)  # a round's check
        self.stragglers = _step_metrics(r, step_times)
        self.inprocess_spares_promoted, self.inprocess_spares_waiting = _spare_metrics(r)
        self.budget_spent = Gauge("kelastic_restart_budget_spent",
                                  "Global restarts spent by the job", registry=r)  # fmt: skip
        self.budget_max = Gauge("kelastic_restart_budget_max",
                                "Global restart budget of the job", registry=r)  # fmt: skip
        self.worker_exits = Counter(
            "kelastic_worker_exits_total",
            "Worker exits by exit code (or signal name)",
            ["code"],
            registry=r,
        )
        self.last_progress = Gauge(
            "kelastic_last_progress_timestamp_seconds",
            "Unix time of the last training progress (timer acquire); the sidecar's start"
            " until the first",
            registry=r,
        )
        self.downtime = Counter(
            "kelastic_downtime_seconds_total",
            "Seconds without running workers after a start (an in-process restart's: from "
            "its abort to its go), by cause",
            ["cause"],
            registry=r,
        )
        self.etcd_errors = Counter("kelastic_etcd_errors_total", "Failed calls to etcd", registry=r)
        self.worker_starts = Counter(
            "kelastic_worker_starts_total",
            "Workers started, by how: warm (forked by the warm-start zygote) or cold",
            ["start"],
            registry=r,
        )
        for start in ("warm", "cold"):
            self.worker_starts.labels(start=start)
        self.corrupt_values = Counter(
            "kelastic_corrupt_values_total",
            "Corrupt or hostile values refused, by where they were read: rdzv_state and "
            "restart_record (etcd; replaced with fresh ones), master_record (etcd), "
            "inprocess_record (etcd; that fault restarts the processes), inprocess_ready "
            "(etcd; not counted as ready), inprocess_go (etcd; no go: the barrier times out)",
            ["source"],
            registry=r,
        )
        for source in CORRUPT_SOURCES:
            self.corrupt_values.labels(source=source)
        self.checkpoint = _checkpoint_metrics(r)
        # Every cause exists from the start (at 0): a series born at 1 hides its first
        # increase from rate()/increase(), so a job's first restart would not show.
        for cause in CAUSES:
            for level in LEVELS:
                self.restarts.labels(level=level, cause=cause)
            self.downtime.labels(cause=cause)

    def observe_netcheck(self, outcome: CheckOutcome, seconds: float) -> None:
        """Count a round's network check and the ``seconds`` it added."""
        self.netchecks.labels(outcome=outcome.value).inc()
        self.netcheck_seconds.observe(seconds)


def _step_metrics(r: CollectorRegistry, step_times: StepRead | None) -> Counter:
    """Register ``kelastic_step_seconds`` (:class:`StepCollector`) and return
    ``kelastic_stragglers_total`` (straggler episodes begun; see
    :mod:`~kelastic_sidecar.steptime`)."""
    r.register(StepCollector(step_times))
    return Counter(
        "kelastic_stragglers_total",
        "Straggler episodes begun on this node: a local rank whose median step time "
        "exceeds the other ranks' median by the set factor",
        registry=r,
    )


class StepCounts(Protocol):
    """What :class:`StepCollector` reads of the node's step times (the sidecar's
    :class:`~kelastic_sidecar.steptime.StepHistogram` has it)."""

    @property
    def buckets(self) -> tuple[float, ...]:
        """Upper bounds, seconds."""

    @property
    def counts(self) -> tuple[int, ...]:
        """Cumulative counts, one per bound, then the total."""

    @property
    def sum(self) -> float:
        """Seconds of all steps."""


#: Reads the node's step-time histogram now.
StepRead = Callable[[], StepCounts]


class StepCollector(Collector):
    """Exports ``kelastic_step_seconds``, the node's workers' step times (every local rank
    in one histogram: no rank label), counted by the step-time tracker and read at scrape
    time.

    Args:
        read: the histogram now (:class:`StepCounts`); None: an empty one.
    """

    def __init__(self, read: StepRead | None) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """Yield the histogram family."""
        family = HistogramMetricFamily(
            "kelastic_step_seconds",
            "Workers' step times on this node: from an expires() timer's acquire to its "
            "release, as the sidecar received them",
        )
        if self._read is None:
            family.add_metric([], [("+Inf", 0)], 0.0)
        else:
            h = self._read()
            bounds = [str(float(b)) for b in h.buckets] + ["+Inf"]  # "0.005", "1.0"
            family.add_metric([], list(zip(bounds, h.counts, strict=True)), h.sum)
        yield family
