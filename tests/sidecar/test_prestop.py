"""The Pod-is-terminating handshake: the trainer's ``preStop`` hook (``kelastic.prestop``)
and the sidecar's socket (:mod:`kelastic_sidecar.prestop`), on real Unix sockets; the
departure notice a terminating sidecar waits for, in a real etcd. The whole sequence on
real processes: ``tests/faults/test_pod_termination.py``."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic import contract
from kelastic.etcd_values import MAX_NAME_LEN
from kelastic.prestop import Reply, parse_reply, reply_left, reply_not_left, tell
from kelastic_etcd import EtcdClient
from kelastic_sidecar.prestop import (
    MAX_CONCURRENT,
    MAX_LINE,
    READ_TIMEOUT,
    PodTermination,
    PrestopServer,
)
from kelastic_sidecar.supervisor import departure_reason
from tests.conftest import wait_for

NO_LINE = f"error: no request line within {MAX_LINE} bytes and {READ_TIMEOUT:g} s\n".encode()


class _Loop:
    """Stands for the supervisor's main loop: interrupted, it leaves with ``reason``."""

    def __init__(self, reason: str = "disruption") -> None:
        self.reason = reason
        self.interrupts = 0
        self.termination = PodTermination(self.interrupt)

    def interrupt(self) -> None:
        self.interrupts += 1
        threading.Thread(target=self.termination.left, args=(self.reason,), daemon=True).start()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kps-") as d:
        yield Path(d)


def _server(
    path: Path, termination: PodTermination, timeout: float = 5.0
) -> Iterator[PrestopServer]:
    server = PrestopServer(path, termination, timeout, access="owner")
    server.start()
    try:
        yield server
    finally:
        server.close()


def _raw(path: Path, data: bytes, close_write: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(READ_TIMEOUT + 5)
        sock.connect(str(path))
        if data:
            sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        return sock.recv(1024)


# ----------------------------------------------------------------- the handshake


def test_a_request_interrupts_the_armed_loop_once_and_gets_its_departure() -> None:
    loop = _Loop()
    loop.termination.arm()
    got = [loop.termination.request(5.0) for _ in range(3)]
    assert got == ["disruption"] * 3 and loop.interrupts == 1
    assert loop.termination.terminating


def test_a_request_before_the_loop_runs_interrupts_it_as_it_starts() -> None:
    loop = _Loop()
    answer: list[str | None] = []
    waiter = threading.Thread(target=lambda: answer.append(loop.termination.request(10.0)))
    waiter.start()
    wait_for(lambda: loop.termination.terminating, 10, what="the request seen")
    assert loop.interrupts == 0  # nothing to interrupt yet: no handlers installed
    loop.termination.arm()
    waiter.join(10)
    assert answer == ["disruption"] and loop.interrupts == 1


def test_a_disarmed_loop_is_not_interrupted_and_the_first_departure_stands() -> None:
    loop = _Loop()
    loop.termination.arm()
    loop.termination.disarm()
    assert loop.termination.request(0.05) is None and loop.interrupts == 0  # not in time
    loop.termination.left("scale_down")
    loop.termination.left("")  # the supervisor's final word changes nothing
    assert loop.termination.request(0.05) == "scale_down"


# ------------------------------------------------------------------- the socket


def test_the_hook_tells_the_sidecar_and_reads_its_departure(short_dir: Path) -> None:
    loop = _Loop("disruption")
    loop.termination.arm()
    path = contract.prestop_socket_path(short_dir)
    for server in _server(path, loop.termination):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # access "owner"
        assert tell(path, 10.0) == Reply(True, "disruption")
        done = subprocess.run(
            [sys.executable, "-m", "kelastic.prestop", "--socket", str(path)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0
        assert (
            done.stdout.strip() == "kelastic prestop: the sidecar left the rendezvous (disruption)"
        )
        assert server.refused == 0
    assert not path.exists()  # closed: the socket file is removed


def test_a_sidecar_that_does_not_leave_in_time_says_so(short_dir: Path) -> None:
    termination = PodTermination(lambda: None)  # a loop that never leaves
    termination.arm()
    path = contract.prestop_socket_path(short_dir)
    for _ in _server(path, termination, timeout=0.2):
        assert tell(path, 10.0) == Reply(False, "still in the rendezvous after 0.2 s")


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"stop\n", b"error: expected 'terminating'\n"),
        (b"terminating now\n", b"error: expected 'terminating'\n"),
        (b"\x00\xff" * 10 + b"\n", b"error: expected 'terminating'\n"),
        (b"t" * (MAX_LINE * 4), NO_LINE),  # no newline within bounds
        (b"terminating", NO_LINE),  # closed before its newline
        (b"", NO_LINE),
    ],
    ids=["other-word", "extra-words", "binary", "too-long", "no-newline", "nothing"],
)
def test_a_malformed_request_is_refused_and_stops_nothing(
    short_dir: Path, data: bytes, why: bytes
) -> None:
    loop = _Loop()
    loop.termination.arm()
    path = contract.prestop_socket_path(short_dir)
    for server in _server(path, loop.termination):
        assert _raw(path, data) == why
        assert server.refused == 1 and loop.interrupts == 0
        assert not loop.termination.terminating


