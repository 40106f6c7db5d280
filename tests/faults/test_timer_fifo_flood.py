"""The worker's timer client under a full FIFO: a flood of unthrottled torch
``FileTimerClient`` writers fills the pipe faster than the server drains it, and a
server that stops reading leaves it full. A watched worker's own timer (``kelastic.timer``:
``expires()``) waits for room, within a bound, instead of failing with
``BlockingIOError`` (torch's client) or blocking for ever (a blocking write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kelastic import timer
from kelastic.contract import KELASTIC_TIMER_TOKEN, TORCHELASTIC_TIMER_FILE
from kelastic_sidecar.timer import TimerServer
from tests.conftest import wait_for
from tests.prereq import require_module

#: Unthrottled torch clients in the flood, and how long it lasts (seconds).
FLOODERS = 16
FLOOD_S = 4.0

# FLOODERS torch clients, forked from one process that imported torch once: on "go" each
# acquires and releases for FLOOD_S seconds as fast as it can; then prints one JSON list
# of their counts: ok, BlockingIOError, any other error.
TORCH_FLOOD = """
    import json, os, sys, time
    from torch.distributed.elastic.timer import FileTimerClient
    fifo, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    children = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            client = FileTimerClient(fifo)
            os.read(go_r, 1)
            ok = refused = other = 0
            scope = f"flood-{os.getpid()}"
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for release in (False, True):
                    try:
                        if release:
                            client.release(scope)
                        else:
                            client.acquire(scope, time.time() + 600)
                        ok += 1
                    except BlockingIOError:
                        refused += 1
                    except Exception:
                        other += 1
            os.write(out_w, (json.dumps([ok, refused, other]) + "\\n").encode())
            os._exit(0)
        children.append(pid)
    os.close(out_w)
    print("ready", flush=True)
    sys.stdin.readline()
    os.write(go_w, b"x" * count)
    for pid in children:
        os.waitpid(pid, 0)
    with os.fdopen(out_r) as reports:
        print(json.dumps([json.loads(line) for line in reports]), flush=True)
"""

# A watched worker's timed steps (kelastic.timer.expires) for FLOOD_S seconds; prints its
# counts as JSON: steps done, and each error by type.
WATCHED_WORKER = """
    import collections, json, sys, time
    from kelastic.timer import expires
    sys.stdin.readline()
    steps, errors = 0, collections.Counter()
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        try:
            with expires(after=600, scope="step"):
                steps += 1
        except Exception as exc:
            errors[type(exc).__name__] += 1
    print(json.dumps({"steps": steps, "errors": errors}), flush=True)
"""


def _python(body: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body), *args], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _report(proc: subprocess.Popen[str], timeout: float) -> Any:
    """The last line of the child's output, as JSON, once it exited 0."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_a_server_that_stops_reading_never_blocks_the_client_for_ever(tmp_path: Path) -> None:
    """The server holds the FIFO open but reads nothing (a stopped sidecar): once the
    pipe is full, a request fails with ``TimeoutError`` after the client's write bound
    (before: the blocking write waited for ever)."""
    fifo = tmp_path / "timer.fifo"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the server: never reads
    client = timer.FifoTimerClient(fifo, token="t")
    outcome: list[BaseException] = []
    requests = [0]

    def flood() -> None:
        try:
            while True:
                client.acquire("step", time.time() + 600)
                requests[0] += 1
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        wait_for(lambda: outcome, timeout=timer.WRITE_TIMEOUT + 30,
                 what="the request to a full FIFO failing")  # fmt: skip
    finally:
        while len(os.read(reader, 1 << 16)) == 1 << 16:  # drain: a blocked writer ends
            pass
        os.close(reader)
        thread.join(30)
        client.close()
    assert isinstance(outcome[0], TimeoutError), outcome
    assert "stayed full" in str(outcome[0]) and str(fifo) in str(outcome[0])
    assert requests[0] > 0  # the pipe took requests until it was full


def test_sixteen_torch_clients_never_refuse_a_watched_workers_own_timer(tmp_path: Path) -> None:
    """16 torch clients acquire and release as fast as they can (the pipe fills while
    the server drains); a watched worker's timed steps beside them never fail: each
    request waits for room. Prints the torch clients' own refusal rate."""
    require_module("torch")
    fifo = tmp_path / "timer.fifo"
    server = TimerServer(fifo, on_reap=lambda event: None)
    server.start()
    env = dict(os.environ, **{TORCHELASTIC_TIMER_FILE: str(fifo), KELASTIC_TIMER_TOKEN: "tok"})
    worker = _python(WATCHED_WORKER, str(FLOOD_S), env=env)
    flood = _python(TORCH_FLOOD, str(fifo), str(FLOODERS), str(FLOOD_S))
    try:
        server.watch_pid(worker.pid, "tok")
        assert flood.stdout is not None
        assert flood.stdout.readline() == "ready\n"  # torch imported, children forked
        for proc in (flood, worker):
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        mine = _report(worker, 120)
        theirs = _report(flood, 120)
    finally:
        for proc in (flood, worker):
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        server.stop()
    assert len(theirs) == FLOODERS
    ok, refused, other = (sum(r[i] for r in theirs) for i in range(3))
    print(f"\n{FLOODERS} torch clients, {FLOOD_S:g} s: {ok} requests taken, {refused} "
          f"refused (BlockingIOError, {100 * refused / max(1, ok + refused):.0f} %); "
          f"watched worker: {mine['steps']} steps, errors {mine['errors']}")  # fmt: skip
    assert refused > 0, "no flood: the pipe never filled"
    assert mine["errors"] == {}, mine
    assert mine["steps"] > 0 and other == 0


@pytest.fixture(autouse=True)
def _no_stray_default_client() -> None:
    timer.forget_default_client()
