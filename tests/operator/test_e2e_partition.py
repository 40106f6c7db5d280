"""Network partitions on two real nodes: the digits job (real torch DDP over gloo in the
trainer image, the kelastic sidecar, Pod Security ``restricted``) with one Pod on each
node, its Pods talking across a real veth network (:mod:`tests.k8s.fabric`), and the node
of the Pod that does not hold rank 0 cut off for 20 s (one case 60 s), then healed
(and, last, cut for longer than the job's ``nodeLostSeconds`` after its Node went not
Ready: a dead node, its Pod replaced):

- from **etcd** only (its Pods' packets to and from its etcd relay dropped);
- from its **peers** only (its Pods' packets to and from the other node's Pods dropped);
- from **all**: both, and the kubelet from the API server and back.

Each test prints what kelastic did (the restarts charged, the Pods replaced, the time from
the cut to training again and from the heal to the full world again, the epochs trained
twice) and asserts what is promised: the job trains to the end (accuracy >= 0.90), no
checkpointed epoch is lost, and the restarts are those the README's failure table says.

The Pods reach etcd at one address, ``ETCD_VIP`` (a Service, as kube-proxy would make
it): each node DNATs it to a relay of its own, so cutting one node from etcd leaves the
other's path alone. The operator reaches etcd directly.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
import yaml

from kelastic_operator.handlers import OperatorContext, register
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.pods import PodSettings
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, StoreCache
from tests.k8s.cluster import Client, ClusterUnavailable, ControlPlane, pods_by_name, wait_until
from tests.k8s.fabric import Fabric
from tests.k8s.images import KELASTIC
from tests.k8s.kopf_thread import KopfThread
from tests.k8s.node import NODE_LABEL, PLACEMENT, TOLERATION, RealNode

from .conftest import DIGITS, operator_client, worker_procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
T = 120.0  # seconds a step of a scenario may take on a loaded 2-core machine
ETCD_VIP = "10.96.100.2"
#: how long each cut lasts: 20 s is > the job's lease TTL (5 s) and < the node-monitor
#: grace period (50 s); 60 s cut from everything lets the Node go NotReady too
CUTS = [("etcd", 20.0), ("peers", 20.0), ("all", 20.0), ("all", 60.0)]
EPOCHS = 40
SECOND_NODE = "kelastic-node-2"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def fabric(
    k8s_cluster: ControlPlane,
    node: RealNode,
    etcd_server: EmbeddedEtcd,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fabric]:
    """The session's node and a second one (``kelastic-node-2``, the same images), joined
    by a fabric; the tests' etcd offered to both nodes' Pods at ``ETCD_VIP``."""
    second = RealNode(k8s_cluster, tmp_path_factory.mktemp("node2"), node.images,
                      name=SECOND_NODE, index=2)  # fmt: skip
    fab = Fabric([node, second])
    try:
        try:
            second.start()
            fab.start()
        except ClusterUnavailable as exc:
            pytest.fail(f"the second node or the fabric did not start: {exc}")
        print(f"\nsecond node ready in {second.startup_seconds:.1f} s "
              f"(image import {second.image_import_seconds:.1f} s)")  # fmt: skip
        port = int(etcd_server.endpoint.rpartition(":")[2])
        for n in fab.nodes:
            n.expose(etcd_server.endpoint)
        fab.service(ETCD_VIP, port)
        yield fab
    finally:
        fab.stop()
        second.stop()
    assert fab.leftovers() == [], fab.leftovers()
    assert second.leftovers() == [], second.leftovers()


def _by_name(fab: Fabric, name: str) -> RealNode:
    (found,) = [n for n in fab.nodes if n.name == name]
    return found


@contextlib.contextmanager
def _operator(cluster: ControlPlane, k8s: Client, pods_etcd: str, own_etcd: str) -> Iterator[None]:
    """The operator's handlers serving ``k8s``'s namespace as its ServiceAccount (as
    :func:`tests.operator.conftest.running_operator`), telling the Pods ``pods_etcd`` and
    reaching etcd itself at ``own_etcd``."""
    client = operator_client(cluster, k8s.namespace)
    api = client.api_client()
    ctx = OperatorContext(
        api=api,
        pod_settings=PodSettings(sidecar_image=KELASTIC, etcd_endpoints=(pods_etcd,), stop_grace=3),
        stores=StoreCache(lambda _: EtcdRendezvousStore([own_etcd], timeout=3, time_retry=0.5)),
        resync_seconds=30.0,
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    try:
        with KopfThread(client, registry):
            yield
            k8s.kubectl("delete", "elasticjobs", "--all", "--wait=false", check=False)
    finally:
        ctx.status_hubs.close()
        ctx.stores.close()
        api.close()


# ------------------------------------------------------------- Pod to Pod across nodes


def _placed(name: str, node: str, command: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {NODE_LABEL: "true", "kubernetes.io/hostname": node},
            "tolerations": [TOLERATION],
            "containers": [{"name": "main", "image": KELASTIC, "command": command}],
        },
    }  # fmt: skip


def _pod_status(k8s: Client, name: str) -> dict[str, Any]:
    return (k8s.get("pod", name) or {}).get("status") or {}


#: connect to PEER:8080 and read one line, 3 s at most
CLIENT = (
    "import socket, sys\n"
    "with socket.create_connection((sys.argv[1], 8080), timeout=3) as s:\n"
    "    print(s.makefile().readline().strip())\n"
)
SERVER = (
    "import socket, os\n"
    "srv = socket.create_server(('0.0.0.0', 8080))\n"
    "while True:\n"
    "    c, addr = srv.accept()\n"
    "    c.sendall(f'hello {addr[0]} from {os.uname().nodename}\\n'.encode())\n"
    "    c.close()\n"
)


def test_pods_on_two_nodes_talk_over_the_fabric_and_a_cut_stops_them(
    k8s: Client, fabric: Fabric
) -> None:
    """A Pod on each node: one serves TCP, the other connects to its Pod IP across the
    fabric; with the client's node cut from its peers the connection fails, healed it
    works again. Nothing leaves the namespaces: a node has no route beyond them."""
    first, second = fabric.nodes
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        _placed("server", first.name, ["python", "-c", SERVER])))  # fmt: skip
    ip = wait_until(lambda: _pod_status(k8s, "server").get("podIP"), T, 0.2, what="server IP")
    assert ip.startswith(first.pod_cidr.rsplit(".", 2)[0])
    wait_until(lambda: _pod_status(k8s, "server").get("phase") == "Running", T, 0.2,
               what="server Running")  # fmt: skip

    def client(name: str) -> tuple[str, str]:
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(
            _placed(name, second.name, ["python", "-c", CLIENT, ip])))  # fmt: skip
        phase = wait_until(
            lambda: _pod_status(k8s, name).get("phase") in ("Succeeded", "Failed")
            and _pod_status(k8s, name)["phase"],
            T, 0.2, what=f"{name} done",
        )  # fmt: skip
        return phase, second.log(k8s.namespace, name, "main")

    phase, text = client("across")
    assert phase == "Succeeded", f"{text}\n{second.explain(k8s.namespace)}"
    client_ip = _pod_status(k8s, "across")["podIP"]
    assert text.strip() == f"hello {client_ip} from server", text  # no NAT on the way
    fabric.cut(second, "peers")
    try:
        phase, text = client("while-cut")
        assert phase == "Failed", text
        assert "timed out" in text, text
    finally:
        fabric.heal(second)
    phase, text = client("healed")
    assert phase == "Succeeded", text
    for n in fabric.nodes:  # no default route: a Pod's packet to elsewhere goes nowhere
        assert "default" not in n.nsenter("ip", "route", "show"), n.nsenter("ip", "route")


# ----------------------------------------------------------------- the digits job, cut


def _manifest(epochs: int = EPOCHS, **spec: Any) -> str:
    doc = copy.deepcopy(yaml.safe_load(DIGITS.read_text()))
    doc["spec"].update(replicas=2, minReplicas=1, maxReplicas=2, **spec)
    pod = doc["spec"]["template"]["spec"]
    pod.update(copy.deepcopy(PLACEMENT))
    pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"kelastic.dev/job-name": "digits"}},
         "topologyKey": "kubernetes.io/hostname"}]}}  # one Pod per node  # fmt: skip
    pod["containers"][0]["args"] = ["--epochs", str(epochs), "--batch-size", "8",
                                    "--step-timeout", "3"]  # fmt: skip
    return yaml.safe_dump(doc)


def _status(k8s: Client) -> dict[str, Any]:
    return ((k8s.get("elasticjob", "digits") or {}).get("status")) or {}


EPOCH = re.compile(r"^(\S+) .*\bepoch (\d+)/\d+ step \d+ .* world (\d+) ")
STOP = re.compile(r"^(\S+) .*kelastic\.launch INFO: attempt \d+: stop requested: (.*)$")
ROUND = re.compile(r"^(\S+) .*kelastic\.launch INFO: attempt \d+ \(round (\d+)\): starting")


def _when(stamp: str) -> float:
    """A container log's RFC 3339 timestamp (nanoseconds) as ``time.time()``."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    day = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC)
    return day.timestamp() + float(f"0.{frac or 0}")


