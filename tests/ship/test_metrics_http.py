"""Both ``/metrics`` endpoints over real HTTP: the sidecar's own server
(:class:`~kelastic_sidecar.http.SidecarHttpServer`) and the operator's (``prometheus_client``'s
``start_http_server``, as ``python -m kelastic_operator`` starts it on its registry).

- Each negotiates its format: OpenMetrics for ``Accept: application/openmetrics-text``
  (what Prometheus sends), the Prometheus text format otherwise; both parse (OpenMetrics
  with prometheus_client's strict parser, the text format with ``promtool check metrics``).
- No series carries a ``job`` label (Prometheus' own target label): the ElasticJob is
  ``elasticjob``.
- Both carry ``kelastic_build_info{version, python_version}`` 1.
- The metrics and labels the READMEs document are the ones a scrape shows: the chart
  README's table lists every family of each endpoint with its exact label set (and label
  values where it names them), and every ``kelastic_...{labels}`` the top-level README
  mentions has exactly those labels.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families as parse_text

import kelastic
from kelastic_operator.metrics import OperatorMetrics
from kelastic_sidecar.http import SidecarHttpServer
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer import TimerStats

from .tools import CHART, ROOT, ToolMissing, system_tool

OPENMETRICS = "application/openmetrics-text"
#: What Prometheus 2.x sends when it scrapes.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PHASES = ("Pending", "Running", "Failed")
#: Labels of the exposition itself, not of a metric.
BUCKET_LABELS = {"le", "quantile"}

#: metric -> {label -> documented values (empty: any)}
Documented = dict[str, dict[str, set[str]]]


@pytest.fixture
def sidecar() -> Iterator[str]:
    """A sidecar's /metrics URL; every labelled family has a series."""
    metrics = SidecarMetrics(lambda: TimerStats(acquired=3, active=1))
    metrics.worker_exits.labels(code="SIGKILL").inc()
    server = SidecarHttpServer(
        "127.0.0.1", 0, metrics.registry, lambda: True, lambda: True, lambda: {}
    )
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.stop()


@pytest.fixture
def operator() -> Iterator[str]:
    """An operator's /metrics URL, served as ``python -m kelastic_operator`` serves it."""
    metrics = OperatorMetrics()
    metrics.set_phase("ml", "digits", "Running", PHASES)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def parse_openmetrics(text: str) -> Iterable[Metric]:
    """prometheus_client's strict OpenMetrics parser (raises on anything invalid)."""
    families: Iterable[Metric] = openmetrics_parser.text_string_to_metric_families(text)  # type: ignore[no-untyped-call]
    return families


def _scrape(url: str, accept: str | None) -> tuple[str, str]:
    """(Content-Type, body) of a GET with that Accept header (none when None)."""
    headers = {"Accept": accept} if accept is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return str(r.headers["Content-Type"]), r.read().decode()


