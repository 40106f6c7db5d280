"""Hang evidence (:mod:`kelastic_sidecar.hang_evidence`): a real ``py-spy`` reads a real
SIGSTOPped Python process; the timer server reads a hung worker's stacks before it reaps
it and names where it was; and the cases where no stacks can be had (py-spy missing,
hanging past its budget, failing; the process gone) say why and never hold the reap up
beyond the budget. Real processes, signals and FIFOs; the fake py-spys are shell scripts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic.contract import TORCHELASTIC_TIMER_FILE
from kelastic_sidecar.config import ConfigError, SidecarConfig
from kelastic_sidecar.events import Event, WorkerReaped
from kelastic_sidecar.hang_evidence import Evidence, Outcome, StackCollector, collect_all
from kelastic_sidecar.hang_evidence.collector import DUMP_ATTEMPTS
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.timer import ReapEvent, TimerServer, TimerStats, hard_timeout_reap
from kelastic_sidecar.timer.report import process_state
from kelastic_sidecar.wiring import kill_reporter
from tests.conftest import wait_for

#: A worker that takes a timer, then stops itself in ``stuck_here`` (line STOP_LINE):
#: stopped before its deadline whatever the load, as the ``hang`` fault stops one.
WORKER = """\
import contextlib, os, signal, sys
from kelastic.timer import expires


def stuck_here():
    os.kill(os.getpid(), signal.SIGSTOP)


after = float(sys.argv[1])  # 0: no timer (no timer server)
with expires(after=after, scope="step") if after else contextlib.nullcontext():
    stuck_here()
"""
STOP_LINE = 6

needs_pyspy = pytest.mark.skipif(
    shutil.which("py-spy") is None, reason="py-spy (the sidecar extra) is not installed"
)


@pytest.fixture
def worker_script(tmp_path: Path) -> Path:
    path = tmp_path / "hung_worker.py"
    path.write_text(WORKER)
    return path


def _spawn(script: Path, after: float, fifo: Path | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK="3")
    if fifo is not None:
        env[TORCHELASTIC_TIMER_FILE] = str(fifo)
    return subprocess.Popen([sys.executable, str(script), str(after)], env=env)


def _fake_pyspy(folder: Path, body: str) -> Path:
    path = folder / "fake-py-spy"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def _gone(pid: int) -> bool:
    return process_state(pid) in ("", "Z")


# -------------------------------------------------------------- the collector alone


@needs_pyspy
def test_py_spy_reads_a_stopped_process_and_names_where_it_stopped(
    tmp_path: Path, worker_script: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    proc = _spawn(worker_script, 0)
    procs.append(proc)
    wait_for(lambda: process_state(proc.pid) == "T", timeout=30, what="the worker stopped")
    outcomes: list[Outcome] = []
    evidence = StackCollector(tmp_path / "ev", on_outcome=outcomes.append)(proc.pid)
    assert evidence.outcome is Outcome.COLLECTED, evidence
    assert evidence.summary == f"main thread at {worker_script}:{STOP_LINE} in stuck_here"
    assert evidence.path == tmp_path / "ev" / f"rank-3-pid-{proc.pid}.txt"
    dump = evidence.path.read_text()
    assert "Thread" in dump and f"stuck_here ({worker_script}:{STOP_LINE})" in dump
    assert evidence.line() == f"{evidence.summary} (stacks in {evidence.path})"
    assert outcomes == [Outcome.COLLECTED]
    assert process_state(proc.pid) == "T"  # read, not resumed


def test_a_missing_py_spy_is_named_and_nothing_is_collected(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    outcomes: list[Outcome] = []
    collect = StackCollector(tmp_path, exe="kelastic-no-such-py-spy", on_outcome=outcomes.append)
    evidence = collect(os.getpid())
    assert evidence.outcome is Outcome.UNAVAILABLE
    assert evidence.summary == "stacks unavailable: kelastic-no-such-py-spy not found on PATH"
    assert evidence.line() == evidence.summary  # no stacks: no file named
    assert outcomes == [Outcome.UNAVAILABLE]


def test_a_pid_already_gone_is_named_and_no_earlier_dump_is_overwritten(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    fake = _fake_pyspy(tmp_path, "echo never run >&2; exit 9\n")
    earlier = tmp_path / "ev" / f"pid-{proc.pid}.txt"
    earlier.parent.mkdir()
    earlier.write_text("an earlier dump")
    evidence = StackCollector(tmp_path / "ev", exe=str(fake))(proc.pid)
    assert evidence.outcome is Outcome.UNAVAILABLE
    assert evidence.summary == f"stacks unavailable: process {proc.pid} is gone"
    assert evidence.path is None and earlier.read_text() == "an earlier dump"


def test_a_failing_py_spy_gives_its_error(tmp_path: Path) -> None:
    """As on a Pod without CAP_SYS_PTRACE: py-spy cannot read the worker's memory."""
    fake = _fake_pyspy(
        tmp_path,
        """\
        echo "Error: Failed to read process memory" >&2
        echo "Caused by:" >&2
        echo "    0: Permission denied (os error 1)" >&2
        echo "Stack backtrace:" >&2
        echo "   0: main" >&2
        exit 1
        """,
    )
    evidence = StackCollector(tmp_path / "ev", exe=str(fake))(os.getpid())
    assert evidence.outcome is Outcome.UNAVAILABLE
    assert evidence.summary == (
        "stacks unavailable: fake-py-spy failed (exit 1): Failed to read process memory: "
        "Permission denied (os error 1)"
    ).replace("fake-py-spy", str(fake))
    assert evidence.path is not None and "Permission denied" in evidence.path.read_text()


