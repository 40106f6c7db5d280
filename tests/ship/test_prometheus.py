"""A real Prometheus scrapes a local-mode run's sidecars and the chart's operator; every
dashboard query and every alert expression is checked against what it scraped.

- the sidecars: ``LocalRunner`` in-process running the steps job (2 nodes x 2 workers, the
  ``tests/workers/steps.py`` worker, no torch) with a killed worker and a hung one (reaped by
  its timer), so restarts, exits, downtime and reaps have data; the job then keeps stepping
  until the test touches its stop file;
- the operator: ``python -m kelastic_operator`` with the arguments of the chart's rendered
  Deployment (its etcd and metrics port swapped for local ones) against the Kubernetes API
  emulator, reconciling an ElasticJob of the same name (its Pods stay Pending: no kubelet);
- Prometheus (Debian's package) on loopback with a 1 s scrape interval, the alert rules
  loaded, and the scrape jobs named and labelled as the chart's ServiceMonitor/PodMonitor do.

Every /metrics also passes ``promtool check metrics``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic_operator import crd
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from kelastic_operator.local.faults import Fault
from kelastic_operator.local.runner import LocalOptions, LocalRunner
from kelastic_operator.model import ElasticJob, load_manifest
from tests.conftest import wait_for
from tests.k8s.harness import K8sApi
from tests.localrun import write_job

from .tools import CHART, ROOT, ToolMissing, helm_binary, render, system_tool

pytestmark = pytest.mark.timeout(300)

NAMESPACE = "default"
DIGITS = ROOT / "examples/digits/elasticjob.yaml"
RATE_INTERVAL = "20s"  # what Grafana's $__rate_interval is at a 1 s scrape interval and more

# Metrics that have no series until something fails (labelled counters start empty), each
# with what it takes. Everything else the dashboard and the alerts name must have data.
NEEDS_A_FAILURE = {
    "kelastic_operator_reconcile_errors_total": "a failed reconcile pass (API error or bug)",
}
# Alert expressions that return nothing while the system is healthy (they are still
# evaluated here, and their series checked): why each one stays empty in these runs.
QUIET_ALERTS = {
    "KelasticJobFailing": "needs an ElasticJob in phase Failed",
    "KelasticRendezvousStuck": "needs a node waiting in rendezvous (these runs are past it)",
    "KelasticOperatorDown": "needs no operator up (absent() of a present series)",
    "KelasticEtcdUnreachable": "needs failing etcd calls from a sidecar",
}


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


class Prometheus:
    """The real Prometheus server on loopback with a temporary config and TSDB."""

    def __init__(self, workdir: Path, scrape_configs: list[dict[str, Any]], rules: Path) -> None:
        self.port = free_port()
        self.at: float | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "1s",
            },
            "rule_files": [str(rules)],
            "scrape_configs": scrape_configs,
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                str(system_tool("prometheus")),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(lambda: _get(self.url("/-/ready"))[0] == 200, 60, 0.2, what="Prometheus ready")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query's ``data`` at :attr:`at` (now when None); raises on an ill-formed
        expression."""
        params = {"query": expr} if self.at is None else {"query": expr, "time": f"{self.at:.3f}"}
        code, body = _get(self.url("/api/v1/query?" + urllib.parse.urlencode(params)))
        doc = json.loads(body)
        assert code == 200 and doc["status"] == "success", f"{expr}: {body}"
        return dict(doc["data"])

    def has_data(self, expr: str) -> bool:
        return bool(self.query(expr)["result"])

    def targets_up(self) -> dict[str, str]:
        doc = json.loads(_get(self.url("/api/v1/targets"))[1])
        return {t["scrapeUrl"]: t["health"] for t in doc["data"]["activeTargets"]}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _tools() -> None:
    try:
        system_tool("prometheus")
        system_tool("promtool")
        helm_binary()
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def _start_operator(
    api: K8sApi, etcd: EmbeddedEtcd, workdir: Path, manifest: Path
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """The operator, started with the chart's rendered command and arguments (etcd, metrics
    port and peering swapped for local ones), reconciling ``manifest`` (no kubelet: its Pods
    stay Pending)."""
    api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    (dep,) = [o for o in render() if o["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    port = free_port()
    swapped = ("--etcd-endpoints=", "--metrics-port=", "--peering=")
    args = [a for a in container["args"] if not a.startswith(swapped)]
    args += [
        f"--etcd-endpoints={etcd.endpoint}",
        f"--metrics-port={port}",
        "--standalone",
        "--resync-seconds=1",
    ]
    env = {
        **api.env(),
        "POD_ID": "kelastic-operator-test",
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("operator", "worker_lib", "sidecar")),
    }
    log_path = workdir / "operator.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *container["command"][1:], *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api.kubectl("apply", "-f", str(manifest))
    wait_for(
        lambda: (
            "kelastic_operator_pods_created_total" in _get(f"http://127.0.0.1:{port}/metrics")[1]
            and "kelastic_operator_pods_created_total 0.0"
            not in _get(f"http://127.0.0.1:{port}/metrics")[1]
        ),
        60,
        0.2,
        what="the operator's metrics",
    )
    return proc, port, log_path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']}/{target['refId']}", target["expr"]))
    return out


def _grafana(expr: str, job: str) -> str:
    return (
        expr.replace("$namespace", NAMESPACE)
        .replace("$job", job)
        .replace("$__rate_interval", RATE_INTERVAL)
    )


def _alerts() -> list[dict[str, Any]]:
    rules = yaml.safe_load((CHART / "rules" / "kelastic.rules.yaml").read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(kelastic_[a-z_]+|up)\b(?=\s*[{\[)])", expr))


def _steps_job(tmp_path: Path) -> tuple[Path, Path, list[str], Path | None]:
    """The steps job (no torch): 2 nodes x 2 workers, budget 2, stepping until a stop file."""
    stop = tmp_path / "stop"
    manifest = write_job(
        tmp_path / "job.yaml",
        name="steps",
        replicas=2,
        nproc=2,
        max_restarts=2,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_TIMEOUT": "1"},
    )
    return manifest, tmp_path, ["kill:rank=1,after=1", "hang:rank=2,after=4"], stop


def _digits_job(tmp_path: Path) -> tuple[Path, Path, list[str], Path | None]:
    """The digits example (torch DDP) with the README's faults, its budget cut to 2."""
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["maxRestarts"] = 2
    manifest = tmp_path / "digits.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    return manifest, DIGITS.parent, ["kill:rank=1,after=4", "hang:rank=2,after=4"], None


JOBS = {
    "steps": _steps_job,
    "digits": _digits_job,
}


@pytest.mark.parametrize(
    "kind", ["steps", pytest.param("digits", marks=[pytest.mark.slow, pytest.mark.timeout(600)])]
)
def test_prometheus_scrapes_sidecars_and_operator_and_every_query_has_data(
    kind: str, tmp_path: Path, k8s_api: K8sApi, etcd_server: EmbeddedEtcd
) -> None:
    _tools()
    manifest, manifest_dir, fault_specs, stop = JOBS[kind](tmp_path)
    job: ElasticJob = load_manifest(manifest)
    name = job.metadata.name
    operator, operator_port, operator_log = _start_operator(
        k8s_api, etcd_server, tmp_path, manifest
    )
    lines: list[str] = []
    runner = LocalRunner(
        job,
        manifest_dir,
        LocalOptions(
            workdir=tmp_path / "runs",
            stop_grace=2,
            status_interval=2,
            faults=[Fault.parse(f) for f in fault_specs],
        ),
        say=lambda line: lines.append(f"[kelastic] {line}"),
        echo=lambda line, _err: lines.append(line),
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.run()), daemon=True)
    thread.start()
    prom: Prometheus | None = None
    try:
        wait_for(
            lambda: len(runner.pods) == 2 and all(p.http_port for p in runner.pods),
            60,
            what="the sidecars",
        )
        rules = tmp_path / "rules.yaml"
        rules.write_text((CHART / "rules" / "kelastic.rules.yaml").read_text())
        sidecars = [
            {
                "targets": [f"127.0.0.1:{p.http_port}"],
                "labels": {"namespace": NAMESPACE, "elasticjob": name, "pod": p.name},
            }
            for p in runner.pods
        ]
        operators = [
            {"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": "kelastic-system"}}
        ]
        scrape: list[dict[str, Any]] = [
            {"job_name": "kelastic-sidecar", "static_configs": sidecars},
            {"job_name": "kelastic-operator", "honor_labels": True, "static_configs": operators},
        ]
        prom = Prometheus(tmp_path / "prometheus", scrape, rules)
        # Both faults hit and were recovered from: 2 restarts, workers stepping again.
        wait_for(
            lambda: any("restart 2/2" in x for x in lines),
            240,
            0.2,
            what="two restarts\n" + "\n".join(lines[-40:]),
        )
        wait_for(
            lambda: (
                prom is not None
                and prom.has_data(
                    'sum(kelastic_workers_reaped_total{job="kelastic-sidecar"}) >= 1'
                    " and on() sum(kelastic_restart_budget_spent) >= 4"
                    " and on() sum(kelastic_timers_active) > 0"
                )
            ),
            120,
            0.5,
            what="Prometheus to scrape the reap, both restarts and running workers",
        )
        time.sleep(3)  # a few more scrapes of the resumed round
        prom.at = time.time()  # every query below is evaluated at this instant
        assert set(prom.targets_up().values()) == {"up"}, prom.targets_up()

        # promtool check metrics on every /metrics.
        for port in [p.http_port for p in runner.pods] + [operator_port]:
            text = _get(f"http://127.0.0.1:{port}/metrics")[1]
            check = subprocess.run(
                [str(system_tool("promtool")), "check", "metrics"],
                input=text,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert check.returncode == 0 and not check.stdout.strip(), (port, check.stdout)
        _check_queries(prom, name)
        if stop is not None:
            stop.touch()
        thread.join(400)
        assert result == [0], "\n".join(lines[-60:])
        assert kind != "digits" or any("final test accuracy" in x for x in lines)
    finally:
        runner.interrupt()
        thread.join(30)
        if prom is not None:
            prom.close()
        _stop(operator)
    assert "Traceback" not in operator_log.read_text(errors="replace")


def _check_queries(prom: Prometheus, job: str) -> None:
    # Every dashboard query returns data (those naming only NEEDS_A_FAILURE metrics aside).
    empty = [(n, e) for n, e in _dashboard_queries() if not prom.has_data(_grafana(e, job))]
    allowed = {
        (n, e)
        for n, e in empty
        if _metric_names(e) & set(NEEDS_A_FAILURE) and not _metric_names(e) - set(NEEDS_A_FAILURE)
    }
    assert set(empty) <= allowed, f"dashboard queries without data: {sorted(set(empty) - allowed)}"
    # The template variables resolve to this run.
    namespaces = prom.query("group by (namespace) (kelastic_world_size)")["result"]
    assert [r["metric"] for r in namespaces] == [{"namespace": NAMESPACE}]
    jobs = prom.query(f'group by (elasticjob) (kelastic_world_size{{namespace="{NAMESPACE}"}})')
    assert [r["metric"]["elasticjob"] for r in jobs["result"]] == [job]

    # Every alert expression is well-formed and names series that exist; the alerts this
    # run provokes return data, the others (QUIET_ALERTS) need the failure they name.
    alerts = _alerts()
    assert {a["alert"] for a in alerts} >= set(QUIET_ALERTS)
    for alert in alerts:
        data = prom.query(alert["expr"])["result"]
        if alert["alert"] in QUIET_ALERTS:
            assert data == [], (alert["alert"], data)
        else:
            assert data, f"{alert['alert']}: {alert['expr']} returned nothing"
        for name in _metric_names(alert["expr"]):
            exists = prom.has_data(f'count({{__name__="{name}"}})')
            assert exists or name in NEEDS_A_FAILURE, name
        assert alert["annotations"]["runbook"]

    # Every metric the dashboard names exists unless it needs a failure.
    dash_names = set().union(*(_metric_names(e) for _, e in _dashboard_queries()))
    missing = {n for n in dash_names if not prom.has_data(f'count({{__name__="{n}"}})')}
    assert missing <= set(NEEDS_A_FAILURE), missing

    # The numbers make sense.
    world = prom.query(f'max(kelastic_world_size{{elasticjob="{job}"}})')["result"]
    assert world and float(world[0]["value"][1]) == 4
    by_cause = prom.query("sum by (cause) (kelastic_restarts_total)")["result"]
    causes = {r["metric"]["cause"] for r in by_cause}
    assert {"worker_failure", "hang"} <= causes, causes
    goodput = float(prom.query("avg(kelastic_goodput_ratio)")["result"][0]["value"][1])
    assert 0 < goodput < 1
    phase = prom.query(f'kelastic_operator_job_phase{{namespace="{NAMESPACE}",job="{job}"}} == 1')
    assert [r["metric"]["phase"] for r in phase["result"]] == ["Pending"]
