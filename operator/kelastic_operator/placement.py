"""Where the job's Pods may run: plain functions over a Pod spec (a dict as the API takes
it), called by :func:`~kelastic_operator.pods.build_pod`.

:func:`avoid_nodes` keeps a Pod off the Nodes in ``status.quarantinedNodes`` (those a Pod
of the job failed its preflight check on): a required node-affinity term on the Node's
name (``matchFields`` ``metadata.name`` ``NotIn``; a Node's ``kubernetes.io/hostname``
label need not equal its name). The user's own required terms are kept: the Kubernetes
scheduler ORs a Pod's ``nodeSelectorTerms`` and ANDs the requirements inside each, so the
requirement is added to every term (one term of its own when there is none); preferred
terms and Pod (anti-)affinity are untouched. Required, not preferred: a Node whose check
failed (a bad GPU, a broken driver) would fail every replacement the same way; when no
Node is left, the Pod stays Pending and the job shrinks after
``pendingTimeoutSeconds``, as for any unschedulable Pod.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

__all__ = ["avoid_nodes"]


def avoid_nodes(pod_spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """Add to ``pod_spec`` (in place) the requirement that its Node is none of ``nodes``;
    nothing when ``nodes`` is empty."""
    if not nodes:
        return
    requirement = {"key": "metadata.name", "operator": "NotIn", "values": sorted(set(nodes))}
    affinity = pod_spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchFields"] = [*(term.get("matchFields") or []), copy.deepcopy(requirement)]
    required["nodeSelectorTerms"] = terms
