"""Hostile input to the timer server: floods of forged timers,
other local users, forged tokens, and a hang armed behind a flood. Real FIFOs, real
child processes, real signals; conditions waited on with deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.contract import KELASTIC_TIMER_TOKEN
from kelastic_sidecar.control import ControlServer
from kelastic_sidecar.ipc import ipc_access
from kelastic_sidecar.timer import ReapEvent, TimerServer
from kelastic_sidecar.timer import reader as timer_reader
from tests.conftest import strict_umask, wait_for
from tests.prereq import require_module
from tests.sidecar.test_timer_server import finish, raw_write, request, spawn

# Waits for "go" on stdin, so that it is watched before its first request; then holds a
# timer of 0.3 s and hangs in it (with $KELASTIC_TIMER_TOKEN when the test sets it).
HANGS_ON_GO = """
    import sys, time
    from kelastic.timer import expires
    sys.stdin.readline()
    with expires(after=0.3, scope="hang"):
        time.sleep(120)
"""


def _fill(fifo: Path, lines: list[str]) -> None:
    """Write ``lines`` through one blocking descriptor (waits while the pipe is full)."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        data = "".join(lines).encode()
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


@pytest.fixture
def local_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local mode: no Kubernetes in the env, no explicit access setting."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KELASTIC_IPC_ACCESS", raising=False)


# ------------------------------------------------------------------ item 1: budgets


def test_a_flood_of_timers_for_other_pids_cannot_crowd_out_a_watched_worker(
    tmp_path: Path,
) -> None:
    """Before: 70,000 forged far-future timers filled the one table and a watched
    worker's acquire was dropped like anyone's, so its hang was never reaped."""
    fifo = tmp_path / "timer.fifo"
    reaps: list[ReapEvent] = []
    server = TimerServer(fifo, on_reap=reaps.append, max_timers=1000)
    server.start()
    proc = spawn(fifo, HANGS_ON_GO)
    try:
        far = time.time() + 3600
        _fill(fifo, [request(100_000 + n, "forged", far) for n in range(3000)])
        wait_for(lambda: server.stats().requests == 3000, 30, what="the flood read")
        assert server.stats().dropped_unwatched == 2000
        server.watch_pid(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: reaps, 10, what="on_reap")
        stats = server.stats()
        assert (stats.reaped, stats.dropped_unwatched, stats.active) == (1, 2000, 1000)
    finally:
        finish(proc)
        server.stop()


def test_a_watched_pid_has_its_own_budget(tmp_path: Path) -> None:
    fifo = tmp_path / "timer.fifo"
    server = TimerServer(fifo, max_timers=2, max_timers_per_pid=3, kill=lambda p, s: None)
    server.start()
    try:
        server.watch_pid(4_000_001)
        far = time.time() + 3600
        for n in range(5):
            raw_write(fifo, request(4_000_001, f"s{n}", far))
            raw_write(fifo, request(4_100_000 + n, "x", far))
        wait_for(lambda: server.stats().requests == 10, 30, what="requests")
        stats = server.stats()
        assert (stats.active, stats.dropped_capacity, stats.dropped_unwatched) == (5, 5, 3)
    finally:
        server.stop()


# ------------------------------------------------------------ item 1: who may write

AS_NOBODY = """
    import os, socket, sys
    os.setgid(65534)
    os.setuid(65534)
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
        print("fifo:open")
    except PermissionError:
        print("fifo:refused")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[2])
        print("socket:open")
    except PermissionError:
        print("socket:refused")
"""


