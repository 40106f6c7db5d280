"""The operator end to end on the Kubernetes API emulator, with the real kubectl and a real
etcd: kopf handlers, the official client, Pods, status, Events, scaling, replacement,
failure, success, and the finalizer that deletes the job's etcd keys.

The emulator runs no kubelet: tests play it by patching Pod statuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kelastic import contract
from kelastic_operator import crd
from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.harness import K8sApi, KopfThread, wait_until

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples/digits/elasticjob.yaml"
pytestmark = pytest.mark.timeout(180)
T = 20.0  # seconds any single expectation may take


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


@pytest.fixture
def operator(k8s_api: K8sApi, etcd_server: EmbeddedEtcd) -> Iterator[OperatorContext]:
    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    registry = kopf.OperatorRegistry()
    api = k8s_api.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(
            sidecar_image="kelastic:test", etcd_endpoints=(etcd_server.endpoint,)
        ),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=3, time_retry=0.5)),
        resync_seconds=0.5,
    )
    register(registry, ctx)
    with KopfThread(k8s_api, registry):
        yield ctx
    ctx.stores.close()
    api.close()


def job(k8s_api: K8sApi, name: str = "digits") -> dict[str, Any]:
    return json.loads(k8s_api.kubectl("get", "ej", name, "-o", "json").stdout)


def status_of(k8s_api: K8sApi, name: str = "digits") -> dict[str, Any]:
    return job(k8s_api, name).get("status") or {}


def pods(k8s_api: K8sApi) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in k8s_api.objects("Pod", "default")}


def set_pod_status(k8s_api: K8sApi, name: str, phase: str, ready: bool = False,
                   exit_code: int | None = None, message: str = "") -> None:  # fmt: skip
    """Play the kubelet: write a Pod's status."""
    status: dict[str, Any] = {
        "phase": phase,
        "podIP": f"10.0.0.{int(name.rsplit('-', 1)[1]) + 1}",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if exit_code is not None:
        status["containerStatuses"] = [{
            "name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
            "state": {"terminated": {"exitCode": exit_code, "message": message,
                                     "reason": "Completed" if exit_code == 0 else "Error",
                                     "finishedAt": "2026-01-01T00:00:00Z"}},
        }]  # fmt: skip
    code, body = k8s_api.request(
        "PATCH", f"/api/v1/namespaces/default/pods/{name}/status", {"status": status},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    assert code == 200, body


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in st.get("conditions") or [] if c["type"] == kind)


def events(k8s_api: K8sApi, name: str = "digits") -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in k8s_api.objects("Event", "default")
            if e["involvedObject"]["name"] == name]  # fmt: skip


