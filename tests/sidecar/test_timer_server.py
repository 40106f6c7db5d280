"""TimerServer with real FIFOs, real child processes and real signals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kelastic.contract import TORCHELASTIC_TIMER_FILE
from kelastic.timer import FifoTimerClient
from kelastic_sidecar.timer import ReapEvent, TimerServer
from tests.conftest import strict_umask, wait_for
from tests.prereq import require_module


class Recorder:
    """Collects on_reap events and the kill calls (delegating to os.kill)."""

    def __init__(self, real: bool = True) -> None:
        self.events: list[ReapEvent] = []
        self.kills: list[tuple[int, int]] = []
        self.real = real

    def on_reap(self, event: ReapEvent) -> None:
        self.events.append(event)

    def has_events(self, count: int) -> Callable[[], bool]:
        return lambda: len(self.events) == count

    def kill(self, pid: int, sig: int) -> None:
        self.kills.append((pid, sig))
        if self.real:
            os.kill(pid, sig)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    return tmp_path / "timer.fifo"


@pytest.fixture
def server(fifo: Path, rec: Recorder) -> Iterator[TimerServer]:
    srv = TimerServer(fifo, on_reap=rec.on_reap, kill=rec.kill)
    srv.start()
    yield srv
    srv.stop()


def spawn(fifo: Path, body: str) -> subprocess.Popen[str]:
    """A python child with TORCHELASTIC_TIMER_FILE set; reads stdin, so closing it ends it."""
    env = dict(os.environ, **{TORCHELASTIC_TIMER_FILE: str(fifo)})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def raw_write(fifo: Path, line: str) -> None:
    """One request as a writer that opens and closes the FIFO per request (torch style)."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def request(pid: int, scope: str, expiration: float, sig: int = 9) -> str:
    return (
        json.dumps(
            {
                "version": 1,
                "pid": pid,
                "scope_id": scope,
                "expiration_time": expiration,
                "signal": sig,
            }
        )
        + "\n"
    )


HUNG = """
    import time
    from kelastic.timer import expires
    with expires(after=0.3, scope="{scope}"):
        time.sleep(120)
"""


