"""Tainting a quarantined Node, when the operator is told to (``--taint-quarantined-nodes``;
the chart's ``operator.taintQuarantinedNodes``, which alone grants ``get``/``patch`` on
Nodes).

A job's ``status.quarantinedNodes`` keeps that job's new Pods off a Node (node affinity,
:mod:`~kelastic_operator.placement`). The taint keeps every new Pod off it, of every job
and every other workload that does not tolerate it: ``kelastic.dev/quarantined``, value
the job that quarantined it (``<namespace>.<job>``, cut to a label value's 63
characters), effect ``NoSchedule``. Running Pods are not evicted (not ``NoExecute``:
another tenant's Pods are not ours to stop). Nothing removes it: the Node's owner does,
once the Node is mended (``kubectl taint nodes NODE kelastic.dev/quarantined-``).

The patch is a JSON patch that first tests the Node's ``resourceVersion``, so a taint
another controller added meanwhile is never overwritten (a conflict is tried again, up to
:data:`ATTEMPTS` times).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .reconcile_views import Event, format_time

__all__ = ["ATTEMPTS", "TAINT_EFFECT", "TAINT_KEY", "taint_node", "taint_value"]

TAINT_KEY: Final = "kelastic.dev/quarantined"
TAINT_EFFECT: Final = "NoSchedule"
#: Patches tried when the Node changed under the operator.
ATTEMPTS: Final = 3


def taint_value(namespace: str, job: str) -> str:
    """``<namespace>.<job>`` as a label value (63 characters, alphanumeric at both ends)."""
    text = re.sub(r"[^A-Za-z0-9._-]", "-", f"{namespace}.{job}")[:63]
    return text.strip("._-") or "kelastic"


def taint_node(core: client.CoreV1Api, node: str, value: str, now: datetime) -> Event:
    """Add the quarantine taint to ``node`` unless it has one; the Event that says what
    happened (``NodeTainted``, or ``NodeTaintFailed`` with the API's reason: a Node gone,
    no RBAC, conflicts past :data:`ATTEMPTS`). Never raises an API error."""
    taint = {"key": TAINT_KEY, "value": value, "effect": TAINT_EFFECT,
             "timeAdded": format_time(now)}  # fmt: skip
    why = ""
    for _ in range(ATTEMPTS):
        try:
            found: Any = core.read_node(node)
            taints = list(found.spec.taints or [])
            if any(t.key == TAINT_KEY for t in taints):
                return Event("Normal", "NodeTainted", f"node {node} already has {TAINT_KEY}")
            patch = [
                {"op": "test", "path": "/metadata/resourceVersion",
                 "value": found.metadata.resource_version},
                {"op": "add", "path": "/spec/taints/-", "value": taint} if taints
                else {"op": "add", "path": "/spec/taints", "value": [taint]},
            ]  # fmt: skip
            core.patch_node(node, patch)
        except ApiException as exc:
            why = f"{exc.status} {exc.reason}"
            if exc.status in (409, 422):  # the Node changed (the test failed): again
                continue
            break
        else:
            return Event(
                "Warning", "NodeTainted",
                f"node {node} tainted {TAINT_KEY}={value}:{TAINT_EFFECT}: no new Pod is "
                f"scheduled there until it is removed (kubectl taint nodes {node} "
                f"{TAINT_KEY}-)",
            )  # fmt: skip
    return Event("Warning", "NodeTaintFailed", f"cannot taint node {node}: {why}")
