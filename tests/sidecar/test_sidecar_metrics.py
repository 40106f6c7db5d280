"""The sidecar's metrics reflect the real timer server's counters at scrape time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer import TimerServer
from tests.conftest import wait_for


def _samples(metrics: SidecarMetrics) -> dict[str, float]:
    """``name`` (or ``name{label=value}`` for labelled series) -> value."""
    text = generate_latest(metrics.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_timer_counters_are_exported_from_the_live_server(tmp_path: Path) -> None:
    server = TimerServer(tmp_path / "timer.fifo")
    server.start()
    try:
        metrics = SidecarMetrics(server.stats)
        fd = os.open(tmp_path / "timer.fifo", os.O_WRONLY | os.O_NONBLOCK)
        good = {"version": 1, "pid": os.getpid(), "scope_id": "s",
                "expiration_time": 4e9, "signal": 9}  # fmt: skip
        os.write(fd, b"not json\n" + json.dumps(good).encode() + b"\n")
        os.close(fd)
        wait_for(lambda: server.stats().requests == 1, 10, what="the request to be read")
        samples = _samples(metrics)
        assert samples["kelastic_timers_active"] == 1
        assert samples["kelastic_timer_requests_total"] == 1
        assert samples["kelastic_timer_bad_requests_total"] == 1
        assert samples["kelastic_workers_reaped_total"] == 0
        before = _samples(metrics)
        assert before["kelastic_restarts_total{cause=hang,level=process}"] == 0  # before the first
        assert before["kelastic_restarts_total{cause=hang,level=inprocess}"] == 0
        assert before["kelastic_downtime_seconds_total{cause=node_lost}"] == 0
        metrics.restarts.labels(level="process", cause="hang").inc()
        after = _samples(metrics)
        assert after["kelastic_restarts_total{cause=hang,level=process}"] == 1
        assert after["kelastic_restarts_total{cause=hang,level=inprocess}"] == 0
        assert after["kelastic_restarts_total{cause=worker_failure,level=process}"] == 0
    finally:
        server.stop()
