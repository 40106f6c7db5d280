"""The operator end to end on the real test cluster, with the real kubectl and a real etcd:
kopf handlers running as the operator's ServiceAccount, Pods, status, Events, scaling,
replacement, failure, success, and the finalizer that stops the Pods and then deletes the
job's etcd keys.

The Pods go to a Node no kubelet runs (:class:`~tests.k8s.nodes.ManualNode`): the tests
play its kubelet by writing the Pods' status; the real scheduler places them and the real
API server validates every write."""

from __future__ import annotations

import json
from typing import Any

import kopf
import pytest
import yaml

from kelastic import contract
from kelastic_operator.handlers import register
from kelastic_operator.job_reconciler import OperatorContext
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.cluster import Client, ControlPlane, pods_by_name, wait_until
from tests.k8s.kopf_thread import KopfThread
from tests.k8s.nodes import ManualNode

from .conftest import job_manifest, operator_client

pytestmark = pytest.mark.timeout(180)
T = 30.0  # seconds any single expectation may take


class Etcd:
    """A small etcd helper for the test (plays the sidecars' part)."""

    def __init__(self, endpoint: str) -> None:
        import pyetcd

        host, port = endpoint.rsplit(":", 1)
        self.client = pyetcd.MultiEndpointEtcd3Client(
            [pyetcd.Endpoint(host, int(port), secure=False, time_retry=1)], timeout=5, failover=True
        )

    def put(self, key: str, value: Any) -> None:
        self.client.put(key, json.dumps(value))

    def keys(self, prefix: str) -> set[str]:
        return {m.key.decode() for _, m in self.client.get_prefix(prefix)}


def job(k8s: Client, name: str = "digits") -> dict[str, Any]:
    return json.loads(k8s.kubectl("get", "ej", name, "-o", "json").stdout)


def status_of(k8s: Client, name: str = "digits") -> dict[str, Any]:
    found = k8s.get("elasticjob", name)
    return (found or {}).get("status") or {}


def uid_of(k8s: Client, pod: str) -> str | None:
    found = pods_by_name(k8s).get(pod)
    return str(found["metadata"]["uid"]) if found else None


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in st.get("conditions") or [] if c["type"] == kind)


def events(k8s: Client, name: str = "digits") -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in k8s.objects("events")
            if e["involvedObject"]["name"] == name]  # fmt: skip