def test_a_torn_read_of_a_running_worker_is_read_again_a_refusal_is_not(tmp_path: Path) -> None:
    """``--nonblocking`` reads a running worker's memory while it changes: a read can be
    torn (CI, a rank waiting for its peers: ``Failed to copy PyCodeObject: Bad address``).
    It is read again within the budget; a refusal (no ptrace access) is said at once."""
    count = tmp_path / "count"
    fake = _fake_pyspy(
        tmp_path,
        f"""\
        echo x >> {count}
        if [ "$(wc -l < {count})" -lt 3 ]; then
            echo "Error: Failed to get stack traces" >&2
            echo "Caused by:" >&2
            echo "    0: Failed to copy PyCodeObject: Bad address (os error 14)" >&2
            exit 1
        fi
        echo 'Thread {os.getpid()} (idle): "MainThread"'
        echo '    _wait_for_peers (/w/steps.py:40)'
        """,
    )
    evidence = StackCollector(tmp_path / "ev", exe=str(fake))(os.getpid())
    assert evidence.outcome is Outcome.COLLECTED, evidence
    assert evidence.summary == "main thread at /w/steps.py:40 in _wait_for_peers"
    assert count.read_text().count("x") == 3
    # torn every time: the last error is said after DUMP_ATTEMPTS reads, within the budget
    count.write_text("")
    (tmp_path / "always").mkdir()
    always = _fake_pyspy(tmp_path / "always", f"""\
        echo x >> {count}
        echo "Error: Failed to copy PyCodeObject: Bad address (os error 14)" >&2
        exit 1
        """)  # fmt: skip
    evidence = StackCollector(tmp_path / "ev2", exe=str(always))(os.getpid())
    assert evidence.outcome is Outcome.UNAVAILABLE and "Bad address" in evidence.summary
    assert count.read_text().count("x") == DUMP_ATTEMPTS


def test_a_long_dump_is_cut_at_the_bound_with_a_marker(tmp_path: Path) -> None:
    fake = _fake_pyspy(
        tmp_path,
        f"""\
        echo 'Thread {os.getpid()} (idle): "MainThread"'
        echo '    train (/w/train.py:9)'
        head -c 200000 /dev/zero | tr '\\0' 'x'
        """,
    )
    evidence = StackCollector(tmp_path / "ev", exe=str(fake), max_bytes=4096)(os.getpid())
    assert evidence.summary == "main thread at /w/train.py:9 in train"
    assert evidence.path is not None
    text = evidence.path.read_text()
    assert len(text.encode()) <= 4096 and text.endswith("than 4096 bytes]\n")


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="budget"):
        StackCollector(tmp_path, budget=-1)
    with pytest.raises(ValueError, match="budget"):
        StackCollector(tmp_path, budget=float("nan"))
    with pytest.raises(ValueError, match="max_bytes"):
        StackCollector(tmp_path, max_bytes=10)
    env = {
        "KELASTIC_JOB_NAME": "j", "KELASTIC_JOB_UID": "u", "KELASTIC_POD_NAME": "p",
        "KELASTIC_ETCD_ENDPOINTS": "127.0.0.1:2379", "KELASTIC_MIN_NODES": "1",
        "KELASTIC_MAX_NODES": "1",
    }  # fmt: skip
    assert SidecarConfig.from_env(env).hang_evidence_budget == 2.0
    assert (
        SidecarConfig.from_env({**env, "KELASTIC_HANG_EVIDENCE_BUDGET": "0"}).hang_evidence_budget
        == 0
    )
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ConfigError, match="KELASTIC_HANG_EVIDENCE_BUDGET"):
            SidecarConfig.from_env({**env, "KELASTIC_HANG_EVIDENCE_BUDGET": bad})
    off = StackCollector(tmp_path, budget=0)(os.getpid())
    assert off.summary == "stacks unavailable: collection is off (budget 0 s)"


