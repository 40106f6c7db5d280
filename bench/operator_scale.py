"""Operator scale: many ElasticJobs through the real API server, their Pods on kwok Nodes.

The real control plane of the tests (``tests/k8s/cluster.py``: etcd, kube-apiserver,
controller-manager, scheduler, built by ``scripts/build-k8s.sh``) plus ``kwok``, which
plays the kubelet of fake Nodes (Pods go Running at once, no process). The operator runs
as a process, ``python -m kelastic_operator``, logged in as its ServiceAccount with the
RBAC of ``deploy/``, the API server auditing that account's every request.

Measured: ``kubectl apply`` of J jobs x R replicas -> every Pod created (seconds);
reconcile duration (the operator's histogram, p50/p99 by interpolation as Prometheus'
``histogram_quantile`` does); the operator's RSS and CPU; the API requests it sends per
idle job per minute once everything runs (from the audit log); then ``kubectl delete`` of
every job -> nothing left in the API or in etcd. No torch baseline: torch has no operator.

The floor, in the same run before the jobs: the API server's own create throughput for
Pods like the operator's, from 16 parallel clients (:func:`_floor`), as the time it would
take for every Pod of the jobs; the ratio says how close the operator comes to it.

Targets: all Pods within 60 s and within 1.5x of the floor; operator RSS <= 300 MB; idle
jobs cost ~0 requests (no polling).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .common import REPO, CaseResult, Check, Row, child_env, embedded_etcd, log, stop_process

OPERATOR_USER = "system:serviceaccount:kelastic-system:kelastic-operator"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STAGES = REPO / "bench" / "kwok-stages.yaml"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def histogram_quantile(text: str, name: str, q: float) -> float:
    """``histogram_quantile(q, name)`` over one scrape's cumulative buckets (seconds)."""
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


def _nodes(count: int, pods_each: int) -> dict[str, Any]:
    items = [{"apiVersion": "v1", "kind": "Node",
              "metadata": {"name": f"kwok-{i}", "annotations": {KWOK_ANNOTATION: "fake"},
                           "labels": {"type": "kwok", "kubernetes.io/hostname": f"kwok-{i}"}},
              "spec": {"taints": [KWOK_TAINT]},
              "status": {"allocatable": {"cpu": "1000", "memory": "4Ti", "pods": str(pods_each)},
                         "capacity": {"cpu": "1000", "memory": "4Ti", "pods": str(pods_each)}}}
             for i in range(count)]  # fmt: skip
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _jobs(namespace: str, jobs: int, replicas: int) -> dict[str, Any]:
    template = {
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "tolerations": [{"key": KWOK_TAINT["key"], "operator": "Exists"}],
            "containers": [{"name": "trainer", "image": "fake/trainer",
                            "command": ["python", "train.py"]}],
        }
    }  # fmt: skip
    items = [{"apiVersion": "kelastic.dev/v1alpha1", "kind": "ElasticJob",
              "metadata": {"name": f"scale-{j}", "namespace": namespace},
              "spec": {"replicas": replicas, "nprocPerNode": 1, "template": template}}
             for j in range(jobs)]  # fmt: skip
    return {"apiVersion": "v1", "kind": "List", "items": items}


#: Parallel clients of the floor measurement (the operator's write threads).
FLOOR_CLIENTS = 16


def _floor(cluster: Any, kubeconfig: Path, etcd: str, count: int) -> float:
    """The API server's own Pod-create throughput in this run, Pods per second:
    :data:`FLOOR_CLIENTS` threads of the official client (kept-alive connections, as the
    operator's) create ``count`` Pods exactly like the operator's (``build_pod`` of the
    bench's job spec; no owner) in a namespace of their own, scheduled and run by kwok as
    the jobs' are; then they are deleted and gone before the jobs are applied."""
    import concurrent.futures

    from kubernetes import client, config
    from tests.k8s.cluster import wait_until

    from kelastic_operator.model import parse_job
    from kelastic_operator.pods import PodSettings, build_pod

    ns = "floor"
    cluster.namespace(ns)
    job = parse_job(_jobs(ns, 1, count)["items"][0])
    settings = PodSettings(sidecar_image="kelastic:bench", etcd_endpoints=(etcd,))
    pods = []
    for i in range(count):
        pod = build_pod("floor", ns, "00000000-0000-0000-0000-000000000000", job.spec, i,
                        settings)  # fmt: skip
        pod["metadata"].pop("ownerReferences", None)  # no owner: the GC would take them
        pods.append(pod)
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)  # type: ignore[no-untyped-call]
    cfg.connection_pool_maxsize = FLOOR_CLIENTS
    core = client.CoreV1Api(client.ApiClient(cfg))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(FLOOR_CLIENTS) as pool:
        list(pool.map(lambda pod: core.create_namespaced_pod(ns, pod), pods))
    rate = count / (time.monotonic() - started)
    core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    path = f"/api/v1/namespaces/{ns}/pods"
    wait_until(lambda: _count(cluster, path) == 0, 300, 1.0, what="the floor's Pods deleted")
    return rate