@dataclass
class Logs:
    """The trainers' output with the kubelet's timestamps, read through the API while the
    test runs (a replaced Pod's text is kept); skips the Pods of a cut node."""

    cluster: ControlPlane
    namespace: str
    texts: dict[str, str] = field(default_factory=dict)  # pod uid -> text

    def poll(self, skip_nodes: set[str]) -> None:
        for name, pod in pods_by_name(self.cluster.admin, self.namespace).items():
            if (pod.get("spec") or {}).get("nodeName") in skip_nodes:
                continue
            code, body = self.cluster.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}/log"
                "?container=trainer&timestamps=true",
            )  # fmt: skip
            if code == 200 and isinstance(body, str):
                self.texts[pod["metadata"]["uid"]] = body

    def epochs(self) -> list[tuple[float, int, int]]:
        """``(time, epoch done, world size)`` of every epoch line, in time order."""
        out = []
        for text in self.texts.values():
            for line in text.splitlines():
                m = EPOCH.match(line)
                if m:
                    out.append((_when(m[1]), int(m[2]), int(m[3])))
        return sorted(out)

    def rounds(self) -> list[tuple[float, int]]:
        """``(time, round)`` of every launcher's start of a worker group, in time order."""
        out = []
        for text in self.texts.values():
            for line in text.splitlines():
                m = ROUND.match(line)
                if m:
                    out.append((_when(m[1]), int(m[2])))
        return sorted(out)

    def stops(self) -> list[tuple[float, str]]:
        """``(time, why)`` of every launcher's stop of its worker group (``node_lost: ...``,
        ``scale``, ...), in time order."""
        out = []
        for text in self.texts.values():
            for line in text.splitlines():
                m = STOP.match(line)
                if m:
                    out.append((_when(m[1]), m[2]))
        return sorted(out)

    def text(self) -> str:
        return "\n".join(self.texts.values())


