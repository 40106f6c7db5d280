"""Harness for the in-process restart tests: a test coordinator playing the sidecar over
the real unix socket, and real worker processes (``python -c WORKER``) that report what
they do as JSON lines on stdout. Everything waits on conditions with deadlines.

The coordinator's default policy is the sidecar's simplest one: the first ``fault`` of
the current iteration ``n`` makes it send ``abort(n + 1)`` to every worker; once every
worker sent ``ready(m)`` for the current target ``m`` it sends ``go(m)`` with a fresh
``MASTER_PORT``. ``auto=False`` leaves every decision to the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic._control import LineBuffer
from kelastic.inprocess_messages import (
    MAX_LINE,
    Abort,
    CoordinatorMessage,
    Fault,
    GiveUp,
    Go,
    Hello,
    Ready,
    WorkerMessage,
    encode,
    parse_worker_message,
)
from kelastic_operator.local.etcd import free_port

ROOT = Path(__file__).resolve().parents[2]

# What a worker does is chosen by KL_* env (per rank: KL_<NAME>_<rank>, else KL_<NAME>).
WORKER = textwrap.dedent(
    r"""
    import faulthandler, json, os, signal, sys, threading, time
    faulthandler.enable()  # stacks of a crashed worker
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks of a stuck worker
    from kelastic.inprocess import CallWrapper, RestartAbort, Wrapper
    from kelastic.timer import expires

    RANK = int(os.environ.get("RANK", "0"))
    WORLD = int(os.environ.get("WORLD_SIZE", "1"))

    def opt(name, default=""):
        return os.environ.get(f"KL_{name}_{RANK}", os.environ.get(f"KL_{name}", default))

    def emit(event, **kw):
        print(json.dumps({"event": event, "rank": RANK, "t": time.time(), **kw}), flush=True)

    class NoTimer:  # a timer client without a server: only the progress hook matters
        def acquire(self, scope_id, expiration_time):
            pass

        def release(self, scope_id):
            pass

    def sockets():
        count = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
            except OSError:
                pass  # the listing's own descriptor
        return count

    def flag(name):  # a file the test creates to release the worker
        return os.path.exists(os.path.join(os.environ["KL_DIR"], name))

    def health(cw):
        emit("health", iteration=cw.iteration, fault=repr(cw.fault))
        if opt("UNHEALTHY") == "1":
            raise RuntimeError("unhealthy device")

    def finalize(cw):
        emit("finalize", iteration=cw.iteration)
        if opt("BAD_FINALIZE") == "1":
            raise OSError("cannot release the device")

    if opt("GLOO") == "1":  # imported before the function, like a training script does
        import datetime, torch, torch.distributed as dist
    else:
        dist = None

    SOFT = float(opt("SOFT", "0")) or None
    # "iteration:step[,iteration:step...]": where KL_DO happens
    FAULTS = [[int(x) for x in f.split(":")] for f in opt("FAULT", "-1:-1").split(",")]
    FAULT_AT = FAULTS[0]

    @Wrapper(finalize=finalize, health_check=health, soft_timeout=SOFT, hard_timeout=600)
    def train(call_wrapper: CallWrapper | None = None):
        cw = call_wrapper
        it = cw.iteration
        emit("enter", iteration=it, port=os.environ.get("MASTER_PORT"), sockets=sockets(),
             await_go=os.environ.get("KELASTIC_INPROCESS_AWAIT_GO"))
        if opt("DO") == "early" and it == FAULT_AT[0]:  # the peers wait in init
            while not flag("fault_now"):
                time.sleep(0.005)
            emit("raising", iteration=it, step=-1)
            raise ValueError(f"early boom in rank {RANK}")
        try:
            if dist is not None:
                while opt("JOIN_FLAG") and not flag(opt("JOIN_FLAG")):  # joins late
                    time.sleep(0.005)
                emit("init", iteration=it)
                dist.init_process_group("gloo", rank=RANK, world_size=WORLD,
                                        timeout=datetime.timedelta(seconds=120))
                t = torch.ones(64)
            for step in range(int(opt("STEPS", "5"))):
                what = opt("DO") if [it, step] in FAULTS else ""
                if what == "raise":
                    emit("raising", iteration=it, step=step)
                    raise ValueError(f"boom in rank {RANK}")
                if what == "spin":  # pure Python, no ping: aborted asynchronously
                    emit("spinning", iteration=it, step=step)
                    while True:
                        pass
                if what == "atomic":
                    with cw.atomic():
                        emit("atomic_in", iteration=it)
                        seen = False
                        while not flag("leave_atomic"):
                            if not seen and cw._atomic._guard.requested:
                                seen = True  # the monitor got the abort, held back
                                emit("abort_held", iteration=it)
                            time.sleep(0.005)
                        emit("atomic_out", iteration=it)
                if what == "atomic_raise" or (opt("DO") == "atomic_raise" and it > 0):
                    with cw.atomic():  # a fault inside; the next iteration's section works
                        emit("atomic_in", iteration=it)
                        if what:
                            raise ValueError(f"boom in atomic in rank {RANK}")
                    emit("atomic_out", iteration=it)
                if what == "expired":  # a timed step outliving its deadline, no ping
                    emit("expiring", iteration=it, step=step)
                    with expires(after=0.3, scope="held step", client=NoTimer()):
                        while True:
                            time.sleep(0.01)
                if what == "wait":  # sleep in short slices, no ping
                    emit("waiting", iteration=it, step=step)
                    while True:
                        time.sleep(0.01)
                if dist is not None:
                    dist.all_reduce(t)
                    if what == "blocked":  # the peers wait for this rank in all_reduce
                        emit("blocking", iteration=it, step=step)
                        while True:
                            time.sleep(0.01)
                if opt("TIMED") == "1":  # progress by a timed step instead of ping()
                    with expires(after=60, client=NoTimer()):
                        pass
                else:
                    cw.ping()
                emit("step", iteration=it, step=step)
                if opt("PACE"):
                    time.sleep(float(opt("PACE")))
            if dist is not None:
                dist.all_reduce(t)
        except RestartAbort:
            emit("aborted", iteration=it, how="RestartAbort")
            raise
        except BaseException as exc:
            emit("aborted", iteration=it, how=type(exc).__name__, what=str(exc)[:200])
            raise
        if dist is not None:
            dist.destroy_process_group()
        return {"iteration": it, "rank": RANK}


    from kelastic.errors import record  # the error file, when $TORCHELASTIC_ERROR_FILE is set
    value = record(train)()
    emit("result", value=value, threads=[t.name for t in threading.enumerate()])
    """
)


@dataclass
class Log:
    """Events from the coordinator and the workers, with a condition to wait on."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, entry: dict[str, Any]) -> None:
        entry.setdefault("t", time.time())
        with self.cond:
            self.entries.append(entry)
            self.cond.notify_all()

    def wait(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60.0, what: str = ""
    ) -> dict[str, Any]:
        """The first entry matching ``pred``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for entry in self.entries:
                    if pred(entry):
                        return entry
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(json.dumps(e, default=str) for e in self.entries[-40:])
                    raise AssertionError(f"timed out waiting for {what or pred}; log:\n{tail}")
                self.cond.wait(left)

    def find(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self.cond:
            return [e for e in self.entries if pred(e)]


def ev(event: str, **match: Any) -> Callable[[dict[str, Any]], bool]:
    """Predicate: a worker event ``event`` whose fields include ``match``."""
    return lambda e: e.get("event") == event and all(e.get(k) == v for k, v in match.items())


def msg(kind: type, **match: Any) -> Callable[[dict[str, Any]], bool]:
    """Predicate: a message of ``kind`` the coordinator received, fields matching."""
    return lambda e: (
        isinstance(e.get("msg"), kind) and all(getattr(e["msg"], k) == v for k, v in match.items())
    )


class Coordinator:
    """Plays the sidecar's in-process coordinator on ``run_dir/inprocess.sock``."""

    def __init__(self, run_dir: Path, world: int, log: Log, auto: bool = True) -> None:
        self.path = contract.inprocess_socket_path(run_dir)
        self.world = world
        self.log = log
        self.auto = auto
        self.give_up_on_fault = False
        self.failed = ""
        self.iteration = 0
        self.conns: dict[int, socket.socket] = {}  # by rank
        self._lock = threading.RLock()
        self._ready: dict[int, set[int]] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.path))
        self._server.listen(16)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _read(self, conn: socket.socket) -> None:
        buffer = LineBuffer(MAX_LINE)
        rank = -1
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.log.add({"src": "coord", "closed": rank})
                return
            for line in buffer.feed(data):
                message = parse_worker_message(line)
                if isinstance(message, Hello):
                    rank = message.rank
                    with self._lock:
                        self.conns[rank] = conn
                self.log.add({"src": "coord", "rank": rank, "msg": message})
                if self.auto:
                    self._policy(rank, message)

    def _policy(self, rank: int, message: WorkerMessage) -> None:
        with self._lock:
            if isinstance(message, Hello):  # a late rank learns what it missed
                if self.failed:
                    self.send(rank, GiveUp(reason=self.failed))
                elif message.iteration < self.iteration:
                    self.send(rank, Abort(iteration=self.iteration, reason="late"))
            elif isinstance(message, Fault) and message.iteration == self.iteration:
                if self.give_up_on_fault:
                    self.failed = f"rank {rank}: {message.cause}"
                    self.broadcast(GiveUp(reason=self.failed))
                    return
                self.iteration += 1
                self.broadcast(Abort(iteration=self.iteration, reason=f"rank {rank} faulted"))
            elif isinstance(message, Ready) and message.iteration == self.iteration:
                ready = self._ready.setdefault(message.iteration, set())
                ready.add(rank)
                if len(ready) == self.world:
                    self.go(self.iteration)

    def go(self, iteration: int, port: int | None = None) -> None:
        """Send ``go(iteration)`` with a fresh ``MASTER_PORT`` to every worker."""
        env = {contract.MASTER_PORT: str(port or free_port()),
               contract.ENV_INPROCESS_ITERATION: str(iteration)}  # fmt: skip
        self.broadcast(Go(iteration=iteration, env=env))

    def send(self, rank: int, message: CoordinatorMessage) -> None:
        """Send ``message`` to ``rank`` (once its hello arrived)."""
        self.log.wait(msg(Hello, rank=rank), what=f"hello of rank {rank}")
        with self._lock:
            conn = self.conns[rank]
            self.log.add({"src": "coord", "sent": message, "to": rank})
            with contextlib.suppress(OSError):
                conn.sendall(encode(message))

    def broadcast(self, message: CoordinatorMessage) -> None:
        with self._lock:
            for rank in sorted(self.conns):
                self.send(rank, message)

    def drop(self, rank: int) -> None:
        """Close the connection to ``rank`` (the sidecar went away)."""
        with self._lock:
            conn = self.conns.pop(rank)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for conn in self.conns.values():
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self.conns.clear()


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[str]
    stderr: list[str] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)  # its output's readers


