"""Test harness for the in-process coordinator: nodes on a real etcd, ranks as clients
speaking the protocol over the real unix socket (the real Wrapper comes later)."""

from __future__ import annotations

import contextlib
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kelastic import contract
from kelastic.inprocess_messages import (
    Abort,
    CoordinatorMessage,
    Fault,
    Hello,
    Progress,
    Ready,
    WorkerMessage,
    encode,
    parse_coordinator_message,
)
from kelastic.sockaddr import unix_address
from kelastic_etcd import EtcdClient
from kelastic_sidecar.config import InProcessSettings
from kelastic_sidecar.inprocess.coordinator import InProcessCoordinator, RoundContext
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer import TimerStats
from tests.conftest import wait_for


class Rank:
    """One wrapped worker, played by a socket client: sends messages, collects replies."""

    def __init__(self, path: Path, local_rank: int, rank: int, iteration: int = 0) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(path) as address:
            self.sock.connect(address)
        self.inbox: queue.Queue[CoordinatorMessage | None] = queue.Queue()
        self.got: list[CoordinatorMessage] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.send(Hello(pid=123456, local_rank=local_rank, rank=rank, iteration=iteration))

    def _read(self) -> None:
        buf = b""
        try:
            while chunk := self.sock.recv(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.inbox.put(parse_coordinator_message(line))
        except OSError:
            pass
        self.inbox.put(None)  # closed

    def send(self, msg: WorkerMessage) -> None:
        self.sock.sendall(encode(msg))

    def fault(self, iteration: int, message: str = "ValueError: boom") -> None:
        self.send(Fault(iteration, self.local_rank, "exception", message))

    def ready(self, iteration: int) -> None:
        self.send(Ready(iteration, self.local_rank))

    def progress(self, iteration: int) -> None:
        self.send(Progress(iteration, self.local_rank))

    def expect(self, kind: type, timeout: float = 20.0) -> CoordinatorMessage:
        """The next message, which must be of ``kind``."""
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank {self.rank}: no {kind.__name__} in {timeout}s") from None
        assert isinstance(msg, kind), f"rank {self.rank}: expected {kind.__name__}, got {msg}"
        self.got.append(msg)
        return msg

    def closed(self, timeout: float = 20.0) -> bool:
        """Whether the coordinator closed the connection (after any messages)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if msg is None:
                return True
            self.got.append(msg)
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class Node:
    """One node's coordinator and its ranks."""

    name: str
    coordinator: InProcessCoordinator
    metrics: SidecarMetrics
    run_dir: Path
    ctx: RoundContext | None = None
    ranks: list[Rank] = field(default_factory=list)
    killed: list[tuple[int, int]] = field(default_factory=list)
    #: what the coordinator's ``on_kill`` and ``kill`` saw, in order: ``("reap", pid,
    #: why)`` (the supervisor's reap of the hard timeout), ``("kill", pid, signal)``
    told: list[tuple[str, int, object]] = field(default_factory=list)

    @property
    def socket_path(self) -> Path:
        return contract.inprocess_socket_path(self.run_dir)

    def begin(
        self,
        round_: int,
        group_rank: int,
        participants: tuple[str, ...],
        nproc: int = 2,
        connect: bool = True,
        master: bool = True,
    ) -> int:
        """Begin round ``round_`` as ``group_rank`` (the ranks' env names a placeholder
        master unless not ``master``); connect the ranks as clients when ``connect``."""
        world = len(participants) * nproc
        envs = {
            lr: {
                contract.RANK: str(group_rank * nproc + lr),
                contract.LOCAL_RANK: str(lr),
                contract.WORLD_SIZE: str(world),
                contract.MASTER_ADDR: "round-master",
                contract.MASTER_PORT: "1",
                contract.KELASTIC_TIMER_TOKEN: f"token-{self.name}-{lr}",
            }
            for lr in range(nproc)
        }
        for env in envs.values():
            if not master:
                del env[contract.MASTER_ADDR], env[contract.MASTER_PORT]
        self.ctx = RoundContext(
            round=round_,
            group_rank=group_rank,
            group_world_size=len(participants),
            nproc=nproc,
            envs=envs,
            pod_ip=self.coordinator.pod_ip,
            participants=participants,
        )
        base = self.coordinator.begin(self.ctx)
        if connect:
            self.ranks = [self.connect(lr, base) for lr in range(nproc)]
        return base

    def connect(self, local_rank: int, iteration: int = 0) -> Rank:
        assert self.ctx is not None
        rank = Rank(
            self.socket_path, local_rank, self.ctx.group_rank * self.ctx.nproc + local_rank,
            iteration,
        )  # fmt: skip
        coord = self.coordinator
        wait_for(lambda: coord._call(lambda: coord.machine.has_session(local_rank)), 10,
                 what=f"{self.name} rank {local_rank} connected")  # fmt: skip
        return rank

    def flush(self) -> None:
        """Wait until the coordinator handled everything queued before now."""
        self.coordinator._call(lambda: None)


#: A rank (``python -c NEVER_READY SOCKET [beat]``) that says hello as local rank 1 and
#: then never answers: hung where no abort reaches it (a collective, a store's connect
#: retry). With ``beat``, its monitor thread runs: a ``beat`` every 50 ms (until stopped),
#: from when a line arrives on its stdin.
NEVER_READY = """
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
hello = {"type": "hello", "pid": os.getpid(), "local_rank": 1, "rank": 1, "iteration": 0}
s.sendall(json.dumps(hello).encode() + b"\\n")
print("connected", flush=True)
beat = sys.argv[2:] == ["beat"]
if beat:
    sys.stdin.readline()
while True:
    if beat:
        s.sendall(b'{"type":"beat","local_rank":1}\\n')
    time.sleep(0.05 if beat else 60)
"""


def settings(max_restarts: int = 10, soft: float = 30.0, hard: float = 60.0) -> InProcessSettings:
    return InProcessSettings(
        enabled=True, max_restarts=max_restarts, soft_timeout=soft, hard_timeout=hard
    )


@contextlib.contextmanager
def make_node(
    name: str,
    store: EtcdClient,
    prefix: str,
    pod_ip: str = "127.0.0.1",
    cfg: InProcessSettings | None = None,
) -> Iterator[Node]:
    run_dir = Path(tempfile.mkdtemp(prefix="kl-ip-", dir="/tmp"))
    metrics = SidecarMetrics(lambda: TimerStats())
    node = Node(name, None, metrics, run_dir)  # type: ignore[arg-type]

    def kill(pid: int, sig: int) -> None:
        node.killed.append((pid, sig))
        node.told.append(("kill", pid, sig))
        import os

        os.kill(pid, sig)

    node.coordinator = InProcessCoordinator(
        cfg or settings(), store, contract.Keys(prefix), name, metrics, run_dir, pod_ip,
        kill=kill, on_kill=lambda pid, why: node.told.append(("reap", pid, why)),
    )  # fmt: skip
    node.coordinator.start()
    try:
        yield node
    finally:
        for rank in node.ranks:
            rank.close()
        node.coordinator.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def sample(metrics: SidecarMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@contextlib.contextmanager
def rank_1_process(node: Node, script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """Local rank 1 of ``node`` played by a real process (``python -c script SOCKET
    *args``, which prints ``connected`` after its hello), connected; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(node.socket_path), *args],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
        coord = node.coordinator
        wait_for(lambda: coord._call(lambda: coord.machine.has_session(1)), 10, what="hello")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def fault_rank_0_and_leave(node: Node) -> None:
    """Connect local rank 0 of ``node``, make it fault in iteration 0 and leave it: the
    abort into iteration 1 waits for local rank 1 alone."""
    node.ranks = [node.connect(0)]
    node.ranks[0].fault(0)
    assert node.ranks[0].expect(Abort).iteration == 1  # type: ignore[attr-defined]
    node.ranks[0].ready(1)