def _count(cluster: Any, path: str) -> int:
    """How many objects a list would return (one item read: ``remainingItemCount``)."""
    code, body = cluster.request("GET", f"{path}?limit=1")
    if code != 200:
        return -1
    return len(body["items"]) + int(body["metadata"].get("remainingItemCount") or 0)


def _quiesce(cluster: Any, quiet: float, limit: float) -> float:
    """Seconds until the audited user (the operator) sent no request for ``quiet``
    seconds (the audit log is written in 1 s batches); ``limit`` at most."""
    started = time.monotonic()
    count, since = len(cluster.audited_requests()), time.monotonic()
    while time.monotonic() - started < limit:
        time.sleep(1.0)
        now = len(cluster.audited_requests())
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet + 1.0:
            return since - started
    return limit


def operator_idle(quick: bool) -> CaseResult:
    """1,000 idle jobs (2 Pods each; quick: 100): what jobs that wait cost the operator."""
    return operator_scale(quick, shape=(100, 2, 2) if quick else (1000, 2, 8),
                          case="operator_idle")  # fmt: skip


def operator_scale(
    quick: bool, shape: tuple[int, int, int] | None = None, case: str = "operator_scale"
) -> CaseResult:
    """The case: ``shape`` = (jobs, replicas, kwok Nodes), by default 100 x 64 on 8
    (quick: 10 x 16 on 2); its rows and checks are named ``case``."""
    import psutil
    from tests.k8s.cluster import ControlPlane, wait_until
    from tests.k8s.fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, start_cluster

    from kelastic_etcd import EtcdClient
    from kelastic_operator.local.etcd import free_port

    jobs, replicas, nodes = shape or ((10, 16, 2) if quick else (100, 64, 8))
    total = jobs * replicas
    idle_window = 35.0 if quick else 60.0  # over one resync (30 s)
    result = CaseResult(case)
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-k8s-") as tmp, embedded_etcd() as etcd:
        started = time.monotonic()
        cluster: ControlPlane = start_cluster(Path(tmp) / "cluster", audit_users=(OPERATOR_USER,))
        log(f"control plane ready in {time.monotonic() - started:.1f} s")
        proc = None
        try:
            admin = cluster.admin
            cluster.spawn("kwok", [
                f"--kubeconfig={admin.kubeconfig}",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--cidr=10.0.0.0/16", "--node-ip=10.0.0.1", f"--config={KWOK_STAGES}",
                # kwok renews each Node's Lease: without a heartbeat the node-lifecycle
                # controller marks the Nodes Unknown and every Pod on them not ready ~50 s
                # in, and the "idle" window measured 6400 readiness changes
                "--node-lease-duration-seconds=40",
            ])  # fmt: skip
            admin.kubectl("apply", "-f", "-", input=json.dumps(_nodes(nodes, total // nodes + 50)))
            # the node-lifecycle controller would lift the not-ready taint once kwok reports
            # the Nodes Ready; it does not run here, so lift it
            taints = json.dumps([{"op": "replace", "path": "/spec/taints", "value": [KWOK_TAINT]}])
            for i in range(nodes):
                admin.kubectl("patch", "node", f"kwok-{i}", "--type=json", "-p", taints)
            sample = total // 4
            floor_rate = _floor(cluster, admin.kubeconfig, etcd, sample)
            floor = total / floor_rate
            log(f"floor: the API server creates {floor_rate:.0f} Pods/s with {FLOOR_CLIENTS} "
                f"clients ({sample} Pods): {total} Pods in {floor:.1f} s")  # fmt: skip
            ns = "scale"
            cluster.namespace(ns)
            operator = cluster.service_account_client(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT,
                                                      default_namespace=ns)  # fmt: skip
            port = free_port()
            op_log = open(Path(tmp) / "operator.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "kelastic_operator", "--standalone",
                 f"--etcd-endpoints={etcd}", f"--metrics-port={port}",
                 f"--health-port={free_port()}", "--log-level=WARNING"],
                env=child_env(**{k: v for k, v in operator.env().items()
                                 if k in ("KUBECONFIG", "KUBECACHEDIR")}),
                stdout=op_log, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip
            wait_until(lambda: _metrics(port), 60, 0.2, what="the operator's /metrics")
            ps = psutil.Process(proc.pid)
            log(f"applying {jobs} jobs x {replicas} replicas = {total} Pods")
            applied = time.monotonic()
            admin.kubectl("apply", "-f", "-", input=json.dumps(_jobs(ns, jobs, replicas)),
                          timeout=300)  # fmt: skip
            pods_path = f"/api/v1/namespaces/{ns}/pods"
            rss: list[float] = []

            def all_created() -> bool:
                rss.append(ps.memory_info().rss / 2**20)
                return _count(cluster, pods_path) >= total

            wait_until(all_created, 600, 0.5, what=f"{total} Pods")
            created = time.monotonic() - applied
            log(f"all {total} Pods created in {created:.1f} s")

            def all_running() -> bool:
                code, body = cluster.request("GET", f"/apis/kelastic.dev/v1alpha1/namespaces/{ns}"
                                                    "/elasticjobs")  # fmt: skip
                phases = [(o.get("status") or {}).get("phase") for o in body["items"]]
                rss.append(ps.memory_info().rss / 2**20)
                return code == 200 and phases.count("Running") == jobs

            wait_until(all_running, 600, 1.0, what="every job Running")
            settle = time.monotonic() - applied
            log(f"every job Running after {settle:.1f} s")
            # idle once the operator's requests stop: every Pod event of the creation
            # reconciled (with 6400 Pods its backlog outlasts "Running" by minutes)
            quiet = _quiesce(cluster, 10.0, 600.0)
            log(f"the operator quiet (no request for 10 s) {quiet:.1f} s after every job ran; "
                f"idle window {idle_window:.0f} s")  # fmt: skip
            before = len(cluster.audited_requests())
            cpu0, t0 = ps.cpu_times(), time.monotonic()
            time.sleep(idle_window)  # the measurement window itself
            cpu1, t1 = ps.cpu_times(), time.monotonic()
            time.sleep(2)  # the audit log is written in 1 s batches
            idle_events = cluster.audited_requests()[before:]
            per_job_min = len(idle_events) / jobs / ((t1 - t0) / 60)
            cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (t1 - t0) * 100
            rss.append(ps.memory_info().rss / 2**20)
            text = _metrics(port)
            p50 = histogram_quantile(text, "kelastic_operator_reconcile_duration_seconds", 0.5)
            p99 = histogram_quantile(text, "kelastic_operator_reconcile_duration_seconds", 0.99)
            verbs: dict[str, int] = {}
            for ev in idle_events:
                key = f"{ev.get('verb')} {ev.get('objectRef', {}).get('resource')}"
                verbs[key] = verbs.get(key, 0) + 1

            log("deleting every job")
            deleted = time.monotonic()
            admin.kubectl("delete", "elasticjobs", "--all", "-n", ns, "--wait=false")
            jobs_path = f"/apis/kelastic.dev/v1alpha1/namespaces/{ns}/elasticjobs"
            wait_until(lambda: _count(cluster, pods_path) == 0 == _count(cluster, jobs_path),
                       600, 1.0, what="everything deleted")  # fmt: skip
            cleanup = time.monotonic() - deleted
            with EtcdClient([etcd]) as store:
                left = len(store.get_prefix(f"/kelastic/{ns}/"))
        finally:
            stop_process(proc)
            cluster.stop()
    note = f"{jobs} jobs x {replicas} replicas on {nodes} kwok Nodes"
    result.rows += [
        Row(case, "apply -> every Pod created", "floor: the API server's creates",
            "s", [floor], ref=True, note=f"{FLOOR_CLIENTS} clients, {floor_rate:.0f} Pods/s"),
        Row(case, "apply -> every Pod created", "kelastic operator", "s", [created],
            note=note),
        Row(case, "reconcile duration p50", "kelastic operator", "s", [p50]),
        Row(case, "reconcile duration p99", "kelastic operator", "s", [p99]),
        Row(case, "operator RSS (max)", "kelastic operator", "MiB", [max(rss)]),
        Row(case, "operator CPU while idle", "kelastic operator", "% of a core",
            [cpu]),
        Row(case, "API requests per idle job per minute", "kelastic operator",
            "req/job/min", [per_job_min], note=f"idle requests by verb: {verbs}"),
        Row(case, "delete all -> nothing left", "kelastic operator", "s", [cleanup]),
    ]  # fmt: skip
    result.checks += [
        Check(case, "operator RSS <= 300 MB", f"{max(rss):.0f} MiB",
              max(rss) * 2**20 <= 300e6),
        Check(case, "idle jobs cost ~0 API requests (< 0.1 per job per minute)",
              f"{per_job_min:.2f}", per_job_min < 0.1),
        Check(case, "nothing left in the API or etcd after delete",
              f"{left} etcd keys", left == 0),
    ]  # fmt: skip
    if jobs <= 100:  # the targets are for a queue admitting 100 jobs; 1,000 idle ones are
        result.checks += [  # measured, with no target
            Check(case, f"all {total} Pods within 60 s", f"{created:.1f} s", created <= 60),
            Check(case, "creation within 1.5x of the floor",
                  f"{created / floor:.2f}x ({floor:.1f} s)", created <= 1.5 * floor),
            Check(case, f"operator CPU while {jobs} jobs idle <= 2 % of a core", f"{cpu:.2f} %",
                  cpu <= 2.0),
        ]  # fmt: skip
    return result
