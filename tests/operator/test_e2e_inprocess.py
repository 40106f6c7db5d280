"""In-process restart on the operator's path: the digits job with
``spec.inProcess.enabled`` on the real test cluster (kubectl, kopf as the operator's
ServiceAccount, real etcd, the real node running each Pod's sidecar and trainer containers
from the images built here, real torch DDP training in a ``restricted`` namespace).

One worker raises inside the wrapped training function (SIGUSR1 with
``KELASTIC_INJECT_RAISE=1`` in the trainer's env, as ``kelastic run --fault raise:...``
does): every rank re-enters the function in the same processes. Asserted: no Pod replaced
and no worker process restarted (same Pod UIDs, same worker pids), no process restart
spent, the restart in the job status (``inProcessRestarts``, ``lastInProcessRestart``) and
in an ``InProcessRestart`` Event, ``kelastic_restarts_total{level="inprocess"}`` on the
sidecars' ``/metrics`` and ``kelastic_operator_restarts_total{level="inprocess"}`` on the
operator's, equal parameter hashes on every rank in the new iteration, and the job
succeeding with its accuracy.

A worker SIGKILLed, or stopped (SIGSTOP: a hang its peers block on), takes the hybrid rung:
only it starts again as a process, its peers keep theirs, no Pod is replaced and no
process restart is spent. A Pod deleted takes the node-change rung.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import yaml

from kelastic import contract
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.labels import SIDECAR_CONTAINER
from tests.k8s.cluster import Client, pods_by_name, wait_until
from tests.k8s.node import PLACEMENT, RealNode

from .conftest import DIGITS, worker_procs
from .conftest import workers as _workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
T = 120.0  # seconds a step of the scenario may take on a loaded 2-core machine
RAISING_RANK = 1
_INPROCESS = re.compile(r'^kelastic_restarts_total\{[^}]*level="inprocess"[^}]*\} (\S+)$', re.M)
_HASH = re.compile(r"^\[(\d+)\]: iteration (\d+): params sha256 ([0-9a-f]{8})", re.M)


def _manifest(epochs: int = 20) -> str:
    """The digits example with in-process restart on, the Wrapper's fault injection armed
    (SIGUSR1 raises inside the wrapped function), ``epochs`` epochs, on the test's node."""
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["inProcess"] = {"enabled": True}
    pod = doc["spec"]["template"]["spec"]
    pod.update(PLACEMENT)
    trainer = pod["containers"][0]
    trainer["args"] = ["--epochs", str(epochs), "--batch-size", "8", "--step-timeout", "5"]
    trainer["env"].append({"name": contract.ENV_INJECT_RAISE, "value": "1"})
    return yaml.safe_dump(doc)


def _status(k8s: Client) -> dict[str, Any]:
    return ((k8s.get("elasticjob", "digits") or {}).get("status")) or {}


def _logs(node: RealNode, namespace: str) -> str:
    return node.logs(namespace, "trainer")


def _sidecar_metrics(node: RealNode, namespace: str) -> dict[str, str]:
    """Pod name -> its kelastic sidecar's ``/metrics`` text, fetched at the Pod's IP from
    inside the node's network."""
    out = {}
    for name, pod in pods_by_name(node.cluster.admin, namespace).items():
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            out[name] = node.http_get(f"http://{ip}:{contract.DEFAULT_HTTP_PORT}/metrics")
    return out


def _metric_sum(texts: dict[str, str], pattern: re.Pattern[str]) -> float:
    return sum(float(v) for text in texts.values() for v in pattern.findall(text))


def _hashes(logs: str, iteration: int) -> dict[int, str]:
    """Tee label (the worker's first global rank) -> its parameter hash at ``iteration``."""
    return {int(r): h for r, it, h in _HASH.findall(logs) if int(it) == iteration}


def _all(by_rank: dict[int, Any]) -> dict[int, Any] | None:
    """``by_rank`` when it has all 4 ranks, else None (for :func:`wait_until`)."""
    return by_rank if sorted(by_rank) == [0, 1, 2, 3] else None


def _restarted(status: dict[str, Any]) -> dict[str, Any] | None:
    return status if (status.get("inProcessRestarts") or 0) >= 1 else None