@dataclass
class Measured:
    """What a cut cost: see :func:`_measure`."""

    cut: str
    seconds: float
    restarts: int
    replacements: int
    epoch_at_cut: int
    stalls: list[tuple[float, float, int, int]]  # (from, to) after the cut; epochs before/after
    to_train_again: float
    to_full_world: float
    epochs_redone: int
    accuracy: float
    cold_start: float  # the job's first worker start to its first epoch line (for scale)
    last_round: tuple[int, float]  # the round training resumed in; its start after the cut
    stops: list[tuple[float, str]] = field(default_factory=list)  # after the cut: why

    def line(self) -> str:
        stalls = ", ".join(
            f"{a:.1f}-{b:.1f} s (epoch {e0} -> {e1})" for a, b, e0, e1 in self.stalls
        )
        return (
            f"cut from {self.cut} for {self.seconds:.0f} s at epoch {self.epoch_at_cut}: "
            f"{self.restarts} restart(s) charged, {self.replacements} Pod(s) replaced; "
            f"training again {self.to_train_again:.1f} s after the cut, world 4 again "
            f"{self.to_full_world:.1f} s after the heal; stalls (from the cut) {stalls or 'none'}; "
            f"{self.epochs_redone} epoch(s) trained twice; accuracy {self.accuracy:.4f}; "
            f"resumed in round {self.last_round[0]}, started {self.last_round[1]:.1f} s after "
            f"the cut (the job's cold start: {self.cold_start:.1f} s); worker groups stopped: "
            + "; ".join(f"+{t:.1f} s {why[:120]}" for t, why in self.stops)
        )


