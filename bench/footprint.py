"""Sidecar footprint: an idle ``python -m kelastic_sidecar`` (env as ``kelastic run`` sets
it, before a launcher connects) sampled with psutil over a bounded window."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from .common import CaseResult, Check, Row, child_env, embedded_etcd, log, median, stop_process


def _sidecar_env(endpoint: str, run_dir: Path, http_port: int) -> dict[str, str]:
    from kelastic import contract

    run_id = uuid.uuid4().hex[:12]
    return child_env(
        KELASTIC_LOCAL_RUN=run_id,
        **{
            contract.ENV_RUN_DIR: str(run_dir),
            contract.ENV_JOB_NAME: "bench",
            contract.ENV_NAMESPACE: "default",
            contract.ENV_JOB_UID: run_id,
            contract.ENV_POD_NAME: "bench-0",
            contract.ENV_POD_IP: "127.0.0.1",
            contract.ENV_ETCD_ENDPOINTS: endpoint,
            contract.ENV_MIN_NODES: "2",
            contract.ENV_MAX_NODES: "2",
            contract.ENV_NPROC_PER_NODE: "2",
            contract.ENV_MAX_RESTARTS: "3",
            contract.ENV_JOIN_TIMEOUT: "600",
            contract.ENV_LAST_CALL_TIMEOUT: "30",
            contract.ENV_LEASE_TTL: "10",
            contract.ENV_STOP_GRACE: "5",
            contract.ENV_HTTP_HOST: "127.0.0.1",
            contract.ENV_HTTP_PORT: str(http_port),
        },
    )


def footprint(quick: bool, window: float | None = None) -> CaseResult:
    import psutil

    from kelastic_operator.local.etcd import free_port

    window = window if window is not None else (5.0 if quick else 60.0)
    result = CaseResult("sidecar_footprint")
    with embedded_etcd() as endpoint, tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp:
        port = free_port()
        env = _sidecar_env(endpoint, Path(tmp) / "run", port)
        log_file = open(Path(tmp) / "sidecar.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "kelastic_sidecar"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            started = time.monotonic()
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() - started > 30:
                        raise RuntimeError(
                            "sidecar did not become healthy: "
                            + (Path(tmp) / "sidecar.log").read_text()[-500:]
                        ) from None
                    time.sleep(0.05)
            time.sleep(1.0)  # past start-up
            log(f"sidecar_footprint: sampling the idle sidecar for {window:.0f} s")
            ps = psutil.Process(proc.pid)
            rss: list[float] = []
            cpu: list[float] = []
            total0 = sum(ps.cpu_times()[:2])
            t_start = time.monotonic()
            end = t_start + window
            while time.monotonic() < end:
                c0, t0 = sum(ps.cpu_times()[:2]), time.monotonic()
                time.sleep(min(1.0, max(0.05, end - t0)))
                c1, t1 = sum(ps.cpu_times()[:2]), time.monotonic()
                cpu.append(100 * (c1 - c0) / (t1 - t0))
                rss.append(ps.memory_info().rss / 2**20)
            whole = 100 * (sum(ps.cpu_times()[:2]) - total0) / (time.monotonic() - t_start)
            threads = ps.num_threads()
        finally:
            stop_process(proc)
            log_file.close()
    result.rows += [
        Row("sidecar_footprint", "idle sidecar RSS", "kelastic sidecar", "MiB", rss,
            note=f"{threads} threads"),
        Row("sidecar_footprint", "idle sidecar CPU (1 s samples)", "kelastic sidecar",
            "% of a core", cpu, extra={"whole_window_pct": whole, "window_s": window}),
    ]  # fmt: skip
    result.checks += [
        Check("sidecar_footprint", "RSS <= 60 MB", f"{max(rss):.1f} MiB max", max(rss) <= 60),
        Check(
            "sidecar_footprint",
            "CPU <= 1% of a core",
            f"{whole:.2f}% over {window:.0f} s (median 1 s sample {median(cpu):.2f}%)",
            whole <= 1.0,
        ),
    ]
    return result