def test_a_raise_restarts_the_digits_job_in_process_on_kubernetes(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    api, ns = k8s, k8s.namespace
    api.kubectl("apply", "-f", "-", input=_manifest())
    wait_until(lambda: _status(api).get("worldSize") == 4, T, what="world size 4")
    wait_until(lambda: "epoch 2/" in _logs(node, ns), T, what="training")
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(api).items()}
    workers = wait_until(lambda: _all(_workers(node, ns)), T, what="4 workers")
    assert len(_hashes(_logs(node, ns), 0)) == 4

    # rank 1 raises inside the wrapped function
    raised_at = time.monotonic()
    os.kill(workers[RAISING_RANK], signal.SIGUSR1)
    new = wait_until(lambda: _all(_hashes(_logs(node, ns), 1)), T, interval=0.1,
                     what="every rank in iteration 1")  # fmt: skip
    reentered_s = time.monotonic() - raised_at
    assert len(set(new.values())) == 1, new  # every rank continues from the same state
    assert _workers(node, ns) == workers  # the same processes
    status = wait_until(lambda: _restarted(_status(api)), T, what="the restart in the status")
    last = status["lastInProcessRestart"]
    assert last["iteration"] == 1 and last["rank"] == RAISING_RANK, last
    assert last["cause"] == "exception" and "InjectedFault" in last["message"], last
    assert last["node"] in uids and last["time"], last
    sidecars = _sidecar_metrics(node, ns)
    assert _metric_sum(sidecars, _INPROCESS) >= 1, sidecars
    restart_s = [
        float(m) for text in sidecars.values()
        for m in re.findall(r"^kelastic_inprocess_restart_seconds_sum (\S+)$", text, re.M)
    ]  # fmt: skip
    events = api.kubectl("get", "events", "--field-selector", "reason=InProcessRestart",
                         "-o", "jsonpath={.items[*].message}").stdout  # fmt: skip
    assert "in-process restart 1/" in events and f"rank {RAISING_RANK}" in events, events
    operator_level = digits_operator.metrics.registry.get_sample_value(
        "kelastic_operator_restarts_total", {"level": "inprocess"}
    )
    assert operator_level == 1, operator_level
    print(f"\nraise -> every rank re-entered the function: {reentered_s:.2f}s (log poll); "
          f"sidecars' kelastic_inprocess_restart_seconds_sum: {restart_s}")  # fmt: skip

    # The job finishes; nothing was restarted but the function.
    wait_until(lambda: _status(api).get("phase") == "Succeeded", 3 * T, what="Succeeded")
    final = _status(api)
    assert (final.get("restartsSpent") or 0) == 0 and not final.get("replacements"), final
    assert final["inProcessRestarts"] == 1, final
    assert {n: p["metadata"]["uid"] for n, p in pods_by_name(api).items()} == uids
    logs = _logs(node, ns)
    accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)", logs)]
    assert accuracies and accuracies[-1] >= 0.90, logs[-2000:]
    assert "resumed from checkpoint" not in logs  # no process started again


def _pod_ranks(node: RealNode, namespace: str) -> dict[str, set[int]]:
    """Pod name -> the global ranks of its live worker processes."""
    out: dict[str, set[int]] = {}
    for name, rank, _ in worker_procs(node, namespace):
        out.setdefault(name, set()).add(rank)
    return out


def test_a_deleted_pod_keeps_the_survivors_processes_on_kubernetes(
    k8s: Client, digits_operator: OperatorContext, node: RealNode
) -> None:
    """The node-change rung on the operator's path: a Pod deleted mid-training (its
    sidecar leaves the round: an unplanned departure, a lost node) ends the round; the
    other Pod's workers are not stopped: they restart in process into the next round, and
    again when the operator's replacement Pod joins, whose workers start as processes."""
    api, ns = k8s, k8s.namespace
    # epochs enough that the two survivors (about 0.8 s an epoch) are still training when
    # the replacement's workers start: with 20 a loaded machine finished the job first (CI)
    doc = yaml.safe_load(_manifest(epochs=80))
    doc["spec"]["podReplacement"] = {"backoffSeconds": 0}
    api.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: _status(api).get("worldSize") == 4, T, what="world size 4")
    wait_until(lambda: "epoch 2/" in _logs(node, ns), T, what="training")
    workers = wait_until(lambda: _all(_workers(node, ns)), T, what="4 workers")
    by_pod = wait_until(lambda: _pod_ranks(node, ns) or None, T, what="ranks per Pod")
    victim = next(name for name, ranks in by_pod.items() if 0 not in ranks)
    kept = {r: workers[r] for r in workers if r not in by_pod[victim]}
    assert len(kept) == 2, (by_pod, workers)

    sidecar_logs = {}

    def restarted() -> dict[str, Any] | None:
        # the deleted Pod's log is kept as last read, for a failure's message
        sidecar_logs["all"] = node.logs(ns, SIDECAR_CONTAINER)
        return _restarted(_status(api))

    api.kubectl("delete", "pod", victim, "--wait=false")
    try:
        status = wait_until(restarted, 2 * T, what="the carry in the status")
    except AssertionError as exc:
        logs = "\n".join(sidecar_logs.values())
        raise AssertionError(f"{exc}: {_status(api)}\n{logs}") from None
    last = status["lastInProcessRestart"]
    assert last["cause"] == "node_lost" and victim in last["message"], last

    # the replacement joins (the survivors' next round, or a later one: a round change
    # that spends nothing) and all 4 ranks step again, in one iteration past 0
    def joined() -> dict[int, str] | None:
        logs = _logs(node, ns)
        newest = max((int(it) for _, it, _ in _HASH.findall(logs)), default=0)
        return _all(_hashes(logs, newest)) if newest >= 1 else None

    try:
        hashes = wait_until(joined, 3 * T, what="4 ranks in the iteration after the replacement")
    except AssertionError as exc:
        restarted()
        logs = "\n".join(sidecar_logs.values())
        tail = _logs(node, ns)[-3000:]
        raise AssertionError(f"{exc}: {_status(api)}\n{logs}\n{tail}") from None
    assert len(set(hashes.values())) == 1, hashes  # every rank continues from one state
    now = _workers(node, ns)
    restarted()  # the sidecars' logs, for the message
    assert {r: now.get(r) for r in kept} == kept, (now, kept, "\n".join(sidecar_logs.values()))
    wait_until(lambda: _status(api).get("phase") == "Succeeded", 4 * T, what="Succeeded")
    final = _status(api)
    assert (final.get("restartsSpent") or 0) == 0, final  # no process restart
    assert final["inProcessRestarts"] == 1, final  # the lost node; the join spent none
    logs = _logs(node, ns)
    accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)", logs)]
    assert accuracies and accuracies[-1] >= 0.90, logs[-2000:]


