"""The operator's Prometheus metrics (served on ``/metrics`` by ``python -m kelastic_operator``).

Metrics live in their own :class:`prometheus_client.CollectorRegistry` so that tests can
run several operators in one process and read each one's numbers. No label is named
``job`` (Prometheus' own target label): an ElasticJob's name is ``elasticjob``, as on the
sidecars' series. ``/metrics`` is ``prometheus_client``'s server, which answers in
OpenMetrics when the scraper asks for ``application/openmetrics-text``.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

import kelastic

#: ``kind`` values of ``kelastic_operator_reconcile_errors_total``.
ERROR_KINDS = ("api", "crash")
#: ``level`` values of ``kelastic_operator_restarts_total``, cheapest rung first (the
#: sidecars' ``kelastic_restarts_total`` has ``inprocess`` and ``process`` too, per node).
RESTART_LEVELS = ("inprocess", "process", "pod")


class OperatorMetrics:
    """Counters and gauges of one operator instance.

    Attributes:
        registry: what ``/metrics`` serves.
        reconciles: reconcile passes, by outcome (ok, error).
        reconcile_errors: failed reconcile passes, by kind (api, crash).
        reconcile_duration: seconds per reconcile pass (see :meth:`time_reconcile`).
        pod_replacements: Pods created in place of a failed or deleted one.
        restarts: restarts of the jobs by ``level`` (:data:`RESTART_LEVELS`), job-wide,
            counted from the growth of the status the operator stored.
        jobs: ElasticJobs per phase (kept by :meth:`set_phase` / :meth:`forget`).
        pods_created, pods_deleted: Pods the operator created / deleted, by reason.
        nodes_removed: rendezvous nodes removed.
        pods_lost: Pods force-deleted because their Node was not Ready for the job's
            ``nodeLostSeconds`` (rule 10 of :mod:`~kelastic_operator.reconcile`).
        phase: 1 for the phase each job is in (``namespace``, ``elasticjob``, ``phase``
            labels: the ElasticJob's namespace and name).
        build_info: ``kelastic_build_info`` 1, labelled with the kelastic ``version`` and the
            ``python_version``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.build_info = Info(
            "kelastic_build",
            "1, labelled with the kelastic version and the Python version running it",
            registry=self.registry,
        )
        self.build_info.info(
            {"version": kelastic.__version__, "python_version": platform.python_version()}
        )
        self.reconciles = Counter(
            "kelastic_operator_reconciles", "Reconcile passes", ["outcome"], registry=self.registry
        )
        self.reconcile_errors = Counter(
            "kelastic_operator_reconcile_errors",
            "Failed reconcile passes, by kind (api: Kubernetes/etcd API error, crash: a bug)",
            ["kind"],
            registry=self.registry,
        )
        # Every label value exists from the start (at 0): a series born at 1 hides its first
        # increase from rate()/increase(), so one failed pass would never show on a graph.
        for outcome in ("ok", "error"):
            self.reconciles.labels(outcome)
        for kind in ERROR_KINDS:
            self.reconcile_errors.labels(kind)
        self.reconcile_duration = Histogram(
            "kelastic_operator_reconcile_duration_seconds",
            "Seconds per reconcile pass of one ElasticJob",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.pod_replacements = Counter(
            "kelastic_operator_pod_replacements",
            "Pods created in place of a failed or deleted Pod of a job",
            registry=self.registry,
        )
        self.restarts = Counter(
            "kelastic_operator_restarts",
            "Restarts of the operator's jobs, one per restart job-wide, by level of the "
            "restart ladder (inprocess: the ranks re-entered the training function in the "
            "same processes; process: the worker group's processes restarted; pod: a failed "
            "Pod replaced), as the jobs' status counts them",
            ["level"],
            registry=self.registry,
        )
        for level in RESTART_LEVELS:
            self.restarts.labels(level)
        self.jobs = Gauge(
            "kelastic_operator_jobs", "ElasticJobs per phase", ["phase"], registry=self.registry
        )
        self._job_phase: dict[tuple[str, str], str | None] = {}
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
        self.pods_lost = Counter(
            "kelastic_operator_pods_lost",
            "Pods force-deleted because their Node stayed not Ready for nodeLostSeconds",
            registry=self.registry,
        )
        self.phase = Gauge(
            "kelastic_operator_job_phase",
            "1 for the current phase of each ElasticJob",
            ["namespace", "elasticjob", "phase"],
            registry=self.registry,
        )

    def set_phase(
        self, namespace: str, elasticjob: str, phase: str | None, phases: tuple[str, ...]
    ) -> None:
        """Mark ``phase`` as the ElasticJob's phase (every other phase 0)."""
        for p in phases:
            self.phase.labels(namespace, elasticjob, p).set(1 if p == phase else 0)
        self._job_phase[(namespace, elasticjob)] = phase
        self._count_jobs(phases)

    def _count_jobs(self, phases: tuple[str, ...]) -> None:
        for p in phases:
            self.jobs.labels(p).set(sum(1 for v in self._job_phase.values() if v == p))

    @contextlib.contextmanager
    def time_reconcile(self) -> Iterator[None]:
        """Observe one reconcile pass: its duration, and its outcome (``ok`` unless it raises;
        an exception counts as an ``error`` and is re-raised)."""
        started = time.monotonic()
        try:
            yield
        except Exception as exc:
            self.reconciles.labels("error").inc()
            self.reconcile_errors.labels(_error_kind(exc)).inc()
            raise
        else:
            self.reconciles.labels("ok").inc()
        finally:
            self.reconcile_duration.observe(time.monotonic() - started)

    def forget(self, namespace: str, elasticjob: str, phases: tuple[str, ...]) -> None:
        """Drop a deleted ElasticJob's phase series."""
        for p in phases:
            with contextlib.suppress(KeyError):
                self.phase.remove(namespace, elasticjob, p)
        self._job_phase.pop((namespace, elasticjob), None)
        self._count_jobs(phases)


def _error_kind(exc: Exception) -> str:
    """``api`` for a Kubernetes API or OS/network error, ``crash`` for anything else (a bug).

    The API server being unreachable is an ``api`` error too: the ``kubernetes`` client lets
    urllib3's own errors through (``MaxRetryError`` after a refused connection), and those
    are not ``OSError``. By class name and module, so that this module need not import
    ``kubernetes`` (which reads KUBECONFIG when first imported)."""
    api = isinstance(exc, OSError) or any(
        c.__name__ == "ApiException" or c.__module__ == "urllib3.exceptions"
        for c in type(exc).__mro__
    )
    return "api" if api else "crash"