def test_a_silent_client_is_dropped_after_the_read_timeout(short_dir: Path) -> None:
    loop = _Loop()
    path = contract.prestop_socket_path(short_dir)
    for server in _server(path, loop.termination):
        started = time.monotonic()
        assert _raw(path, b"", close_write=False) == NO_LINE
        assert time.monotonic() - started >= READ_TIMEOUT - 0.1
        assert server.refused == 1 and not loop.termination.terminating


def test_a_flood_of_connections_is_refused_past_the_bound_and_the_hook_still_answers(
    short_dir: Path,
) -> None:
    """More silent connections than :data:`MAX_CONCURRENT` at once: the extra ones are
    refused at once (``busy``); once the silent ones are dropped the hook is served."""
    loop = _Loop()
    loop.termination.arm()
    path = contract.prestop_socket_path(short_dir)
    for server in _server(path, loop.termination):
        held = []
        for _ in range(MAX_CONCURRENT):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            held.append(sock)
        try:
            wait_for(lambda: _raw(path, b"terminating\n") == b"error: busy\n", 10,
                     what="a connection past the bound refused")  # fmt: skip
            assert loop.interrupts == 0
        finally:
            for sock in held:
                sock.close()

        def served() -> bool:
            try:
                return tell(path, 10.0) == Reply(True, "disruption")
            except ValueError:  # "busy" while the dropped connections' slots are freed
                return False

        wait_for(served, READ_TIMEOUT + 10, what="the hook served once the flood is gone")
        assert server.refused >= 1 and loop.interrupts == 1


# ------------------------------------------------------------------- the codec


def test_the_answers_round_trip_and_anything_else_is_refused() -> None:
    assert parse_reply(reply_left("disruption")) == Reply(True, "disruption")
    assert parse_reply(reply_left("")) == Reply(True, "-")
    assert parse_reply(reply_left("a\nb\x00c" + "x" * 500)).text == "a?b?c" + "x" * 115
    assert parse_reply(reply_not_left(2.5)) == Reply(False, "still in the rendezvous after 2.5 s")
    for bad in (b"", b"error: busy\n", b"leftover\n", b"\xff\xfe"):
        with pytest.raises(ValueError, match="the sidecar answered"):
            parse_reply(bad)


def test_the_hook_with_no_sidecar_or_a_bad_timeout(short_dir: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-m", "kelastic.prestop", "--socket", str(short_dir / "none.sock")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert gone.returncode == 0 and "the sidecar did not answer at" in gone.stdout
    for bad in ("0", "-1", "nan", "inf", "soon"):
        refused = subprocess.run(
            [sys.executable, "-m", "kelastic.prestop", "--timeout", bad],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 2 and "--timeout" in refused.stderr, (bad, refused)


# ------------------------------------------------------- the notice waited for


def test_a_terminating_sidecar_waits_for_a_notice_posted_late(
    store: EtcdClient, job_prefix: str
) -> None:
    key = contract.Keys(job_prefix).departing("j-1")
    timer = threading.Timer(0.5, store.put, (key, contract.DEPARTURE_DISRUPTION.encode()))
    timer.start()
    started = time.monotonic()
    assert departure_reason(store, key, wait=10.0) == "disruption"
    assert time.monotonic() - started < 9.0  # read as it came, not at the deadline
    timer.join()


def test_no_notice_is_shutdown_after_the_wait_and_at_once_without_one(
    store: EtcdClient, job_prefix: str
) -> None:
    key = contract.Keys(job_prefix).departing("j-2")
    started = time.monotonic()
    assert departure_reason(store, key) == "shutdown"
    assert departure_reason(store, key, wait=0.6) == "shutdown"
    assert time.monotonic() - started >= 0.6
    store.put(key, b"\xff" * 500)  # a crafted notice: decoded within bounds, never raises
    crafted = departure_reason(store, key)
    assert crafted == "\ufffd" * len(crafted) and 0 < len(crafted) <= MAX_NAME_LEN


def test_a_dead_etcd_is_shutdown_after_the_wait() -> None:
    with EtcdClient(["127.0.0.1:1"], timeout=0.3) as dead:
        assert departure_reason(dead, "/kelastic/x/rdzv/departing/j-0", wait=0.5) == "shutdown"


class _Stop(Exception):
    pass


def test_the_default_interrupt_is_sigterm_in_the_main_thread_raised_where_arm_is_called() -> None:
    """A request that came before the main loop ran interrupts it as :meth:`arm` is called:
    the supervisor's SIGTERM handler raises there, so ``arm()`` sits inside the ``try``
    whose ``except SidecarShutdown`` leaves the rendezvous."""
    import signal

    def raise_stop(signum: int, frame: object) -> None:
        raise _Stop(signum)

    old = signal.signal(signal.SIGTERM, raise_stop)
    termination = PodTermination()  # SIGTERM to the main thread, as the sidecar has it
    answer: list[str | None] = []
    waiter = threading.Thread(target=lambda: answer.append(termination.request(10.0)))
    try:
        waiter.start()
        wait_for(lambda: termination.terminating, 10, what="the request seen")
        with pytest.raises(_Stop):
            termination.arm()
            time.sleep(10)  # the signal interrupts this at the latest
        termination.left("disruption")
        waiter.join(10)
        assert answer == ["disruption"]
    finally:
        signal.signal(signal.SIGTERM, old)