#: A fault of the worker of rank 1 (not rank 0's Pod's store host): the signal sent from
#: the node, and the restart's cause in the job status (``hang``: its peers' expired step
#: timers, a soft timeout, may name the restart first; the stopped rank then joins it).
WORKER_FAULTS = {
    "kill": (signal.SIGKILL, {"worker_died"}),
    "hang": (signal.SIGSTOP, {"soft_timeout", "hang"}),
}


@pytest.mark.parametrize("fault", list(WORKER_FAULTS))
def test_a_killed_or_hung_worker_alone_starts_again_on_kubernetes(
    k8s: Client, digits_operator: OperatorContext, node: RealNode, fault: str
) -> None:
    """The hybrid rung on the operator's path: rank 1's worker SIGKILLed, or stopped
    (SIGSTOP) so that its peers block on it in DDP's all-reduce until their step timers
    (5 s) expire and they leave in process, and it is killed (reaped by the timer server
    after the grace, hard - soft timeout = 10 s, or at the 40 s hard timeout). Only rank 1
    starts again as a process; ranks 0, 2 and 3 keep their processes, every rank goes on
    from one state, no Pod is replaced and no process restart is spent."""
    api, ns = k8s, k8s.namespace
    sig, causes = WORKER_FAULTS[fault]
    doc = yaml.safe_load(_manifest())
    # soft timeout over a cold respawn's start (its peers wait for it in the next
    # iteration's rendezvous), grace 10 s
    doc["spec"]["inProcess"].update({"softTimeoutSeconds": 30, "hardTimeoutSeconds": 40})
    api.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: _status(api).get("worldSize") == 4, T, what="world size 4")
    wait_until(lambda: "epoch 2/" in _logs(node, ns), T, what="training")
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(api).items()}
    workers = wait_until(lambda: _all(_workers(node, ns)), T, what="4 workers")

    faulted_at = time.monotonic()
    os.kill(workers[RAISING_RANK], sig)
    try:
        new = wait_until(lambda: _all(_hashes(_logs(node, ns), 1)), 2 * T, interval=0.1,
                         what="every rank in iteration 1")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_status(api)}\n{node.logs(ns, SIDECAR_CONTAINER)}") from None
    stepping_s = time.monotonic() - faulted_at
    assert len(set(new.values())) == 1, new  # every rank goes on from one state
    now = wait_until(lambda: _all(_workers(node, ns)), T, what="4 workers again")
    assert {r: now[r] for r in (0, 2, 3)} == {r: workers[r] for r in (0, 2, 3)}, (now, workers)
    assert now[RAISING_RANK] != workers[RAISING_RANK], now  # rank 1 alone is a new process
    status = wait_until(lambda: _restarted(_status(api)), T, what="the restart in the status")
    last = status["lastInProcessRestart"]
    assert last["iteration"] == 1 and last["cause"] in causes, last
    sidecar = node.logs(ns, SIDECAR_CONTAINER)
    assert "local rank 1 starts again as a process now, to enter iteration 1" in sidecar, sidecar
    if fault == "hang":  # one record of the hang, whoever killed it
        assert re.search(r"worker pid \d+ hung: .*(reaped by the timer server|killed by the "
                         r"sidecar)", sidecar), sidecar  # fmt: skip
    print(f"\n{fault} of rank 1 -> every rank in iteration 1: {stepping_s:.2f}s (log poll)")

    wait_until(lambda: _status(api).get("phase") == "Succeeded", 3 * T, what="Succeeded")
    final = _status(api)
    assert (final.get("restartsSpent") or 0) == 0 and not final.get("replacements"), final
    assert final["inProcessRestarts"] == 1, final
    assert {n: p["metadata"]["uid"] for n, p in pods_by_name(api).items()} == uids
    logs = _logs(node, ns)
    accuracies = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)", logs)]
    assert accuracies and accuracies[-1] >= 0.90, logs[-2000:]
