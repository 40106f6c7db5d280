"""Quarantine after hardware-looking failures (rule 12 of reconcile,
:mod:`kelastic_operator.quarantine`): a Node with two restarts charged on it for failures
whose text looks like the hardware's is quarantined and the job's Pods there replaced;
the charges' Node as the sidecar writes it and the operator reads it. The preflight case:
``tests/operator/test_placement.py``; on the real control plane:
``tests/operator/test_e2e_quarantine.py``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kelastic import contract
from kelastic.contract import Keys
from kelastic_etcd import EtcdClient
from kelastic_operator.etcd_view import view_from_keys
from kelastic_operator.quarantine import (
    HARDWARE_FAILURES,
    REPLACE_QUARANTINED_REASON,
    hardware_looking,
)
from kelastic_operator.reconcile import DeletePod, PodView, RendezvousView, reconcile
from kelastic_operator.reconcile_views import ChargeView
from kelastic_sidecar.restart_budget import RestartBudget

from .test_reconcile import T0, job, pod, spec

XID = (
    "worker_failure: rank 3 on j-0 (round 2) exited with code 1: NCCL error: unhandled "
    "system error; dmesg: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"
)
ECC = "worker_failure: rank 2 on j-0 (round 5): CUDA error: uncorrectable ECC error encountered"


@pytest.mark.parametrize(
    ("text", "hardware"),
    [
        (XID, True),
        (ECC, True),
        ("RuntimeError: CUDA error: unspecified launch failure", True),
        ("torch.distributed.DistBackendError: NCCL error in: ... ncclSystemError", True),
        ("NET/IB : ibv_modify_qp failed with 110", True),
        ("worker_failure: rank 1 killed by SIGBUS", True),
        ("OSError: [Errno 5] Input/output error: '/data/shard-7'", True),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", False),
        ("RuntimeError: CUDA error: device-side assert triggered", False),
        ("oom: rank 1 killed by the OOM killer", False),
        ("hang: rank 2 (round 3): timer 'train_step' expired", False),
        ("ValueError: Xidian dataset not found", False),
    ],
)
def test_what_looks_like_the_hardware(text: str, hardware: bool) -> None:
    assert hardware_looking(text) is hardware


def placed(p: PodView, node: str) -> PodView:
    return dataclasses.replace(p, node_name=node)


PODS = [placed(pod(0), "gpu-a"), placed(pod(1), "gpu-b"), placed(pod(2), "gpu-a")]


def charges(*items: tuple[int, str, str]) -> RendezvousView:
    return RendezvousView(charges=tuple(ChargeView(r, "worker_failure", "j-0", host, text)
                                        for r, host, text in items))  # fmt: skip


def test_two_hardware_failures_on_a_node_quarantine_it_and_move_the_jobs_pods() -> None:
    assert HARDWARE_FAILURES == 2
    view = charges((2, "gpu-a", XID), (3, "gpu-b", "RuntimeError: boom"), (5, "gpu-a", ECC))
    plan = reconcile(job(spec(replicas=3), phase="Running"), PODS, T0, view)
    assert plan.status.quarantined_nodes == ["gpu-a"]
    assert plan.delete == [DeletePod("j-0", REPLACE_QUARANTINED_REASON),
                           DeletePod("j-2", REPLACE_QUARANTINED_REASON)]  # fmt: skip
    assert plan.depart_nodes == ["j-0", "j-2"]  # planned: their peers charge nothing
    (event,) = [e for e in plan.events if e.reason == "NodeQuarantined"]
    assert event.message.startswith("node gpu-a: 2 hardware-looking failures charged on it "
                                    "(rounds 2, 5; the last: worker_failure: rank 2")  # fmt: skip
    assert plan.status.replacements == 0
    # once: the next pass (the Pods being deleted) does nothing more
    moving = [dataclasses.replace(p, deleting=p.node_name == "gpu-a") for p in PODS]
    again = reconcile(job(spec(replicas=3), **plan.status.as_patch()), moving, T0, view)
    assert not again.delete and not [e for e in again.events if e.reason == "NodeQuarantined"]


@pytest.mark.parametrize(
    "view",
    [
        charges((2, "gpu-a", XID)),  # once is not a pattern
        charges((2, "gpu-a", XID), (2, "gpu-a", ECC)),  # one round, two nodes' reports
        charges((2, "gpu-a", XID), (3, "gpu-b", ECC)),  # one each
        charges((2, "", XID), (3, "", ECC)),  # no Node known (an older sidecar, local mode)
        charges((2, "gpu-a", "RuntimeError: boom"), (3, "gpu-a", "ValueError: x")),
    ],
)
def test_what_does_not_quarantine(view: RendezvousView) -> None:
    plan = reconcile(job(spec(replicas=3), phase="Running"), PODS, T0, view)
    assert plan.status.quarantined_nodes == [] and not plan.delete


def test_a_finishing_job_moves_nothing() -> None:
    view = charges((2, "gpu-a", XID), (5, "gpu-a", ECC))
    done = [placed(pod(0, phase="Succeeded"), "gpu-a"), *PODS[1:]]
    plan = reconcile(job(spec(replicas=3), phase="Running"), done, T0, view)
    assert not [d for d in plan.delete if d.reason == REPLACE_QUARANTINED_REASON]


def test_the_charges_carry_the_node_the_sidecar_ran_on(etcd_endpoint: str, job_prefix: str) -> None:
    keys = Keys(job_prefix)
    store = EtcdClient([etcd_endpoint])
    budget = RestartBudget(store, keys, max_restarts=5, host="gpu-a")
    budget.charge(2, "worker_failure", "j-0", {"summary": XID, "tail": ["x", 7]})
    RestartBudget(store, keys, max_restarts=5).charge(3, "hang", "j-1", {"summary": "hang"})
    kv = {keys.restarts: store.get(keys.restarts)[0]}  # type: ignore[index]
    (first, second) = view_from_keys(job_prefix, kv, 2).charges
    assert (first.round, first.pod, first.host) == (2, "j-0", "gpu-a")
    assert first.text == XID + "\nx"  # the tail's strings only
    assert (second.host, second.text) == ("", "hang")
    store.close()


@pytest.mark.parametrize(
    "detail",
    [{"host": 7}, {"host": ["gpu-a"]}, {"tail": "not a list"}, {"summary": {"a": 1}},
     {"host": "h" * 10000, "summary": "s" * 10000}],
)  # fmt: skip
def test_a_crafted_charge_is_read_within_bounds(detail: dict[str, Any]) -> None:
    prefix = contract.job_prefix("ns", "j", "u")
    entry = {"round": 1, "cause": "hang", "node": "j-0", "detail": detail, "time": 1.0}
    raw = json.dumps({"version": 1, "count": 1, "last_round": 1, "history": [entry]}).encode()
    (charge,) = view_from_keys(prefix, {Keys(prefix).restarts: raw}, 2).charges
    assert isinstance(charge.host, str) and len(charge.host) <= 4096
    assert len(charge.text) <= 4096


def test_the_plan_names_the_nodes_quarantined_by_this_pass_for_the_taint() -> None:
    view = charges((2, "gpu-a", XID), (5, "gpu-a", ECC))
    plan = reconcile(job(spec(replicas=3), phase="Running"), PODS, T0, view)
    assert plan.taint_nodes == ["gpu-a"]
    again = reconcile(job(spec(replicas=3), **plan.status.as_patch()), PODS, T0, view)
    assert again.taint_nodes == []  # tainted once, when it was quarantined


@pytest.mark.parametrize(
    ("namespace", "name", "value"),
    [("ml", "digits", "ml.digits"), ("a" * 40, "b" * 40, "a" * 40 + "." + "b" * 22),
     ("ns", "j_x!", "ns.j_x"), ("-", "-", "kelastic")],
)  # fmt: skip
def test_the_taints_value_is_a_label_value(namespace: str, name: str, value: str) -> None:
    from kelastic_operator.node_taint import taint_value

    assert taint_value(namespace, name) == value and len(value) <= 63