def _measure(
    cut: tuple[str, float], logs: Logs, cut_at: float, heal_at: float, final: dict[str, Any]
) -> Measured:
    """From the epoch lines: the epoch done at the cut; the stalls after it (two epoch
    lines more than 3 s apart: an epoch takes ~1 s); the time from the cut to the first
    epoch line after the first stall (0 when training never stopped); from the heal to the
    first epoch line at world 4; the epochs trained twice (an epoch line whose number was
    already printed)."""
    epochs = logs.epochs()
    before = [e for t, e, _ in epochs if t <= cut_at]
    after = [(t, e, w) for t, e, w in epochs if t > cut_at]
    at_cut = max(before, default=0)
    stalls = []
    prev_t, prev_e = cut_at, at_cut
    for t, e, _ in after:
        if t - prev_t > 3.0:
            stalls.append((prev_t - cut_at, t - cut_at, prev_e, e))
        prev_t, prev_e = t, e
    again = stalls[0][1] if stalls else 0.0
    full = next((t - heal_at for t, _, w in after if t > heal_at and w == 4), float("nan"))
    seen: set[int] = set()
    redone = 0
    for _, e, _ in epochs:
        redone += e in seen
        seen.add(e)
    found = re.findall(r"final test accuracy (\d\.\d+)", logs.text())
    rounds = logs.rounds()
    cold = epochs[0][0] - rounds[0][0] if epochs and rounds else float("nan")
    resumed_at = cut_at + again
    last = max(((r, t - cut_at) for t, r in rounds if t < resumed_at), default=(0, float("nan")))
    return Measured(
        cut=cut[0],
        seconds=cut[1],
        restarts=int(final.get("restartsSpent") or 0),
        replacements=int(final.get("replacements") or 0),
        epoch_at_cut=at_cut,
        stalls=stalls,
        to_train_again=again,
        to_full_world=full,
        epochs_redone=redone,
        accuracy=float(found[-1]) if found else float("nan"),
        cold_start=cold,
        last_round=last,
        stops=[(t - cut_at, why) for t, why in logs.stops() if t > cut_at],
    )


MEASURED: list[Measured] = []