def _as_nobody(fifo: Path, sock: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(AS_NOBODY), str(fifo), str(sock)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.split()


@pytest.mark.usefixtures("local_env")
def test_locally_other_users_can_write_neither_fifo_nor_control_socket(
    pod_run_dir: Path,
) -> None:
    """Before: the FIFO was 0622 and the socket 0666 in 0755 folders, so any local user
    could forge timers (or stop hang detection) and talk to the supervisor."""
    assert os.getuid() == 0, "the test suite runs as root (CI) to switch users"
    assert ipc_access() == "owner"
    fifo, sock = pod_run_dir / "timer.fifo", pod_run_dir / "control.sock"
    server = TimerServer(fifo, kill=lambda p, s: None)
    control = ControlServer(sock, lambda msg: None)
    with strict_umask():
        server.start()
        control.start()
    try:
        assert fifo.stat().st_mode & 0o777 == 0o600
        assert sock.stat().st_mode & 0o777 == 0o600
        assert _as_nobody(fifo, sock) == ["fifo:refused", "socket:refused"]
    finally:
        control.close()
        server.stop()


def test_access_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KELASTIC_IPC_ACCESS", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert ipc_access() == "pod"  # the trainer's user may be unknown; the volume is the Pod's
    monkeypatch.setenv("KELASTIC_IPC_ACCESS", "group")
    server = TimerServer(tmp_path / "timer.fifo", kill=lambda p, s: None)
    server.start()
    try:
        assert (tmp_path / "timer.fifo").stat().st_mode & 0o777 == 0o620
    finally:
        server.stop()
    monkeypatch.setenv("KELASTIC_IPC_ACCESS", "everyone")
    with pytest.raises(ValueError, match="KELASTIC_IPC_ACCESS"):
        TimerServer(tmp_path / "timer.fifo")


# ------------------------------------------------------------------ item 1: tokens

ARMS_THEN_HANGS = """
    import sys, time
    from kelastic.timer import FifoTimerClient
    client = FifoTimerClient(sys.argv[1])
    client.acquire("step", time.time() + 600)
    print("armed", flush=True)
    sys.stdin.readline()
    client.acquire("hang", time.time() + 0.3)
    time.sleep(120)
"""


@pytest.fixture
def tokened(tmp_path: Path) -> Iterator[tuple[TimerServer, Path, list[ReapEvent]]]:
    fifo = tmp_path / "timer.fifo"
    reaps: list[ReapEvent] = []
    server = TimerServer(fifo, on_reap=reaps.append)
    server.start()
    yield server, fifo, reaps
    server.stop()


def test_requests_naming_a_worker_without_its_token_are_refused(
    tokened: tuple[TimerServer, Path, list[ReapEvent]],
) -> None:
    server, fifo, reaps = tokened
    env = dict(os.environ, **{KELASTIC_TIMER_TOKEN: "s3cret"})
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ARMS_THEN_HANGS), str(fifo)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        server.watch_pid(proc.pid, "s3cret")
        assert proc.stdout is not None and proc.stdout.readline().strip() == "armed"
        wait_for(lambda: server.stats().acquired == 1, 30, what="the worker's own acquire")
        # Forged: a due timer with a wrong token, then without one (the worker has sent
        # its token, so tokenless requests naming it are refused), and a forged release.
        raw_write(fifo, request(proc.pid, "x", time.time() - 1)[:-2] + ', "token": "guess"}\n')
        raw_write(fifo, request(proc.pid, "y", time.time() - 1))
        raw_write(fifo, request(proc.pid, "step", -1, 0))
        wait_for(lambda: server.stats().forged == 3, 30, what="three refusals")
        assert proc.poll() is None and server.stats().reaped == 0
        assert server.active_timers() == 1  # "step" is still held
        assert proc.stdin is not None
        proc.stdin.write("go\n")  # the worker's own (tokened) timer still works
        proc.stdin.flush()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: reaps, 10, what="on_reap")
        assert reaps[0].scope_id == "hang"
    finally:
        finish(proc)


TORCH_CLIENT = """
    import sys, time
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient
    client = FileTimerClient(sys.argv[1])
    print("imported", flush=True)
    sys.stdin.readline()
    client.acquire("torch_step", time.time() + 0.3)
    time.sleep(120)
"""


def test_torchs_unmodified_client_still_works_for_a_watched_worker(
    tokened: tuple[TimerServer, Path, list[ReapEvent]],
) -> None:
    require_module("torch")
    server, fifo, reaps = tokened
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TORCH_CLIENT), str(fifo)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        server.watch_pid(proc.pid, "a-token-it-never-sends")
        assert proc.stdout is not None and proc.stdout.readline().strip() == "imported"
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: reaps, 10, what="on_reap")
        assert reaps[0].scope_id == "torch_step" and server.stats().forged == 0
    finally:
        finish(proc)


# ------------------------------------------------------------- item 3: flood fairness