def test_digits_lifecycle(
    k8s_api: K8sApi, operator: OperatorContext, etcd_server: EmbeddedEtcd
) -> None:
    k8s_api.kubectl("apply", "-f", str(DIGITS))
    uid = job(k8s_api)["metadata"]["uid"]
    prefix = contract.job_prefix("default", "digits", uid)
    keys = contract.Keys(prefix)
    etcd = Etcd(etcd_server.endpoint)

    # 1. two pods, built right
    wait_until(lambda: set(pods(k8s_api)) == {"digits-0", "digits-1"}, T, what="2 pods")
    pod = pods(k8s_api)["digits-0"]
    assert pod["metadata"]["labels"]["kelastic.dev/job-uid"] == uid
    assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
    sidecar = pod["spec"]["initContainers"][-1]
    assert (sidecar["name"], sidecar["restartPolicy"]) == ("kelastic-sidecar", "Always")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_ETCD_ENDPOINTS] == etcd_server.endpoint
    assert env[contract.ENV_JOB_UID] == uid
    assert pod["spec"]["containers"][0]["command"][:5] == [
        "python", "-m", "kelastic.launch", "--nproc-per-node", "2"]  # fmt: skip
    st = wait_until(lambda: status_of(k8s_api).get("phase") == "Pending" and status_of(k8s_api),
                    T, what="Pending")  # fmt: skip
    assert st["selector"] == "kelastic.dev/job-name=digits"
    assert (
        st["replicas"] == 2 and st["observedGeneration"] == job(k8s_api)["metadata"]["generation"]
    )

    # 2. the kubelet runs them; the sidecars form round 1 -> Running with world size 4
    for name in ("digits-0", "digits-1"):
        etcd.put(keys.alive(name), {"node": name})
    etcd.put(keys.rdzv_state, {"version": 1, "round": 1, "complete": True,
                               "participants": {"digits-0": 0, "digits-1": 1}})  # fmt: skip
    etcd.put(keys.restarts, {"version": 1, "count": 0, "last_round": -1, "history": []})
    set_pod_status(k8s_api, "digits-0", "Running", ready=True)
    set_pod_status(k8s_api, "digits-1", "Running", ready=True)
    st = wait_until(lambda: (s := status_of(k8s_api)).get("readyReplicas") == 2 and s, T,
                    what="Running")  # fmt: skip
    assert st["phase"] == "Running" and st["worldSize"] == 4 and st["round"] == 1
    assert condition(st, "Running")["status"] == "True"
    assert st["startTime"]
    row = k8s_api.kubectl("get", "ej", "digits", "--no-headers").stdout.split()
    assert row[:6] == ["digits", "Running", "2", "2", "4", "0"]
    # (the operator may see one pod running before the other: minReplicas is 1)
    wait_until(lambda: any(r == "Running" and m.startswith("Pending -> Running: ")
                           for r, m in events(k8s_api)), T, what="the Running event")  # fmt: skip

    # 3. kubectl scale -> a third pod
    k8s_api.kubectl("scale", "ej/digits", "--replicas=3")
    wait_until(lambda: "digits-2" in pods(k8s_api), T, what="the third pod")
    set_pod_status(k8s_api, "digits-2", "Running", ready=True)
    wait_until(lambda: status_of(k8s_api).get("readyReplicas") == 3, T, what="3 ready")
    assert k8s_api.kubectl("get", "ej", "digits", "-o",
                           "jsonpath={.status.replicas}").stdout == "3"  # fmt: skip

    # 4. kubectl delete pod -> replaced, and its node leaves rendezvous at once
    old_uid = pods(k8s_api)["digits-1"]["metadata"]["uid"]
    k8s_api.kubectl("delete", "pod", "digits-1")
    wait_until(lambda: (p := pods(k8s_api).get("digits-1")) and p["metadata"]["uid"] != old_uid,
               T, what="digits-1 replaced")  # fmt: skip
    wait_until(lambda: keys.alive("digits-1") not in etcd.keys(prefix), T,
               what="digits-1's alive key removed")  # fmt: skip
    assert keys.alive("digits-0") in etcd.keys(prefix)
    assert status_of(k8s_api).get("replacements", 0) == 0  # a deletion spends no budget
    set_pod_status(k8s_api, "digits-1", "Running", ready=True)
    etcd.put(keys.restarts, {"version": 1, "count": 1, "last_round": 1, "history": []})
    wait_until(lambda: status_of(k8s_api).get("restartsSpent") == 1, T, what="restarts shown")

    # 5. scale down: highest index first, its node dropped
    etcd.put(keys.alive("digits-2"), {"node": "digits-2"})
    k8s_api.kubectl("scale", "ej/digits", "--replicas=2")
    wait_until(lambda: set(pods(k8s_api)) == {"digits-0", "digits-1"}, T, what="digits-2 gone")
    wait_until(lambda: keys.alive("digits-2") not in etcd.keys(prefix), T, what="node dropped")

    # 6. all pods succeed -> Succeeded
    for name in ("digits-0", "digits-1"):
        set_pod_status(k8s_api, name, "Succeeded", exit_code=0, message="succeeded")
    st = wait_until(lambda: (s := status_of(k8s_api)).get("phase") == "Succeeded" and s, T,
                    what="Succeeded")  # fmt: skip
    assert condition(st, "Succeeded")["status"] == "True"
    assert condition(st, "Running")["status"] == "False"
    assert st["completionTime"]
    assert set(pods(k8s_api)) == {"digits-0", "digits-1"}  # cleanupPolicy Running keeps them

    # 7. kubectl delete ej -> pods and etcd keys gone
    assert etcd.keys(prefix)
    k8s_api.kubectl("delete", "ej", "digits", "--wait=false")
    wait_until(lambda: not k8s_api.objects("ElasticJob", "default"), T, what="the job gone")
    wait_until(lambda: not pods(k8s_api), T, what="its pods gone")
    wait_until(lambda: not etcd.keys(prefix), T, what="its etcd keys gone")

    # the operator's /metrics saw it all
    sample = operator.metrics.registry.get_sample_value
    assert (sample("kelastic_operator_pods_created_total") or 0) >= 4
    assert (sample("kelastic_operator_pods_deleted_total") or 0) >= 1
    assert (sample("kelastic_operator_rendezvous_nodes_removed_total") or 0) >= 2