def test_digits_lifecycle(
    k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd, manual_node: ManualNode
) -> None:
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(node=manual_node))
    uid = job(k8s)["metadata"]["uid"]
    prefix = contract.job_prefix(k8s.namespace, "digits", uid)
    keys = contract.Keys(prefix)
    etcd = Etcd(etcd_server.endpoint)

    # 1. two pods, built right
    wait_until(lambda: set(pods_by_name(k8s)) == {"digits-0", "digits-1"}, T, what="2 pods")
    pod = pods_by_name(k8s)["digits-0"]
    assert pod["metadata"]["labels"]["kelastic.dev/job-uid"] == uid
    assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
    sidecar = pod["spec"]["initContainers"][-1]
    assert (sidecar["name"], sidecar["restartPolicy"]) == ("kelastic-sidecar", "Always")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_ETCD_ENDPOINTS] == etcd_server.endpoint
    assert env[contract.ENV_JOB_UID] == uid
    assert pod["spec"]["containers"][0]["command"][:5] == [
        "python", "-m", "kelastic.launch", "--nproc-per-node", "2"]  # fmt: skip
    st = wait_until(lambda: status_of(k8s).get("phase") == "Pending" and status_of(k8s),
                    T, what="Pending")  # fmt: skip
    assert st["selector"] == "kelastic.dev/job-name=digits"
    assert st["replicas"] == 2 and st["observedGeneration"] == job(k8s)["metadata"]["generation"]

    # 2. the kubelet runs them; the sidecars form round 1 -> Running with world size 4
    for name in ("digits-0", "digits-1"):
        etcd.put(keys.alive(name), {"node": name})
    etcd.put(keys.rdzv_state, {"version": 1, "round": 1, "complete": True,
                               "participants": {"digits-0": 0, "digits-1": 1}})  # fmt: skip
    etcd.put(keys.restarts, {"version": 1, "count": 0, "last_round": -1, "history": []})
    manual_node.set_status(k8s.namespace, "digits-0", "Running", ready=True)
    manual_node.set_status(k8s.namespace, "digits-1", "Running", ready=True)
    st = wait_until(lambda: (s := status_of(k8s)).get("readyReplicas") == 2 and s, T,
                    what="Running")  # fmt: skip
    assert st["phase"] == "Running" and st["worldSize"] == 4 and st["round"] == 1
    assert condition(st, "RendezvousReady")["status"] == "True"
    assert condition(st, "RendezvousReady")["message"] == "round 1: world size 4"
    assert st["startTime"]
    row = k8s.kubectl("get", "ej", "digits", "--no-headers").stdout.split()
    assert row[:6] == ["digits", "Running", "2", "2", "4", "0"]
    # (the operator may see one pod running before the other: minReplicas is 1)
    wait_until(lambda: any(r == "Running" and m.startswith("Pending -> Running: ")
                           for r, m in events(k8s)), T, what="the Running event")  # fmt: skip

    # 3. kubectl scale -> a third pod
    k8s.kubectl("scale", "ej/digits", "--replicas=3")
    wait_until(lambda: "digits-2" in pods_by_name(k8s), T, what="the third pod")
    manual_node.set_status(k8s.namespace, "digits-2", "Running", ready=True)
    wait_until(lambda: status_of(k8s).get("readyReplicas") == 3, T, what="3 ready")
    assert k8s.kubectl("get", "ej", "digits", "-o",
                           "jsonpath={.status.replicas}").stdout == "3"  # fmt: skip

    # 4. kubectl delete pod -> replaced, and its node leaves rendezvous at once
    old_uid = pods_by_name(k8s)["digits-1"]["metadata"]["uid"]
    k8s.kubectl("delete", "pod", "digits-1")
    wait_until(lambda: uid_of(k8s, "digits-1") not in (None, old_uid), T,
               what="digits-1 replaced")  # fmt: skip
    wait_until(lambda: keys.alive("digits-1") not in etcd.keys(prefix), T,
               what="digits-1's alive key removed")  # fmt: skip
    assert keys.alive("digits-0") in etcd.keys(prefix)
    assert status_of(k8s).get("replacements", 0) == 0  # a deletion spends no budget
    manual_node.set_status(k8s.namespace, "digits-1", "Running", ready=True)
    etcd.put(keys.restarts, {"version": 1, "count": 1, "last_round": 1, "history": []})
    wait_until(lambda: status_of(k8s).get("restartsSpent") == 1, T, what="restarts shown")

    # 5. scale down: highest index first, its node dropped
    etcd.put(keys.alive("digits-2"), {"node": "digits-2"})
    k8s.kubectl("scale", "ej/digits", "--replicas=2")
    wait_until(lambda: set(pods_by_name(k8s)) == {"digits-0", "digits-1"}, T, what="digits-2 gone")
    wait_until(lambda: keys.alive("digits-2") not in etcd.keys(prefix), T, what="node dropped")

    # 6. all pods succeed -> Succeeded
    for name in ("digits-0", "digits-1"):
        manual_node.set_status(k8s.namespace, name, "Succeeded", exit_code=0, message="succeeded")
    st = wait_until(lambda: (s := status_of(k8s)).get("phase") == "Succeeded" and s, T,
                    what="Succeeded")  # fmt: skip
    assert condition(st, "Complete")["status"] == "True"
    assert condition(st, "RendezvousReady")["status"] == "False"
    assert st["completionTime"]
    assert set(pods_by_name(k8s)) == {"digits-0", "digits-1"}  # cleanupPolicy Running keeps them

    # 7. kubectl delete ej -> pods and etcd keys gone
    assert etcd.keys(prefix)
    k8s.kubectl("delete", "ej", "digits", "--wait=false")
    wait_until(lambda: not k8s.objects("elasticjobs"), T, what="the job gone")
    wait_until(lambda: not pods_by_name(k8s), T, what="its pods gone")
    wait_until(lambda: not etcd.keys(prefix), T, what="its etcd keys gone")

    # the operator's /metrics saw it all
    sample = operator.metrics.registry.get_sample_value
    assert (sample("kelastic_operator_pods_created_total") or 0) >= 4
    assert (sample("kelastic_operator_pods_deleted_total") or 0) >= 1
    assert (sample("kelastic_operator_rendezvous_nodes_removed_total") or 0) >= 2


