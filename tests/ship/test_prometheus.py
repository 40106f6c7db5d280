"""A real Prometheus scrapes a local-mode run's sidecars and the chart's operator; every
dashboard query and every alert expression is checked against what it scraped.

- the sidecars: ``LocalRunner`` in-process running the steps job (2 nodes x 2 workers, the
  ``tests/workers/steps.py`` worker, no torch) with a killed worker and a hung one (reaped by
  its timer), so restarts, exits, downtime and reaps have data; the job then keeps stepping
  until the test touches its stop file;
- the operator: ``python -m kelastic_operator`` with the arguments of the chart's rendered
  Deployment (watching the test's namespace; its etcd and metrics port swapped for local
  ones, ``--standalone``) against the real test cluster (tests/k8s), logged in as the
  ``kelastic-operator`` ServiceAccount with deploy/'s RBAC, reconciling an ElasticJob of the
  same name in the test's namespace (its Pods stay Pending, unschedulable: they do not
  tolerate the test node's taint, and no other Node exists);
- Prometheus (Debian's package) on loopback with a 1 s scrape interval, the alert rules
  loaded, and the scrape jobs named and labelled as the chart's ServiceMonitor/PodMonitor do.

Every /metrics also passes ``promtool check metrics``, has no ``job`` label (Prometheus'
own), has ``kelastic_build_info`` and answers Prometheus' Accept header in OpenMetrics.
In that run the restart budget is spent (2/2) and a hung worker is reaped, so
``KelasticRestartBudgetNearlySpent`` and ``KelasticHangReaped`` return data and fire; the
four other alerts must stay quiet there.

A second test (``test_prometheus_fires_every_alert_on_real_failures``) drives each of those
four failures for real, with real processes, and checks that the chart's alert expression
returns data and that Prometheus fires the alert:

- ``KelasticRendezvousStuck``: a job with ``minReplicas: 2`` started with one node; it waits
  in rendezvous (``kelastic_rendezvous_in_progress`` 1);
- ``KelasticEtcdUnreachable``: another job's sidecar reaches etcd through a TCP proxy
  (:mod:`tests.ship.tcpproxy`) that is cut while its worker trains; its watch of the
  rendezvous fails and ``kelastic_etcd_errors_total`` rises;
- ``KelasticJobFailing``: the waiting job gets its second node; rank 0 raises on every
  attempt, the budget (``maxRestarts: 1``) is spent, the sidecars report the job failed in
  etcd and the operator (reading the same etcd keys: the local run is given the
  ElasticJob's uid) sets phase Failed;
- ``kelastic_operator_reconcile_errors_total`` (a dashboard query; its series exist at 0
  from the start): the operator reaches the API server through a TCP proxy that is then
  cut while a third job's rendezvous completes (its second node joins after the cut), so
  writing its status fails and its reconcile passes fail, counted as kind ``api``, none as
  ``crash`` (idle jobs make no API request: the operator's watch cache knows them);
- ``KelasticOperatorDown``: the operator process is stopped; ``up`` goes 0.

The alerts are loaded from the chart's rule file with one substitution, so that they fire
within seconds: every ``for: <N>m`` becomes ``for: <N>s`` (minutes read as seconds);
expressions, labels and annotations are the chart's, byte for byte.
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

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from kelastic_operator.local.faults import Fault
from kelastic_operator.local.runner import ENV_LOCAL_RUN, LocalOptions, LocalRunner
from kelastic_operator.model import ElasticJob, load_manifest
from tests.conftest import wait_for
from tests.k8s.cluster import Client, ControlPlane
from tests.localrun import write_job

from .tcpproxy import TcpProxy
from .tools import CHART, ROOT, ToolMissing, helm_binary, render, system_tool

pytestmark = pytest.mark.timeout(300)

DIGITS = ROOT / "examples/digits/elasticjob.yaml"
RATE_INTERVAL = "20s"  # what Grafana's $__rate_interval is at a 1 s scrape interval and more

RULES = CHART / "rules" / "kelastic.rules.yaml"
#: What Prometheus 2.x asks for when it scrapes.
OPENMETRICS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

# Alert expressions that return nothing while the system is healthy (the healthy run checks
# that they stay empty, and their series exist); the failure test drives each of them.
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
    k8s: Client,
    account: Client,
    etcd: EmbeddedEtcd,
    workdir: Path,
    manifest: Path,
    api_url: str | None = None,
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """The operator, started with the chart's rendered command and arguments (watching
    ``k8s``'s namespace; etcd and metrics port swapped for local ones, no leader election),
    logged in as ``account``, reconciling ``manifest`` applied in ``k8s``'s namespace (its
    Pods stay Pending: nothing places them on the tainted test node).
    ``api_url``: where it reaches the API server (default: the server itself)."""
    (dep,) = [
        o for o in render(f"operator.namespaces={{{k8s.namespace}}}") if o["kind"] == "Deployment"
    ]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert f"--namespace={k8s.namespace}" in container["args"]
    port = free_port()
    swapped = ("--etcd-endpoints=", "--metrics-port=")
    args = [a for a in container["args"] if not a.startswith(swapped)]
    args += [
        f"--etcd-endpoints={etcd.endpoint}",
        f"--metrics-port={port}",
        "--standalone",
        "--resync-seconds=1",
    ]
    env = {**account.env(), "POD_ID": "kelastic-operator-test"}
    if api_url is not None:
        config = yaml.safe_load(account.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = api_url
        kubeconfig = workdir / "operator-kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        env["KUBECONFIG"] = str(kubeconfig)
    env = {
        **env,
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
    _apply_job(k8s, manifest)
    try:
        wait_for(
            lambda: (
                "kelastic_operator_pods_created_total"
                in _get(f"http://127.0.0.1:{port}/metrics")[1]
                and "kelastic_operator_pods_created_total 0.0"
                not in _get(f"http://127.0.0.1:{port}/metrics")[1]
            ),
            60,
            0.2,
            what="the operator to create the job's Pods",
        )
    except AssertionError as exc:
        _stop(proc)
        raise AssertionError(f"{exc}\n{log_path.read_text(errors='replace')[-4000:]}") from None
    return proc, port, log_path


def _apply_job(k8s: Client, manifest: Path) -> str:
    """Apply a local job's manifest as an ElasticJob in ``k8s``'s namespace (its containers
    given an image: a real API server refuses a container without one); returns its uid."""
    doc = yaml.safe_load(manifest.read_text())
    for c in doc["spec"]["template"]["spec"]["containers"]:
        c.setdefault("image", "kelastic.test/steps:0")
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))
    name = doc["metadata"]["name"]
    uid = k8s.kubectl("get", "elasticjob", name, "-o", "jsonpath={.metadata.uid}").stdout
    assert uid.strip(), name
    return str(uid).strip()


def _ej(k8s: Client, name: str) -> dict[str, Any]:
    """The ElasticJob ``name`` as the API server has it."""
    return dict(json.loads(k8s.kubectl("get", "elasticjob", name, "-o", "json").stdout))


def _operator_account(cluster: ControlPlane, k8s: Client) -> Client:
    """The ``kelastic-operator`` ServiceAccount (deploy/rbac.yaml) defaulting to ``k8s``'s
    namespace."""
    return cluster.service_account_client(
        "kelastic-system", "kelastic-operator", default_namespace=k8s.namespace
    )


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


def _grafana(expr: str, job: str, namespace: str) -> str:
    return (
        expr.replace("$namespace", namespace)
        .replace("$elasticjob", job)
        .replace("$__rate_interval", RATE_INTERVAL)
    )


def _alerts() -> list[dict[str, Any]]:
    rules = yaml.safe_load(RULES.read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def _fast_rules(dest: Path) -> Path:
    """The chart's rule file with every ``for: <N>m`` read as ``for: <N>s``; nothing else
    changes (checked: the parsed rules are equal once ``for`` is set aside)."""
    text = RULES.read_text()
    fast, count = re.subn(r"^(\s+for: )(\d+)m$", r"\g<1>\2s", text, flags=re.MULTILINE)
    chart, scaled = yaml.safe_load(text), yaml.safe_load(fast)
    assert count == sum("for" in r for g in chart["groups"] for r in g["rules"]) > 0

    def without_for(doc: dict[str, Any]) -> Any:
        return [[{k: v for k, v in r.items() if k != "for"} for r in g["rules"]]
                for g in doc["groups"]]  # fmt: skip

    assert without_for(chart) == without_for(scaled)
    dest.write_text(fast)
    return dest


def _firing(prom: Prometheus, alert: str, labels: dict[str, str]) -> bool:
    """Whether Prometheus fires ``alert`` for a series carrying ``labels``."""
    sel = {"alertname": alert, "alertstate": "firing", **labels}
    return prom.has_data("ALERTS{" + ",".join(f'{k}="{v}"' for k, v in sel.items()) + "}")


def _wait_alert(prom: Prometheus, alert: str, labels: dict[str, str], timeout: float) -> None:
    """Wait until the chart's expression of ``alert`` returns a series carrying ``labels``,
    then until Prometheus fires the alert (its ``for:`` read as seconds) for it."""
    (rule,) = [r for r in _alerts() if r["alert"] == alert]

    def data() -> bool:
        result = prom.query(rule["expr"])["result"]
        return any(labels.items() <= r["metric"].items() for r in result)

    wait_for(data, timeout, 0.25, what=f"{alert}: {rule['expr']} to return {labels}")
    wait_for(lambda: _firing(prom, alert, labels), timeout, 0.25, what=f"{alert} to fire")


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
    kind: str,
    tmp_path: Path,
    k8s_cluster: ControlPlane,
    k8s: Client,
    etcd_server: EmbeddedEtcd,
) -> None:
    _tools()
    ns = k8s.namespace
    manifest, manifest_dir, fault_specs, stop = JOBS[kind](tmp_path)
    job: ElasticJob = load_manifest(manifest)
    name = job.metadata.name
    operator, operator_port, operator_log = _start_operator(
        k8s, _operator_account(k8s_cluster, k8s), etcd_server, tmp_path, manifest
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
        rules = _fast_rules(tmp_path / "rules.yaml")
        sidecars = [
            {
                "targets": [f"127.0.0.1:{p.http_port}"],
                "labels": {"namespace": ns, "elasticjob": name, "pod": p.name},
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
        # a few more scrapes of the resumed round: every target's latest sample taken 2 s
        # (two scrape intervals) after the recovery was seen
        seen = time.time()
        wait_for(lambda: prom is not None and prom.has_data(f"min(timestamp(up)) > {seen + 2:.3f}"),
                 60, 0.25, what="two more scrapes of every target")  # fmt: skip
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
            # no `job` label from kelastic (Prometheus' own); kelastic_build_info is there
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            assert not [s for s in samples if "job" in s.labels], port
            assert [s.value for s in samples if s.name == "kelastic_build_info"] == [1], port
            # ... and Prometheus' Accept header gets OpenMetrics
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics", headers={"Accept": OPENMETRICS_ACCEPT}
            )
            with urllib.request.urlopen(request, timeout=5) as resp:
                ctype = resp.headers["Content-Type"]
                assert ctype.startswith("application/openmetrics-text"), (port, ctype)
        _check_queries(prom, name, ns)
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
    assert not _strays([runner.run_id]), "processes left behind"


def _check_queries(prom: Prometheus, job: str, namespace: str) -> None:
    # Every dashboard query returns data (the reconcile errors' rate is 0 here: its series
    # exist from the start; test_prometheus_fires_every_alert_on_real_failures sees it rise).
    empty = [
        (n, e) for n, e in _dashboard_queries() if not prom.has_data(_grafana(e, job, namespace))
    ]
    assert not empty, f"dashboard queries without data: {empty}"
    # The template variables resolve to this run.
    namespaces = prom.query("group by (namespace) (kelastic_world_size)")["result"]
    assert [r["metric"] for r in namespaces] == [{"namespace": namespace}]
    jobs = prom.query(f'group by (elasticjob) (kelastic_world_size{{namespace="{namespace}"}})')
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
            assert _firing(prom, alert["alert"], {"elasticjob": job}), alert["alert"]
        for name in _metric_names(alert["expr"]):
            assert prom.has_data(f'count({{__name__="{name}"}})'), name
        assert alert["annotations"]["runbook_url"]

    # Every metric the dashboard names exists.
    dash_names = set().union(*(_metric_names(e) for _, e in _dashboard_queries()))
    missing = {n for n in dash_names if not prom.has_data(f'count({{__name__="{n}"}})')}
    assert not missing, missing

    # The numbers make sense.
    world = prom.query(f'max(kelastic_world_size{{elasticjob="{job}"}})')["result"]
    assert world and float(world[0]["value"][1]) == 4
    by_cause = prom.query("sum by (cause) (kelastic_restarts_total)")["result"]
    causes = {r["metric"]["cause"] for r in by_cause}
    assert {"worker_failure", "hang"} <= causes, causes
    goodput = float(prom.query("avg(kelastic_goodput_ratio)")["result"][0]["value"][1])
    assert 0 < goodput < 1
    phase = prom.query(
        f'kelastic_operator_job_phase{{namespace="{namespace}",elasticjob="{job}"}} == 1'
    )
    assert [r["metric"]["phase"] for r in phase["result"]] == ["Pending"]


class _Run:
    """A ``LocalRunner`` on a thread (run dirs under ``workdir``), its output collected."""

    def __init__(self, job: ElasticJob, manifest_dir: Path, workdir: Path, **options: Any) -> None:
        self.lines: list[str] = []
        self.result: list[int] = []
        self.runner = LocalRunner(
            job,
            manifest_dir,
            LocalOptions(workdir=workdir, stop_grace=2, status_interval=2, **options),
            say=lambda line: self.lines.append(f"[kelastic] {line}"),
            echo=lambda line, _err: self.lines.append(line),
        )
        self.thread = threading.Thread(
            target=lambda: self.result.append(self.runner.run()), daemon=True
        )
        self.thread.start()

    def phase(self, index: int) -> str | None:
        """The ``/status`` phase of replica ``index`` as the runner last polled it."""
        pods = list(self.runner.pods)
        return pods[index].status.get("phase") if len(pods) > index else None

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def stop(self) -> None:
        """Interrupt the run (if still running) and wait for it to stop everything."""
        self.runner.interrupt()
        self.thread.join(60)


def test_prometheus_fires_every_alert_on_real_failures(
    tmp_path: Path, k8s_cluster: ControlPlane, k8s: Client, etcd_server: EmbeddedEtcd
) -> None:
    """Each alert the healthy run leaves quiet, driven by a real failure (module doc)."""
    _tools()
    stop = tmp_path / "stop"
    failing_manifest = write_job(
        tmp_path / "failing.yaml", name="failing", replicas=2, min_replicas=2,
        max_restarts=1, env={"STEPS_FAIL_RANK": "0", "STEPS_FAIL_AT": "3"},
    )  # fmt: skip
    cut_manifest = write_job(
        tmp_path / "etcdcut.yaml", name="etcdcut", replicas=1, max_restarts=1,
        env={"STEPS_STOP_FILE": str(stop)},
    )  # fmt: skip
    ns = k8s.namespace
    api_proxy = TcpProxy(urllib.parse.urlsplit(k8s.url).netloc)
    etcd_proxy = TcpProxy(etcd_server.endpoint)
    operator: subprocess.Popen[bytes] | None = None
    runs: list[_Run] = []
    prom: Prometheus | None = None
    try:
        operator, operator_port, operator_log = _start_operator(
            k8s,
            _operator_account(k8s_cluster, k8s),
            etcd_server,
            tmp_path,
            failing_manifest,
            f"https://{api_proxy.endpoint}",
        )
        # The local run of "failing" plays the ElasticJob the operator reconciles: the same
        # namespace and uid, so the same etcd keys (its sidecars' reports reach the operator).
        failing = load_manifest(failing_manifest)
        failing.metadata.namespace = ns
        uid = k8s.kubectl("get", "elasticjob", "failing", "-o", "jsonpath={.metadata.uid}")
        failing.metadata.uid = str(uid.stdout).strip()
        assert failing.metadata.uid
        # One node of the two it needs: it waits in rendezvous.
        failing_run = _Run(
            failing, tmp_path, tmp_path / "failing", replicas=1, etcd=[etcd_server.endpoint]
        )
        runs.append(failing_run)
        cut_run = _Run(
            load_manifest(cut_manifest), tmp_path, tmp_path / "etcdcut", etcd=[etcd_proxy.endpoint]
        )
        runs.append(cut_run)
        wait_for(
            lambda: all(r.runner.pods and r.runner.pods[0].http_port for r in runs),
            60,
            what="the sidecars",
        )
        sidecars = [
            {
                "targets": [f"127.0.0.1:{r.runner.pods[0].http_port}"],
                "labels": {
                    "namespace": ns,
                    "elasticjob": r.runner.job.metadata.name,
                    "pod": r.runner.pods[0].name,
                },
            }
            for r in runs
        ]
        operators = [
            {"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": "kelastic-system"}}
        ]
        prom = Prometheus(
            tmp_path / "prometheus",
            [
                {"job_name": "kelastic-sidecar", "static_configs": sidecars},
                {
                    "job_name": "kelastic-operator",
                    "honor_labels": True,
                    "static_configs": operators,
                },
            ],
            _fast_rules(tmp_path / "rules.yaml"),
        )
        job_labels = {"namespace": ns}

        # etcd cut from a training sidecar: its rendezvous watch fails, the counter rises.
        wait_for(lambda: cut_run.phase(0) == "running", 60, 0.2, what="etcdcut to train\n"
                 + cut_run.output())  # fmt: skip
        etcd_proxy.cut()
        # Meanwhile "failing" has waited in rendezvous since it started.
        _wait_alert(prom, "KelasticRendezvousStuck", {**job_labels, "elasticjob": "failing"}, 60)
        assert failing_run.phase(0) == "rendezvous"
        _wait_alert(
            prom,
            "KelasticEtcdUnreachable",
            {**job_labels, "elasticjob": "etcdcut", "pod": "etcdcut-0"},
            60,
        )
        assert cut_run.phase(0) == "running"  # the workers train on without etcd

        # The second node arrives; rank 0 raises on every attempt: 1 restart, then the job
        # fails, and the operator reads the sidecars' reports.
        failing_run.runner.add_replica()
        _wait_alert(prom, "KelasticJobFailing", {**job_labels, "elasticjob": "failing"}, 90)
        failing_run.thread.join(60)
        assert failing_run.result == [1], failing_run.output()
        status = _ej(k8s, "failing")
        assert status["status"]["phase"] == "Failed", status["status"]
        assert "budget spent" in status["status"]["lastFailure"]["message"], status["status"]

        # The operator loses the API server while a job's rendezvous completes: writing
        # the new world size fails, and so do its reconcile passes until it can. (Idle jobs
        # cost the operator no API request: its watch cache knows them.) "outage" plays an
        # ElasticJob as "failing" did: one node waits for the second, which comes after the cut.
        outage_manifest = write_job(
            tmp_path / "outage.yaml", name="outage", replicas=2, min_replicas=2,
            max_restarts=1, env={"STEPS_STOP_FILE": str(stop)},
        )  # fmt: skip
        outage = load_manifest(outage_manifest)
        outage.metadata.namespace = ns
        outage.metadata.uid = _apply_job(k8s, outage_manifest)
        outage_run = _Run(
            outage, tmp_path, tmp_path / "outage", replicas=1, etcd=[etcd_server.endpoint]
        )
        runs.append(outage_run)
        wait_for(lambda: outage_run.phase(0) == "rendezvous", 60, 0.2, what="outage to wait")
        wait_for(
            lambda: (_ej(k8s, "outage").get("status") or {}).get("phase") == "Pending",
            60, 0.2, what="the operator to reconcile outage",
        )  # fmt: skip
        api_proxy.cut()
        outage_run.runner.add_replica()
        wait_for(lambda: outage_run.phase(0) == "running", 60, 0.2, what="outage to train\n"
                 + outage_run.output())  # fmt: skip
        (errors,) = [e for n, e in _dashboard_queries() if "reconcile_errors" in e]

        def api_errors() -> bool:
            assert prom is not None
            result = prom.query(_grafana(errors, "failing", ns))["result"]
            return any(r["metric"] == {"kind": "api"} and float(r["value"][1]) > 0 for r in result)

        wait_for(api_errors, 60, 0.25, what=f"{errors} to show kind api above 0")
        # ... and none of them counts as a crash (a bug): an unreachable API is an API error.
        crashes = 'kelastic_operator_reconcile_errors_total{job="kelastic-operator",kind="crash"}'
        assert prom.has_data(f"{crashes} == 0"), operator_log.read_text(errors="replace")[-4000:]

        # The operator stops: nothing up in its scrape job.
        _stop(operator)
        operator = None
        _wait_alert(prom, "KelasticOperatorDown", {}, 60)

        # Every alert the healthy run leaves quiet was driven above.
        assert set(QUIET_ALERTS) == {
            "KelasticRendezvousStuck", "KelasticEtcdUnreachable", "KelasticJobFailing",
            "KelasticOperatorDown",
        }  # fmt: skip
        # Without etcd, the node still notices its workers finishing (leaving the rendezvous
        # and reporting then wait on etcd until their timeouts: the run is stopped instead).
        stop.touch()
        wait_for(lambda: cut_run.phase(0) == "succeeded", 30, 0.2, what="etcdcut to finish")
    finally:
        for run in runs:
            run.stop()
        if prom is not None:
            prom.close()
        if operator is not None:
            _stop(operator)
        api_proxy.close()
        etcd_proxy.close()
    assert not _strays([r.runner.run_id for r in runs]), "processes left behind"


def _strays(run_ids: list[str]) -> list[str]:
    """Processes a local run started (marked with its run id) that still exist."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(ENV_LOCAL_RUN) in run_ids:
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        except psutil.Error:
            continue
    return found