def test_a_hang_armed_behind_a_flood_is_acted_on_before_the_flood_is_parsed(
    tmp_path: Path,
) -> None:
    """The server is held in on_reap while 8000 lines of unwatched pids and then a due
    timer of a watched pid are queued in the pipe. Before: every line ahead of it was
    parsed first (the hang was signalled seconds late under a real flood). Now the
    watched pid's line is applied as soon as it is read and the deadline acted on at the
    next turn, long before the flood is parsed. Counts, not times: no timing assert."""
    fifo = tmp_path / "timer.fifo"
    hold = threading.Event()
    held = threading.Event()
    seen: dict[int, int] = {}  # pid -> requests parsed when it was signalled

    def on_reap(event: ReapEvent) -> None:
        if event.pid == 4_000_001:
            held.set()
            hold.wait(30)

    server = TimerServer(fifo, on_reap=on_reap, kill=lambda p, s: None)

    def kill(pid: int, sig: int) -> None:
        seen[pid] = server._table.stats.requests  # called with the server's lock held

    server._table.kill = kill
    server.start()
    try:
        server.watch_pid(4_000_001)
        server.watch_pid(4_000_002)
        raw_write(fifo, request(4_000_001, "first", time.time() - 1))
        wait_for(held.is_set, 30, what="the server held in on_reap")
        far = time.time() + 3600
        _fill(fifo, [request(200_000 + n, "flood", far) for n in range(8000)])
        raw_write(fifo, request(4_000_002, "hang", time.time() - 1))
        hold.set()
        wait_for(lambda: 4_000_002 in seen, 30, what="the hang signalled")
        print(f"\nrequests parsed when the hang was signalled: {seen[4_000_002]}")
        assert seen[4_000_002] < 4000, seen  # before: 8002
        wait_for(lambda: server.stats().requests == 8002, 30, what="the rest of the flood")
    finally:
        hold.set()
        server.stop()


def test_a_watched_pids_requests_keep_their_order_when_some_are_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watched pid's lines jump the queue only when none of its own are queued: its
    release must not be applied before its acquire (a stale timer would kill it)."""
    monkeypatch.setattr(timer_reader, "WATCHED_PER_TURN", 4)  # small turns: one read each
    monkeypatch.setattr(timer_reader, "READ_PER_TURN", 65536)
    monkeypatch.setattr(timer_reader, "LINES_PER_TURN", 16)
    fifo = tmp_path / "timer.fifo"
    hold, held = threading.Event(), threading.Event()

    def on_reap(event: ReapEvent) -> None:
        held.set()
        hold.wait(30)

    server = TimerServer(fifo, on_reap=on_reap, kill=lambda p, s: None)
    server.start()
    try:
        a, w = 4_000_001, 4_000_002
        server.watch_pid(a)
        server.watch_pid(w)
        raw_write(fifo, request(a, "first", time.time() - 1))
        wait_for(held.is_set, 30, what="the server held in on_reap")
        far = time.time() + 3600
        stream = [request(300_000 + n, "filler", far) for n in range(100)]
        stream += [request(w, f"burn{n}", -1, 0) for n in range(10)]  # its fast budget
        stream += [request(w, "s", far)]  # queued: the budget is spent
        stream += [request(400_000 + n, "filler", far) for n in range(700)]  # > 64 KiB
        stream += [request(w, "s", -1, 0)]  # read a turn later: must wait behind "s"
        _fill(fifo, stream)
        hold.set()
        wait_for(lambda: server.stats().requests == 1 + len(stream), 30, what="all read")
        assert server.stats().released == 1
        assert (w, "s") not in server._table.timers  # released after it was acquired
    finally:
        hold.set()
        server.stop()


def test_drops_and_corrupt_values_are_exported_as_metrics() -> None:
    from prometheus_client import generate_latest

    from kelastic_sidecar.metrics import SidecarMetrics
    from kelastic_sidecar.timer import TimerStats

    stats = TimerStats(dropped_capacity=5, dropped_unwatched=3, forged=2, shed=7)
    metrics = SidecarMetrics(lambda: stats)
    metrics.corrupt_values.labels(source="rdzv_state").inc()
    text = generate_latest(metrics.registry).decode()
    for line in (
        'kelastic_timer_requests_dropped_total{reason="unwatched"} 3.0',
        'kelastic_timer_requests_dropped_total{reason="capacity"} 2.0',
        'kelastic_timer_requests_dropped_total{reason="forged"} 2.0',
        'kelastic_timer_requests_dropped_total{reason="shed"} 7.0',
        'kelastic_corrupt_values_total{source="rdzv_state"} 1.0',
        'kelastic_corrupt_values_total{source="restart_record"} 0.0',
    ):
        assert line in text, text