@pytest.mark.parametrize(("cut", "seconds"), CUTS, ids=[f"{c}-{s:.0f}s" for c, s in CUTS])
def test_a_node_cut_off_mid_training(
    cut: str,
    seconds: float,
    k8s: Client,
    k8s_cluster: ControlPlane,
    fabric: Fabric,
    etcd_server: EmbeddedEtcd,
) -> None:
    ns = k8s.namespace
    k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    k8s.claim("digits-checkpoints")
    port = int(etcd_server.endpoint.rpartition(":")[2])
    logs = Logs(k8s_cluster, ns)
    timeline: list[str] = []
    t0 = time.time()

    def explain() -> str:
        return "\n".join([f"status: {_status(k8s)}", *timeline,
                          *(n.explain(ns, 25) for n in fabric.nodes)])  # fmt: skip

    def wait(condition: Any, timeout: float, what: str, skip: set[str] | None = None) -> Any:
        last: list[Any] = [None]

        def check() -> Any:
            logs.poll(skip or set())
            status = _status(k8s)
            failure = status.get("lastFailure") or {}
            nodes = " ".join(f"{n.name}={'Ready' if n.is_ready() else 'NotReady'}"
                             for n in fabric.nodes)  # fmt: skip
            seen = (status.get("phase"), status.get("worldSize"), status.get("restartsSpent"),
                    status.get("replacements"), failure.get("message", "")[:200],
                    status.get("readyReplicas"), nodes)  # fmt: skip
            if seen != last[0]:
                last[0] = seen
                timeline.append(f"{time.time() - t0:7.1f} s phase {seen[0]} world {seen[1]} "
                                f"ready {seen[5]} restarts {seen[2]} replacements {seen[3]} "
                                f"{nodes} {seen[4]}")  # fmt: skip
            return condition()

        try:
            return wait_until(check, timeout, 0.5, what=what)
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{explain()}")

    with _operator(k8s_cluster, k8s, f"{ETCD_VIP}:{port}", etcd_server.endpoint):
        k8s.kubectl("apply", "-f", "-", input=_manifest())
        wait(lambda: _status(k8s).get("worldSize") == 4, 2 * T, "world size 4")
        wait(lambda: "epoch 3/" in logs.text(), T, "training")
        where = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods_by_name(k8s).values()}
        assert sorted(where.values()) == sorted(n.name for n in fabric.nodes), where

        # cut the node of the Pod without global rank 0 (rank 0's holds MASTER_ADDR)
        def ranks() -> dict[int, str] | None:
            found = {r: pod for n in fabric.nodes for pod, r, _ in worker_procs(n, ns)}
            return found if sorted(found) == [0, 1, 2, 3] else None

        holder = wait(ranks, T, "the 4 workers")[0]
        victim = _by_name(fabric, next(n for p, n in where.items() if p != holder))
        cut_at = fabric.cut(victim, cut)
        timeline.append(f"{cut_at - t0:7.1f} s cut {victim.name} from {cut}")
        skip = {victim.name} if cut == "all" else set()
        wait(lambda: time.time() - cut_at >= seconds, seconds + 10, "the cut", skip)
        heal_at = fabric.heal(victim)
        timeline.append(f"{heal_at - t0:7.1f} s healed")
        wait(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"), 5 * T, "done")
        final = _status(k8s)
        logs.poll(set())
        print(f"\n{cut}: {final}\n" + "\n".join(timeline))
        assert final["phase"] == "Succeeded", explain()
    measured = _measure((cut, seconds), logs, cut_at, heal_at, final)
    MEASURED.append(measured)
    print(measured.line())
    assert measured.accuracy >= 0.90, logs.text()[-3000:]
    # nothing checkpointed is lost, nothing trained twice: rank 0 checkpoints each epoch
    # before it prints its line, and a new round resumes from the last checkpoint
    assert measured.epochs_redone == 0, measured
    assert sorted({e for _, e, _ in logs.epochs()}) == list(range(1, EPOCHS + 1)), measured
    # the design (README, failure handling): a node cut off and back costs one restart,
    # charged to it; its Pod is not failed, so nothing is replaced
    assert (measured.restarts, measured.replacements) == (1, 0), measured


def test_a_node_back_after_its_peer_finished_the_training_trains_nothing_again(
    k8s: Client, k8s_cluster: ControlPlane, fabric: Fabric, etcd_server: EmbeddedEtcd
) -> None:
    """The node without rank 0 cut from etcd until its peer, training alone, has finished
    the job's epochs (its Pod Succeeded), then healed: the end of the training closed the
    rendezvous, so it forms no round and succeeds with nothing left to train; no epoch is
    trained twice. Found in CI (the 20 s cut of ``test_a_node_cut_off_mid_training``
    healed just after the peer finished): the node back formed a round alone and trained
    two epochs again from a persisted step."""
    ns = k8s.namespace
    k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    k8s.claim("digits-checkpoints")
    port = int(etcd_server.endpoint.rpartition(":")[2])
    logs = Logs(k8s_cluster, ns)

    def wait(condition: Any, timeout: float, what: str) -> Any:
        def check() -> Any:
            logs.poll(set())
            return condition()

        try:
            return wait_until(check, timeout, 0.5, what=what)
        except AssertionError as exc:
            pytest.fail(f"{exc}\nstatus: {_status(k8s)}\n" +
                        "\n".join(n.explain(ns, 25) for n in fabric.nodes))  # fmt: skip

    def trainer(pod: str) -> dict[str, Any]:
        statuses = _pod_status(k8s, pod).get("containerStatuses") or []
        return next((c for c in statuses if c.get("name") == "trainer"), {})

    with _operator(k8s_cluster, k8s, f"{ETCD_VIP}:{port}", etcd_server.endpoint):
        k8s.kubectl("apply", "-f", "-", input=_manifest())
        wait(lambda: _status(k8s).get("worldSize") == 4, 2 * T, "world size 4")
        wait(lambda: "epoch 3/" in logs.text(), T, "training")
        where = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods_by_name(k8s).values()}

        def ranks() -> dict[int, str] | None:
            found = {r: pod for n in fabric.nodes for pod, r, _ in worker_procs(n, ns)}
            return found if sorted(found) == [0, 1, 2, 3] else None

        holder = wait(ranks, T, "the 4 workers")[0]
        back = next(p for p in where if p != holder)
        fabric.cut(_by_name(fabric, where[back]), "etcd")
        wait(lambda: _pod_status(k8s, holder).get("phase") == "Succeeded", 5 * T,
             f"{holder} finished the training alone")  # fmt: skip
        fabric.heal(_by_name(fabric, where[back]))
        wait(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"), 3 * T, "done")
        final = _status(k8s)
        logs.poll(set())
        ended = (trainer(back).get("state") or {}).get("terminated") or {}
    assert final["phase"] == "Succeeded", final
    assert ended.get("exitCode") == 0, ended
    assert "the training finished on" in ended.get("message", "") and (
        f"{back} has nothing left to train" in ended["message"]), ended  # fmt: skip
    epochs = [e for _, e, _ in logs.epochs()]
    assert len(epochs) == len(set(epochs)) == EPOCHS, epochs  # none trained twice, none lost
    assert (final.get("restartsSpent"), final.get("replacements") or 0) == (1, 0), final


def test_print_the_measurements() -> None:
    """One line per cut (``-s`` shows them; also in tests/k8s/README.md)."""
    for m in MEASURED:
        print(m.line())


#: The lost-node test's ``spec.nodeLostSeconds``.
NODE_LOST = 10.0
#: Its epochs: the survivor alone must not finish them before the Node is healed (~90 s
#: after the cut: the grace period, nodeLostSeconds, the waits; about 1.2 s an epoch alone,
#: and 40 epochs ended the job before the Pod was created again in one run).
LOST_EPOCHS = 300


def test_a_node_dead_past_node_lost_seconds_has_its_pod_replaced(
    k8s: Client, k8s_cluster: ControlPlane, fabric: Fabric, etcd_server: EmbeddedEtcd
) -> None:
    """A node cut off from everything (dead, as the control plane sees it) for longer than
    the node-monitor grace period (~50 s) and the job's ``nodeLostSeconds`` (10 s): the
    operator force-deletes its Pod (a graceful deletion would never be confirmed) and
    creates it again, Pending meanwhile (one Pod per node, and the dead Node is tainted);
    the survivor trains alone, the loss charged once. Healed, the Node takes the new Pod,
    which joins (a scale round, no charge), and the job ends with nothing lost."""
    ns = k8s.namespace
    k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    k8s.claim("digits-checkpoints")
    port = int(etcd_server.endpoint.rpartition(":")[2])
    logs = Logs(k8s_cluster, ns)
    t0 = time.time()
    timeline: list[str] = []

    def wait(condition: Any, timeout: float, what: str, skip: set[str] | None = None) -> Any:
        def check() -> Any:
            logs.poll(skip or set())
            return condition()

        try:
            found = wait_until(check, timeout, 0.5, what=what)
        except AssertionError as exc:
            pytest.fail(f"{exc}\nstatus: {_status(k8s)}\n" + "\n".join(timeline))
        timeline.append(f"{time.time() - t0:7.1f} s {what}")
        return found

    with _operator(k8s_cluster, k8s, f"{ETCD_VIP}:{port}", etcd_server.endpoint):
        job = _manifest(LOST_EPOCHS, nodeLostSeconds=NODE_LOST)
        k8s.kubectl("apply", "-f", "-", input=job)
        wait(lambda: _status(k8s).get("worldSize") == 4, 2 * T, "world size 4")
        wait(lambda: "epoch 3/" in logs.text(), T, "training")
        pods = pods_by_name(k8s)
        where = {name: p["spec"]["nodeName"] for name, p in pods.items()}

        def ranks() -> dict[int, str] | None:
            found = {r: pod for n in fabric.nodes for pod, r, _ in worker_procs(n, ns)}
            return found if sorted(found) == [0, 1, 2, 3] else None

        holder = wait(ranks, T, "the 4 workers")[0]
        lost = next(name for name in where if name != holder)
        victim = _by_name(fabric, where[lost])
        first_uid = pods[lost]["metadata"]["uid"]
        fabric.cut(victim, "all")
        skip = {victim.name}
        wait(lambda: not victim.is_ready(), 150, f"{victim.name} not Ready", skip)

        def replaced() -> bool:
            pod = pods_by_name(k8s).get(lost)
            return pod is not None and pod["metadata"]["uid"] != first_uid

        wait(replaced, NODE_LOST + T, f"{lost} force-deleted and created again", skip)
        failure = (_status(k8s).get("lastFailure") or {}).get("message", "")
        assert failure.startswith(f"node_lost: node {victim.name} not Ready since "), failure
        alone = "the survivor trains alone (world 2)"
        wait(lambda: any(w == 2 for _, _, w in logs.epochs()), 3 * T, alone, skip)
        fabric.heal(victim)
        timeline.append(f"{time.time() - t0:7.1f} s healed")
        wait(lambda: _status(k8s).get("worldSize") == 4, 3 * T, "the new Pod joined (world 4)")
        wait(lambda: _status(k8s).get("phase") in ("Succeeded", "Failed"), 8 * T, "done")
        final = _status(k8s)
        logs.poll(set())
    print("\n" + "\n".join(timeline) + f"\nfinal: {final}")
    assert final["phase"] == "Succeeded", final
    # the loss is charged once, by the survivor; the force-deletion and the new Pod's
    # joining charge nothing, and no Pod is counted as a replacement
    assert (final.get("restartsSpent"), final.get("replacements") or 0) == (1, 0), final
    accuracy = [float(a) for a in re.findall(r"final test accuracy (\d\.\d+)", logs.text())]
    assert accuracy and max(accuracy) >= 0.90, logs.text()[-3000:]
    assert sorted({e for _, e, _ in logs.epochs()}) == list(range(1, LOST_EPOCHS + 1))
