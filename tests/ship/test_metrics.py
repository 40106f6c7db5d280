"""The documented metrics, by name, as the sidecar and the operator export them."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kelastic_operator.metrics import OperatorMetrics
from kelastic_sidecar.metrics import GoodputClock, SidecarMetrics
from kelastic_sidecar.timer import TimerStats

PHASES = ("Pending", "Running", "Failed")


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_the_sidecar_exports_every_listed_metric() -> None:
    m = SidecarMetrics(lambda: TimerStats(acquired=5, expired=1, reaped=1, active=2))
    m.restarts.labels(level="process", cause="hang").inc()
    m.worker_exits.labels(code="SIGKILL").inc()
    m.downtime.labels(cause="hang").inc(1.5)
    names = {name for name, _ in _samples(m.registry)}
    for name in (
        "kelastic_rendezvous_rounds_total",
        "kelastic_rendezvous_duration_seconds_count",
        "kelastic_rendezvous_in_progress",
        "kelastic_world_size",
        "kelastic_restarts_total",
        "kelastic_timers_active",
        "kelastic_timers_expired_total",
        "kelastic_workers_reaped_total",
        "kelastic_workers_reaped_after_grace_total",
        "kelastic_timers_spared_total",
        "kelastic_timers_overdue",
        "kelastic_worker_exits_total",
        "kelastic_last_progress_timestamp_seconds",
        "kelastic_downtime_seconds_total",
        "kelastic_goodput_ratio",
        "kelastic_productive_seconds_total",
        "kelastic_wall_seconds_total",
        "kelastic_timer_acquires_total",
        "kelastic_etcd_errors_total",
        "kelastic_worker_starts_total",
        "kelastic_restart_budget_spent",
        "kelastic_inprocess_restart_seconds_count",
        "kelastic_inprocess_sessions_dropped_total",
        "kelastic_inprocess_workers_killed_total",
        "kelastic_hang_evidence_total",
        "kelastic_flight_records_total",
        "kelastic_network_checks_total",
        "kelastic_network_check_seconds_count",
        "kelastic_step_seconds_count",
        "kelastic_stragglers_total",
    ):
        assert name in names, name


def test_goodput_is_productive_over_wall_time() -> None:
    now = [100.0]
    clock = GoodputClock(lambda: now[0])
    assert clock.ratio() == 0.0
    now[0] = 110.0
    clock.set_running(True)
    clock.set_running(True)  # repeating a state changes nothing
    now[0] = 140.0
    assert clock.productive_seconds() == 30.0 and clock.ratio() == 0.75
    clock.set_running(False)
    now[0] = 160.0
    assert clock.productive_seconds() == 30.0 and clock.ratio() == 0.5
    assert not clock.running


def test_the_operator_counts_jobs_by_phase_and_times_reconciles() -> None:
    m = OperatorMetrics()
    m.set_phase("ml", "a", "Running", PHASES)
    m.set_phase("ml", "b", "Running", PHASES)
    m.set_phase("ml", "c", "Failed", PHASES)
    s = _samples(m.registry)
    assert s[("kelastic_operator_jobs", (("phase", "Running"),))] == 2
    assert s[("kelastic_operator_jobs", (("phase", "Failed"),))] == 1
    m.forget("ml", "b", PHASES)
    assert _samples(m.registry)[("kelastic_operator_jobs", (("phase", "Running"),))] == 1

    with m.time_reconcile():
        pass
    with pytest.raises(OSError), m.time_reconcile():
        raise OSError("etcd down")
    with pytest.raises(KeyError), m.time_reconcile():
        raise KeyError("a bug")
    s = _samples(m.registry)
    assert s[("kelastic_operator_reconcile_duration_seconds_count", ())] == 3
    assert s[("kelastic_operator_reconciles_total", (("outcome", "ok"),))] == 1
    assert s[("kelastic_operator_reconciles_total", (("outcome", "error"),))] == 2
    assert s[("kelastic_operator_reconcile_errors_total", (("kind", "api"),))] == 1
    assert s[("kelastic_operator_reconcile_errors_total", (("kind", "crash"),))] == 1
    assert s[("kelastic_operator_pod_replacements_total", ())] == 0
