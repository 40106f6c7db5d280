"""Kueue's controller manager on the test control plane: the real ``cmd/kueue`` of
``sigs.k8s.io/kueue`` (built by ``scripts/build-kueue.sh``), with its CRDs, RBAC and
webhooks, as a child process of the test run.

    with KueueManager(cluster, workdir) as kueue:     # ~7-10 s to ready on 2 cores
        kueue.admin.kubectl("apply", "-f", "queues.yaml")

What it installs, and how, since the API server here reaches no Service:

- the **CRDs** of the module's ``config/components/crd/bases`` (server-side apply: the
  Workload CRD is 1.4 MB), the conversion webhook of those the module's kustomization
  patches (``webhook_in_<plural>.yaml``: workloads, local and cluster queues, cohorts,
  MultiKueue clusters) set to ``clientConfig.url: https://127.0.0.1:<port>/convert``;
- the **admission webhooks** of ``config/components/webhook/manifests.yaml`` whose rules
  are Kueue's own group (``kueue.x-k8s.io``: Workloads, ClusterQueues, ResourceFlavors,
  Cohorts), each at ``https://127.0.0.1:<port><its path>``, under the names the release
  gives them (``kueue-mutating-webhook-configuration``, ...). The webhooks of the job
  integrations (Pods, Jobs, Deployments...) are left out: this cluster is shared by the
  whole test run, and nothing here hands Kueue a Job;
- one **CA** of its own (``workdir/pki``) that signs the webhook server's and the metrics
  server's certificates, and is the webhooks' ``caBundle``;
- the manager runs as the ServiceAccount ``kueue-system/kueue-controller-manager`` (a
  TokenRequest token) bound to the release's ``manager-role`` (``config/components/rbac/
  role.yaml``, as ``kueue-manager-role``) and ``metrics-auth-role``, and the Role
  ``manager-secrets-role`` in its namespace: exactly the release's RBAC;
- its **Configuration** (``workdir/kueue-config.yaml``): namespace ``kueue-system``,
  leader election off, ``internalCertManagement`` off, health (plain HTTP), metrics and
  webhooks on free ports of 127.0.0.1, ``PartialAdmission`` on (beta, on by default
  since 0.5: set anyway), ``VisibilityOnDemand`` off (its API server reads its
  certificate from ``/visibility`` and would bind a fixed port), and
  ``integrations.externalFrameworks: [ElasticJob.v1alpha1.kelastic.dev]``.

With ``internalCertManagement`` off, Kueue 0.17 reads its metrics certificate from the
fixed path ``/etc/kueue/metrics/certs`` (``cmd/kueue/main.go``; it exits when it is
missing). The manager therefore runs in a mount namespace of its own (``unshare
--mount``) where ``/etc`` is a read-only overlay of a folder of ``workdir`` holding that
certificate over the machine's ``/etc``: nothing is written to this machine's ``/etc``,
and the overlay goes with the process.

``stop()`` leaves nothing: the webhook configurations first (nothing can be refused
while Kueue stops), the process (SIGTERM, SIGKILL after 15 s), the finalizers Kueue put
on its objects, the CRDs (and every Kueue object with them), the RBAC and the namespace.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kelastic._workers import child_preexec
from kelastic_operator.local.etcd import free_port

from .certs import CertAuthority
from .cluster import ROOT, Client, ClusterUnavailable, ControlPlane, log_tail, wait_until

Obj = dict[str, Any]
BUILD_SCRIPT = ROOT / "scripts" / "build-kueue.sh"
#: Kueue's API group, and the Workload API the tests write (v1beta2 is the storage
#: version of Kueue 0.17; v1beta1 is still served, deprecated, through the conversion
#: webhook).
GROUP = "kueue.x-k8s.io"
API = f"{GROUP}/v1beta2"
#: the ElasticJob as Kueue's ``integrations.externalFrameworks`` names it:
#: ``Kind.version.group`` of deploy/crds/elasticjobs.kelastic.dev.yaml
ELASTICJOB_FRAMEWORK = "ElasticJob.v1alpha1.kelastic.dev"
NAMESPACE = "kueue-system"
ACCOUNT = "kueue-controller-manager"
WEBHOOK_CONFIGS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
#: Kueue's finalizer on ClusterQueues, ResourceFlavors and admitted Workloads
RESOURCE_IN_USE = f"{GROUP}/resource-in-use"
STOP_GRACE_SECONDS = 15.0


class KueueUnavailable(ClusterUnavailable):
    """Kueue is not built, or its manager did not start (its log's tail in the message)."""


def kueue_bin(build: bool = False) -> Path:
    """The folder holding the ``kueue`` binary (its ``config/`` is beside it).

    ``$KELASTIC_KUEUE_BIN`` names one; else ``scripts/build-kueue.sh`` finds its cache
    (and, with ``build``, builds it: ~5 min cold on 2 cores).

    Args:
        build: run the build script when the cache lacks the binary.

    Returns:
        The bin folder (``<cache>/kueue-v<version>/bin``).

    Raises:
        KueueUnavailable: not built (and ``build`` is false), or the build failed.
    """
    env = os.environ.get("KELASTIC_KUEUE_BIN")
    if env:
        return Path(env)
    probe = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^KUEUE_VERSION=/,/^CONFIG=/p" {BUILD_SCRIPT}); '
         'have=1; [ -x "$BIN/kueue" ] && [ -f "$BIN/.complete" ] || have=0; echo "$have $BIN"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    have, folder = probe.stdout.split(maxsplit=1)
    if have == "1":
        return Path(folder.strip())
    if not build:
        raise KueueUnavailable(
            f"Kueue is not built in {folder.strip()}: run bash scripts/build-kueue.sh "
            "(or bash scripts/test-tools.sh)"
        )
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if result.returncode:
        raise KueueUnavailable(f"scripts/build-kueue.sh failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def _load_all(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def conversion_patched(config: Path) -> set[str]:
    """The CRDs (``<plural>.kueue.x-k8s.io``) whose conversion webhook the module's CRD
    kustomization enables (its uncommented ``patches/webhook_in_<plural>.yaml``).

    Args:
        config: the ``config`` folder beside the ``kueue`` binary.

    Returns:
        CRD names, e.g. ``{"workloads.kueue.x-k8s.io", ...}``.
    """
    kustomization = yaml.safe_load((config / "crd" / "kustomization.yaml").read_text())
    names = set()
    for patch in kustomization.get("patches") or []:
        file = Path(patch["path"]).name
        if file.startswith("webhook_in_"):
            for doc in _load_all(config / "crd" / "patches" / file):
                names.add(doc["metadata"]["name"])
    return names


class KueueManager:
    """Kueue's controller manager, webhooks and CRDs on a running test control plane.

    Args:
        cluster: the started :class:`~tests.k8s.cluster.ControlPlane`.
        workdir: the Configuration, certificates, the ``/etc`` overlay and ``kueue.log``.
        bin_dir: the folder of the ``kueue`` binary (:func:`kueue_bin` by default); its
            ``../config`` holds the CRDs, webhook manifests and RBAC of the release.
        external_frameworks: ``integrations.externalFrameworks`` (``Kind.version.group``).
        feature_gates: more Kueue feature gates (over the defaults set here).

    ``start()`` raises :class:`KueueUnavailable` when the manager does not become ready
    (its log's tail in the message), after undoing what it installed. ``startup_seconds``
    is how long start-up took.
    """

    def __init__(
        self,
        cluster: ControlPlane,
        workdir: Path,
        bin_dir: Path | None = None,
        external_frameworks: tuple[str, ...] = (ELASTICJOB_FRAMEWORK,),
        feature_gates: dict[str, bool] | None = None,
    ) -> None:
        self.cluster = cluster
        self.admin: Client = cluster.admin
        self.workdir = Path(workdir)
        self.bin_dir = bin_dir
        self.external_frameworks = external_frameworks
        self.feature_gates = {"PartialAdmission": True, "VisibilityOnDemand": False,
                              **(feature_gates or {})}  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.webhook_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self.startup_seconds = 0.0
        self.crds: list[str] = []
        self.log_path = self.workdir / "kueue.log"

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> KueueManager:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def config_dir(self) -> Path:
        """The release's manifests copied by the build (``<bin>/../config``)."""
        return (self.bin_dir or kueue_bin()).parent / "config"

    @property
    def webhook_url(self) -> str:
        """``https://127.0.0.1:<port>``: where the API server calls the webhooks."""
        return f"https://127.0.0.1:{self.webhook_port}"

    def start(self) -> KueueManager:
        """Install the CRDs and RBAC, start the manager, wait until it is ready, install
        the webhooks and wait until the API server calls them.

        Returns:
            self.

        Raises:
            KueueUnavailable: the binary is missing, or the manager exited or was not
                ready (readyz, then a webhook answering) within 90 s; what was
                installed is removed again.
        """
        started = time.monotonic()
        self.bin_dir = self.bin_dir or kueue_bin()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the webhook port goes into the CRDs' conversion URL before the manager starts
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        try:
            ca_bundle = self._certificates()
            self._install_crds(ca_bundle)
            kubeconfig = self._install_rbac()
            self._spawn(kubeconfig, self._write_config())
            wait_until(self._ready, 90, 0.2, what="Kueue's /readyz")
            self._install_webhooks(ca_bundle)
            wait_until(self._webhooks_answer, 30, 0.2,
                       what="the API server to call Kueue's mutating webhook")  # fmt: skip
        except Exception as exc:  # whatever failed, undo what was installed
            tail = self.log_tail()
            self.stop()
            raise KueueUnavailable(f"Kueue did not start: {exc}\n{tail}") from exc
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Remove the webhooks, stop the manager (SIGTERM, then SIGKILL after 15 s), clear
        Kueue's finalizers, delete the CRDs (every Kueue object with them), the RBAC and
        the namespace. Safe to call twice and after a failed start.

        Raises:
            AssertionError: a CRD or the namespace was still there 60 s after its
                deletion (everything else was cleaned up first).
        """
        kubectl = self.admin.kubectl
        for kind, name in WEBHOOK_CONFIGS.items():
            kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        for crd in self.crds:
            self._clear_finalizers(crd)
        if self.crds:
            kubectl("delete", "crd", *self.crds, "--ignore-not-found", "--wait=false",
                    check=False)  # fmt: skip
        kubectl("delete", "clusterrolebinding", "kueue-manager-rolebinding",
                "kueue-metrics-auth-rolebinding", "--ignore-not-found", check=False)  # fmt: skip
        kubectl("delete", "clusterrole", "kueue-manager-role", "kueue-metrics-auth-role",
                "--ignore-not-found", check=False)  # fmt: skip
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false",
                check=False)  # fmt: skip
        crds, self.crds = self.crds, []
        gone = [f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c}" for c in crds]
        gone.append(f"/api/v1/namespaces/{NAMESPACE}")  # a next start must not find it ending
        wait_until(lambda: all(self.cluster.request("GET", p)[0] == 404 for p in gone), 60, 0.2,
                   what=f"Kueue's CRDs and namespace to be deleted: {crds}")  # fmt: skip

    def log_tail(self, lines: int = 40, width: int = 400) -> str:
        """The last ``lines`` of the manager's log under a ``--- kueue:`` header, each cut
        to ``width`` characters (its errors carry whole Go stack traces)."""
        tail = log_tail(self.log_path, "kueue", lines).splitlines()
        return "\n".join(line if len(line) <= width else line[:width] + " [...]" for line in tail)

    # --- start-up steps -----------------------------------------------------------------

    def _certificates(self) -> str:
        """The CA, the webhook server's certificate (``certDir``) and the metrics one
        (the ``/etc`` overlay); returns the CA bundle (base64 PEM)."""
        ca = CertAuthority(self.workdir / "pki")
        serving = ca.issue("kueue-webhook", "kueue-webhook", server_names=("localhost",),
                           server_ips=("127.0.0.1",))  # fmt: skip
        for folder in (self.workdir / "webhook-certs",
                       self.workdir / "etc" / "kueue" / "metrics" / "certs"):  # fmt: skip
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(serving.cert, folder / "tls.crt")
            shutil.copy(serving.key, folder / "tls.key")
        return base64.b64encode(ca.cert.read_bytes()).decode()

    def _install_crds(self, ca_bundle: str) -> None:
        converted = conversion_patched(self.config_dir)
        crds = []
        for path in sorted((self.config_dir / "crd" / "bases").glob("*.yaml")):
            for crd in _load_all(path):
                if crd["metadata"]["name"] in converted:
                    crd["spec"]["conversion"] = {
                        "strategy": "Webhook",
                        "webhook": {
                            "clientConfig": {"url": f"{self.webhook_url}/convert",
                                             "caBundle": ca_bundle},
                            "conversionReviewVersions": ["v1"],
                        },
                    }  # fmt: skip
                crds.append(crd)
        self.crds = [crd["metadata"]["name"] for crd in crds]
        self._apply(crds)
        self.admin.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                           *(f"crd/{name}" for name in self.crds), timeout=90)  # fmt: skip

    def _install_rbac(self) -> Path:
        """The namespace, ServiceAccount and the release's ClusterRoles bound to it;
        returns the kubeconfig of that account (a TokenRequest token, 2 h)."""
        rbac = self.config_dir / "rbac"
        docs: list[Obj] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
        ]  # fmt: skip
        for file, role in (("role.yaml", "manager-role"),
                           ("metrics_auth_role.yaml", "metrics-auth-role")):  # fmt: skip
            (doc,) = (d for d in _load_all(rbac / file) if d["metadata"]["name"] == role)
            doc["metadata"] = {"name": f"kueue-{role}"}
            docs.append(doc)
            docs.append({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": f"kueue-{role}binding"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": f"kueue-{role}"},
                "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT,
                              "namespace": NAMESPACE}],
            })  # fmt: skip
        # its Role in its namespace (MultiKueue's cluster controller watches Secrets)
        (secrets,) = _load_all(rbac / "manager_secrets_role.yaml")
        secrets["metadata"] = {"name": "kueue-manager-secrets-role", "namespace": NAMESPACE}
        docs.append(secrets)
        docs.append({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "kueue-manager-secrets-rolebinding", "namespace": NAMESPACE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "kueue-manager-secrets-role"},
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
        })  # fmt: skip
        self._apply(docs)
        return self.cluster.service_account_client(NAMESPACE, ACCOUNT).kubeconfig

    def _write_config(self) -> Path:
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port,
                        "certDir": str(self.workdir / "webhook-certs")},
            "featureGates": self.feature_gates,
            "integrations": {"frameworks": ["batch/job"],
                             "externalFrameworks": list(self.external_frameworks)},
        }  # fmt: skip
        path = self.workdir / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _spawn(self, kubeconfig: Path, config: Path) -> None:
        overlay = self.workdir / "etc"
        if any(c in str(overlay) for c in ":,"):
            raise KueueUnavailable(f"{overlay}: overlayfs cannot take ':' or ',' in a path")
        # /etc/kueue/metrics/certs is fixed in Kueue: a read-only overlay of our folder on
        # /etc, in a mount namespace that goes with the process
        unshare = ["unshare", "--mount"] if os.geteuid() == 0 else [
            "unshare", "--mount", "--map-root-user"]  # fmt: skip
        script = 'mount -t overlay kueue-etc -o "lowerdir=$1:/etc" /etc && shift && exec "$@"'
        cmd = [*unshare, "--", "sh", "-c", script, "sh", str(overlay),
               str(self.bin_dir or kueue_bin()) + "/kueue", f"--config={config}",
               "--zap-log-level=info"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        with open(self.log_path, "ab") as log:
            # the manager dies with the process that started it (a killed test run leaves
            # no Kueue behind): PR_SET_PDEATHSIG survives unshare's and sh's exec
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=functools.partial(child_preexec, os.getpid()),
            )  # fmt: skip

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise AssertionError(f"the kueue manager exited with {code}")
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _install_webhooks(self, ca_bundle: str) -> None:
        configs = []
        for doc in _load_all(self.config_dir / "webhook" / "manifests.yaml"):
            hooks = [h for h in doc["webhooks"]
                     if all(GROUP in rule["apiGroups"] for rule in h["rules"])]  # fmt: skip
            for hook in hooks:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": self.webhook_url + path, "caBundle": ca_bundle}
            doc["metadata"] = {"name": WEBHOOK_CONFIGS[doc["kind"]]}
            doc["webhooks"] = hooks
            configs.append(doc)
        self._apply(configs)

    def _webhooks_answer(self) -> bool:
        """A server-side dry run of a ClusterQueue comes back with the finalizer that only
        Kueue's mutating webhook adds: the API server calls the webhooks."""
        probe = {"apiVersion": API, "kind": "ClusterQueue",
                 "metadata": {"name": "kelastic-webhook-probe"}, "spec": {}}  # fmt: skip
        result = self.admin.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                    input=json.dumps(probe), check=False)  # fmt: skip
        if result.returncode:
            return False
        return RESOURCE_IN_USE in (json.loads(result.stdout)["metadata"].get("finalizers") or [])

    # --- helpers ------------------------------------------------------------------------

    def _apply(self, docs: list[Obj]) -> None:
        # server-side: the Workload CRD is too large for kubectl's last-applied annotation
        self.admin.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=kelastic-tests",
            "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
            timeout=120,
        )  # fmt: skip

    def _clear_finalizers(self, crd: str) -> None:
        """Remove the finalizers of every object of ``crd``: no Kueue is left to remove
        them, and the CRD's deletion waits for its objects."""
        result = self.admin.kubectl("get", crd, "--all-namespaces", "-o", "json", check=False)
        if result.returncode:
            return
        for item in json.loads(result.stdout)["items"]:
            meta = item["metadata"]
            if meta.get("finalizers"):
                where = ["-n", meta["namespace"]] if meta.get("namespace") else []
                self.admin.kubectl("patch", crd, meta["name"], *where, "--type=merge", "-p",
                                   '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
