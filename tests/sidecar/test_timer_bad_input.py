"""Hostile and broken input on the timer FIFO: counted, skipped, never fatal, never lossy."""

from __future__ import annotations

import json
import logging
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic_sidecar.timer import TimerServer
from tests.conftest import wait_for

WATCHED = 4_100_000  # a fake pid: kill is a recorder, nothing is ever signalled


class Kills:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pid: int, sig: int) -> None:
        self.calls.append((pid, sig))


@pytest.fixture
def kills() -> Kills:
    return Kills()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    return tmp_path / "timer.fifo"


@pytest.fixture
def server(fifo: Path, kills: Kills) -> Iterator[TimerServer]:
    srv = TimerServer(fifo, kill=kills)
    srv.start()
    srv.watch_pid(WATCHED)
    yield srv
    srv.stop()


def req(scope: str, expiration: float | None = None, pid: int = WATCHED, **over: Any) -> bytes:
    body: dict[str, Any] = {
        "version": 1,
        "pid": pid,
        "scope_id": scope,
        "expiration_time": time.time() + 600 if expiration is None else expiration,
        "signal": 9,
    }
    body.update(over)
    return json.dumps(body).encode()


def write(fifo: Path, data: bytes) -> None:
    """Open (blocking: the server reads), write everything, close."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def settle(server: TimerServer, requests: int) -> None:
    wait_for(lambda: server.stats().requests >= requests, timeout=20, what=f"{requests} requests")


def bad_field(**over: Any) -> bytes:
    return req("bad", **over)


MALFORMED: dict[str, bytes] = {
    "bad json": b"{not json",
    "truncated object": b'{"version": 1, "pid": 4100000, "scope_id": "x"',
    "array": b"[1, 2, 3]",
    "string": b'"just a string"',
    "null": b"null",
    "missing signal": json.dumps(
        {"version": 1, "pid": WATCHED, "scope_id": "x", "expiration_time": 1.0}
    ).encode(),
    "pid string": bad_field(pid="4100000"),
    "pid zero": bad_field(pid=0),
    "pid negative": bad_field(pid=-5),
    "pid bool": bad_field(pid=True),
    "pid float": bad_field(pid=1.5),
    "pid huge": bad_field(pid=2**40),
    "scope int": bad_field(scope_id=5),
    "scope null": bad_field(scope_id=None),
    "scope too long": bad_field(scope_id="s" * 1025),
    "expiration string": bad_field(expiration_time="soon"),
    "expiration bool": bad_field(expiration_time=True),
    "expiration NaN": bad_field(expiration_time=float("nan")),
    "expiration Infinity": bad_field(expiration_time=float("inf")),
    "expiration -Infinity": bad_field(expiration_time=float("-inf")),
    "expiration 1e400": req("bad").replace(
        b'"expiration_time": ', b'"expiration_time": 1e400, "_": '
    ),
    "expiration huge int": bad_field(expiration_time=10**400),
    "signal 65": bad_field(signal=65),
    "signal negative": bad_field(signal=-1),
    "signal bool": bad_field(signal=True),
    "signal string": bad_field(signal="9"),
    "signal float": bad_field(signal=9.0),
    "version 2": bad_field(version=2),
    "version bool": bad_field(version=True),
    "version string": bad_field(version="1"),
    "no version": json.dumps(
        {"pid": WATCHED, "scope_id": "x", "expiration_time": 1.0, "signal": 9}
    ).encode(),
    "binary garbage": b"\x00\xff\xfe\x80\x01garbage\x7f",
    "invalid utf-8 in a string": req("bad").replace(b'"bad"', b'"\xff\xfe"'),
    "deep nesting": b"[" * 3000,
    "NUL bytes": b"\x00" * 100,
}


@pytest.mark.parametrize("line", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_line_is_counted_and_neighbours_survive(
    server: TimerServer, fifo: Path, line: bytes, kills: Kills
) -> None:
    # In one write: valid, bad, valid.
    write(fifo, req("before") + b"\n" + line + b"\n" + req("after") + b"\n")
    settle(server, 2)
    wait_for(lambda: server.stats().malformed == 1, timeout=20, what="malformed counted")
    stats = server.stats()
    assert (stats.requests, stats.acquired, stats.active, stats.oversized) == (2, 2, 2, 0)
    assert kills.calls == []


def test_extra_fields_and_blank_lines_are_accepted(server: TimerServer, fifo: Path) -> None:
    write(fifo, b"\n  \n" + req("extra", future_field=[1, 2]) + b"\r\n")
    settle(server, 1)
    stats = server.stats()
    assert (stats.acquired, stats.malformed) == (1, 0)


def test_pid_one_is_accepted_but_never_signalled(
    server: TimerServer, fifo: Path, kills: Kills
) -> None:
    write(fifo, req("init", time.time() - 1, pid=1) + b"\n")
    wait_for(lambda: server.stats().unknown_pid == 1, timeout=20, what="unknown pid")
    assert kills.calls == []


def test_line_over_pipe_buf_is_discarded_until_newline(server: TimerServer, fifo: Path) -> None:
    write(fifo, req("a") + b"\n" + b"x" * 10_000 + b"\n" + req("b") + b"\n")
    settle(server, 2)
    stats = server.stats()
    assert (stats.oversized, stats.malformed, stats.acquired) == (1, 0, 2)


def test_line_of_exactly_pipe_buf_bytes_is_accepted_one_more_is_not(
    server: TimerServer, fifo: Path
) -> None:
    def padded(scope: str, size: int) -> bytes:
        line = req(scope)
        return line[:-1] + b" " * (size - len(line)) + b"}"

    write(fifo, padded("fits", select.PIPE_BUF) + b"\n")
    write(fifo, padded("too_long", select.PIPE_BUF + 1) + b"\n")
    write(fifo, req("next") + b"\n")
    settle(server, 2)
    stats = server.stats()
    assert (stats.acquired, stats.oversized) == (2, 1)


def test_writer_closing_mid_line_loses_only_its_own_line(server: TimerServer, fifo: Path) -> None:
    write(fifo, req("a") + b"\n" + req("dead")[:25])  # dies mid-line, no newline
    write(fifo, req("b") + b"\n")  # a fresh writer, glued to the fragment
    settle(server, 2)
    stats = server.stats()
    assert (stats.malformed, stats.acquired, stats.active) == (1, 2, 2)


def test_oversized_unterminated_junk_then_a_valid_line(server: TimerServer, fifo: Path) -> None:
    write(fifo, b"y" * 20_000)  # no newline; the writer goes away
    write(fifo, req("survivor") + b"\n")
    settle(server, 1)
    stats = server.stats()
    assert (stats.oversized, stats.acquired) == (1, 1)


def test_flood_is_rate_limited_in_logs_and_valid_lines_all_land(
    server: TimerServer, fifo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kelastic_sidecar.timer")
    bad = list(MALFORMED.values())
    stream = bytearray()
    for n in range(3000):
        stream += bad[n % len(bad)] + b"\n"
        if n % 100 == 0:
            stream += req(f"ok{n}") + b"\n"
    write(fifo, bytes(stream))
    settle(server, 30)
    wait_for(lambda: server.stats().malformed == 3000, timeout=30, what="all counted")
    assert server.stats().acquired == 30
    warnings = [r for r in caplog.records if r.name == "kelastic_sidecar.timer"]
    assert 1 <= len(warnings) <= 3


def test_many_writers_many_bad_lines_server_keeps_reaping(
    server: TimerServer, fifo: Path, kills: Kills
) -> None:
    for n in range(20):
        write(fifo, b"\xde\xad" * n + b"\n" + req(f"s{n}", time.time() + 600) + b"\n")
    write(fifo, req("hang", time.time() - 1) + b"\n")
    wait_for(lambda: kills.calls, timeout=20, what="reap after the junk")
    assert kills.calls == [(WATCHED, 9)]
    stats = server.stats()
    assert stats.reaped == 1
    assert stats.active == 0  # the reap cleared all timers of that pid
