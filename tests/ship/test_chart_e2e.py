"""The chart's operator runs the digits job on the real test cluster.

``helm install`` of charts/kelastic into the test's namespace (etcd external: the test
session's etcd, since the bundled one's Service name resolves in a real cluster only; the
operator watching that namespace), then the operator as the release's own ServiceAccount
(a TokenRequest token: exactly the chart's RBAC, a missing verb fails the test), with the
settings the installed Deployment's args give it, read by the operator's own parser: it
campaigns for the chart's leader-election Lease and, once leading, runs the kopf handlers
in a thread. (The Deployment's own Pods stay Pending: they do not tolerate the local
kubelet's taint.) The local kubelet runs the job's Pods, placed there by the job's template
(:data:`tests.k8s.kubelet.PLACEMENT`): the kelastic sidecar and the trainer, real torch DDP.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kelastic import contract
from kelastic_operator.__main__ import build_parser
from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.leader import LeaseElector, LeaseSettings
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from kelastic_sidecar.etcd_store import EtcdStore
from tests.k8s.cluster import Client, ControlPlane, wait_until
from tests.k8s.kopf_thread import KopfThread
from tests.k8s.kubelet import PLACEMENT, LocalKubelet

from .tools import ROOT, Release, ToolMissing, helm_binary, release_name

DIGITS = ROOT / "examples/digits/elasticjob.yaml"
IMAGE = "ghcr.io/kelastic/digits-example:0.1.0"
T = 180.0  # seconds a step may take on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job(k8s: Client) -> dict[str, Any]:
    out = k8s.kubectl("get", "ej", "digits", "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _status(k8s: Client) -> dict[str, Any]:
    return _job(k8s).get("status") or {}


def test_the_charts_operator_runs_the_digits_job(
    k8s_cluster: ControlPlane,
    k8s: Client,
    kubelet: LocalKubelet,
    etcd_server: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    try:
        helm_binary()
    except ToolMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    ns = k8s.namespace
    kubelet.images[IMAGE] = DIGITS.parent
    warnings_before = len(kubelet.warnings)
    release = Release(k8s, release_name(ns))
    with release:
        release.install(
            "etcd.bundled=false",
            f"etcd.external.endpoints={{{etcd_server.endpoint}}}",
            f"operator.namespaces={{{ns}}}",
        )
        dep = k8s.get("deployment", f"{release.prefix}-operator")
        assert dep is not None
        pod_spec = dep["spec"]["template"]["spec"]
        (c,) = pod_spec["containers"]
        assert c["command"] == ["python", "-m", "kelastic_operator"]
        args = build_parser().parse_args(c["args"])
        assert args.etcd_endpoints == etcd_server.endpoint and args.namespace == [ns]
        assert not args.standalone
        # The operator as the Deployment's ServiceAccount, with the chart's RBAC only.
        account = k8s_cluster.service_account_client(ns, pod_spec["serviceAccountName"])
        api = account.api_client()
        ctx = OperatorContext(
            api=api,
            pod_settings=PodSettings(
                sidecar_image=args.sidecar_image,
                etcd_endpoints=tuple(args.etcd_endpoints.split(",")),
                http_port=args.sidecar_http_port,
            ),
            stores=StoreCache(lambda eps: EtcdRendezvousStore(eps)),
            resync_seconds=args.resync_seconds,
            instance=f"{release.prefix}-operator-0",
        )
        # Leader election on the chart's Lease, in the release's namespace (POD_NAMESPACE).
        elector = LeaseElector(
            api, ns, args.lease_name, "chart-e2e",
            LeaseSettings(args.lease_duration, args.renew_deadline, args.retry_period),
        )  # fmt: skip
        leading, lost, stop = threading.Event(), threading.Event(), threading.Event()
        campaign = threading.Thread(
            target=elector.run, args=(leading.set, lost.set, stop), daemon=True
        )
        campaign.start()
        ctx.fence = elector.is_leader
        registry = kopf.OperatorRegistry()
        register(registry, ctx)
        try:
            assert leading.wait(30), "the chart's operator account did not get the Lease"
            lease = k8s.get("lease", args.lease_name)
            assert lease is not None and lease["spec"]["holderIdentity"] == "chart-e2e"
            with KopfThread(account, registry, namespaces=args.namespace):
                k8s.claim("digits-checkpoints")
                job = yaml.safe_load(DIGITS.read_text())
                job["spec"]["template"]["spec"].update(PLACEMENT)
                k8s.kubectl("apply", "-f", "-", input=json.dumps(job))
                try:
                    wait_until(lambda: _status(k8s).get("worldSize") == 4, T, 0.5,
                               what="world size 4")  # fmt: skip
                except AssertionError as exc:  # say why: the job's Events (FailedCreate...)
                    events = k8s.kubectl("get", "events", "--sort-by=.lastTimestamp").stdout
                    raise AssertionError(f"{exc}\n{events[-3000:]}") from None
                pods = [p for p in k8s.objects("pods")
                        if p["metadata"]["name"].startswith("digits-")]  # fmt: skip
                assert len(pods) == 2
                for pod in pods:
                    assert pod["spec"]["initContainers"][-1]["image"] == args.sidecar_image
                    assert pod["spec"]["nodeName"] == kubelet.node
                wait_until(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"),
                           3 * T, 0.5, what="the job to finish")  # fmt: skip
                assert _status(k8s)["phase"] == "Succeeded", _status(k8s)
                logs = "\n".join(kubelet.log(n, name, "trainer")
                                 for (n, name) in list(kubelet.pods) if n == ns)  # fmt: skip
                found = re.findall(r"final test accuracy (\d\.\d+)", logs)
                assert found and float(found[-1]) >= 0.90, logs[-3000:]
                # kubectl delete ej: the operator's finalizer removes the Pods, then etcd keys.
                uid = _job(k8s)["metadata"]["uid"]
                k8s.kubectl("delete", "ej", "digits", "--wait=false")
                wait_until(lambda: not _job(k8s), T, 0.5, what="the job deleted")
                wait_until(lambda: not [p for p in k8s.objects("pods")
                                        if p["metadata"]["name"].startswith("digits-")],
                           T, 0.5, what="the job's Pods gone")  # fmt: skip
                with EtcdStore([etcd_server.endpoint]) as store:
                    prefix = contract.job_prefix(ns, "digits", uid)
                    wait_until(lambda: not store.get_prefix(prefix), T, 0.5,
                               what="the job's etcd keys gone")  # fmt: skip
            assert not lost.is_set(), "the operator lost its Lease during the run"
        finally:
            stop.set()
            campaign.join(30)
            ctx.stores.close()
            api.close()
    assert kubelet.warnings[warnings_before:] == []
