"""The sidecar's metrics reflect the real timer server's counters at scrape time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer_server import TimerServer
from tests.conftest import wait_for


def _samples(metrics: SidecarMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


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
        metrics.restarts.labels(cause="hang").inc()
        assert _samples(metrics)["kelastic_restarts_total"] == 1
    finally:
        server.stop()