def test_the_metric_counts_each_outcome() -> None:
    metrics = SidecarMetrics(TimerStats)
    metrics.hang_evidence.labels(outcome=Outcome.COLLECTED.value).inc()
    value = metrics.registry.get_sample_value
    assert value("kelastic_hang_evidence_total", {"outcome": "collected"}) == 1
    assert value("kelastic_hang_evidence_total", {"outcome": "unavailable"}) == 0


def test_the_hard_timeouts_reap_carries_its_evidence(tmp_path: Path) -> None:
    ev = Evidence(4242, Outcome.COLLECTED, "main thread at /w/t.py:3 in f", tmp_path / "x")
    reap = hard_timeout_reap(4242, "no termination barrier", ev)
    assert (
        reap.why
        == f"no termination barrier; main thread at /w/t.py:3 in f (stacks in {tmp_path / 'x'})"
    )
    assert hard_timeout_reap(4242, "no termination barrier").why == "no termination barrier"


def test_several_pids_are_collected_in_parallel(tmp_path: Path) -> None:
    """Each fake py-spy waits until all of them have started: only a parallel collection
    can finish them within their budget."""
    fake = _fake_pyspy(
        tmp_path,
        f"""\
        touch {tmp_path}/started.$$
        while [ $(ls {tmp_path} | grep -c '^started') -lt 3 ]; do sleep 0.05; done
        echo 'Thread 1 (idle): "MainThread"'
        echo '    f (/w/t.py:1)'
        """,
    )
    collect = StackCollector(tmp_path / "ev", exe=str(fake), budget=60)
    targets = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]  # three live pids
    try:
        found = collect_all(collect, [p.pid for p in targets])
    finally:
        for p in targets:
            p.kill()
            p.wait()
    assert [e.outcome for e in found.values()] == [Outcome.COLLECTED] * 3


# ------------------------------------------------------------------ the timer server


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, list[ReapEvent], list[TimerServer]]]:
    fifo = tmp_path / "timer.fifo"
    events: list[ReapEvent] = []
    servers: list[TimerServer] = []
    yield fifo, events, servers
    for server in servers:
        server.stop()


def _serve(fifo: Path, events: list[ReapEvent], collect: StackCollector) -> TimerServer:
    server = TimerServer(fifo, on_reap=events.append, collect=collect, release=False)
    server.start()
    return server


@needs_pyspy
def test_the_timer_server_names_where_a_stopped_worker_was_before_reaping_it(
    tmp_path: Path,
    worker_script: Path,
    procs: list[subprocess.Popen[bytes]],
    served: tuple[Path, list[ReapEvent], list[TimerServer]],
) -> None:
    fifo, events, servers = served
    servers.append(_serve(fifo, events, StackCollector(tmp_path / "ev")))
    proc = _spawn(worker_script, 1.0, fifo)
    procs.append(proc)
    servers[0].watch_pid(proc.pid)
    assert proc.wait(60) == -signal.SIGKILL
    wait_for(lambda: events, timeout=10, what="the reap")
    [event] = events
    assert event.state == "T" and event.evidence is not None
    where = f"main thread at {worker_script}:{STOP_LINE} in stuck_here"
    path = tmp_path / "ev" / f"rank-3-pid-{proc.pid}.txt"
    assert (
        event.why == f"timer 'step' expired; reaped by the timer server; {where} (stacks in {path})"
    )
    assert "stuck_here" in path.read_text()


