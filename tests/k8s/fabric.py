"""A network between real test nodes, and cuts of one node from it.

    with Fabric([node_a, node_b]) as fabric:      # Pods of a reach Pods of b, and back
        fabric.service("10.96.0.2", etcd_port, node.expose(etcd))   # on every node
        fabric.cut(node_b, "etcd")                # or "peers", or "all"
        fabric.heal(node_b)

What it makes, all in namespaces of the test's own (this machine's namespaces, its
``ip_forward`` and its netfilter are never touched):

- a **fabric** network namespace (an ``unshare --net`` holder running the static
  ``pause``) with a bridge ``br0``, and for each node a veth pair: ``f<index>`` on the
  bridge, ``fab0`` in the node (``10.244.254.<index>/24``). A bridge switches frames:
  the fabric namespace forwards nothing at the IP level and has no address of its own.
- in each node: a route for every other node's Pod CIDR via that node's ``fab0``
  address, ``ip_forward`` on (the node's own namespace), and a chain ``KEL-FABRIC``
  (jumped to from ``FORWARD``) that lets through ``fab0`` only packets between its own
  Pod CIDR and another node's: nothing else enters or leaves a node by the fabric, and a
  node still forwards nothing out through its uplink (``FORWARD -o eth0 -j DROP``).
- **services** (:meth:`service`): a virtual ``ip:port`` DNAT-ed in every node to a relay
  of that node's own (:meth:`RealNode.expose`), as kube-proxy would for a Service, so
  that the same address in the Pod spec reaches one etcd from each node by its own path.
- **cuts** (:meth:`cut`), in the cut node's own netfilter (a chain ``KEL-CUT`` jumped to
  first from ``INPUT``, ``OUTPUT`` and ``FORWARD``; packets are dropped, not refused, as
  when a network goes away): ``etcd`` drops what passes between the node's Pods and its
  etcd relay; ``peers`` drops what passes between its Pods and other nodes' Pods;
  ``all`` both, and its API server relay (the kubelet and in-cluster clients) and its
  uplink (the API server's calls to the kubelet). :meth:`heal` flushes the chain.

:meth:`stop` leaves nothing: the fabric's holder dies (its namespace, the bridge and
every veth pair go with it), and the chains, routes and DNAT rules it wrote in the
nodes are removed (the nodes may live on: the session's node does).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from kelastic._workers import child_preexec, list_children

from .cluster import ClusterUnavailable, wait_until
from .node import RealNode

FABRIC_NET = "10.244.254"
CUTS = ("etcd", "peers", "all")
FABRIC_CHAIN = "KEL-FABRIC"
CUT_CHAIN = "KEL-CUT"


class Fabric:
    """The network between ``nodes`` (see the module docstring).

    Args:
        nodes: started :class:`RealNode` s with distinct indexes.
    """

    def __init__(self, nodes: Iterable[RealNode]) -> None:
        self.nodes = list(nodes)
        if len({n.index for n in self.nodes}) != len(self.nodes):
            raise ValueError("the nodes' indexes must differ")
        self.holder: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.services: list[tuple[str, int]] = []  # (vip, port)
        self.cut_now: dict[str, str] = {}  # node name -> what is cut

    def __enter__(self) -> Fabric:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @staticmethod
    def address(node: RealNode) -> str:
        """The node's address on the fabric (its ``fab0``)."""
        return f"{FABRIC_NET}.{node.index}"

    # ----------------------------------------------------------------------- lifecycle

    def start(self) -> Fabric:
        """Make the fabric namespace, its bridge, each node's link, routes and rules.

        Raises:
            ClusterUnavailable: a command failed (its output in the message).
        """
        try:
            self._start_holder()
            self._in_fabric("ip link set lo up", "ip link add br0 type bridge",
                            "ip link set br0 up")  # fmt: skip
            for node in self.nodes:
                self._attach(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_holder(self) -> None:
        pause = self.nodes[0].bin / "pause"
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--fork", "--kill-child", str(pause)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(child_preexec, os.getpid()),
        )  # fmt: skip

        def started() -> bool:
            assert self.holder is not None
            if self.holder.poll() is not None:
                raise ClusterUnavailable(f"unshare exited with {self.holder.returncode}")
            kids = list_children(self.holder.pid)
            if kids and Path(f"/proc/{kids[0]}/exe").resolve().name == "pause":
                self.pid = kids[0]
                return True
            return False

        wait_until(started, 10, 0.02, what="the fabric's namespace")

    @property
    def netns(self) -> str:
        """The fabric's network namespace (``/proc/<pid>/ns/net``)."""
        return f"/proc/{self.pid}/ns/net"

    def _in_fabric(self, *lines: str) -> None:
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-n", "--", "sh", "-c",
             "\n".join(["set -e", *lines])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if result.returncode:
            raise ClusterUnavailable(f"in the fabric: {(result.stdout + result.stderr)[-2000:]}")

    @staticmethod
    def _in_node(node: RealNode, *lines: str, check: bool = True) -> str:
        """Run shell lines in the node's network namespace only (``nsenter -n``: this
        machine's ``/proc/sys/net`` then shows the node's own namespace)."""
        result = subprocess.run(
            ["nsenter", "-t", str(node.init_pid), "-n", "--", "sh", "-c",
             "\n".join(["set -e" if check else "", *lines])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if check and result.returncode:
            raise ClusterUnavailable(
                f"in node {node.name}: {(result.stdout + result.stderr)[-2000:]}"
            )
        return result.stdout

    def _attach(self, node: RealNode) -> None:
        inside, outside = "fab0", f"f{node.index}"
        self._in_fabric(
            f"ip link add {outside} type veth peer name {inside} netns {node.init_pid}",
            f"ip link set {outside} master br0", f"ip link set {outside} up",
        )  # fmt: skip
        others = [n for n in self.nodes if n is not node]
        self._in_node(node, *[
            f"ip addr add {self.address(node)}/24 dev {inside}",
            f"ip link set {inside} up",
            "sysctl -qw net.ipv4.ip_forward=1",
            *[f"ip route add {o.pod_cidr} via {self.address(o)} dev {inside}" for o in others],
            f"iptables -w -N {FABRIC_CHAIN}",
            *[f"iptables -w -A {FABRIC_CHAIN} -i {inside} -s {o.pod_cidr} -d {node.pod_cidr} "
              "-j ACCEPT" for o in others],
            *[f"iptables -w -A {FABRIC_CHAIN} -o {inside} -s {node.pod_cidr} -d {o.pod_cidr} "
              "-j ACCEPT" for o in others],
            f"iptables -w -A {FABRIC_CHAIN} -i {inside} -j DROP",
            f"iptables -w -A {FABRIC_CHAIN} -o {inside} -j DROP",
            f"iptables -w -I FORWARD 1 -j {FABRIC_CHAIN}",
            # nothing but forwarded Pod traffic: the node's own sockets are not on the fabric
            f"iptables -w -I INPUT 1 -i {inside} -j DROP",
            f"iptables -w -N {CUT_CHAIN}",
            *[f"iptables -w -I {hook} 1 -j {CUT_CHAIN}" for hook in ("INPUT", "OUTPUT",
                                                                     "FORWARD")],
        ])  # fmt: skip

    def stop(self) -> None:
        """Remove everything the fabric made (idempotent)."""
        if self.holder is not None:
            with contextlib.suppress(ProcessLookupError):
                self.holder.kill()
            if self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, 9)
            self.holder.wait(30)
            self.holder = None
        for node in self.nodes:
            if not node.init_pid:
                continue
            self._in_node(node, *[
                f"iptables -w -D {hook} -j {CUT_CHAIN}" for hook in ("INPUT", "OUTPUT", "FORWARD")
            ], f"iptables -w -D FORWARD -j {FABRIC_CHAIN}", "iptables -w -D INPUT -i fab0 -j DROP",
                *[f"iptables -w -F {c}; iptables -w -X {c}" for c in (CUT_CHAIN, FABRIC_CHAIN)],
                *[f"iptables -w -t nat -D PREROUTING -d {vip} -p tcp --dport {port} -j DNAT "
                  f"--to-destination {node.ip}:{port}" for vip, port in self.services],
                "ip link del fab0", check=False)  # fmt: skip
        self.cut_now.clear()
        self.pid = 0

    def leftovers(self) -> list[str]:
        """What of the fabric is still in the nodes or on this machine (should be [])."""
        out = (
            [f"fabric holder {self.pid}"] if self.pid and Path(f"/proc/{self.pid}").exists() else []
        )
        for node in self.nodes:
            if not node.init_pid:
                continue
            rules = self._in_node(node, "iptables -w -S; iptables -w -t nat -S", check=False)
            out += [f"{node.name}: {r}" for r in rules.splitlines()
                    if CUT_CHAIN in r or FABRIC_CHAIN in r or "fab0" in r
                    or any(vip in r for vip, _ in self.services)]  # fmt: skip
            links = self._in_node(node, "ip -o link show", check=False)
            out += [f"{node.name}: link fab0" for line in links.splitlines() if " fab0@" in line]
        return out

    # ------------------------------------------------------------------------ services

    def service(self, vip: str, port: int) -> str:
        """``vip:port``, DNAT-ed in every node to that node's relay at its own address and
        ``port`` (which :meth:`RealNode.expose` must have made); returns ``vip:port``."""
        for node in self.nodes:
            if not any(r.endswith(f":{port}") for r in node.relays):
                raise ValueError(f"node {node.name} exposes nothing on port {port}")
            self._in_node(node, f"iptables -w -t nat -A PREROUTING -d {vip} -p tcp --dport {port}"
                                f" -j DNAT --to-destination {node.ip}:{port}")  # fmt: skip
        self.services.append((vip, port))
        return f"{vip}:{port}"

    # ---------------------------------------------------------------------------- cuts

    def cut(self, node: RealNode, what: str) -> float:
        """Cut ``node`` off: from ``etcd`` (every service port of :meth:`service`), from
        its ``peers`` (the other nodes' Pods), or from ``all`` (both, the API server's relay
        and the uplink). Returns the time (``time.time()``) the rules were in place."""
        if what not in CUTS:
            raise ValueError(f"cut {what!r}: one of {CUTS}")
        rules: list[str] = []
        if what in ("etcd", "all"):
            for _, port in self.services:
                rules += [f"-A {CUT_CHAIN} -d {node.ip} -p tcp --dport {port} -j DROP",
                          f"-A {CUT_CHAIN} -s {node.ip} -p tcp --sport {port} -j DROP"]  # fmt: skip
        if what in ("peers", "all"):
            for other in self.nodes:
                if other is not node:
                    rules += [f"-A {CUT_CHAIN} -s {other.pod_cidr} -j DROP",
                              f"-A {CUT_CHAIN} -d {other.pod_cidr} -j DROP"]  # fmt: skip
        if what == "all":
            port = node.cluster.port
            rules += [f"-A {CUT_CHAIN} -d {node.ip} -p tcp --dport {port} -j DROP",
                      f"-A {CUT_CHAIN} -s {node.ip} -p tcp --sport {port} -j DROP",
                      f"-A {CUT_CHAIN} -i eth0 -j DROP",
                      f"-A {CUT_CHAIN} -o eth0 -j DROP"]  # fmt: skip
        # one iptables-restore: every rule at the same instant (--noflush keeps the others)
        text = "\n".join(["*filter", f"-F {CUT_CHAIN}", *rules, "COMMIT", ""])
        result = subprocess.run(
            ["nsenter", "-t", str(node.init_pid), "-n", "--", "iptables-restore", "-w",
             "--noflush"], input=text, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if result.returncode:
            raise ClusterUnavailable(f"cut {what} of {node.name}: {result.stderr[-2000:]}")
        at = time.time()
        self.cut_now[node.name] = what
        return at

    def heal(self, node: RealNode) -> float:
        """Undo :meth:`cut`; returns the time the rules were gone."""
        self._in_node(node, f"iptables -w -F {CUT_CHAIN}")
        self.cut_now.pop(node.name, None)
        return time.time()

    def cut_rules(self, node: RealNode) -> list[str]:
        """The rules of the node's cut chain now (``iptables -S``)."""
        return self._in_node(node, f"iptables -w -S {CUT_CHAIN}").splitlines()[1:]
