"""Flight records on a hang, with real processes: two gloo workers with torch's flight
recorder on, armed by ``@record``; rank 1 stays in Python (not stopped) while rank 0
waits in the next all-reduce. The sidecar's collector asks each for its record (a byte
on its FIFO, heard by a thread of its own while the main thread is stuck in the
collective), reads it within the budget, and the hang's summary names rank 1 from the
records; the stopped, unarmed, reused-pid, silent and lying cases cost at most the
budget and never harm the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic import contract
from kelastic.flight_recorder import (
    Collective,
    FlightRecord,
    ask_fifo,
    decode_record,
    record_name,
)
from kelastic.hang_where import HangWhere, RankWhere, summarize
from kelastic.sockaddr import free_port
from kelastic_sidecar.hang_evidence import Evidence, Outcome, StackCollector
from kelastic_sidecar.hang_evidence.flight import await_record, request_record
from kelastic_sidecar.timer.report import process_state
from tests.conftest import wait_for

WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from kelastic.errors import record

    @record
    def main():
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}",
                                rank=rank, world_size=2)
        t = torch.ones(1000)
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()  # collective #4
        print("trained", flush=True)
        if rank == 1:
            while True:  # in Python, never entering collective #5
                time.sleep(0.05)
        dist.all_reduce(t)  # #5: waits for rank 1 for ever

    main()
    """
)


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, contract.ENV_RUN_DIR: str(run_dir), **extra}
    env.pop(contract.ENV_FLIGHT_RECORDER_BUFFER, None)
    return env | extra


@pytest.fixture()
def hung_pair(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, port],
            env=_env(tmp_path, RANK=str(r), TORCH_FR_BUFFER_SIZE="200"),
            stdout=subprocess.PIPE,
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == b"trained\n"
        yield contract.flight_records_dir(tmp_path), procs
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


def _collector(
    flight_dir: Path, budget: float = 5.0, told: list[Outcome] | None = None
) -> StackCollector:
    """A collector asking for records in ``flight_dir``; each ask's outcome to ``told``."""
    return StackCollector(flight_dir.parent / "stacks", budget=budget, flight_dir=flight_dir,
                          on_record=None if told is None else told.append)  # fmt: skip


def test_each_rank_answers_with_its_collectives_and_the_summary_names_the_late_one(
    hung_pair: tuple[Path, list[subprocess.Popen[bytes]]],
) -> None:
    flight_dir, (rank0, rank1) = hung_pair
    collect = _collector(flight_dir)
    # rank 0 is in all-reduce #5 once its record says so (it enters it after "trained")
    pending = Collective("default_pg", 5, "gloo:all_reduce", done=False)
    first = wait_for(
        lambda: (ev := collect(rank0.pid)).collectives == (pending,) and ev,
        timeout=60, what="rank 0 in all-reduce #5",
    )  # fmt: skip
    told: list[Outcome] = []
    late = _collector(flight_dir, told=told)(rank1.pid)
    assert told == [Outcome.COLLECTED]  # kelastic_flight_records_total{outcome="collected"}
    assert late.collectives == (Collective("default_pg", 4, "gloo:barrier", done=True),), late
    assert late.flight == str(flight_dir / record_name(rank1.pid, 1))
    record = decode_record((flight_dir / record_name(rank0.pid, 0)).read_bytes())
    assert record.pid == rank0.pid and record.rank == 0 and record.entries == 5
    assert process_state(rank0.pid) == "S" and rank0.poll() is None  # answered, alive
    assert rank1.poll() is None

    wheres = [
        HangWhere(3, "job-0", (
            RankWhere(0, 0, rank0.pid, "S", False, first.line(), first.collectives),
            RankWhere(1, 1, rank1.pid, "S", False, late.line(), late.collectives),
        ))
    ]  # fmt: skip
    line = summarize(wheres)
    assert "culprit: rank 1 on job-0 (state S)" in line, line
    assert "not in gloo:all_reduce #5 of default_pg, which the others entered" in line, line
    assert "waiting: rank 0 on job-0" in line, line


def test_a_stopped_worker_is_not_asked_and_a_collection_stays_in_its_budget(
    hung_pair: tuple[Path, list[subprocess.Popen[bytes]]],
) -> None:
    flight_dir, (_, rank1) = hung_pair
    rank1.send_signal(signal.SIGSTOP)
    wait_for(lambda: process_state(rank1.pid) == "T", what="rank 1 stopped")
    ev = _collector(flight_dir, budget=1.0)(rank1.pid)
    assert ev.collectives == () and ev.flight == "not asked: the process is in state T", ev
    rank1.send_signal(signal.SIGCONT)
    assert rank1.poll() is None


