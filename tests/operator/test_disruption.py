"""A Pod that a disruption takes (its ``DisruptionTarget`` condition: ``kubectl drain``'s
eviction, a preemption, the taint manager) departs with a notice, so its peers charge
nothing; a plain deletion stays a fault. The trainer's ``preStop`` hook that lets the
sidecar leave first. The same on the real node: ``test_e2e_node_faults.py``'s drain."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

from kelastic import contract
from kelastic_operator.pods import build_pod, trainer_lifecycle
from kelastic_operator.reconcile import RendezvousView, pod_view, reconcile

from .test_pods import SETTINGS, UID, digits_spec
from .test_reconcile import T0, job, pod


def _obj(conditions: list[Any], deleting: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "j-0", "uid": "p0"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running", "conditions": conditions}}


def test_the_pod_view_reads_a_true_disruption_target_and_nothing_else() -> None:
    evicted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    view = pod_view("j", _obj([{"type": "Ready", "status": "True"}, evicted]))
    assert view is not None and view.disruption == "EvictionByEvictionAPI" and view.deleting
    for conditions in (
        [{**evicted, "status": "False"}],  # the pod GC cleared a stale one
        [{"type": "Ready", "status": "True", "reason": "EvictionByEvictionAPI"}],
        ["DisruptionTarget", 7, None],  # crafted entries are passed over
        [],
    ):
        seen = pod_view("j", _obj(conditions))
        assert seen is not None and seen.disruption == "", conditions
    crafted = pod_view("j", _obj([{**evicted, "reason": "x" * 5000}]))
    assert crafted is not None and len(crafted.disruption) == 128  # bounded
    unnamed = pod_view("j", _obj([{"type": "DisruptionTarget", "status": "True"}]))
    assert unnamed is not None and unnamed.disruption == "Disruption"


def test_a_disrupted_pod_departs_with_a_notice_before_its_node_is_removed() -> None:
    taken = dataclasses.replace(pod(0, deleting=True), disruption="PreemptionByScheduler")
    plan = reconcile(job(phase="Running"), [taken, pod(1)], T0)
    assert plan.disrupted_nodes == ["j-0"] and plan.remove_nodes == ["j-0"]
    assert not plan.depart_nodes  # not a scale-down
    events = [(e.type, e.reason, e.message) for e in plan.events if e.reason == "PodDisrupted"]
    assert events == [("Normal", "PodDisrupted", "pod j-0 is taken by PreemptionByScheduler: "
                       "its node leaves the rendezvous, no restart charged")]  # fmt: skip
    # once the notice is in etcd, the next passes post it again (idempotent) but say nothing
    again = reconcile(job(phase="Running"), [taken, pod(1)], T0,
                      rendezvous=RendezvousView(departing=frozenset({"j-0"})))  # fmt: skip
    assert again.disrupted_nodes == ["j-0"]
    assert not [e for e in again.events if e.reason == "PodDisrupted"]


def test_a_plain_deletion_or_a_condition_without_deletion_posts_no_notice() -> None:
    deleted = pod(0, deleting=True)  # kubectl delete pod: a fault its peers charge
    plan = reconcile(job(phase="Running"), [deleted, pod(1)], T0)
    assert plan.remove_nodes == ["j-0"] and not plan.disrupted_nodes
    # a condition whose deletion never came (a failed eviction): the Pod keeps training
    marked = dataclasses.replace(pod(0), disruption="EvictionByEvictionAPI")
    plan = reconcile(job(phase="Running"), [marked, pod(1)], T0)
    assert not plan.remove_nodes and not plan.disrupted_nodes
    # a finished Pod being deleted has no node to take out
    done = dataclasses.replace(pod(0, phase="Succeeded", deleting=True), disruption="Eviction")
    plan = reconcile(job(phase="Running"), [done, pod(1)], T0)
    assert "j-0" not in plan.disrupted_nodes


def test_the_trainer_gets_the_prestop_hook_and_a_users_own_hook_is_kept() -> None:
    built = build_pod("digits", "ml", UID, digits_spec(), 0, SETTINGS)
    trainer = built["spec"]["containers"][0]
    command = trainer["lifecycle"]["preStop"]["exec"]["command"]
    assert command == [SETTINGS.python, "-m", "kelastic.prestop"]
    # the command runs and exits 0 with nothing to tell (no sidecar here): a hook that
    # failed would only delay the Pod's stop
    done = subprocess.run([sys.executable, *command[1:], "--timeout", "1"], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and "the sidecar did not answer" in done.stdout, done
    own = {"preStop": {"exec": {"command": ["sh", "-c", "flush"]}}, "postStart": {"exec": {}}}
    assert trainer_lifecycle({"lifecycle": own}) == own
    theirs = trainer_lifecycle({"lifecycle": {"postStart": {"exec": {"command": ["x"]}}}})
    assert theirs["postStart"] == {"exec": {"command": ["x"]}} and "preStop" in theirs


def test_the_disruption_departure_is_one_the_operator_posts() -> None:
    assert contract.DEPARTURE_DISRUPTION in contract.OPERATOR_DEPARTURES
    assert contract.DEPARTURE_SCALE_DOWN in contract.OPERATOR_DEPARTURES
