"""A real Kubernetes node for the test cluster: kubelet, containerd, runc and the CNI bridge.

    with RealNode(cluster, workdir, images=build_images()) as node:  # ~10-20 s to Ready
        node.expose("127.0.0.1:2379")   # -> "10.244.255.2:2379": etcd as its Pods reach it

What runs, all built here (``scripts/build-k8s.sh``: kubelet; ``scripts/build-node.sh``:
containerd 2.x, its runc shim, crictl, the CNI plugins, pause; Debian's runc 1.1):

- a **holder**: ``unshare --pid --fork --mount --net`` with the static ``pause`` as its init.
  Everything of the node runs inside its namespaces (kubelet, containerd, the shims and
  every container below them), so that: its mounts never reach this machine's mount table
  (``/var`` and ``/run`` are folders of the node's own, ``/proc`` is the namespace's own);
  its network (the uplink ``eth0``, the CNI bridge ``cni0`` and each Pod's address) lives
  in a network namespace the test made; and when the holder dies every process of the
  node dies with it (the kernel kills a PID namespace whose init exits).
- the **uplink**: a veth pair, ``kel<id>`` here (``10.244.255.<4i+1>/30``) and ``eth0`` in
  the node (``10.244.255.<4i+2>``, the Node's InternalIP). This machine reaches only that
  /30 (the API server's ``kubectl logs`` to the kubelet, the test's operator to the
  relays); the node forwards nothing towards it (``FORWARD -o eth0 -j DROP`` in the node),
  so no Pod traffic leaves the node's namespace.
- **relays** (:meth:`expose`): a service of this machine's loopback (the API server, an
  etcd) offered at the node's address on the same port, by a socket this process opens
  inside the node's namespace. ``kubernetes.default`` (10.96.0.1:443) is DNAT-ed in the
  node to the API server's relay, the one rule kube-proxy would write for it.
- **containerd** with the CRI plugin (overlayfs, runc, ``restrict_oom_score_adj`` since a
  negative ``oom_score_adj`` is not permitted here) and the images of ``images`` imported.
- **kubelet**, registering the Node through the real API server as ``system:node:<name>``
  (Node authorizer, NodeRestriction), cgroupfs driver with ``cgroupRoot`` below this
  process's own cgroup in every v1 hierarchy (created here, removed at stop),
  ``failCgroupV1: false``, probes, logs, eviction thresholds it never reaches. Its three
  kernel tunables (``kernel.panic=10``, ``kernel.panic_on_oops=1``,
  ``vm.overcommit_memory=1``) are files bind-mounted over those ``/proc/sys`` entries in the
  node's mount namespace: ``protectKernelDefaults: true`` finds them set and writes nothing,
  and this machine's values stay as they are.

:meth:`stop` leaves nothing: every process of the node (SIGKILL through the PID
namespace), the cgroups it made, the uplink (gone with the namespace), the Node object.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kelastic._workers import child_preexec, list_children

from .cluster import (
    ROOT,
    ClusterUnavailable,
    ControlPlane,
    Obj,
    control_plane_bin,
    log_tail,
    wait_until,
)

NODE_BUILD_SCRIPT = ROOT / "scripts" / "build-node.sh"
RUNC = "/usr/sbin/runc"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
#: kubelet asks for these and, with protectKernelDefaults, refuses to start without them.
KERNEL_TUNABLES = {
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "vm/overcommit_memory": "1",
}
KUBERNETES_SERVICE = ("10.96.0.1", 443)
#: Test nodes carry this label and taint, so that only Pods meant for them run there (a
#: Deployment a test applies to check its manifest stays Pending unless it tolerates it).
NODE_LABEL = "kelastic.dev/test-node"
TAINT = {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
#: The Pod-spec fields that place a Pod on the test's real nodes (part of the job's own
#: template, as a user's node selector and tolerations would be).
PLACEMENT: Obj = {"nodeSelector": {NODE_LABEL: "true"}, "tolerations": [TOLERATION]}


def node_bin() -> Path:
    """The folder of containerd, its shim, ctr, crictl, the CNI plugins and pause
    (``$KELASTIC_NODE_BIN``, else ``scripts/build-node.sh``'s cache).

    Raises:
        ClusterUnavailable: not built (run ``bash scripts/build-node.sh``).
    """
    env = os.environ.get("KELASTIC_NODE_BIN")
    if env:
        return Path(env)
    probe = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^CONTAINERD_VERSION=/,/^TOOLS=/p" {NODE_BUILD_SCRIPT}); '
         'have=1; for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || have=0; done; '
         '[ -f "$BIN/.complete" ] || have=0; echo "$have $BIN"'],
        capture_output=True, text=True, check=True, env={**os.environ, "KELASTIC_REPO": str(ROOT)},
    )  # fmt: skip
    have, folder = probe.stdout.split(maxsplit=1)
    if have != "1":
        raise ClusterUnavailable(
            f"the node runtime is not built in {folder.strip()}: "
            "run bash scripts/build-node.sh (or bash scripts/test-tools.sh)"
        )
    return Path(folder.strip())


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path in each v1 hierarchy (``/proc/self/cgroup``), keyed by the
    hierarchy's folder under ``/sys/fs/cgroup`` (``memory``, ``cpu``, ``systemd``, ...)."""
    mounted = {p.name for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()}
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers and "unified" in mounted:  # hybrid mode's v2 mount: runc
            out["unified"] = path  # makes the containers' cgroups there too
        for name in controllers.split(","):
            name = name.removeprefix("name=")
            if name and name in mounted:
                out[name] = path
    return out


def _rmdir_tree(root: Path) -> None:
    """Remove a cgroup folder and every cgroup below it, deepest first (a cgroup is removed
    with ``rmdir`` once it holds no process; one that still does stays)."""
    folders = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for folder in [*folders, root]:
        with contextlib.suppress(OSError):
            folder.rmdir()


class NodeCgroups:
    """The kubelet's ``cgroupRoot``: one path, below this process's own cgroup in every v1
    hierarchy (the deepest of them, so it is below all), created in each, removed at
    :meth:`remove` with everything the kubelet made beneath it.

    Args:
        leaf: the last path element (unique per node and run).
    """

    def __init__(self, leaf: str) -> None:
        own = _own_cgroups()
        base = max(own.values(), key=lambda p: p.count("/"))
        self.path = f"{base.rstrip('/')}/{leaf}"
        self.hierarchies = sorted(own)
        self._made: list[Path] = []

    def create(self) -> None:
        """Make the path in every hierarchy (cpuset: each new level gets its parent's
        ``cpuset.cpus`` and ``cpuset.mems``, or it could hold no process). First remove
        what a killed run left beside it: ``kelastic-*-<pid>`` trees whose pid is gone and
        that hold no process."""
        self._remove_stale()
        for name in self.hierarchies:
            folder = Path("/sys/fs/cgroup") / name
            for part in self.path.strip("/").split("/"):
                parent, folder = folder, folder / part
                if folder.is_dir():
                    continue
                folder.mkdir()
                self._made.append(folder)
                if name == "cpuset":
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (folder / knob).write_text((parent / knob).read_text())

    def _remove_stale(self) -> None:
        parent = self.path.rsplit("/", 1)[0]
        for name in self.hierarchies:
            base = Path("/sys/fs/cgroup") / name / parent.strip("/")
            for tree in base.glob("kelastic-*-*") if base.is_dir() else []:
                pid = tree.name.rsplit("-", 1)[1]
                if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                    continue
                _rmdir_tree(tree)

    def pids(self) -> list[int]:
        """Every process in the tree, in any hierarchy."""
        out: set[int] = set()
        for name in self.hierarchies:
            root = Path("/sys/fs/cgroup") / name / self.path.strip("/")
            if root.is_dir():
                for procs in root.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError):
                        out.update(int(x) for x in procs.read_text().split())
        return sorted(out)

    def remove(self) -> None:
        """Remove the tree, deepest first (the processes must be gone)."""
        for name in self.hierarchies:
            root = Path("/sys/fs/cgroup") / name / self.path.strip("/")
            if root.is_dir():
                _rmdir_tree(root)
        for folder in reversed(self._made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        # and the levels above it that a killed run made and left (rmdir removes only an
        # empty cgroup without processes: our own, or anyone's in use, stays)
        for name in self.hierarchies:
            folder = (Path("/sys/fs/cgroup") / name / self.path.strip("/")).parent
            while folder != Path("/sys/fs/cgroup") / name:
                with contextlib.suppress(OSError):
                    folder.rmdir()
                folder = folder.parent

    def leftovers(self) -> list[str]:
        """The folders of the tree still present (empty after :meth:`remove`)."""
        return [str(f) for f in self._made if f.exists()]


def claim_index(lowest: int) -> tuple[int, int]:
    """The lowest node index from ``lowest`` (to 63) that no other node of any test run on
    this machine holds, and the descriptor of the lock that holds it for this one (an
    exclusive ``flock`` of ``/tmp/kelastic-node-<index>.lock``: the kernel drops it when
    the process dies, so a killed run frees its index). An index picks the uplink's host
    addresses, the only ones the nodes share with this machine's network namespace.

    Raises:
        ClusterUnavailable: all 63 are held.
    """
    for index in range(lowest, 64):
        fd = os.open(f"/tmp/kelastic-node-{index}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return index, fd
    raise ClusterUnavailable(f"no free node index in {lowest}..63 (/tmp/kelastic-node-*.lock)")


class RealNode:
    """One real node of the test cluster; see the module docstring.

    Args:
        cluster: the control plane the kubelet registers with.
        workdir: configs, logs, containerd's root, the kubelet's root and the Pods' volumes.
        images: image archives (:func:`tests.k8s.images.build_images`) to import.
        name: the Node's name; ``index`` (1-63) picks its addresses: the lowest index from
            it that no other node on this machine holds (:func:`claim_index`), so that test
            runs side by side never share the uplink's addresses.
        labels, taints: the Node's labels and registration taints.
        capacity_memory: what the Node says it has (allocatable memory).
    """

    def __init__(
        self,
        cluster: ControlPlane,
        workdir: Path,
        images: dict[str, Path] | None = None,
        *,
        name: str = "kelastic-node-1",
        index: int = 1,
        labels: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
    ) -> None:
        if not 1 <= index <= 63:
            raise ValueError(f"node index {index} not in 1..63")
        index, self._index_lock = claim_index(index)
        self.cluster = cluster
        self.workdir = Path(workdir)
        self.images = dict(images or {})
        self.name = name
        self.index = index
        self.labels = {NODE_LABEL: "true", **(labels or {})}
        self.taints = [TAINT] if taints is None else taints
        self.host_ip = f"10.244.255.{4 * index + 1}"
        self.ip = f"10.244.255.{4 * index + 2}"
        self.pod_cidr = f"10.244.{index}.0/24"
        self.host_link = f"kel{os.getpid() % 100000}n{index}"
        self.bin = node_bin()
        self.k8s_bin = cluster.bin_dir or control_plane_bin()
        # sockets: short paths (sun_path is 108 bytes; pytest's tmp paths are long)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"kn{index}-", dir="/tmp"))
        self.cgroups = NodeCgroups(f"kelastic-{name}-{os.getpid()}")
        self.holder: subprocess.Popen[bytes] | None = None
        self.init_pid = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.relays: dict[str, Any] = {}
        self.startup_seconds = 0.0
        self.image_import_seconds = 0.0
        self._logs: dict[tuple[str, str, str, str], str] = {}

    # ----------------------------------------------------------------------- lifecycle

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def containerd_sock(self) -> Path:
        return self.run_dir / "containerd.sock"

    def start(self) -> RealNode:
        """Bring the node up and wait for its Node to be Ready.

        Raises:
            ClusterUnavailable: a part did not start (its log's tail in the message).
        """
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.cgroups.create()
            self._start_holder()
            self._setup_mounts()
            self._setup_network()
            self.expose(f"127.0.0.1:{self.cluster.port}")
            self._dnat(KUBERNETES_SERVICE, (self.ip, self.cluster.port))
            self._start_containerd()
            t0 = time.monotonic()
            self.import_images(self.images.values())
            self.image_import_seconds = time.monotonic() - t0
            self._start_kubelet()
            self.wait_ready(120)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Stop everything of the node and leave nothing behind (idempotent)."""
        for relay in self.relays.values():
            relay.close()
        self.relays.clear()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for pid in self.cgroups.pids():  # the containers (also killed with the PID namespace)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.holder is not None:
            with contextlib.suppress(ProcessLookupError):
                self.holder.kill()  # unshare --kill-child: its init goes, then every process
            if self.init_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.init_pid, signal.SIGKILL)
            self.holder.wait(30)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not self.cgroups.pids(), 30, 0.1, what="the node's processes to end")
        self.cgroups.remove()
        # containerd's snapshots: ~4.5 GB per node with the trainer image (the layer blobs
        # went after unpacking; its overlay mounts went with the node's mount namespace)
        shutil.rmtree(self.workdir / "containerd", ignore_errors=True)
        if Path(f"/sys/class/net/{self.host_link}").exists():
            subprocess.run(["ip", "link", "del", self.host_link], check=False)
        with contextlib.suppress(Exception):
            self.cluster.request("DELETE", f"/api/v1/nodes/{self.name}")
        if self._index_lock >= 0:  # the addresses are free for another node now
            os.close(self._index_lock)
            self._index_lock = -1
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.holder = None
        self.init_pid = 0

    # ----------------------------------------------------------------- the namespaces

    def _start_holder(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--net",
             "--propagation", "private", "--mount-proc", str(self.bin / "pause")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(child_preexec, os.getpid()),
        )  # fmt: skip

        def init_started() -> bool:
            assert self.holder is not None
            if self.holder.poll() is not None:
                raise ClusterUnavailable(f"unshare exited with {self.holder.returncode}")
            kids = list_children(self.holder.pid)
            if kids and Path(f"/proc/{kids[0]}/exe").resolve().name == "pause":
                self.init_pid = kids[0]
                return True
            return False

        wait_until(init_started, 10, 0.02, what="the node's namespaces")

    @property
    def netns(self) -> str:
        """The node's network namespace (``/proc/<init>/ns/net``)."""
        return f"/proc/{self.init_pid}/ns/net"

    def nsenter(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        """Run ``cmd`` inside the node (its PID, mount and network namespaces)."""
        result = subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-p", "-m", "-n", "--", *cmd],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode:
            raise ClusterUnavailable(
                f"in node {self.name}: {' '.join(cmd)} exited {result.returncode}: "
                f"{(result.stdout + result.stderr)[-2000:]}"
            )
        return result.stdout

    def _setup_mounts(self) -> None:
        var = self.workdir / "var"
        for sub in ("lib", "log", "tmp", "cache"):
            (var / sub).mkdir(parents=True, exist_ok=True)
        (var / "tmp").chmod(0o1777)
        with contextlib.suppress(FileExistsError):
            (var / "run").symlink_to("/run")
        sysctl = self.workdir / "sysctl"
        sysctl.mkdir(exist_ok=True)
        script = [
            "set -e",
            f"mount --bind {var} /var",
            "mount -t tmpfs -o mode=0755 kelastic-node-run /run",
        ]
        for key, value in KERNEL_TUNABLES.items():
            file = sysctl / key.replace("/", ".")
            file.write_text(value + "\n")
            script.append(f"mount --bind {file} /proc/sys/{key}")
        self.nsenter("sh", "-c", "\n".join(script))

    def _setup_network(self) -> None:
        subprocess.run(["ip", "link", "add", self.host_link, "type", "veth", "peer", "name",
                        "eth0", "netns", str(self.init_pid)], check=True)  # fmt: skip
        subprocess.run(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_link],
                       check=True)  # fmt: skip
        subprocess.run(["ip", "link", "set", self.host_link, "up"], check=True)
        self.nsenter("sh", "-c", "\n".join([
            "set -e",
            "ip link set lo up",
            f"ip addr add {self.ip}/30 dev eth0",
            "ip link set eth0 up",
            # nothing of the node's Pods is ever forwarded out of its namespace
            "iptables -w -P FORWARD ACCEPT",
            "iptables -w -A FORWARD -o eth0 -j DROP",
        ]))  # fmt: skip

    def _dnat(self, vip: tuple[str, int], to: tuple[str, int]) -> None:
        self.nsenter("iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-d", vip[0], "-p", "tcp",
                     "--dport", str(vip[1]), "-j", "DNAT", "--to-destination",
                     f"{to[0]}:{to[1]}")  # fmt: skip

    def expose(self, target: str) -> str:
        """Offer ``target`` (``host:port`` on this machine) inside the node, at the node's
        address and the same port; returns that endpoint (what Pods, the kubelet and this
        process all reach it by). Idempotent per target."""
        from tests.ship.tcpproxy import TcpProxy

        if target not in self.relays:
            port = int(target.rpartition(":")[2])
            self.relays[target] = TcpProxy(target, listen=(self.ip, port), netns=self.netns)
        return str(self.relays[target].endpoint)

    # ------------------------------------------------------------------- containerd

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.procs[name] = subprocess.Popen(
            ["nsenter", "-t", str(self.init_pid), "-p", "-m", "-n", "--", *cmd],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=functools.partial(child_preexec, os.getpid()),
        )  # fmt: skip
        log.close()

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last ``lines`` of a node component's log (``containerd``, ``kubelet``)."""
        return log_tail(self.workdir / f"{name}.log", f"{self.name} {name}", lines)

    def _containerd_config(self) -> Path:
        root = self.workdir / "containerd"
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-kelastic.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "kelastic",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                          "ranges": [[{"subnet": self.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=1))  # fmt: skip
        cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
        text = f"""version = 3
root = "{root / "root"}"
state = "{self.run_dir / "state"}"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri",
                    "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{self.containerd_sock}"

[ttrpc]
  address = "{self.run_dir / "containerd.sock.ttrpc"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[{cri_runtime}]
  enable_selinux = false
  restrict_oom_score_adj = true
  [{cri_runtime}.containerd]
    default_runtime_name = "runc"
    [{cri_runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri_runtime}.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [{cri_runtime}.cni]
    bin_dirs = ["{self.bin}"]
    conf_dir = "{cni / "net.d"}"
"""
        path = self.workdir / "containerd.toml"
        path.write_text(text)
        return path

    def _start_containerd(self) -> None:
        config = self._containerd_config()
        self._spawn("containerd", [str(self.bin / "containerd"), "--config", str(config)])

        def serving() -> bool:
            proc = self.procs["containerd"]
            if proc.poll() is not None:
                raise ClusterUnavailable(f"containerd exited {proc.returncode}:\n"
                                         f"{self.log_tail('containerd')}")  # fmt: skip
            return self.ctr("version", check=False).returncode == 0

        wait_until(serving, 60, 0.1, what="containerd to serve")

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against the node's containerd, namespace ``k8s.io``."""
        result = subprocess.run(
            [str(self.bin / "ctr"), "--address", str(self.containerd_sock), "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode:
            raise ClusterUnavailable(f"ctr {' '.join(args)}: {result.stderr[-2000:]}")
        return result

    def crictl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``crictl`` against the node's containerd (CRI)."""
        result = subprocess.run(
            [str(self.bin / "crictl"), "--runtime-endpoint", f"unix://{self.containerd_sock}",
             "--image-endpoint", f"unix://{self.containerd_sock}", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if check and result.returncode:
            raise ClusterUnavailable(f"crictl {' '.join(args)}: {result.stderr[-2000:]}")
        return result

    def import_images(self, archives: Any) -> None:
        """Import image archives into the node's containerd
        (:func:`tests.k8s.images.import_images`), after checking the disk has room for them
        (:func:`tests.k8s.images.check_disk_for_import`: ImageError when it has not)."""
        from .images import check_disk_for_import, import_images

        archives = list(archives)
        check_disk_for_import(self.workdir / "containerd" / "root", archives)
        import_images(self.bin / "ctr", self.containerd_sock, archives)

    # ---------------------------------------------------------------------- kubelet

    def _kubelet_files(self) -> tuple[Path, Path]:
        ca = self.cluster.ca
        cert = ca.issue(f"node-{self.name}", f"system:node:{self.name}", "system:nodes")
        serving = ca.issue(f"kubelet-{self.name}", self.name, server_names=(self.name,),
                           server_ips=(self.ip,))  # fmt: skip
        kubeconfig = self.workdir / "kubelet.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {
                "server": f"https://{self.ip}:{self.cluster.port}",
                "certificate-authority": str(ca.cert), "tls-server-name": "kubernetes"}}],
            "users": [{"name": "u", "user": {"client-certificate": str(cert.cert),
                                             "client-key": str(cert.key)}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        }))  # fmt: skip
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("# no DNS in the test node's network\noptions ndots:0\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroups.path,
            "cgroupsPerQOS": True,
            "failSwapOn": False,
            "protectKernelDefaults": True,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca.cert)}},
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "resolvConf": str(resolv),
            "registerNode": True,
            "registerWithTaints": self.taints,
            "maxPods": 110,
            "podPidsLimit": -1,
            "serializeImagePulls": False,
            # never evict or collect images: this disk's usage is not the test's
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%",
                             "nodefs.inodesFree": "0%", "imagefs.available": "0%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "20s",
            "shutdownGracePeriod": "0s",
            "localStorageCapacityIsolation": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
        }  # fmt: skip
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path, kubeconfig

    def _start_kubelet(self) -> None:
        if "kubelet-config" not in self.__dict__:
            self.__dict__["kubelet-config"] = self._kubelet_files()
        config, kubeconfig = self.__dict__["kubelet-config"]
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self._spawn("kubelet", [
            str(self.k8s_bin / "kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}", f"--node-ip={self.ip}",
            f"--root-dir={self.workdir / 'kubelet'}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
            *([f"--node-labels={labels}"] if labels else []), "--v=2",
        ])  # fmt: skip

    def restart_kubelet(self) -> None:
        """SIGKILL the kubelet and start it again (its Pods keep running)."""
        os.kill(self.process_pid("kubelet"), signal.SIGKILL)
        self.procs["kubelet"].wait(30)
        self._start_kubelet()

    def node(self) -> Obj | None:
        """The Node object, or None."""
        code, body = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        return body if code == 200 else None

    def is_ready(self) -> bool:
        """Whether the Node's Ready condition is True."""
        conds = ((self.node() or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the Node is Ready.

        Raises:
            ClusterUnavailable: the kubelet exited or the Node was not Ready in time.
        """

        def ready() -> bool:
            for name in ("containerd", "kubelet"):
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited {proc.returncode}:\n"
                                             f"{self.log_tail(name)}")  # fmt: skip
            return self.is_ready()

        try:
            wait_until(ready, timeout, 0.2, what=f"Node {self.name} to be Ready")
        except AssertionError as exc:
            raise ClusterUnavailable(f"{exc}\n{self.log_tail('kubelet')}") from exc

    # ------------------------------------------------------------- what tests look at

    def log(self, namespace: str, pod: str, container: str) -> str:
        """What a container wrote, through the API (``kubectl logs``: API server -> this
        kubelet). A Pod deleted since keeps the text last read of it, so that what a test
        gathers over time only grows (:meth:`logs`)."""
        key = (namespace, pod, container)
        code, body = self.cluster.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log?container={container}"
        )
        if code == 200 and isinstance(body, str):
            uid = ((self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")[1]
                    or {}).get("metadata") or {}).get("uid", "")  # fmt: skip
            self._logs[(*key, uid)] = body
        texts = [t for (ns, p, c, _), t in self._logs.items() if (ns, p, c) == key]
        return "\n".join(texts)

    def logs(self, namespace: str, container: str) -> str:
        """Every log of ``container`` in the namespace's Pods, present and deleted."""
        code, body = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        for pod in body.get("items", []) if code == 200 else []:
            self.log(namespace, pod["metadata"]["name"], container)
        return "\n".join(t for (ns, _, c, _), t in self._logs.items()
                         if ns == namespace and c == container)  # fmt: skip

    def container_pids(self, pod: Obj, container: str) -> list[int]:
        """Host pids of the processes in a container of ``pod`` (its cgroup under this
        node's ``cgroupRoot``; the container id from the Pod's status)."""
        status = pod.get("status") or {}
        cid = ""
        for c in (status.get("containerStatuses") or []) + (
            status.get("initContainerStatuses") or []
        ):
            if c["name"] == container and c.get("containerID"):
                cid = c["containerID"].split("://", 1)[1]
        if not cid:
            return []
        root = Path("/sys/fs/cgroup/pids") / self.cgroups.path.strip("/")
        uid = pod["metadata"]["uid"]
        out: list[int] = []
        for folder in root.rglob(f"pod{uid}"):
            procs = folder / cid / "cgroup.procs"
            with contextlib.suppress(OSError):
                out += [int(x) for x in procs.read_text().split()]
        return out

    def http_get(self, url: str, timeout: float = 5.0) -> str:
        """GET ``url`` from inside the node's network (a Pod's IP and port)."""
        import urllib.request

        from .netns import in_netns

        def get() -> str:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return str(response.read().decode())

        return in_netns(self.netns, get)

    def pids(self) -> list[int]:
        """Host pids of the processes in the node's own PID namespace (its init, containerd,
        the shims, the kubelet; the containers, in PID namespaces nested below it, are in
        :meth:`container_pids` and the node's cgroups)."""
        if not self.init_pid:
            return []
        try:
            ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns/pid") == ns:
                        out.append(int(entry.name))
        return sorted(out)

    def process_pid(self, name: str, timeout: float = 10.0) -> int:
        """The host pid of a node component (``kubelet``, ``containerd``): the child of its
        ``nsenter``, waited for (``nsenter`` forks it just after it started).

        Raises:
            ProcessLookupError: ``nsenter`` exited, or no child within ``timeout`` s.
        """
        proc = self.procs[name]

        def child() -> int | None:
            if proc.poll() is not None:
                raise ProcessLookupError(f"{name} of node {self.name} exited {proc.returncode}")
            kids = list_children(proc.pid)
            return kids[0] if kids else None

        try:
            return wait_until(child, timeout, 0.02, what=f"{name} of node {self.name}")
        except AssertionError as exc:
            raise ProcessLookupError(str(exc)) from None

    def explain(self, namespace: str, lines: int = 15) -> str:
        """What a failing test should print: each Pod's phase and container states, the
        tail of each container's log, the namespace's Warning events, the kubelet's tail."""
        out = []
        code, body = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        for pod in body.get("items", []) if code == 200 else []:
            name, status = pod["metadata"]["name"], pod.get("status") or {}
            out.append(f"=== pod {name}: {status.get('phase')} {status.get('reason', '')} "
                       f"ip={status.get('podIP')}")  # fmt: skip
            for c in (status.get("initContainerStatuses") or []) + (
                status.get("containerStatuses") or []
            ):
                out.append(f"  {c['name']}: ready={c.get('ready')} restarts={c.get('restartCount')}"
                           f" state={json.dumps(c.get('state'))[:400]}")  # fmt: skip
                text = self.log(namespace, name, c["name"])
                out += [f"    | {line}" for line in text.splitlines()[-lines:]]
        code, body = self.cluster.request(
            "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector=type%3DWarning"
        )
        for ev in body.get("items", []) if code == 200 else []:
            out.append(f"event {ev['involvedObject'].get('name')}: {ev.get('reason')}: "
                       f"{ev.get('message', '')[:300]}")  # fmt: skip
        out.append(self.log_tail("kubelet", lines))
        return "\n".join(out)

    def leftovers(self) -> list[str]:
        """What of the node is still on this machine after :meth:`stop` (should be [])."""
        out = self.cgroups.leftovers()
        if Path(f"/sys/class/net/{self.host_link}").exists():
            out.append(f"link {self.host_link}")
        mounts = Path("/proc/self/mounts").read_text()
        out += [line for line in mounts.splitlines() if str(self.workdir) in line]
        return out