def _sleeper(tmp_path: Path, code: str = "") -> subprocess.Popen[bytes]:
    """A Python process that is not a worker (runs ``code``, then sleeps)."""
    script = f"import os, time\n{code}\nprint('up', flush=True)\ntime.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(tmp_path),
                            stdout=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def test_an_unarmed_or_reused_pid_is_not_asked(tmp_path: Path) -> None:
    flight_dir = contract.flight_records_dir(tmp_path)
    flight_dir.mkdir(parents=True)
    proc = _sleeper(tmp_path)
    try:
        told: list[Outcome] = []
        ev = _collector(flight_dir, budget=1.0, told=told)(proc.pid)
        assert ev.flight.startswith("not armed (no TORCH_FR_BUFFER_SIZE"), ev
        assert told == []  # not asked: not counted
        # the FIFO of an earlier, dead process under the same pid: nobody listens
        os.mkfifo(ask_fifo(flight_dir, proc.pid))
        started = time.monotonic()
        ev = _collector(flight_dir, budget=1.0)(proc.pid)
        assert ev.flight.startswith(f"not armed (nothing listens on ask-{proc.pid}"), ev
        assert time.monotonic() - started < 1.0 + 2.0  # not waited for
        # something at the FIFO's name that is no FIFO: not written to
        ask_fifo(flight_dir, proc.pid).unlink()
        ask_fifo(flight_dir, proc.pid).write_bytes(b"")
        ev = _collector(flight_dir, budget=1.0)(proc.pid)
        assert ev.flight == f"could not ask: ask-{proc.pid} is not a FIFO", ev
        assert ask_fifo(flight_dir, proc.pid).read_bytes() == b""
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(30)


def _listener(tmp_path: Path, answer: str) -> subprocess.Popen[bytes]:
    """A process that listens on its FIFO as an armed worker does and then runs
    ``answer`` (Python; ``path`` is its record's path) instead of writing a record."""
    flight_dir = contract.flight_records_dir(tmp_path)
    flight_dir.mkdir(parents=True, exist_ok=True)
    code = textwrap.dedent(f"""
        import pathlib, threading
        d = pathlib.Path({str(flight_dir)!r})
        os.mkfifo(d / f"ask-{{os.getpid()}}")
        def listen():
            fd = os.open(d / f"ask-{{os.getpid()}}", os.O_RDONLY)
            os.read(fd, 64)
            path = d / f"pid-{{os.getpid()}}.json"
            {answer}
        threading.Thread(target=listen, daemon=True).start()
    """)
    return _sleeper(tmp_path, code)


def _first_heard(collect: StackCollector, pid: int) -> Evidence:
    """The first collection that the listener heard: its thread opens the FIFO a moment
    after the process says it is up (until then an ask finds nobody listening)."""
    return wait_for(
        lambda: (ev := collect(pid)).flight.startswith("not armed (nothing listens") is False
        and ev,
        timeout=30, what="the listener listening",
    )  # fmt: skip


def test_an_armed_worker_that_never_answers_costs_the_budget_only(tmp_path: Path) -> None:
    proc = _listener(tmp_path, "time.sleep(120)")
    try:
        told: list[Outcome] = []
        collect = _collector(contract.flight_records_dir(tmp_path), budget=1.0, told=told)
        started = time.monotonic()
        ev = _first_heard(collect, proc.pid)
        took = time.monotonic() - started
        assert ev.flight == "not written within the budget" and ev.collectives == (), ev
        assert told == [Outcome.UNAVAILABLE]  # asked once, counted once
        assert 1.0 <= took < 1.0 + 2.0, took  # the budget, and a slack for a loaded machine
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('path.write_text(\'{"version": 1, "pid": 1e999}\')', "flight record:"),
        ('path.write_text(\'{"version": 2, "pid": 1, "last": [], "trace": []}\')',
         "flight record:"),
        ('path.write_text(\'{"version": 1, "pid": 1, "rank": null, "last": [], "trace": []}\')',
         "the record names pid 1"),
    ],
)  # fmt: skip
def test_a_record_that_is_not_one_is_refused_with_its_reason(
    tmp_path: Path, answer: str, why: str
) -> None:
    """A crafted or corrupt record (a number past any bound, another version, another
    process's): the collector says why and names no collective."""
    proc = _listener(tmp_path, answer)
    try:
        ev = _first_heard(_collector(contract.flight_records_dir(tmp_path), budget=5.0), proc.pid)
        assert ev.collectives == () and ev.flight.startswith(why), ev
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("size", [None, "0", "x", "-5"])
def test_without_the_recorder_on_nothing_is_armed(tmp_path: Path, size: str | None) -> None:
    script = "from kelastic import flight_recorder; print(flight_recorder.arm())"
    env = _env(tmp_path) if size is None else _env(tmp_path, TORCH_FR_BUFFER_SIZE=size)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         check=True)  # fmt: skip
    assert out.stdout == b"False\n"
    assert not contract.flight_records_dir(tmp_path).exists()


