"""The alert rules: ``promtool check rules`` and ``promtool test rules`` (every alert has a
unit test in charts/kelastic/tests/alerts.test.yaml), each with a runbook line."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from .tools import CHART, ToolMissing, system_tool

RULES = CHART / "rules" / "kelastic.rules.yaml"
TESTS = CHART / "tests" / "alerts.test.yaml"
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


def test_every_alert_has_severity_runbook_and_a_unit_test() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    firing = {
        case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]
    }
    quiet = {
        case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]
    }
    assert firing == ALERTS and quiet == ALERTS  # each alert: fires when it should, not before
