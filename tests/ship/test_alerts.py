"""The alert rules: ``promtool check rules`` and ``promtool test rules`` (every alert has a
unit test in charts/kelastic/tests/alerts.test.yaml), each with a ``runbook_url`` into
docs/runbooks.md (a section of its own there)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from .tools import CHART, ROOT, ToolMissing, system_tool

RULES = CHART / "rules" / "kelastic.rules.yaml"
TESTS = CHART / "tests" / "alerts.test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_URL = "https://github.com/kelastic/kelastic/blob/main/docs/runbooks.md#"
ALERTS = {
    "KelasticJobFailing",
    "KelasticRestartBudgetNearlySpent",
    "KelasticHangReaped",
    "KelasticRendezvousStuck",
    "KelasticOperatorDown",
    "KelasticEtcdUnreachable",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        tool = system_tool("promtool")
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    return subprocess.run(
        [str(tool), *args], capture_output=True, text=True, timeout=120, cwd=TESTS.parent
    )


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", str(TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """The dashboard's queries, Grafana's variables filled in, as recording rules: promtool
    parses each (a misspelt function or an unbalanced selector fails here, before a
    Prometheus runs them in tests/ship/test_prometheus.py)."""
    dashboard = json.loads((CHART / "dashboards" / "kelastic.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    fill = {"$namespace": "ns", "$elasticjob": "job", "$__rate_interval": "1m"}
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"kelastic:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_every_alert_has_severity_runbook_and_a_unit_test() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, rule
        # `job` is Prometheus' scrape job only; the ElasticJob is `elasticjob`, as exposed
        assert "label_replace" not in rule["expr"], rule["alert"]
        assert set(re.findall(r'\bjob="([^"]*)"', rule["expr"])) <= {"kelastic-operator"}
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    firing = {
        case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]
    }
    quiet = {
        case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]
    }
    assert firing == ALERTS and quiet == ALERTS  # each alert: fires when it should, not before


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the markdown's headings (lower case, spaces as dashes, no
    punctuation)."""
    return {
        re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.MULTILINE)
    }


def test_every_runbook_url_names_a_section_of_docs_runbooks() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    anchors = _anchors(RUNBOOKS.read_text())
    urls = {r["alert"]: r["annotations"]["runbook_url"] for r in rules}
    for alert, url in urls.items():
        assert url == RUNBOOK_URL + alert.lower(), (alert, url)
        assert alert.lower() in anchors, f"docs/runbooks.md has no section {alert}"
    # one section per alert, and none for an alert that does not exist
    assert anchors - {"runbooks-of-the-kelastic-alerts"} == {a.lower() for a in ALERTS}
