"""kelastic.timer: the FIFO client, configure() and expires()."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kelastic.timer as ktimer
from kelastic.contract import TORCHELASTIC_TIMER_FILE
from kelastic.timer import FifoTimerClient, configure, expires
from kelastic_sidecar.timer import TimerServer
from tests.conftest import wait_for
from tests.prereq import require_module


class FifoReader:
    """A bare reader of a FIFO (no server): returns the raw request lines."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.buf = b""

    def lines(self, n: int, timeout: float = 10.0) -> list[bytes]:
        def enough() -> bool:
            if select.select([self.fd], [], [], 0.05)[0]:
                self.buf += os.read(self.fd, 65536)
            return self.buf.count(b"\n") >= n

        wait_for(enough, timeout=timeout, interval=0, what=f"{n} lines")
        *lines, self.buf = self.buf.split(b"\n")
        return [line + b"\n" for line in lines]

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    return tmp_path / "timer.fifo"


@pytest.fixture
def reader(fifo: Path) -> Iterator[FifoReader]:
    r = FifoReader(fifo)
    yield r
    r.close()


@pytest.fixture(autouse=True)
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no process-wide client and no env."""
    monkeypatch.setattr(ktimer, "_client", None)
    monkeypatch.delenv(TORCHELASTIC_TIMER_FILE, raising=False)


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id, None))


def test_wire_format_is_byte_identical_to_torch(fifo: Path, reader: FifoReader) -> None:
    client = FifoTimerClient(fifo)
    client.acquire("step", 1234.5)
    client.release("step")
    acquire, release = reader.lines(2)
    assert json.loads(acquire) == {
        "version": 1,
        "pid": os.getpid(),
        "scope_id": "step",
        "expiration_time": 1234.5,
        "signal": int(signal.SIGKILL),
    }
    assert json.loads(release)["expiration_time"] == -1
    assert json.loads(release)["signal"] == 0
    file_based = require_module("torch.distributed.elastic.timer.file_based_local_timer")
    req = file_based.FileTimerRequest
    assert acquire.decode() == req(os.getpid(), "step", 1234.5, signal.SIGKILL).to_json() + "\n"
    assert release.decode() == req(os.getpid(), "step", -1, 0).to_json() + "\n"
    client.close()


def test_fifo_stays_open_across_requests(fifo: Path, reader: FifoReader) -> None:
    client = FifoTimerClient(fifo)
    client.acquire("a", time.time() + 60)
    fd = client._fd
    assert fd is not None and not os.get_blocking(fd)  # a full pipe is waited on by poll
    client.release("a")
    assert client._fd == fd
    reader.lines(2)
    client.close()
    assert client._fd is None
    client.close()  # idempotent
    client.acquire("b", time.time() + 60)  # reopens after close
    reader.lines(1)
    client.close()


def test_dropped_client_closes_its_descriptor(fifo: Path, reader: FifoReader) -> None:
    client = FifoTimerClient(fifo)
    client.acquire("a", time.time() + 60)
    fd = client._fd
    assert fd is not None
    before = os.fstat(fd)
    del client
    gc.collect()
    try:
        after = os.fstat(fd)
    except OSError:
        return  # closed, and the number is still free
    # another thread of the test process may have been given the same number since: it
    # must name another file
    assert (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino), "still open"


def test_oversized_request_raises_value_error_and_sends_nothing(
    fifo: Path, reader: FifoReader
) -> None:
    client = FifoTimerClient(fifo)
    with pytest.raises(ValueError, match="PIPE_BUF"):
        client.acquire("\u00e9" * 1000, time.time() + 60)  # 6 bytes each as JSON
    with pytest.raises(ValueError, match="1024"):
        client.release("x" * 1025)
    client.acquire("ok", time.time() + 60)
    [line] = reader.lines(1)
    assert json.loads(line)["scope_id"] == "ok"
    client.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, True])
def test_acquire_rejects_bad_expiration(fifo: Path, bad: Any) -> None:
    with pytest.raises(ValueError):
        FifoTimerClient(fifo).acquire("x", bad)


def test_bad_signal_rejected(fifo: Path) -> None:
    with pytest.raises(ValueError):
        FifoTimerClient(fifo, signal=65)


def test_no_server_is_a_clear_broken_pipe(fifo: Path) -> None:
    client = FifoTimerClient(fifo)
    with pytest.raises(BrokenPipeError, match="timer server not available"):
        client.acquire("x", time.time() + 60)  # no FIFO at all
    os.mkfifo(fifo)
    with pytest.raises(ConnectionError, match="timer server not available"):
        client.acquire("x", time.time() + 60)  # a FIFO without reader: ENXIO, no blocking


def test_not_a_fifo_is_refused(fifo: Path) -> None:
    fifo.write_text("")
    with pytest.raises(BrokenPipeError, match="not a FIFO"):
        FifoTimerClient(fifo).acquire("x", time.time() + 60)
    assert fifo.read_text() == ""


def test_configure_without_path_or_env_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=TORCHELASTIC_TIMER_FILE):
        configure()


def test_expires_unconfigured_without_env_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="not configured"), expires(after=1):
        pass


def test_expires_autoconfigures_from_env(
    fifo: Path, reader: FifoReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TORCHELASTIC_TIMER_FILE, str(fifo))
    before = time.time()
    with expires(after=30, scope="auto"):
        pass
    acquire, release = (json.loads(line) for line in reader.lines(2))
    assert acquire["scope_id"] == release["scope_id"] == "auto"
    assert before + 30 <= acquire["expiration_time"] <= time.time() + 30
    assert release["expiration_time"] == -1
    assert ktimer._client is not None
    ktimer._client.close()


def test_configure_replaces_and_closes_the_previous_client(fifo: Path, reader: FifoReader) -> None:
    configure(fifo)
    first = ktimer._client
    assert first is not None
    with expires(after=5, scope="a"):
        pass
    assert first._fd is not None
    configure(fifo, signal=signal.SIGTERM)
    assert first._fd is None
    with expires(after=5, scope="b"):
        pass
    lines = [json.loads(line) for line in reader.lines(4)]
    assert [line["signal"] for line in lines] == [9, 0, 15, 0]
    assert ktimer._client is not None
    ktimer._client.close()


def test_expires_default_scope_is_the_callers_line_and_releases_on_exception() -> None:
    client = RecordingClient()
    with pytest.raises(KeyError):
        line = sys._getframe().f_lineno + 1
        with expires(after=2.5, client=client):
            raise KeyError("boom")
    scope = f"{__file__}#{line}"
    assert [(kind, s) for kind, s, _ in client.calls] == [("acquire", scope), ("release", scope)]


def test_expires_acquires_on_entry_not_on_call() -> None:
    client = RecordingClient()
    cm = expires(after=1, scope="s", client=client)
    assert client.calls == []
    before = time.time()
    with cm:
        assert len(client.calls) == 1
    expiration = client.calls[0][2]
    assert expiration is not None and before + 1 <= expiration <= time.time() + 1


def test_expired_timer_names_the_earliest_held_timer_past_its_deadline() -> None:
    """What the in-process wrapper's monitor reads: the timers this process holds through
    expires() (the same scope replaces, leaving releases), those past their deadline."""
    client = RecordingClient()
    assert ktimer.expired_timer() is None
    with expires(after=100, scope="outer", client=client):
        with expires(after=1, scope="inner", client=client):
            deadline = client.calls[-1][2]
            assert deadline is not None
            assert ktimer.expired_timer() is None
            assert ktimer.expired_timer(now=deadline) == ("inner", deadline)
            with expires(after=50, scope="inner", client=client):  # replaces it
                assert ktimer.expired_timer(now=deadline + 1) is None
        assert ktimer.expired_timer(now=deadline + 1000) is not None
        assert ktimer.expired_timer(now=deadline + 1000)[0] == "outer"  # type: ignore[index]
        pid = os.fork()
        if pid == 0:  # the child holds no timer: the server keys the parent's by its pid
            os._exit(0 if ktimer.expired_timer(now=deadline + 1000) is None else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert ktimer.expired_timer(now=deadline + 1000) is None


@pytest.mark.parametrize("after", [float("nan"), float("inf")])
def test_expires_rejects_non_finite_after(after: float) -> None:
    with pytest.raises(ValueError):
        expires(after=after, client=RecordingClient())


def test_thread_safety_no_interleaved_lines(fifo: Path) -> None:
    server = TimerServer(fifo, kill=lambda pid, sig: None)
    server.start()
    client = FifoTimerClient(fifo)
    try:

        def work(n: int) -> None:
            for i in range(200):
                client.acquire(f"t{n}-{i}", time.time() + 600)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: server.stats().requests == 1600, timeout=30, what="requests")
        stats = server.stats()
        assert (stats.malformed, stats.oversized, stats.active) == (0, 0, 1600)
    finally:
        client.close()
        server.stop()


def test_client_survives_a_server_restart(fifo: Path) -> None:
    server = TimerServer(fifo, kill=lambda pid, sig: None)
    server.start()
    client = FifoTimerClient(fifo)
    try:
        client.acquire("before", time.time() + 600)
        wait_for(lambda: server.active_timers() == 1, timeout=10, what="first acquire")
        server.stop()
        replacement = TimerServer(fifo, kill=lambda pid, sig: None)
        replacement.start()
        try:
            client.acquire("after", time.time() + 600)  # EPIPE on the old FIFO, reopen
            wait_for(lambda: replacement.active_timers() == 1, timeout=10, what="reopened")
            assert replacement.stats().requests == 1
            assert client._fd is not None and client._fd_pid == os.getpid()
        finally:
            replacement.stop()
        with pytest.raises(BrokenPipeError):
            client.acquire("gone", time.time() + 600)
    finally:
        client.close()


def test_fork_child_uses_its_own_pid_fd_and_lock(fifo: Path, reader: FifoReader) -> None:
    client = FifoTimerClient(fifo)
    client.acquire("parent", time.time() + 60)
    parent_fd = client._fd
    # Fork while "another thread" holds the client's lock: the child must not deadlock.
    with client._lock:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                reopened = client._fd is None  # the parent's descriptor was dropped
                client.acquire("child", time.time() + 60)
                code = 0 if reopened and client._fd_pid == os.getpid() else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lines = [json.loads(line) for line in reader.lines(2)]
    assert [(r["scope_id"], r["pid"]) for r in lines] == [("parent", os.getpid()), ("child", pid)]
    assert client._fd == parent_fd  # the parent keeps its own
    client.release("parent")
    reader.lines(1)
    client.close()


class _Recording:
    """A timer client that records what it is asked (the server's view)."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.held[scope_id] = expiration_time

    def release(self, scope_id: str) -> None:
        self.held.pop(scope_id, None)


class _Abort(BaseException):
    """An in-process abort (raised asynchronously in the real thing)."""


def test_a_timer_an_abort_left_held_in_enter_is_released_by_release_since() -> None:
    # The abort lands in the progress hook, inside __enter__ after the acquire: __exit__
    # never runs and the server keeps the timer (a loaded run: the rank, waiting at the
    # termination barrier, was reaped 7 s later). release_since releases what was
    # acquired after the snapshot, and only that.
    client = _Recording()
    with expires(after=60, scope="outer", client=client):
        before = ktimer.held_scopes()
        assert before == {"outer"}

        def hook() -> None:
            raise _Abort

        previous = ktimer.set_progress_hook(hook)
        try:
            with pytest.raises(_Abort), expires(after=5, scope="step", client=client):
                pytest.fail("the block never runs: the abort came in __enter__")
        finally:
            ktimer.set_progress_hook(previous)
        assert set(client.held) == {"outer", "step"}  # the server still holds it
        assert ktimer.held_scopes() == {"outer", "step"}
        assert ktimer.release_since(before) == ["step"]
        assert set(client.held) == {"outer"} and ktimer.held_scopes() == {"outer"}
        assert ktimer.release_since(before) == []
    assert client.held == {} and ktimer.held_scopes() == frozenset()


def test_a_timer_whose_acquire_or_release_fails_is_not_left_held() -> None:
    # No server reading: the acquire (or the release) raises; nothing stays held that
    # expired_timer could later report as a soft timeout.
    class _Broken(_Recording):
        def __init__(self, fail_on: str) -> None:
            super().__init__()
            self.fail_on = fail_on

        def acquire(self, scope_id: str, expiration_time: float) -> None:
            if self.fail_on == "acquire":
                raise BrokenPipeError("no timer server reads the FIFO")
            super().acquire(scope_id, expiration_time)

        def release(self, scope_id: str) -> None:
            if self.fail_on == "release":
                raise BrokenPipeError("no timer server reads the FIFO")
            super().release(scope_id)

    with pytest.raises(BrokenPipeError), expires(after=0, scope="a", client=_Broken("acquire")):
        pass
    assert ktimer.held_scopes() == frozenset()
    with pytest.raises(BrokenPipeError), expires(after=0, scope="b", client=_Broken("release")):
        assert ktimer.held_scopes() == {"b"}
    assert ktimer.held_scopes() == frozenset() and ktimer.expired_timer() is None
