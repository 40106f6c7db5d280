"""What a real node does to a running job, and what kelastic does then: the digits job
(real torch DDP in the trainer image, the kelastic sidecar as a native sidecar, Pod
Security ``restricted``) on the real node, with the operator as its ServiceAccount.

- a worker hung inside ``expires()`` (SIGSTOP) in the trainer container is reaped by the
  sidecar, another container of the Pod (shared PID namespace, same uid, no capability);
- the sidecar's process SIGKILLed: the trainer stops its workers and fails the Pod, which
  the operator replaces (see the test for why a sidecar restarted in place cannot take
  the running workers back);
- the kubelet SIGKILLed and started again mid-training: the Pods keep running;
- a worker OOM-killed under the trainer container's memory limit: the root cause says so.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import psutil
import pytest
import yaml

from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.labels import SIDECAR_CONTAINER
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.images import KELASTIC
from tests.k8s.node import PLACEMENT, RealNode

from .conftest import DIGITS, job_manifest, workers
from .test_e2e import events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
T = 120.0  # seconds a step of a scenario may take on a loaded 2-core machine


def _manifest(epochs: int = 30, **spec: Any) -> str:
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"].update(spec)
    pod = doc["spec"]["template"]["spec"]
    pod.update(PLACEMENT)
    pod["containers"][0]["args"] = ["--epochs", str(epochs), "--batch-size", "8",
                                    "--step-timeout", "3"]  # fmt: skip
    return yaml.safe_dump(doc)


def _status(k8s: Client) -> dict[str, Any]:
    return ((k8s.get("elasticjob", "digits") or {}).get("status")) or {}


def _wait(k8s: Client, node: RealNode, condition: Any, timeout: float, what: str) -> Any:
    try:
        return wait_until(condition, timeout, 0.2, what=what)
    except AssertionError as exc:
        pytest.fail(f"{exc}\nstatus: {_status(k8s)}\n{node.explain(k8s.namespace, 25)}")


def _all4(node: RealNode, ns: str) -> dict[int, int] | None:
    found = workers(node, ns)
    return found if sorted(found) == [0, 1, 2, 3] else None


def _accuracy(node: RealNode, ns: str) -> float:
    found = re.findall(r"final test accuracy (\d\.\d+)", node.logs(ns, "trainer"))
    assert found, node.logs(ns, "trainer")[-3000:]
    return float(found[-1])


def _start(k8s: Client, node: RealNode, **spec: Any) -> dict[int, int]:
    k8s.kubectl("apply", "-f", "-", input=_manifest(**spec))
    _wait(k8s, node, lambda: _status(k8s).get("worldSize") == 4, T, "world size 4")
    _wait(k8s, node, lambda: "epoch 2/" in node.logs(k8s.namespace, "trainer"), T, "training")
    found: dict[int, int] = _wait(k8s, node, lambda: _all4(node, k8s.namespace), T, "4 workers")
    return found


def test_a_hung_worker_is_reaped_by_the_sidecar_across_the_container_boundary(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    ns = k8s.namespace
    before = _start(k8s, node)
    hung = before[1]
    os.kill(hung, signal.SIGSTOP)  # inside its train_step timer (3 s)

    # the sidecar (uid 1000, every capability dropped) kills it from its own container
    def reaped() -> bool:
        return not psutil.pid_exists(hung) or psutil.Process(hung).status() == "zombie"

    _wait(k8s, node, reaped, T, "the hung worker reaped")
    _wait(k8s, node, lambda: (_status(k8s).get("restartsSpent") or 0) >= 1, T, "restart shown")
    sidecars = node.logs(ns, SIDECAR_CONTAINER)
    assert re.search(rf"pid {hung}\b.*hung|hung.*pid {hung}\b", sidecars) or "hang" in sidecars

    # where every rank was reaches the job's status and Events: both nodes' sidecars
    # wrote their workers' evidence; the stopped rank is named the culprit
    def both_nodes() -> dict[str, Any] | None:
        found: dict[str, Any] = _status(k8s).get("lastHang") or {}
        return found if found.get("nodes") == 2 else None

    hang = _wait(k8s, node, both_nodes, T, "status.lastHang of both nodes")
    # the sidecars' words on a failure (CI once showed rank 1 as "state Z" here: the stopped
    # rank's reap still queued as its peer's exit ended the round; tests/sidecar/test_witness)
    culprit = r"^hang in round \d+ \(2 nodes reported\): culprit: rank 1 on digits-\d \(stopped\): "
    assert re.search(culprit, hang["message"]), (hang, node.logs(ns, SIDECAR_CONTAINER))
    assert "waiting: " in hang["message"], hang
    # the example turns torch's flight recorder on: the waiting ranks' records, asked for
    # across the container boundary (the trainer's FIFO, the sidecar's uid), say where
    assert re.search(r"waiting: .*\[in gloo:\w+ #\d+ of default_pg\]", hang["message"]), hang
    said = events(k8s)
    assert any(r == "HangEvidence" and "culprit: rank 1" in m for r, m in said), said
    assert any(r == "WorkersRestarted" and ": hang: rank " in m for r, m in said), said
    # the restart was charged by whichever node's timer fired first (often a peer waiting
    # on rank 1); the stopped rank's node amends the charge to name it
    _wait(k8s, node, lambda: (_status(k8s).get("lastRestart") or {}).get("message", "")
          .startswith("hang: rank 1 on digits-"), T, "status.lastRestart names rank 1")  # fmt: skip
    print(f"\nstatus.lastHang: {hang}\nstatus.lastRestart: {_status(k8s)['lastRestart']}")
    _wait(k8s, node, lambda: _status(k8s).get("phase") == "Succeeded", 3 * T, "Succeeded")
    assert _status(k8s)["restartsSpent"] == 1
    assert _accuracy(node, ns) >= 0.90


def test_a_killed_sidecar_fails_its_pod_cleanly_and_the_pod_is_replaced(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    """The kubelet would restart the sidecar in place (``restartPolicy: Always``), but the
    node's etcd session (its lease: the rendezvous drops the node at once), the timers of
    its workers and the round it was in died with the process: a new sidecar cannot take
    running workers back. So the launcher stops the workers as soon as the control
    connection closes and the trainer exits 1 naming the cause; the Pod fails, the
    operator replaces it, the peers re-rendezvous (the lost node charges one restart, as
    a lost node does), and the job finishes."""
    ns = k8s.namespace
    _start(k8s, node)
    pods = pods_by_name(k8s)
    victim = pods["digits-1"]
    side = node.container_pids(victim, SIDECAR_CONTAINER)
    (sidecar,) = [p for p in side if psutil.Process(p).ppid() not in side]
    os.kill(sidecar, signal.SIGKILL)

    def replaced() -> bool:
        pod = pods_by_name(k8s).get("digits-1") or {}
        return pod.get("metadata", {}).get("uid") not in (None, victim["metadata"]["uid"])

    _wait(k8s, node, replaced, T, "digits-1 replaced")
    _wait(k8s, node, lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"), 4 * T, "done")
    final = _status(k8s)
    assert final["phase"] == "Succeeded", f"{final}\n{node.explain(ns, 40)}"
    assert final["replacements"] == 1 and final["restartsSpent"] == 1, final
    last = final["lastFailure"]
    assert (
        last["pod"] == "digits-1"
        and "the sidecar closed the control connection" in (last["message"])
    ), last
    assert _accuracy(node, ns) >= 0.90


def test_a_kubelet_restarted_mid_training_changes_nothing(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    ns = k8s.namespace
    before = _start(k8s, node)
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
    node.restart_kubelet()
    node.wait_ready(T)
    assert workers(node, ns) == before  # the same worker processes
    _wait(k8s, node, lambda: _status(k8s).get("phase") == "Succeeded", 3 * T, "Succeeded")
    final = _status(k8s)
    assert (final.get("restartsSpent") or 0) == 0 and not final.get("replacements"), final
    assert {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()} == uids
    assert _accuracy(node, ns) >= 0.90


#: rank 1 fills 400 MiB (touched: resident) under the trainer's 200 MiB limit; the rest sleep
OOM_WORKER = (
    "import os, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    hog = b'x' * (400 << 20)\n"
    "while True:\n"
    "    time.sleep(0.2)\n"
)


def test_a_worker_oom_killed_under_the_containers_limit_is_named_in_the_root_cause(
    k8s: Client, node_operator: OperatorContext, node: RealNode
) -> None:
    """The kernel's OOM killer takes a worker under the trainer container's memory limit
    (cgroup v1 here): the job's root cause says it was the OOM killer (cause ``oom``), with
    the container's limit and the rank, not a bare SIGKILL; a FailJob rule on ``oom`` fails
    the job at once, with its restart budget left."""
    k8s.claim("digits-checkpoints")
    doc = yaml.safe_load(job_manifest("oom", replicas=1, minReplicas=1, maxReplicas=1,
                                      nprocPerNode=2, maxRestarts=3))  # fmt: skip
    doc["spec"]["failurePolicy"] = {
        "rules": [{"action": "FailJob", "onCauses": {"operator": "In", "values": ["oom"]}}]
    }
    pod = doc["spec"]["template"]["spec"]
    pod.update(PLACEMENT)
    trainer = pod["containers"][0]
    trainer.update(image=KELASTIC, command=["python", "-c", OOM_WORKER], args=[])
    trainer.pop("workingDir", None)
    trainer["resources"] = {"requests": {"cpu": "100m", "memory": "200Mi"},
                            "limits": {"memory": "200Mi"}}  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def status() -> dict[str, Any]:
        return ((k8s.get("elasticjob", "oom") or {}).get("status")) or {}

    _wait(k8s, node, lambda: status().get("phase") == "Failed", T, "the job Failed")
    final = status()
    message = (final.get("lastFailure") or {}).get("message", "")
    assert "OOM killer" in message and "200 MiB" in message, final
    assert "oom: rank 1" in message, final
    assert "rule 0 (FailJob: cause oom)" in message, final
    assert final.get("restartsSpent") in (None, 0), final


def test_kubectl_drain_evicts_the_pods_with_departure_notices_and_charges_nothing(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    """``kubectl drain`` of a node evicts its Pods through the eviction API (a maintenance,
    not a fault): the Pods leave with departure notices, no restart is charged, and the
    job trains on once the node is uncordoned."""
    ns = k8s.namespace
    _start(k8s, node)
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
    admin = node.cluster.admin
    try:
        drained = admin.kubectl(
            "drain", node.name, "--pod-selector", "kelastic.dev/job-name=digits",
            "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s", check=False,
        )  # fmt: skip
        assert drained.returncode == 0, drained.stderr
    finally:
        admin.kubectl("uncordon", node.name)

    def evicted() -> bool:
        now = {p["metadata"]["uid"] for p in pods_by_name(k8s).values()}
        return set(uids.values()).isdisjoint(now)

    _wait(k8s, node, evicted, T, "the Pods evicted")
    _wait(k8s, node, lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"), 4 * T, "done")
    final = _status(k8s)
    print(f"\nafter a drain: {final}")
    assert final["phase"] == "Succeeded", final
    assert (final.get("restartsSpent") or 0) == 0, final
    # the operator saw the evictions' DisruptionTarget and posted the notices; the
    # kubelet ran the trainers' preStop hook (kelastic.prestop) without a failure
    disrupted = [m for r, m in events(k8s) if r == "PodDisrupted"]
    assert disrupted and all("EvictionByEvictionAPI" in m for m in disrupted), events(k8s)
    hooks = [e for e in k8s.objects("events") if e.get("reason") == "FailedPreStopHook"]
    assert not hooks, hooks
    assert _accuracy(node, ns) >= 0.90
