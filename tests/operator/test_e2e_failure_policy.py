"""spec.failurePolicy on the real control plane: what the operator makes of the two
outcomes a rule gives a Pod, with the exact termination messages the sidecar writes
(:mod:`kelastic_sidecar.failure_rules`, :func:`~kelastic_sidecar.round_end.closed_outcome`).
kopf handlers as the operator's ServiceAccount, a real etcd, Pods on a Node no kubelet runs
(:class:`~tests.k8s.nodes.ManualNode`: the test writes their status as the kubelet would,
after the sidecar ended as the rule said; each action's sidecar side runs for real in
tests/operator/local/test_failure_rules.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.failure_policy import parse_rules
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_sidecar.failure import Failure
from kelastic_sidecar.failure_rules import verdict
from kelastic_sidecar.round_end import closed_outcome
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest

pytestmark = pytest.mark.timeout(180)
T = 30.0  # seconds any single expectation may take
RULES = [
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
    {"action": "RestartPod", "onSignals": {"operator": "In", "values": [7]}},
]


def status_of(k8s: Client, name: str) -> dict[str, Any]:
    found = k8s.get("elasticjob", name)
    return (found or {}).get("status") or {}


def start(k8s: Client, node: ManualNode, name: str) -> str:
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(
        name, node, replicas=1, minReplicas=1, failurePolicy={"rules": RULES},
        podReplacement={"maxReplacements": 1, "backoffSeconds": 0}))  # fmt: skip
    wait_until(lambda: f"{name}-0" in pods_by_name(k8s), T, what=f"{name}-0")
    node.set_status(k8s.namespace, f"{name}-0", "Running", ready=True)
    wait_until(lambda: status_of(k8s, name).get("phase") == "Running", T, what="Running")
    return str(pods_by_name(k8s)[f"{name}-0"]["metadata"]["uid"])


def test_fail_job_fails_the_job_and_its_condition_names_the_rule(
    k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    start(k8s, manual_node, "rule42")
    fault = Failure(cause="worker_failure", node="rule42-0", round=0, rank=1, exitcode=42,
                    message="ValueError: bad labels")  # fmt: skip
    decided = verdict(parse_rules(RULES), fault)
    key, value = decided.close_reason(3)
    _, message = closed_outcome({**fault.as_dict(), key: value}, 3)
    manual_node.set_status(k8s.namespace, "rule42-0", "Failed", exit_code=1, message=message)
    st = wait_until(lambda: (s := status_of(k8s, "rule42")).get("phase") == "Failed" and s, T,
                    what="Failed")  # fmt: skip
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "JobFailed"
    assert "spec.failurePolicy rule 0 (FailJob: exit code 42) applies" in failed["message"]
    assert "exited with code 42: ValueError: bad labels" in failed["message"]
    assert st.get("replacements", 0) == 0  # a job failure: no Pod is replaced


def test_restart_pod_replaces_the_pod_and_the_job_goes_on(
    k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    first = start(k8s, manual_node, "bus")
    fault = Failure(cause="worker_failure", node="bus-0", round=0, rank=0, signal=7)
    message = verdict(parse_rules(RULES), fault).pod_summary(fault)
    assert "rule 1 (RestartPod: signal SIGBUS)" in message
    manual_node.set_status(k8s.namespace, "bus-0", "Failed", exit_code=1, message=message)
    wait_until(lambda: (p := pods_by_name(k8s).get("bus-0")) is not None
               and p["metadata"]["uid"] != first, T, what="bus-0 replaced")  # fmt: skip
    st = wait_until(lambda: (s := status_of(k8s, "bus")).get("replacements") == 1 and s, T,
                    what="one replacement spent")  # fmt: skip
    assert st["phase"] != "Failed" and st["lastFailure"]["message"].startswith(
        "pod restart asked by spec.failurePolicy rule 1 (RestartPod: signal SIGBUS)")  # fmt: skip