def test_a_forked_child_arms_under_its_own_pid_and_a_clean_exit_removes_the_fifo(
    tmp_path: Path,
) -> None:
    """A process armed once is armed; a forked child (no listening thread of its
    parent's) arms again under its pid; a clean exit removes the process's FIFO (the
    child's ``os._exit`` leaves its own, which nobody listens on: never asked)."""
    script = textwrap.dedent(
        """
        import os
        from kelastic import contract, flight_recorder
        assert flight_recorder.arm() and flight_recorder.arm()  # once per process
        pid = os.fork()
        if pid == 0:
            os._exit(0 if flight_recorder.arm() else 3)
        _, status = os.waitpid(pid, 0)
        names = sorted(p.name for p in contract.flight_records_dir().iterdir())
        print(os.waitstatus_to_exitcode(status), pid, os.getpid(), *names, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script],
                         env=_env(tmp_path, TORCH_FR_BUFFER_SIZE="10"),
                         capture_output=True, check=True)  # fmt: skip
    code, child, parent, *names = out.stdout.decode().split()
    assert code == "0", out.stderr
    assert set(names) == {f"ask-{child}", f"ask-{parent}"}
    left = {p.name for p in contract.flight_records_dir(tmp_path).iterdir()}
    assert left == {f"ask-{child}"}


def test_the_record_is_named_by_the_rank_its_sidecar_asks_with(tmp_path: Path) -> None:
    """An in-process restart may renumber a worker after its ``$RANK`` was set: the record
    is named (and says) the rank its sidecar knows it by, the one the ask carries."""
    code = "from kelastic import flight_recorder\nassert flight_recorder.arm()"
    script = f"import os, time\n{code}\nprint('up', flush=True)\ntime.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            env=_env(tmp_path, RANK="7", TORCH_FR_BUFFER_SIZE="10"))  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        flight_dir = contract.flight_records_dir(tmp_path)
        wait_for(lambda: request_record(flight_dir, proc.pid, 3) is None, what="asked")
        record = await_record(flight_dir, proc.pid, 3, time.monotonic() + 30)
        assert isinstance(record, FlightRecord) and (record.pid, record.rank) == (proc.pid, 3)
        assert not (flight_dir / record_name(proc.pid, 7)).exists()
    finally:
        proc.kill()
        proc.wait(30)


def test_the_in_process_hard_timeouts_kill_carries_the_waiting_ranks_record(
    hung_pair: tuple[Path, list[subprocess.Popen[bytes]]],
) -> None:
    """The in-process hard timeout's ``on_kill`` (``wiring.kill_reporter``, what the
    coordinator calls just before its SIGKILL) reads a worker that waits in a collective
    (not stopped) with the same collector: it asks for the flight record, and the reap it
    queues says which collective the worker was in."""
    from kelastic_sidecar.events import WorkerReaped
    from kelastic_sidecar.wiring import kill_reporter

    flight_dir, (rank0, _) = hung_pair
    pending = Collective("default_pg", 5, "gloo:all_reduce", done=False)
    wait_for(lambda: _collector(flight_dir)(rank0.pid).collectives == (pending,),
             timeout=60, what="rank 0 in all-reduce #5")  # fmt: skip
    queued: list[object] = []
    kill_reporter(_collector(flight_dir), queued.append)(rank0.pid, "no barrier within 10 s")
    [event] = queued
    assert isinstance(event, WorkerReaped) and event.reap.evidence is not None
    assert event.reap.evidence.collectives == (pending,), event.reap.evidence
    assert event.reap.evidence.flight == str(flight_dir / record_name(rank0.pid, 0))
    assert event.reap.why.startswith("no barrier within 10 s; "), event.reap.why
