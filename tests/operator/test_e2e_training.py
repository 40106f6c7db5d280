"""The operator running the real digits job on the real test cluster: kubectl, kopf as the
operator's ServiceAccount, real etcd, and the real node (kubelet, containerd, runc) running
each Pod's sidecar and trainer containers from the images built here (real torch DDP
training across Pod IPs), in a namespace that enforces Pod Security ``restricted``.

One job goes through these scenarios in order: Running with its world size ->
``kubectl scale`` mid-training (a third node joins at the next round) -> ``kubectl delete
pod`` mid-training (replaced; training resumes from its checkpoint; the restart shows in
the status) -> Succeeded, its persisted steps on the claim loadable with plain torch DCP
-> ``kubectl delete ej`` (Pods, then etcd keys, gone).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kelastic import contract
from kelastic.checkpoint.persist import complete_steps
from kelastic_etcd import EtcdClient
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.node import PLACEMENT, RealNode

from .conftest import DIGITS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
T = 120.0  # seconds a step of the scenario may take on a loaded 2-core machine


def _status(k8s: Client) -> dict[str, Any]:
    return ((k8s.get("elasticjob", "digits") or {}).get("status")) or {}


def _trainer_logs(node: RealNode, namespace: str) -> str:
    return node.logs(namespace, "trainer")


def _manifest() -> str:
    """The digits example, unchanged but for the placement on the test's node."""
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["template"]["spec"].update(PLACEMENT)
    return yaml.safe_dump(doc)


def test_digits_runs_scales_survives_a_pod_deletion_and_succeeds(
    k8s: Client,
    digits_operator: OperatorContext,
    node: RealNode,
    etcd_server: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    api, ns = k8s, k8s.namespace
    api.kubectl("apply", "-f", "-", input=_manifest())

    # Running, world size 4, as kubectl shows it.
    wait_until(lambda: _status(api).get("worldSize") == 4, T, what="world size 4")
    table = api.kubectl("get", "ej", "digits").stdout
    assert re.search(r"digits\s+Running\s+2\s+\d\s+4\s+0", table), table
    wait_until(lambda: "epoch 2/" in _trainer_logs(node, ns), T, what="training")

    # Scale up mid-training: a third node joins at the next round; no restart is spent.
    api.kubectl("scale", "ej/digits", "--replicas=3")
    wait_until(lambda: _status(api).get("worldSize") == 6, T, what="world size 6")
    wait_until(lambda: re.search(r"world 6", _trainer_logs(node, ns)), T, what="a step at 6")
    assert (_status(api).get("restartsSpent") or 0) == 0
    # Every rank saves every step in memory, but the new node's ranks 4, 5 hold none: the
    # sidecars agree on no step (never a mixed one), the job says so, all ranks read disk.
    wait_until(lambda: (_status(api).get("lastCheckpoint") or {}).get("round", 0) >= 1, T,
               what="status.lastCheckpoint")  # fmt: skip
    last = _status(api)["lastCheckpoint"]
    assert last.get("tier") == "none" and "step" not in last, last
    wait_until(lambda: "ranks holds: the workers start without one" in api.kubectl(
        "get", "events", "--field-selector", "reason=CheckpointNotRestored", "-o", "json"
    ).stdout, T, what="a CheckpointNotRestored Event")  # fmt: skip

    # Delete a Pod mid-training: replaced, the group restarts and resumes from checkpoint.
    old_uid = pods_by_name(api)["digits-1"]["metadata"]["uid"]
    resumed_before = _trainer_logs(node, ns).count("resumed from checkpoint")
    api.kubectl("delete", "pod", "digits-1", "--wait=false")
    wait_until(
        lambda: pods_by_name(api).get("digits-1", {}).get("metadata", {}).get("uid")
        not in (None, old_uid),
        T, what="a replacement digits-1",
    )  # fmt: skip
    wait_until(lambda: (_status(api).get("restartsSpent") or 0) >= 1, T, what="restart shown")
    wait_until(
        lambda: _trainer_logs(node, ns).count("resumed from checkpoint") > resumed_before,
        T, what="training resumed from the checkpoint",
    )  # fmt: skip

    # The job finishes.
    wait_until(lambda: _status(api).get("phase") == "Succeeded", 3 * T, what="Succeeded")
    accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)",
                                               _trainer_logs(node, ns))]  # fmt: skip
    assert accuracies and accuracies[-1] >= 0.90
    # The deleted Pod cost exactly one restart; the scale-up none.
    assert _status(api)["restartsSpent"] == 1
    # The sidecars persisted steps to the claim (spec.checkpoint.persist: every 200th, and
    # what memory held when digits-1 was deleted), each loadable with plain torch DCP.
    pv = k8s.cluster.workdir / "volumes" / f"{ns}-digits-checkpoints"[:63]
    root = pv / "kelastic-checkpoints"
    steps = complete_steps(root)
    assert steps and len(steps) <= 2, sorted(p.name for p in root.iterdir())  # keep: 2
    whole = tmp_path / "step.pt"
    dcp_to_torch_save(str(root / f"step-{steps[0]}" / "rank-0"), str(whole))
    state = torch.load(whole, weights_only=False)
    assert state["updates"] == steps[0] and state["model"], sorted(state)
    uid = json.loads(api.kubectl("get", "ej", "digits", "-o", "json").stdout)["metadata"]["uid"]

    # Deleting the job removes its Pods and its etcd keys.
    api.kubectl("delete", "ej", "digits")
    wait_until(lambda: not pods_by_name(api), T, what="pods gone")
    prefix = contract.job_prefix(ns, "digits", uid)
    with EtcdClient([etcd_server.endpoint]) as store:
        wait_until(lambda: not store.get_prefix(prefix), T, what="etcd keys gone")
