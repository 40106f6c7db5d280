"""Quarantine of Nodes whose Pods failed their preflight check: reconcile records the Node
(``status.quarantinedNodes``, once, bounded) and new Pods carry a required node-affinity
term keeping them off it (``kelastic_operator.placement.avoid_nodes``), merged with the
user's own terms; the Pods stay valid for the API server's schema."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Any

import kubernetes_validate as kv
import pytest

from kelastic import contract
from kelastic_operator.model import MAX_QUARANTINED, load_manifest
from kelastic_operator.placement import avoid_nodes
from kelastic_operator.pods import PodSettings, build_pod, pod_spec_hash
from kelastic_operator.reconcile import reconcile
from kelastic_operator.reconcile_views import format_time

from .test_checkpoint_volume import ROOT
from .test_reconcile import T0, job, pod, spec

NOT_IN = {"key": "metadata.name", "operator": "NotIn", "values": ["node-a", "node-b"]}
PREFLIGHT = f"{contract.PREFLIGHT_FAILED_PREFIX}j-1: exited with code 3: GPU 1: ECC errors"


def test_no_nodes_to_avoid_changes_nothing() -> None:
    pod_spec = {"containers": []}
    avoid_nodes(pod_spec, [])
    assert pod_spec == {"containers": []}


def test_without_an_affinity_one_required_term_keeps_the_pod_off_the_nodes() -> None:
    pod_spec: dict[str, Any] = {}
    avoid_nodes(pod_spec, ["node-b", "node-a", "node-b"])
    required = pod_spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert required == {"nodeSelectorTerms": [{"matchFields": [NOT_IN]}]}


def test_the_users_terms_are_kept_and_each_gets_the_requirement() -> None:
    gpu = {"key": "gpu", "operator": "In", "values": ["a100", "h100"]}
    zone = {"key": "metadata.name", "operator": "NotIn", "values": ["old"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [gpu]}}]
    pod_spec: dict[str, Any] = {"affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [gpu]}, {"matchFields": [zone]},
            ]},
            "preferredDuringSchedulingIgnoredDuringExecution": preferred,
        },
        "podAntiAffinity": {"x": 1},
    }}  # fmt: skip
    before = copy.deepcopy(pod_spec)
    avoid_nodes(pod_spec, ["node-a", "node-b"])
    node_affinity = pod_spec["affinity"]["nodeAffinity"]
    terms = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [gpu], "matchFields": [NOT_IN]},
                     {"matchFields": [zone, NOT_IN]}]  # fmt: skip
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert pod_spec["affinity"]["podAntiAffinity"] == before["affinity"]["podAntiAffinity"]


def test_a_built_pod_avoids_the_nodes_is_valid_and_its_digest_does_not_change() -> None:
    settings = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd:2379",))
    digits = load_manifest(ROOT / "examples/digits/elasticjob.yaml").spec
    pod_doc = build_pod("digits", "ml", "u1", digits, 0, settings, ["node-a", "node-b"])
    terms = pod_doc["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]  # fmt: skip
    assert all(NOT_IN in t["matchFields"] for t in terms)
    kv.validate(pod_doc, "1.33", strict=True)
    plain = build_pod("digits", "ml", "u1", digits, 0, settings)
    assert (
        "affinity" not in plain["spec"] or plain["spec"]["affinity"] != pod_doc["spec"]["affinity"]
    )
    assert pod_doc["metadata"]["annotations"] == plain["metadata"]["annotations"]  # the digest
    assert pod_spec_hash(digits) == plain["metadata"]["annotations"][next(
        k for k in plain["metadata"]["annotations"] if k.endswith("spec-hash"))]  # fmt: skip


def _failed(i: int, message: str, node: str) -> Any:
    return replace(pod(i, "Failed", msg=message, code=1, at=T0), node_name=node)


def test_a_pod_that_failed_its_preflight_quarantines_its_node_once() -> None:
    st = {"phase": "Running", "startTime": format_time(T0), "observedGeneration": 1}
    plan = reconcile(job(spec(), **st), [pod(0), _failed(1, PREFLIGHT, "node-a")],
                     T0 + timedelta(seconds=1))  # fmt: skip
    assert plan.status.quarantined_nodes == ["node-a"]
    (event,) = [e for e in plan.events if e.reason == "NodeQuarantined"]
    assert event.message == (
        "node node-a: pod j-1 failed its preflight check; the job's new Pods avoid it"
    )
    pods = [pod(0), _failed(1, PREFLIGHT, "node-a")]
    again = reconcile(job(spec(), **plan.status.as_patch()), pods, T0 + timedelta(seconds=2))
    assert again.status.quarantined_nodes == ["node-a"]
    assert "NodeQuarantined" not in [e.reason for e in again.events]


@pytest.mark.parametrize(
    ("message", "node"),
    [
        ("worker_failure: rank 3 on j-1 (round 2) exited with code 1: boom", "node-a"),
        (PREFLIGHT, ""),  # never bound to a Node: nothing to avoid
        ("a job failed: preflight failed on j-1: x", "node-a"),  # not the prefix
    ],
)
def test_other_failures_quarantine_nothing(message: str, node: str) -> None:
    st = {"phase": "Running", "startTime": format_time(T0), "observedGeneration": 1}
    plan = reconcile(job(spec(), **st), [pod(0), _failed(1, message, node)], T0)
    assert plan.status.quarantined_nodes == []
    assert "NodeQuarantined" not in [e.reason for e in plan.events]


def test_the_quarantine_is_bounded_dropping_the_oldest() -> None:
    full = [f"node-{i}" for i in range(MAX_QUARANTINED)]
    st = {"phase": "Running", "startTime": format_time(T0), "observedGeneration": 1,
          "quarantinedNodes": full}  # fmt: skip
    plan = reconcile(job(spec(), **st), [pod(0), _failed(1, PREFLIGHT, "node-new")], T0)
    assert plan.status.quarantined_nodes == [*full[1:], "node-new"]
