"""The operator's Prometheus metrics (served on ``/metrics`` by ``python -m kelastic_operator``).

Metrics live in their own :class:`prometheus_client.CollectorRegistry` so that tests can
run several operators in one process and read each one's numbers.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge


class OperatorMetrics:
    """Counters and gauges of one operator instance.

    Attributes:
        registry: what ``/metrics`` serves.
        reconciles: reconcile passes, by outcome (ok, error).
        pods_created, pods_deleted: Pods the operator created / deleted, by reason.
        nodes_removed: rendezvous nodes removed.
        phase: 1 for the phase each job is in (``namespace``, ``job``, ``phase`` labels).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "kelastic_operator_reconciles", "Reconcile passes", ["outcome"], registry=self.registry
        )
        self.pods_created = Counter(
            "kelastic_operator_pods_created", "Pods created", registry=self.registry
        )
        self.pods_deleted = Counter(
            "kelastic_operator_pods_deleted", "Pods deleted", registry=self.registry
        )
        self.nodes_removed = Counter(
            "kelastic_operator_rendezvous_nodes_removed",
            "Nodes removed from rendezvous",
            registry=self.registry,
        )
        self.phase = Gauge(
            "kelastic_operator_job_phase",
            "1 for the current phase of each ElasticJob",
            ["namespace", "job", "phase"],
            registry=self.registry,
        )

    def set_phase(
        self, namespace: str, job: str, phase: str | None, phases: tuple[str, ...]
    ) -> None:
        """Mark ``phase`` as the job's phase (every other phase 0)."""
        for p in phases:
            self.phase.labels(namespace, job, p).set(1 if p == phase else 0)

    def forget(self, namespace: str, job: str, phases: tuple[str, ...]) -> None:
        """Drop a deleted job's phase series."""
        for p in phases:
            with contextlib.suppress(KeyError):
                self.phase.remove(namespace, job, p)