def _promtool_check(text: str) -> str:
    """``promtool check metrics`` of a text-format scrape: its complaints ('' when none)."""
    try:
        tool = system_tool("promtool")
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    result = subprocess.run(
        [str(tool), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _exposed(text: str) -> Documented:
    """An OpenMetrics scrape as the READMEs name it: counters with ``_total``, infos with
    ``_info``, histograms by their family name; label -> the values seen."""
    suffix = {"counter": "_total", "info": "_info"}
    out: Documented = {}
    for fam in parse_openmetrics(text):
        labels = out.setdefault(fam.name + suffix.get(fam.type, ""), {})
        for s in fam.samples:
            if s.name == fam.name + "_created":  # a counter's or histogram's creation time
                continue
            for k, v in s.labels.items():
                if k not in BUCKET_LABELS:
                    labels.setdefault(k, set()).add(v)
    return out


_MENTION = re.compile(r"`(kelastic_[a-z_]+)(\{[^`]*\})?`")


def _labels(braces: str | None) -> dict[str, set[str]]:
    """``{a,b="x"|"y"}`` -> ``{"a": set(), "b": {"x", "y"}}``."""
    out: dict[str, set[str]] = {}
    for part in (braces or "{}")[1:-1].replace("\\|", "|").split(","):
        m = re.match(r"\s*([a-zA-Z_]\w*)\s*(?:=\s*(.*))?$", part)
        if m:
            out[m.group(1)] = set(re.findall(r'"([^"]*)"', m.group(2) or ""))
    return out


def _chart_table() -> tuple[Documented, Documented]:
    """The chart README's metrics table: (sidecar column, operator column)."""
    text = (CHART / "README.md").read_text()
    section = text.split("## Metrics, as the dashboard and alerts use them", 1)[1]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    columns: tuple[Documented, Documented] = ({}, {})
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]
        assert len(cells) == 2, row
        for column, cell in zip(columns, cells, strict=True):
            for name, braces in _MENTION.findall(cell):
                column[name] = _labels(braces)
    return columns


def _check_documented(
    documented: Documented, exposed: Documented, where: str, all_values: bool
) -> None:
    """Each documented metric is exposed with exactly the documented label names; the values
    it names are all the values (``all_values``: a table) or some of them (prose)."""
    for name, labels in documented.items():
        assert name in exposed, f"{where}: {name} is not exposed"
        assert set(labels) == set(exposed[name]), f"{where}: {name}{labels} != {exposed[name]}"
        for label, values in labels.items():
            seen = exposed[name][label]
            assert not values or (values == seen if all_values else values <= seen), (
                f"{where}: {name}'s {label} is one of {seen}, not {values}"
            )


@pytest.mark.parametrize("endpoint", ["sidecar", "operator"])
def test_metrics_negotiates_openmetrics_and_the_text_format(
    endpoint: str, request: pytest.FixtureRequest
) -> None:
    url: str = request.getfixturevalue(endpoint)
    for accept in (OPENMETRICS, PROMETHEUS_ACCEPT):
        ctype, body = _scrape(url, accept)
        assert ctype.startswith("application/openmetrics-text; version=1.0.0"), ctype
        assert body.endswith("# EOF\n")
        families = {f.name: f for f in parse_openmetrics(body)}  # strict: raises if invalid
        assert families["kelastic_build"].type == "info"
    for plain in (None, "text/plain", "*/*"):
        ctype, body = _scrape(url, plain)
        assert ctype.startswith("text/plain; version=0.0.4"), (plain, ctype)
        assert "# EOF" not in body
        assert _promtool_check(body) == ""


@pytest.mark.parametrize("endpoint", ["sidecar", "operator"])
def test_no_series_has_a_job_label_and_build_info_is_there(
    endpoint: str, request: pytest.FixtureRequest
) -> None:
    url: str = request.getfixturevalue(endpoint)
    for accept in (OPENMETRICS, None):
        body = _scrape(url, accept)[1]
        parse = parse_openmetrics if accept else parse_text
        samples = [s for f in parse(body) for s in f.samples]
        assert samples
        assert not [s for s in samples if "job" in s.labels], "a `job` label"
        (info,) = [s for s in samples if s.name == "kelastic_build_info"]
        assert info.value == 1
        assert info.labels == {
            "version": kelastic.__version__,
            "python_version": platform.python_version(),
        }
    if endpoint == "operator":
        assert 'kelastic_operator_job_phase{elasticjob="digits",namespace="ml",' in body


def test_the_documented_metrics_and_labels_are_the_exposed_ones(
    sidecar: str, operator: str
) -> None:
    table = _chart_table()
    for column, url, where in zip(table, (sidecar, operator), ("sidecar", "operator"), strict=True):
        exposed = _exposed(_scrape(url, OPENMETRICS)[1])
        _check_documented(column, exposed, f"charts/kelastic/README.md, {where}", True)
        undocumented = set(exposed) - set(column)
        assert not undocumented, f"charts/kelastic/README.md lacks {where}'s {undocumented}"
    both = {
        **_exposed(_scrape(sidecar, OPENMETRICS)[1]),
        **_exposed(_scrape(operator, OPENMETRICS)[1]),
    }
    readme = Path(ROOT / "README.md").read_text()
    mentions = {n: _labels(b) for n, b in _MENTION.findall(readme) if b}
    assert "kelastic_build_info" in mentions
    _check_documented(mentions, both, "README.md", False)


#: Labels a series gets from its scrape, not from the exporter: the scrape job, and the
#: PodMonitor's Pod labels (charts/kelastic/templates/monitoring.yaml).
TARGET_LABELS = {"job", "namespace", "pod", "elasticjob"}


def _query_names(expr: str) -> Iterator[tuple[str, set[str]]]:
    """``(series name, label names)`` a PromQL query uses: each selector's name with the
    labels it matches on, then the labels of each ``by (...)`` with the selectors of its
    argument (``$variables`` stay as they are: only names are read)."""
    for name, braces in re.findall(r"\b(kelastic_[a-z_]+|up)\b(\{[^}]*\})?", expr):
        yield name, set(re.findall(r"(\w+)\s*=~?", braces))
    for by in re.finditer(r"\bby \(([^)]*)\)\s*(?=\()", expr):
        labels = {x.strip() for x in by.group(1).split(",") if x.strip()}
        depth, inner = 0, ""
        for ch in expr[by.end() :]:  # the by's argument: its balanced parentheses
            depth += {"(": 1, ")": -1}.get(ch, 0)
            inner += ch
            if depth == 0:
                break
        for name in re.findall(r"\b(kelastic_[a-z_]+|up)\b", inner):
            yield name, labels


def _family(name: str, exposed: Documented) -> str | None:
    """The exposed family a series name belongs to (a histogram's ``_bucket``, ``_sum``,
    ``_count``), or None."""
    for candidate in (name, re.sub(r"_(bucket|sum|count)$", "", name)):
        if candidate in exposed:
            return candidate
    return None


def test_every_dashboard_query_names_exposed_metrics_and_labels(
    sidecar: str, operator: str
) -> None:
    """Each query of the chart's dashboard names series a scrape shows, and matches or
    groups on labels those series have (or get from their scrape); the restart ladder's
    ``level`` has the rungs its panels show: the sidecars' ``inprocess`` and ``process``,
    the operator's ``pod`` too."""
    exposed = {
        **_exposed(_scrape(sidecar, OPENMETRICS)[1]),
        **_exposed(_scrape(operator, OPENMETRICS)[1]),
        "up": {},  # Prometheus' own
    }
    dashboard = json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets
    for title, expr in targets:
        names = list(_query_names(expr))
        assert names, (title, expr)
        for name, labels in names:
            family = _family(name, exposed)
            assert family is not None, f"{title}: {name} is not exposed ({expr})"
            have = set(exposed[family]) | TARGET_LABELS
            if name.endswith("_bucket"):
                have.add("le")
            assert labels <= have, f"{title}: {name} has no {labels - have} ({expr})"
    ladder = [e for p in dashboard["panels"] if "by rung" in p["title"] for e in
              (t["expr"] for t in p["targets"])]  # fmt: skip
    assert {n for e in ladder for n, _ in _query_names(e)} == {
        "kelastic_restarts_total", "kelastic_operator_restarts_total",
    }  # fmt: skip
    assert exposed["kelastic_restarts_total"]["level"] == {"inprocess", "process"}
    assert exposed["kelastic_operator_restarts_total"]["level"] == {"inprocess", "process", "pod"}
    durations = [e for p in dashboard["panels"] if p["title"] == "In-process restart duration"
                 for e in (t["expr"] for t in p["targets"])]  # fmt: skip
    assert len(durations) == 3 and all("kelastic_inprocess_restart_seconds" in e for e in durations)