def failing_job(name: str, **spec: Any) -> str:
    doc = yaml.safe_load(DIGITS.read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


def test_failed_pods_are_replaced_then_the_job_fails_with_the_root_cause(
    k8s_api: K8sApi, operator: OperatorContext
) -> None:
    manifest = failing_job("flaky", replicas=1, minReplicas=1,
                           podReplacement={"maxReplacements": 1, "backoffSeconds": 0})  # fmt: skip
    k8s_api.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: "flaky-0" in pods(k8s_api), T, what="flaky-0")
    set_pod_status(k8s_api, "flaky-0", "Running", ready=True)
    wait_until(lambda: status_of(k8s_api, "flaky").get("phase") == "Running", T, what="Running")

    first_uid = pods(k8s_api)["flaky-0"]["metadata"]["uid"]
    set_pod_status(k8s_api, "flaky-0", "Failed", exit_code=137,
                   message="kelastic launcher: received SIGKILL")  # fmt: skip
    wait_until(lambda: (p := pods(k8s_api).get("flaky-0")) and p["metadata"]["uid"] != first_uid,
               T, what="the failed pod replaced")  # fmt: skip
    st = wait_until(lambda: (s := status_of(k8s_api, "flaky")).get("replacements") == 1 and s, T,
                    what="one replacement spent")  # fmt: skip
    assert st["lastFailure"]["pod"] == "flaky-0" and st["lastFailure"]["signal"] == 9
    assert any(r == "PodFailed" for r, _ in events(k8s_api, "flaky"))

    cause = "job failed after 3 restarts (budget spent); root cause: worker: rank 1 on flaky-0"
    set_pod_status(k8s_api, "flaky-0", "Running", ready=True)
    set_pod_status(k8s_api, "flaky-0", "Failed", exit_code=1, message=cause)
    st = wait_until(lambda: (s := status_of(k8s_api, "flaky")).get("phase") == "Failed" and s, T,
                    what="Failed")  # fmt: skip
    failed = condition(st, "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == ("True", "JobFailed", cause)
    assert st["lastFailure"]["rank"] == 1
    row = k8s_api.kubectl("get", "ej", "flaky", "--no-headers").stdout.split()
    assert row[1] == "Failed"
    wait_until(lambda: any(r == "Failed" and cause in m for r, m in events(k8s_api, "flaky")), T,
               what="the Failed event")  # fmt: skip


def test_a_spec_an_older_crd_allows_but_the_model_rejects_fails_clearly(
    k8s_api: K8sApi, operator: OperatorContext
) -> None:
    """Defence in depth: with a CRD lacking today's template rules, the operator itself
    fails the job with the model's message instead of building broken Pods."""
    older = crd.crd()
    schema = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    del schema["properties"]["spec"]["properties"]["template"]["properties"]["spec"][
        "x-kubernetes-validations"
    ]
    k8s_api.kubectl("apply", "-f", "-", input=yaml.safe_dump(older))
    doc = yaml.safe_load(DIGITS.read_text())
    doc["metadata"]["name"] = "nocmd"
    del doc["spec"]["template"]["spec"]["containers"][0]["command"]
    k8s_api.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    st = wait_until(lambda: (s := status_of(k8s_api, "nocmd")).get("phase") == "Failed" and s, T,
                    what="Failed")  # fmt: skip
    failed = condition(st, "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "invalid spec: spec: container 'trainer' needs a command" in failed["message"]
    assert not pods(k8s_api)


def test_an_unreachable_etcd_does_not_block_deleting_the_job(k8s_api: K8sApi) -> None:
    """The finalizer retries the etcd cleanup a few times, then lets the job go."""
    from kelastic_operator.local.etcd import free_port

    k8s_api.kubectl("apply", "-f", str(ROOT / crd.CRD_FILE))
    dead = f"127.0.0.1:{free_port()}"
    api = k8s_api.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(etcd_endpoints=(dead,)),
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, timeout=0.5, time_retry=0.2)),
        resync_seconds=0.5,
        finalizer_retries=2,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    with KopfThread(k8s_api, registry):
        k8s_api.kubectl("apply", "-f", str(DIGITS))
        wait_until(lambda: len(pods(k8s_api)) == 2, T, what="pods despite etcd being down")
        wait_until(lambda: job(k8s_api)["metadata"].get("finalizers"), T, what="the finalizer")
        k8s_api.kubectl("delete", "ej", "digits", "--wait=false")
        wait_until(lambda: not k8s_api.objects("ElasticJob", "default"), 30, what="the job gone")
    ctx.stores.close()
    api.close()