def test_what_the_sidecars_write_to_etcd_reaches_the_status_without_a_resync(
    k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd, manual_node: ManualNode
) -> None:
    """Nothing in Kubernetes changes when a round completes or a restart is spent: only
    etcd does. With the operator's 30 s resync (the chart's default) the status showed it
    up to 30 s late, or never for a short job (the chart e2e test timed out on world size
    4 while the job succeeded); the status watch shows it within seconds."""
    assert operator.resync_seconds >= 30
    manifest = job_manifest("quiet", manual_node, replicas=1, minReplicas=1)
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: "quiet-0" in pods_by_name(k8s), T, what="quiet-0")
    manual_node.set_status(k8s.namespace, "quiet-0", "Running", ready=True)
    wait_until(lambda: status_of(k8s, "quiet").get("phase") == "Running", T, what="Running")
    keys = contract.Keys(
        contract.job_prefix(k8s.namespace, "quiet", job(k8s, "quiet")["metadata"]["uid"])
    )
    etcd = Etcd(etcd_server.endpoint)
    soon = 10.0  # well under the resync: only a wake-up by the watch can meet it
    etcd.put(keys.rdzv_state, {"version": 1, "round": 3, "complete": True,
                               "participants": {"quiet-0": 0}})  # fmt: skip
    wait_until(lambda: status_of(k8s, "quiet").get("round") == 3, soon, what="round 3 shown")
    assert status_of(k8s, "quiet")["worldSize"] == 2
    etcd.put(keys.restarts, {"version": 1, "count": 2, "last_round": 2, "history": []})
    wait_until(lambda: status_of(k8s, "quiet").get("restartsSpent") == 2, soon,
               what="2 restarts shown")  # fmt: skip


