"""The sidecar's Prometheus metrics (prometheus-client, one registry per sidecar).

Names follow Prometheus conventions: ``kelastic_`` prefix, base units in the name,
``_total`` for counters. Every series carries no job label of its own: Prometheus adds the
Pod's labels at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SidecarMetrics:
    """All metrics of one sidecar, registered in :attr:`registry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rounds = Counter(
            "kelastic_rendezvous_rounds_total", "Rendezvous rounds this node completed", registry=r
        )
        self.rendezvous_duration = Histogram(
            "kelastic_rendezvous_duration_seconds",
            "Time from starting a rendezvous to its round completing",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
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
            "Worker-group restarts this node took part in, by cause",
            ["cause"],
            registry=r,
        )
        self.budget_spent = Gauge(
            "kelastic_restart_budget_spent", "Global restarts spent by the job", registry=r
        )
        self.budget_max = Gauge(
            "kelastic_restart_budget_max", "Global restart budget of the job", registry=r
        )
        self.timers_active = Gauge(
            "kelastic_timers_active", "Expiration timers currently held by workers", registry=r
        )
        self.timers_expired = Counter(
            "kelastic_timers_expired_total", "Expiration timers that expired", registry=r
        )
        self.workers_reaped = Counter(
            "kelastic_workers_reaped_total", "Hung workers killed by the timer server", registry=r
        )
        self.timer_bad_requests = Counter(
            "kelastic_timer_bad_requests_total",
            "Malformed or oversized lines on the timer FIFO",
            registry=r,
        )
        self.worker_exits = Counter(
            "kelastic_worker_exits_total",
            "Worker exits by exit code (or signal name)",
            ["code"],
            registry=r,
        )
        self.last_progress = Gauge(
            "kelastic_last_progress_timestamp_seconds",
            "Unix time of the last training progress (timer acquire)",
            registry=r,
        )
        self.downtime = Counter(
            "kelastic_downtime_seconds_total",
            "Seconds without running workers after a start, by cause",
            ["cause"],
            registry=r,
        )
        self.etcd_errors = Counter("kelastic_etcd_errors_total", "Failed calls to etcd", registry=r)