def test_hung_child_is_sigkilled_and_on_reap_fires(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    proc = spawn(fifo, HUNG.format(scope="train_step"))
    server.watch_pid(proc.pid)
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        finish(proc)
    wait_for(lambda: rec.events, timeout=10, what="on_reap")
    [event] = rec.events
    assert (event.pid, event.scope_id, event.signal) == (proc.pid, "train_step", signal.SIGKILL)
    assert event.reaped_at >= event.expiration_time
    stats = server.stats()
    assert (stats.acquired, stats.expired, stats.reaped, stats.active) == (1, 1, 1, 0)
    assert server.last_acquire_time is not None


def test_default_scope_of_a_real_child_is_its_file_and_line(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    proc = spawn(
        fifo,
        """
        import time
        from kelastic.timer import expires
        with expires(after=0.2):
            time.sleep(120)
        """,
    )
    server.watch_pid(proc.pid)
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        finish(proc)
    wait_for(lambda: rec.events, timeout=10, what="on_reap")
    assert rec.events[0].scope_id == "<string>#4"


def test_release_prevents_reap(server: TimerServer, fifo: Path, rec: Recorder) -> None:
    proc = spawn(
        fifo,
        """
        import sys, time
        from kelastic.timer import expires
        with expires(after=0.5, scope="quick"):
            pass
        time.sleep(1.0)  # outlive the deadline
        """,
    )
    server.watch_pid(proc.pid)
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        finish(proc)
    stats = server.stats()
    assert (stats.acquired, stats.released, stats.expired, stats.active) == (1, 1, 0, 0)
    assert rec.kills == [] and rec.events == []


def test_signal_zero_timer_expires_without_kill(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    proc = spawn(
        fifo,
        """
        import os, sys, time
        from kelastic.timer import FifoTimerClient
        FifoTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=0).acquire(
            "no_kill", time.time() + 0.2)
        sys.stdin.read()
        """,
    )
    server.watch_pid(proc.pid)
    try:
        wait_for(lambda: server.stats().expired == 1, timeout=30, what="expiry")
        assert proc.poll() is None
        assert rec.kills == [] and rec.events == []
        assert server.active_timers() == 0
    finally:
        finish(proc)


def test_keeps_serving_after_a_reap(server: TimerServer, fifo: Path, rec: Recorder) -> None:
    for n in range(2):
        proc = spawn(fifo, HUNG.format(scope=f"step{n}"))
        server.watch_pid(proc.pid)
        try:
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            finish(proc)
        server.forget_pid(proc.pid)
        wait_for(rec.has_events(n + 1), timeout=10, what="on_reap")
    assert [e.scope_id for e in rec.events] == ["step0", "step1"]
    assert server.stats().reaped == 2


def test_unwatched_pid_is_never_killed(server: TimerServer, fifo: Path, rec: Recorder) -> None:
    proc = spawn(fifo, HUNG.format(scope="orphan"))
    try:
        wait_for(lambda: server.stats().unknown_pid == 1, timeout=30, what="unknown_pid")
        assert proc.poll() is None
        assert rec.kills == [] and rec.events == []
        assert server.stats().expired == 1
    finally:
        finish(proc)


def test_pid_watched_after_acquire_but_before_expiry_is_reaped(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    proc = spawn(
        fifo,
        """
        import sys, time
        from kelastic.timer import expires
        with expires(after=2.0, scope="late_watch"):
            print("acquired", flush=True)
            time.sleep(120)
        """,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "acquired"
        wait_for(lambda: server.active_timers() == 1, timeout=10, what="acquire")
        server.watch_pid(proc.pid)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        finish(proc)
    wait_for(lambda: rec.events, timeout=10, what="on_reap")


def test_torch_file_timer_client_against_our_server(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    require_module("torch.distributed.elastic.timer")
    proc = spawn(
        fifo,
        """
        import os, time
        import torch.distributed.elastic.timer as timer
        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with timer.expires(after=0.5, scope="released"):
            pass
        with timer.expires(after=0.3, scope="torch_hang"):
            time.sleep(120)
        """,
    )
    server.watch_pid(proc.pid)
    try:
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        finish(proc)
    wait_for(lambda: rec.events, timeout=10, what="on_reap")
    assert rec.events[0].scope_id == "torch_hang"
    stats = server.stats()
    assert (stats.acquired, stats.released, stats.malformed) == (2, 1, 0)


def test_our_client_against_torch_file_timer_server(fifo: Path) -> None:
    file_based = require_module("torch.distributed.elastic.timer.file_based_local_timer")
    torch_server = file_based.FileTimerServer(str(fifo), run_id="kelastic-test", max_interval=0.05)
    torch_server.start()
    client = FifoTimerClient(fifo)

    def acquire() -> bool:
        # torch's thread opens the FIFO for reading some time after start().
        try:
            client.acquire("compat", deadline)
        except BrokenPipeError:
            return False
        return True

    try:
        deadline = time.time() + 600
        wait_for(acquire, timeout=30, what="torch server reading")
        # torch's server blocks in readline() while a writer holds the FIFO: close ours.
        client.close()
        key = (os.getpid(), "compat")
        wait_for(lambda: key in torch_server._timers, timeout=30, what="torch registered")
        got = torch_server._timers[key]
        assert (got.expiration_time, got.signal) == (deadline, signal.SIGKILL)
        client.release("compat")
        client.close()
        wait_for(lambda: key not in torch_server._timers, timeout=30, what="torch released")
    finally:
        client.close()
        with contextlib.suppress(OSError):  # unblock torch's thread if still in open()
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        torch_server.run_once()  # its watchdog exits once the FIFO has no writer


def test_earliest_expired_signal_is_used_and_all_timers_of_the_pid_cleared(
    fifo: Path,
) -> None:
    rec = Recorder(real=False)
    server = TimerServer(fifo, on_reap=rec.on_reap, kill=rec.kill)
    server.start()
    try:
        pid, now = 4_000_000, time.time()
        server.watch_pid(pid)
        # One atomic write: the server sees all four timers in one batch.
        raw_write(
            fifo,
            request(pid, "quiet", now - 3, 0)
            + request(pid, "term", now - 2, signal.SIGTERM)
            + request(pid, "kill", now - 1, signal.SIGKILL)
            + request(pid, "future", now + 600, signal.SIGKILL),
        )
        wait_for(lambda: rec.events, timeout=10, what="reap")
        assert rec.kills == [(pid, signal.SIGTERM)]
        assert rec.events[0].scope_id == "term"
        stats = server.stats()
        assert (stats.expired, stats.reaped, stats.active) == (3, 1, 0)
    finally:
        server.stop()


def test_forget_pid_clears_timers_and_prevents_kill(fifo: Path) -> None:
    rec = Recorder(real=False)
    server = TimerServer(fifo, on_reap=rec.on_reap, kill=rec.kill)
    server.start()
    try:
        pid = 4_000_001
        server.watch_pid(pid)
        raw_write(fifo, request(pid, "a", time.time() + 600))
        wait_for(lambda: server.active_timers() == 1, timeout=10, what="acquire")
        server.forget_pid(pid)
        assert server.active_timers() == 0
        raw_write(fifo, request(pid, "b", time.time() - 1))
        wait_for(lambda: server.stats().unknown_pid == 1, timeout=10, what="unknown")
        assert rec.kills == []
        server.watch_pid(pid)
        raw_write(fifo, request(pid, "c", time.time() + 600))
        wait_for(lambda: server.active_timers() == 1, timeout=10, what="acquire")
        server.forget_all()
        assert server.active_timers() == 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("error", "reaped", "failed", "still_watched"),
    [
        (ProcessLookupError(3, "gone"), 0, 0, False),
        (PermissionError(1, "denied"), 0, 1, True),
        (None, 1, 0, True),
    ],
)
def test_kill_outcomes(
    fifo: Path, error: OSError | None, reaped: int, failed: int, still_watched: bool
) -> None:
    calls: list[tuple[int, int]] = []
    events: list[ReapEvent] = []

    def kill(pid: int, sig: int) -> None:
        calls.append((pid, sig))
        if error is not None:
            raise error

    server = TimerServer(fifo, on_reap=events.append, kill=kill)
    server.start()
    try:
        pid = 4_000_002
        server.watch_pid(pid)
        now = time.time()
        raw_write(fifo, request(pid, "x", now - 1) + request(pid, "y", now + 600))
        wait_for(lambda: calls, timeout=10, what="kill attempt")
        wait_for(lambda: server.stats().expired == 1, timeout=10, what="expiry")
        stats = server.stats()
        assert (stats.reaped, stats.kill_failed, stats.active) == (reaped, failed, 0)
        assert len(events) == reaped
        # Still serving; a watched pid can be reaped again, a gone one is unknown.
        raw_write(fifo, request(pid, "z", time.time() - 1))
        wait_for(lambda: server.stats().expired == 2, timeout=10, what="second expiry")
        assert len(calls) == (2 if still_watched else 1)
        assert server.stats().unknown_pid == (0 if still_watched else 1)
    finally:
        server.stop()


def test_on_reap_exception_does_not_stop_the_server(fifo: Path) -> None:
    seen: list[ReapEvent] = []

    def on_reap(event: ReapEvent) -> None:
        seen.append(event)
        raise RuntimeError("callback bug")

    server = TimerServer(fifo, on_reap=on_reap, kill=lambda pid, sig: None)
    server.start()
    try:
        server.watch_pid(4_000_003)
        raw_write(fifo, request(4_000_003, "a", time.time() - 1))
        wait_for(lambda: len(seen) == 1, timeout=10, what="first reap")
        raw_write(fifo, request(4_000_003, "b", time.time() - 1))
        wait_for(lambda: len(seen) == 2, timeout=10, what="second reap")
    finally:
        server.stop()


def test_capacity_limit(fifo: Path) -> None:
    server = TimerServer(fifo, max_timers=3, kill=lambda pid, sig: None)
    server.start()
    client = FifoTimerClient(fifo)
    try:
        far = time.time() + 600
        for n in range(5):
            client.acquire(f"s{n}", far)
        wait_for(lambda: server.stats().requests == 5, timeout=10, what="requests")
        stats = server.stats()
        assert (stats.acquired, stats.dropped_capacity, stats.active) == (3, 2, 3)
        client.acquire("s0", far + 1)  # replacing an existing timer is always allowed
        client.release("s1")
        client.acquire("s9", far)  # room again
        wait_for(lambda: server.stats().requests == 8, timeout=10, what="requests")
        stats = server.stats()
        assert (stats.acquired, stats.released, stats.dropped_capacity) == (5, 1, 2)
        assert stats.active == 3
    finally:
        client.close()
        server.stop()


def test_heap_stays_bounded_under_acquire_release_churn(fifo: Path) -> None:
    server = TimerServer(fifo, kill=lambda pid, sig: None)
    server.start()
    client = FifoTimerClient(fifo)
    try:
        far = time.time() + 3600
        for _ in range(5000):
            client.acquire("step", far)
            client.release("step")
        wait_for(lambda: server.stats().requests == 10000, timeout=60, what="requests")
        assert server.active_timers() == 0
        assert len(server._table.heap) <= 1024 + 2
    finally:
        client.close()
        server.stop()


def test_stop_is_prompt_removes_the_fifo_and_is_idempotent(fifo: Path) -> None:
    server = TimerServer(fifo)
    server.start()
    client = FifoTimerClient(fifo)
    client.acquire("far", time.time() + 3600)  # a long sleep in the server thread
    wait_for(lambda: server.active_timers() == 1, timeout=10, what="acquire")
    thread = server._thread
    assert thread is not None
    began = time.monotonic()
    server.stop()
    assert time.monotonic() - began < 5.0
    assert not thread.is_alive()
    assert not fifo.exists()
    server.stop()
    client.close()


def test_start_replaces_a_stale_file_and_restart_works(fifo: Path) -> None:
    fifo.write_text("stale regular file")
    server = TimerServer(fifo, kill=lambda pid, sig: None)
    server.start()
    try:
        with pytest.raises(RuntimeError):
            server.start()
        server.stop()
        server.start()
        raw_write(fifo, request(os.getpid(), "after_restart", time.time() + 600))
        wait_for(lambda: server.active_timers() == 1, timeout=10, what="acquire")
    finally:
        server.stop()


def test_persistent_and_per_request_writers_together(server: TimerServer, fifo: Path) -> None:
    client = FifoTimerClient(fifo)
    try:
        far = time.time() + 600
        for n in range(50):
            client.acquire(f"persistent{n}", far)
            raw_write(fifo, request(os.getpid(), f"oneshot{n}", far))
        wait_for(lambda: server.active_timers() == 100, timeout=10, what="all timers")
        assert server.stats().malformed == 0
    finally:
        client.close()


def test_watch_pid_refuses_init_and_self(fifo: Path) -> None:
    server = TimerServer(fifo)
    for pid in (0, 1, os.getpid()):
        with pytest.raises(ValueError):
            server.watch_pid(pid)
    with pytest.raises(ValueError):
        TimerServer(fifo, max_timers=0)


def test_the_fifo_is_grown_so_bursts_do_not_fail_torch_clients(tmp_path: Path) -> None:
    import fcntl

    from kelastic_sidecar.timer.server import FIFO_PIPE_SIZE

    server = TimerServer(tmp_path / "timer.fifo")
    server.start()
    try:
        fd = os.open(tmp_path / "timer.fifo", os.O_WRONLY | os.O_NONBLOCK)
        try:
            size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        finally:
            os.close(fd)
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        assert size == min(FIFO_PIPE_SIZE, limit) > 65536
    finally:
        server.stop()


AS_NOBODY = """
    import os, time
    from kelastic.timer import expires
    os.setgid(65534)
    os.setuid(65534)  # the trainer runs as another user than the sidecar
    with expires(after=0.3, scope="other_user"):
        time.sleep(120)
"""


def test_a_worker_of_another_user_can_use_the_fifo(rec: Recorder, pod_run_dir: Path) -> None:
    """With access "pod" (the default on Kubernetes); locally only the sidecar's user may
    write (tests/sidecar/test_timer_hostile.py)."""
    assert os.getuid() == 0, "the test suite runs as root (CI) to switch users"
    fifo = pod_run_dir / "timer.fifo"
    srv = TimerServer(fifo, on_reap=rec.on_reap, kill=rec.kill, access="pod")
    with strict_umask():
        srv.start()
    try:
        assert fifo.stat().st_mode & 0o777 == 0o622
        proc = spawn(fifo, AS_NOBODY)
        srv.watch_pid(proc.pid)
        try:
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            finish(proc)
        wait_for(lambda: rec.events, timeout=10, what="on_reap")
        assert rec.events[0].scope_id == "other_user"
    finally:
        srv.stop()


def test_reap_records_whether_the_worker_was_stopped(
    server: TimerServer, fifo: Path, rec: Recorder
) -> None:
    """A stopped worker (state T) is told apart from one sleeping (S), e.g. blocked in a
    collective on it."""
    stopped = spawn(fifo, HUNG.format(scope="stopped").replace("time.sleep(120)",
                    "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"))  # fmt: skip
    sleeping = spawn(fifo, HUNG.format(scope="sleeping"))
    for proc in (stopped, sleeping):
        server.watch_pid(proc.pid)
    try:
        for proc in (stopped, sleeping):
            assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        finish(stopped)
        finish(sleeping)
    wait_for(rec.has_events(2), timeout=10, what="two reaps")
    states = {e.scope_id: e.state for e in rec.events}
    assert states == {"stopped": "T", "sleeping": "S"}


def test_poll_wakes_at_or_before_the_deadline_and_the_rest_is_slept(fifo: Path) -> None:
    """poll() counts whole milliseconds: rounding up would kill up to 1 ms late."""
    from kelastic_sidecar.timer.server import FINE_SLEEP
    from kelastic_sidecar.timer.wire import _Request

    server = TimerServer(fifo, kill=lambda pid, sig: None)  # not started: no thread
    deadline = time.time() + 0.0405  # not on a whole millisecond
    with server._table.lock:
        server._table.apply(_Request(os.getpid(), "s", deadline, signal.SIGKILL))
    before = time.time()
    ms = server._sleep_ms()
    assert ms is not None and before + ms / 1000 <= deadline
    with server._table.lock:
        server._table.timers.clear()
        server._table.heap.clear()
        soon = time.time() + FINE_SLEEP / 2
        server._table.apply(_Request(os.getpid(), "s", soon, signal.SIGKILL))
    server._sleep_to_deadline()
    assert time.time() >= soon  # slept to it: the expiry check that follows finds it due
    with server._table.lock:
        server._table.timers.clear()
        server._table.heap.clear()
        later = time.time() + 5.0
        server._table.apply(_Request(os.getpid(), "t", later, signal.SIGKILL))
    server._sleep_to_deadline()  # far off: poll() waits for it, not a sleep
    assert time.time() < later