def test_a_hanging_py_spy_delays_the_reap_by_its_budget_only(
    tmp_path: Path,
    worker_script: Path,
    procs: list[subprocess.Popen[bytes]],
    served: tuple[Path, list[ReapEvent], list[TimerServer]],
) -> None:
    """A py-spy that never answers (with a child holding its output, as a stuck
    ``process_vm_readv`` would) is killed, group and all, at the budget; the reap goes
    on. The budget is 0.5 s, the fake sleeps 600 s: the reap must come within the budget
    plus a wide slack for a loaded machine."""
    fake = _fake_pyspy(
        tmp_path, f"sleep 600 & echo $! > {tmp_path}/child; echo $$ > {tmp_path}/spy; wait\n"
    )
    fifo, events, servers = served
    servers.append(_serve(fifo, events, StackCollector(tmp_path / "ev", exe=str(fake), budget=0.5)))
    proc = _spawn(worker_script, 0.5, fifo)
    procs.append(proc)
    servers[0].watch_pid(proc.pid)
    wait_for(lambda: (tmp_path / "child").exists(), timeout=60, what="the fake py-spy started")
    wait_for(lambda: proc.poll() is not None, timeout=0.5 + 15, what="the reap within the budget")
    assert proc.returncode == -signal.SIGKILL
    wait_for(lambda: events, timeout=10, what="the reap")
    assert events[0].why == (
        f"timer 'step' expired; reaped by the timer server; stacks unavailable: {fake} did "
        "not answer within the budget of 0.5 s"
    )
    for name in ("spy", "child"):
        pid = int((tmp_path / name).read_text())
        wait_for(lambda pid=pid: _gone(pid), timeout=10, what=f"the fake py-spy's {name} killed")


def test_without_py_spy_the_reap_goes_on_and_says_why(
    tmp_path: Path,
    worker_script: Path,
    procs: list[subprocess.Popen[bytes]],
    served: tuple[Path, list[ReapEvent], list[TimerServer]],
) -> None:
    fifo, events, servers = served
    servers.append(_serve(fifo, events, StackCollector(tmp_path / "ev", exe="kelastic-no-py-spy")))
    proc = _spawn(worker_script, 0.5, fifo)
    procs.append(proc)
    servers[0].watch_pid(proc.pid)
    assert proc.wait(60) == -signal.SIGKILL
    wait_for(lambda: events, timeout=10, what="the reap")
    assert events[0].why.endswith("; stacks unavailable: kelastic-no-py-spy not found on PATH")
    assert servers[0].stats().reaped == 1


@needs_pyspy
def test_the_hard_timeouts_kill_reads_the_stacks_before_its_reap_is_queued(
    tmp_path: Path, worker_script: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The supervisor's ``on_kill`` for the in-process hard timeout (``wiring``): told
    before the SIGKILL, it reads the stopped worker's stacks and queues its reap with
    them."""
    proc = _spawn(worker_script, 0)
    procs.append(proc)
    wait_for(lambda: process_state(proc.pid) == "T", timeout=30, what="the worker stopped")
    queued: list[Event] = []
    kill_reporter(StackCollector(tmp_path / "ev"), queued.append)(proc.pid, "no barrier")
    [event] = queued
    assert isinstance(event, WorkerReaped) and event.reap.state == "T"
    where = f"main thread at {worker_script}:{STOP_LINE} in stuck_here"
    assert event.reap.why.startswith(f"no barrier; {where} (stacks in ")
    assert (tmp_path / "ev" / f"rank-3-pid-{proc.pid}.txt").is_file()


def test_the_pids_due_for_a_reap_are_those_expire_signals() -> None:
    """``due_reaps`` (whose stacks the server reads first) names exactly the pids that
    ``expire`` at the same time signals: not a timer deferred by the grace, a signal-0
    timer, an unwatched pid or a timer not yet due."""
    from kelastic_sidecar.timer.table import TimerTable
    from kelastic_sidecar.timer.wire import _Request

    kills: list[int] = []
    table = TimerTable(100, 100, kill=lambda pid, sig: kills.append(pid), grace=4.0)
    for pid in (101, 102, 103, 104):
        table.watch(pid, None)
    table.apply(_Request(101, "step", 100.0, signal.SIGKILL))  # overdue at 104
    table.apply(_Request(102, "quiet", 100.0, 0))  # signal 0: expires, no kill
    table.apply(_Request(103, "later", 200.0, signal.SIGKILL))  # not due
    table.apply(_Request(105, "step", 100.0, signal.SIGKILL))  # unwatched
    assert table.due_reaps(100.0) == []  # 101's reap waits for the grace
    assert table.expire(100.0) == [] and kills == []
    assert table.due_reaps(103.9) == []
    assert table.due_reaps(104.0) == [101]
    ev = Evidence(101, Outcome.COLLECTED, "main thread at /w/t.py:1 in f")
    [event] = table.expire(104.0, {101: ev})
    assert kills == [101] and event.evidence is ev and event.why.endswith("; " + ev.summary)
    # 103 expired longer ago than the grace (a stalled server): reaped in one call
    assert table.due_reaps(1000.0) == [103]
    assert [e.pid for e in table.expire(1000.0)] == [103] and kills == [101, 103]