def test_pods_stuck_pending_shrink_the_job_and_it_grows_back(
    k8s_api: K8sApi, operator: OperatorContext
) -> None:
    manifest = failing_job("elastic", replicas=3, minReplicas=1, pendingTimeoutSeconds=3)
    k8s_api.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: len(pods(k8s_api)) == 3, T, what="3 pods")
    first = pods(k8s_api)["elastic-2"]["metadata"]["uid"]
    for name in ("elastic-0", "elastic-1"):  # elastic-2 never gets scheduled
        set_pod_status(k8s_api, name, "Running", ready=True)
    st = wait_until(lambda: (s := status_of(k8s_api, "elastic")).get("targetReplicas") == 2 and s,
                    T, what="the shrink")  # fmt: skip
    assert st["phase"] == "Running"
    wait_until(lambda: "elastic-2" not in pods(k8s_api), T, what="the stuck pod deleted")
    assert any(r == "Shrinking" and "elastic-2" in m for r, m in events(k8s_api, "elastic"))
    # one timeout later it tries the full size again
    wait_until(lambda: (p := pods(k8s_api).get("elastic-2")) and p["metadata"]["uid"] != first,
               T, what="the pod re-created when growing back")  # fmt: skip
    assert status_of(k8s_api, "elastic")["targetReplicas"] == 3
    assert any(r == "GrowingBack" for r, _ in events(k8s_api, "elastic"))


def test_a_template_change_replaces_the_pods_without_spending_restarts(
    k8s_api: K8sApi, operator: OperatorContext, etcd_server: EmbeddedEtcd
) -> None:
    doc = yaml.safe_load(failing_job("roll"))
    k8s_api.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: set(pods(k8s_api)) == {"roll-0", "roll-1"}, T, what="2 pods")
    first = {n: p["metadata"]["uid"] for n, p in pods(k8s_api).items()}
    hashes = {p["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"]
              for p in pods(k8s_api).values()}  # fmt: skip
    for name in first:
        set_pod_status(k8s_api, name, "Running", ready=True)
    wait_until(lambda: status_of(k8s_api, "roll").get("readyReplicas") == 2, T, what="running")

    # kubectl scale is not a spec change of the Pods: nothing is replaced
    k8s_api.kubectl("scale", "ej/roll", "--replicas=3")
    wait_until(lambda: "roll-2" in pods(k8s_api), T, what="the third pod")
    assert {n: pods(k8s_api)[n]["metadata"]["uid"] for n in first} == first

    # a new env var in the trainer: every Pod is replaced, built from the new template
    trainer = doc["spec"]["template"]["spec"]["containers"][0]
    trainer.setdefault("env", []).append({"name": "LEARNING_RATE", "value": "0.5"})
    doc["spec"]["replicas"] = 3
    k8s_api.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def replaced() -> bool:
        now = pods(k8s_api)
        return set(now) == {"roll-0", "roll-1", "roll-2"} and all(
            now[n]["metadata"]["uid"] != uid for n, uid in first.items()
        ) and all(p["metadata"]["annotations"]["kelastic.dev/pod-spec-hash"] not in hashes
                  for p in now.values())  # fmt: skip

    wait_until(replaced, T, what="pods rebuilt from the new template")
    env = pods(k8s_api)["roll-0"]["spec"]["containers"][0]["env"]
    assert {"name": "LEARNING_RATE", "value": "0.5"} in env
    assert any(r == "UpdatingPods" for r, _ in events(k8s_api, "roll"))
    assert status_of(k8s_api, "roll").get("replacements", 0) == 0
    k8s_api.kubectl("delete", "ej", "roll", "--wait=false")
    wait_until(lambda: not pods(k8s_api), T, what="its pods gone")