class Job:
    """``world`` worker processes and a coordinator, in ``run_dir``."""

    def __init__(self, run_dir: Path, world: int, env: dict[str, str] | None = None,
                 auto: bool = True, inprocess: bool = True) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.log = Log()
        self.coord = Coordinator(run_dir, world, self.log, auto) if inprocess else None
        self.workers: list[Worker] = []
        port = free_port()
        for rank in range(world):
            worker_env = {
                **os.environ,
                "PYTHONPATH": f"{ROOT / 'worker_lib'}{os.pathsep}{ROOT}",
                contract.ENV_RUN_DIR: str(run_dir), "KL_DIR": str(run_dir),
                contract.RANK: str(rank), contract.LOCAL_RANK: str(rank),
                contract.WORLD_SIZE: str(world), contract.MASTER_ADDR: "127.0.0.1",
                contract.MASTER_PORT: str(port), "OMP_NUM_THREADS": "1",
                **(env or {}),
            }  # fmt: skip
            worker_env.pop(contract.ENV_INPROCESS, None)
            if inprocess:
                worker_env[contract.ENV_INPROCESS] = "1"
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER], env=worker_env, cwd=run_dir, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            worker = Worker(rank, proc)
            self.workers.append(worker)
            for stream, sink in ((proc.stdout, None), (proc.stderr, worker.stderr)):
                pump = threading.Thread(target=self._pump, args=(rank, stream, sink), daemon=True)
                pump.start()
                worker.pumps.append(pump)

    def _pump(self, rank: int, stream: Any, sink: list[str] | None) -> None:
        for line in stream:
            if sink is not None:
                sink.append(line)
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"event": "text", "rank": rank, "line": line.rstrip()}
            self.log.add({"src": "worker", **entry})

    def flag(self, name: str) -> None:
        (self.run_dir / name).touch()

    def wait_exit(self, timeout: float = 60.0) -> list[int]:
        """Every worker's exit code (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        codes = []
        for worker in self.workers:
            try:
                codes.append(worker.proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank {worker.rank} still running; stderr and stacks:\n" + self.stacks(worker)
                ) from None
        for worker in self.workers:  # its output read to the end (a race, before)
            for pump in worker.pumps:
                pump.join(max(0.1, deadline - time.monotonic()))
        return codes

    def expect_exit(self, codes: list[int], timeout: float = 60.0) -> None:
        """Assert the workers' exit codes, showing the stderr of those that differ."""
        got = self.wait_exit(timeout)
        if got != codes:
            tails = "\n".join(
                f"--- rank {r} (exit {c}):\n" + "".join(self.workers[r].stderr[-40:])
                for r, c in enumerate(got) if c != codes[r]
            )  # fmt: skip
            raise AssertionError(f"exit codes {got}, expected {codes}\n{tails}")

    def stacks(self, worker: Worker) -> str:
        """The worker's stderr after it dumped its threads' stacks (SIGUSR2)."""
        worker.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "most recent call first" not in "".join(
            worker.stderr[-50:]
        ):
            time.sleep(0.05)
        return "".join(worker.stderr)

    def stderr(self, rank: int) -> str:
        return "".join(self.workers[rank].stderr)

    def close(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait()
        if self.coord is not None:
            self.coord.close()


@contextlib.contextmanager
def job(run_dir: Path, world: int, **kwargs: Any) -> Iterator[Job]:
    """A :class:`Job` that is killed and reaped whatever the test did."""
    started = Job(run_dir, world, **kwargs)
    try:
        yield started
    finally:
        started.close()


def test_harness_coordinator_answers_a_hello(tmp_path: Path) -> None:
    with job(tmp_path, 1, env={"KL_STEPS": "1"}) as j:
        j.log.wait(msg(Hello, rank=0, iteration=0), what="hello")
        assert j.wait_exit() == [0]