def test_failed_pods_are_replaced_then_the_job_fails_with_the_root_cause(
    k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    k8s.claim("digits-checkpoints")
    manifest = job_manifest("flaky", manual_node, replicas=1, minReplicas=1,
                            podReplacement={"maxReplacements": 1, "backoffSeconds": 0})  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: "flaky-0" in pods_by_name(k8s), T, what="flaky-0")
    manual_node.set_status(k8s.namespace, "flaky-0", "Running", ready=True)
    wait_until(lambda: status_of(k8s, "flaky").get("phase") == "Running", T, what="Running")

    first_uid = pods_by_name(k8s)["flaky-0"]["metadata"]["uid"]
    manual_node.set_status(k8s.namespace, "flaky-0", "Failed", exit_code=137,
                           message="kelastic launcher: received SIGKILL")  # fmt: skip
    wait_until(lambda: uid_of(k8s, "flaky-0") not in (None, first_uid), T,
               what="the failed pod replaced")  # fmt: skip
    st = wait_until(lambda: (s := status_of(k8s, "flaky")).get("replacements") == 1 and s, T,
                    what="one replacement spent")  # fmt: skip
    assert st["lastFailure"]["pod"] == "flaky-0" and st["lastFailure"]["signal"] == 9
    assert any(r == "PodFailed" for r, _ in events(k8s, "flaky"))

    cause = "job failed after 3 restarts (budget spent); root cause: worker: rank 1 on flaky-0"
    manual_node.set_status(k8s.namespace, "flaky-0", "Running", ready=True)
    manual_node.set_status(k8s.namespace, "flaky-0", "Failed", exit_code=1, message=cause)
    st = wait_until(lambda: (s := status_of(k8s, "flaky")).get("phase") == "Failed" and s, T,
                    what="Failed")  # fmt: skip
    failed = condition(st, "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == ("True", "JobFailed", cause)
    assert st["lastFailure"]["rank"] == 1
    row = k8s.kubectl("get", "ej", "flaky", "--no-headers").stdout.split()
    assert row[1] == "Failed" and "JobFailed" in row, row  # the REASON column
    wide = k8s.kubectl("get", "ej", "flaky", "-o", "wide").stdout
    assert "MESSAGE" in wide and "root cause: worker: rank 1 on flaky-0" in wide
    wait_until(lambda: any(r == "Failed" and cause in m for r, m in events(k8s, "flaky")), T,
               what="the Failed event")  # fmt: skip


def test_a_failing_status_write_delays_replacements_and_loses_none(
    k8s_cluster: ControlPlane, k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    """Status first: while the API server refuses the operator's status writes, no failed
    Pod is replaced (the accounting could not be stored); once writes pass again, every
    replacement is counted and the budget holds. A ValidatingAdmissionPolicy refuses the
    writes while the job carries a label, as an overloaded or failing API server would."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"deny-status-{k8s.namespace}"[:63]},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["kelastic.dev"], "apiVersions": ["*"], "operations": ["UPDATE"],
                "resources": ["elasticjobs/status"]}]},
            "validations": [{"expression": "!has(oldObject.metadata.labels) || "
                             "!('deny-status' in oldObject.metadata.labels)",
                             "message": "status writes refused (test)"}],
        },
    }  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy["metadata"]["name"]},
        "spec": {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": k8s.namespace}}}},
    }  # fmt: skip
    k8s_cluster.admin.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [policy, binding]}))  # fmt: skip
    k8s.claim("digits-checkpoints")
    manifest = job_manifest("flaky", manual_node, replicas=2, minReplicas=1,
                            podReplacement={"maxReplacements": 2, "backoffSeconds": 0})  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: len(pods_by_name(k8s)) == 2, T, what="2 pods")
    for name in ("flaky-0", "flaky-1"):
        manual_node.set_status(k8s.namespace, name, "Running", ready=True)
    wait_until(lambda: status_of(k8s, "flaky").get("readyReplicas") == 2, T, what="running")

    k8s.kubectl("label", "ej", "flaky", "deny-status=1")

    def denied() -> bool:
        result = k8s.kubectl("patch", "ej", "flaky", "--subresource=status", "--type=merge",
                             "-p", '{"status":{}}', check=False)  # fmt: skip
        return "status writes refused" in result.stderr

    wait_until(denied, T, what="the policy to refuse status writes")
    uids = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
    for name in ("flaky-0", "flaky-1"):
        manual_node.set_status(k8s.namespace, name, "Failed", exit_code=1, message="boom")
    # the operator keeps trying and failing to write; nothing may be replaced meanwhile
    wait_until(lambda: (operator.metrics.registry.get_sample_value(
        "kelastic_operator_reconciles_total", {"outcome": "error"}) or 0) >= 3, T,
        what="refused status writes")  # fmt: skip
    assert {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()} == uids
    assert not any(r == "ReplacingPod" for r, _ in events(k8s, "flaky"))

    k8s.kubectl("label", "ej", "flaky", "deny-status-")
    st = wait_until(lambda: (s := status_of(k8s, "flaky")).get("replacements") == 2 and s, T,
                    what="both replacements counted")  # fmt: skip
    assert st["phase"] != "Failed"
    wait_until(lambda: all(p["metadata"]["uid"] not in uids.values()
                           for p in pods_by_name(k8s).values()) and len(pods_by_name(k8s)) == 2,
               T, what="both pods replaced")  # fmt: skip
    # the budget (2) is spent: the next failure fails the job
    manual_node.set_status(k8s.namespace, "flaky-0", "Failed", exit_code=1, message="again")
    st = wait_until(lambda: (s := status_of(k8s, "flaky")).get("phase") == "Failed" and s, T,
                    what="Failed once the budget is spent")  # fmt: skip
    assert condition(st, "Failed")["reason"] == "ReplacementBudgetSpent"
    assert st["replacements"] == 2
    kinds = "validatingadmissionpolicybinding,validatingadmissionpolicy"
    k8s_cluster.admin.kubectl("delete", kinds, policy["metadata"]["name"], check=False)


def test_a_spec_an_older_crd_allows_but_the_model_rejects_fails_clearly(
    k8s: Client, operator: OperatorContext, etcd_server: EmbeddedEtcd
) -> None:
    """Defence in depth: a spec the CRD would let through but the model rejects fails the
    job with the model's message instead of building broken Pods. (The CRD is cluster-wide
    and shared by the tests, so it is not weakened here: the operator's validation is fed
    the spec of a job the CRD accepts, through a pass of the reconciler itself.)"""
    from kelastic_operator.job_reconciler import JobReconciler

    doc = yaml.safe_load(job_manifest("nocmd"))
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    reconciler = JobReconciler(operator, k8s.namespace, "nocmd")
    obj = reconciler._get_job()
    assert obj is not None
    del obj["spec"]["template"]["spec"]["containers"][0]["command"]
    reconciler._get_job = lambda: obj  # type: ignore[method-assign]
    reconciler.reconcile_once()
    st = wait_until(lambda: (s := status_of(k8s, "nocmd")).get("phase") == "Failed" and s, T,
                    what="Failed")  # fmt: skip
    failed = condition(st, "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "invalid spec: spec: container 'trainer' needs a command" in failed["message"]


def test_an_unreachable_etcd_does_not_block_deleting_the_job(
    k8s_cluster: ControlPlane, k8s: Client, manual_node: ManualNode
) -> None:
    """The finalizer retries the etcd cleanup a few times, then lets the job go."""
    dead = f"127.0.0.1:{free_port()}"
    client = operator_client(k8s_cluster, k8s.namespace)
    api = client.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(etcd_endpoints=(dead,)),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=0.5, time_retry=0.2)),
        resync_seconds=0.5,
        finalizer_retries=2,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    k8s.claim("digits-checkpoints")
    with KopfThread(client, registry):
        k8s.kubectl("apply", "-f", "-", input=job_manifest(node=manual_node))
        wait_until(lambda: len(pods_by_name(k8s)) == 2, T, what="pods despite etcd being down")
        wait_until(lambda: job(k8s)["metadata"].get("finalizers"), T, what="the finalizer")
        k8s.kubectl("delete", "ej", "digits", "--wait=false")
        wait_until(lambda: not k8s.objects("elasticjobs"), 60, what="the job gone")
        assert not pods_by_name(k8s)  # its Pods went first
    ctx.stores.close()
    api.close()


def test_only_unschedulable_pods_shrink_the_job_and_it_grows_back(
    k8s_cluster: ControlPlane, k8s: Client, operator: OperatorContext
) -> None:
    """The real scheduler decides: a Node with room for 2 Pods leaves the third
    Unschedulable; that one shrinks the job after pendingTimeoutSeconds. The two placed Pods
    stay Pending too (nothing runs them: as if pulling their image) and are left alone."""
    with ManualNode(k8s_cluster, f"small-{k8s.namespace}"[:60], pods=2) as small:
        k8s.claim("digits-checkpoints")
        manifest = job_manifest("elastic", small, replicas=3, minReplicas=1,
                                pendingTimeoutSeconds=3)  # fmt: skip
        k8s.kubectl("apply", "-f", "-", input=manifest)
        wait_until(lambda: len(pods_by_name(k8s)) == 3, T, what="3 pods")

        def unschedulable() -> list[str]:
            return [n for n, p in pods_by_name(k8s).items()
                    if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                           for c in (p.get("status") or {}).get("conditions") or [])]  # fmt: skip

        (stuck,) = wait_until(unschedulable, T, what="one pod unschedulable")
        placed = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items() if n != stuck}
        st = wait_until(lambda: (s := status_of(k8s, "elastic")).get("targetReplicas") == 2 and s,
                        T, what="the shrink")  # fmt: skip
        wait_until(lambda: stuck not in pods_by_name(k8s), T, what="the stuck pod deleted")
        assert any(r == "Shrinking" and stuck in m for r, m in events(k8s, "elastic"))
        # the placed Pods, still Pending (starting), were not touched
        assert {n: pods_by_name(k8s)[n]["metadata"]["uid"] for n in placed} == placed
        assert all(pods_by_name(k8s)[n]["status"]["phase"] == "Pending" for n in placed)
        # one timeout later it tries the full size again
        wait_until(lambda: stuck in pods_by_name(k8s), T, what="the pod re-created (grow back)")
        assert status_of(k8s, "elastic")["targetReplicas"] == 3
        assert any(r == "GrowingBack" for r, _ in events(k8s, "elastic"))
        assert st["phase"] == "Pending"
        k8s.kubectl("delete", "ej", "elastic", "--wait=false")
        wait_until(lambda: not pods_by_name(k8s), T, what="its pods gone")


def test_a_template_change_replaces_the_pods_without_spending_restarts(
    k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    k8s.claim("digits-checkpoints")
    doc = yaml.safe_load(job_manifest("roll", manual_node))
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: set(pods_by_name(k8s)) == {"roll-0", "roll-1"}, T, what="2 pods")
    first = {n: p["metadata"]["uid"] for n, p in pods_by_name(k8s).items()}
    hashes = {p["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"]
              for p in pods_by_name(k8s).values()}  # fmt: skip
    for name in first:
        manual_node.set_status(k8s.namespace, name, "Running", ready=True)
    wait_until(lambda: status_of(k8s, "roll").get("readyReplicas") == 2, T, what="running")

    # kubectl scale is not a spec change of the Pods: nothing is replaced
    k8s.kubectl("scale", "ej/roll", "--replicas=3")
    wait_until(lambda: "roll-2" in pods_by_name(k8s), T, what="the third pod")
    assert {n: pods_by_name(k8s)[n]["metadata"]["uid"] for n in first} == first

    # a new env var in the trainer: every Pod is replaced, built from the new template
    trainer = doc["spec"]["template"]["spec"]["containers"][0]
    trainer.setdefault("env", []).append({"name": "LEARNING_RATE", "value": "0.5"})
    doc["spec"]["replicas"] = 3
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def replaced() -> bool:
        now = pods_by_name(k8s)
        return set(now) == {"roll-0", "roll-1", "roll-2"} and all(
            now[n]["metadata"]["uid"] != uid for n, uid in first.items()
        ) and all(p["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"] not in hashes
                  for p in now.values())  # fmt: skip

    wait_until(replaced, T, what="pods rebuilt from the new template")
    env = pods_by_name(k8s)["roll-0"]["spec"]["containers"][0]["env"]
    assert {"name": "LEARNING_RATE", "value": "0.5"} in env
    assert any(r == "UpdatingPods" for r, _ in events(k8s, "roll"))
    assert status_of(k8s, "roll").get("replacements", 0) == 0
    k8s.kubectl("delete", "ej", "roll", "--wait=false")
    wait_until(lambda: not pods_by_name(k8s), T, what="its pods gone")


def test_a_restricted_namespace_runs_the_digits_job_with_a_non_root_sidecar(
    k8s: Client, operator: OperatorContext, manual_node: ManualNode
) -> None:
    """Pod Security ``restricted`` admits the digits example's Pods: the sidecar runs as
    the trainer's non-root user with no capability and the RuntimeDefault seccomp profile.
    A template that names no user gets a root sidecar with CAP_KILL, which the namespace
    refuses: the job says so in a FailedCreate Event instead of failing silently."""
    k8s.kubectl("label", "namespace", k8s.namespace,
                "pod-security.kubernetes.io/enforce=restricted")  # fmt: skip
    k8s.claim("digits-checkpoints")
    k8s.kubectl("apply", "-f", "-", input=job_manifest(node=manual_node))
    wait_until(lambda: len(pods_by_name(k8s)) == 2, T, what="both pods admitted")
    sidecar = pods_by_name(k8s)["digits-0"]["spec"]["initContainers"][-1]["securityContext"]
    assert (sidecar["runAsUser"], sidecar["runAsNonRoot"]) == (1000, True)
    assert sidecar["capabilities"] == {"drop": ["ALL"]}

    doc = yaml.safe_load(job_manifest("rooty", manual_node))
    pod_spec = doc["spec"]["template"]["spec"]
    del pod_spec["securityContext"], pod_spec["containers"][0]["securityContext"]
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: any(r == "FailedCreate" and 'violates PodSecurity "restricted' in m
                           for r, m in events(k8s, "rooty")), T,
               what="the refusal reported")  # fmt: skip
    assert not [n for n in pods_by_name(k8s) if n.startswith("rooty-")]
