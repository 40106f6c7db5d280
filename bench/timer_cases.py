"""Timer cases: reap latency and request throughput, torch's FileTimerServer vs ours.

Both servers run in their own process (:mod:`bench._timer_proc`). Clients are processes
forked from this one after torch's timer client was imported (so no client pays for
``import torch`` inside the measurement), and they all use torch's own
``FileTimerClient`` (and torch's ``expires``): the same wire input reaches both servers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import (
    CaseResult,
    Check,
    LineReader,
    Row,
    child_env,
    kill_pids,
    log,
    median,
    percentile,
    stop_process,
)


@dataclass
class _Server:
    proc: subprocess.Popen[str]
    out: LineReader
    fifo: str
    reap_log: Path

    def kill_times(self) -> dict[int, float]:
        """pid -> when the server signalled it (``time.time()``), from its reap log."""
        if not self.reap_log.exists():
            return {}
        pairs = (line.split() for line in self.reap_log.read_text().splitlines() if line)
        return {int(pid): float(t) for pid, t in pairs}

    def command(self, line: str, timeout: float = 10.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.out.get(timeout)

    def stats(self) -> dict[str, Any]:
        return dict(json.loads(self.command("stats")))


@contextlib.contextmanager
def _server(
    impl: str, max_interval: float | None, tmp: Path, step_times: bool = True
) -> Iterator[_Server]:
    """A timer server process (``impl``: torch's or kelastic's); ``step_times=False``:
    kelastic's without the step-time view (``$BENCH_STEP_TIMES=0``)."""
    tag = "" if step_times else "-nosteps"
    fifo = str(tmp / f"timer-{impl}-{max_interval}{tag}.fifo")
    reap_log = tmp / f"reaps-{impl}-{max_interval}{tag}.log"
    args = [sys.executable, "-m", "bench._timer_proc", impl, fifo]
    if max_interval is not None:
        args.append(str(max_interval))
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(BENCH_REAP_LOG=str(reap_log), BENCH_STEP_TIMES="1" if step_times else "0"),
        start_new_session=True,
    )
    try:
        out = LineReader(proc)
        line = out.get(60.0)
        if line != "ready":
            raise RuntimeError(f"timer server said {line!r}")
        yield _Server(proc, out, fifo, reap_log)
    finally:
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2.0)
        stop_process(proc)


def _torch_timer() -> tuple[Any, Any]:
    import logging

    from torch.distributed.elastic.timer import expires
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    return expires, FileTimerClient


# ------------------------------------------------------------------------ reap latency


class _ChildExit(Exception):
    """Ends a forked bench child with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _fork_waiting(max_wait: float, setup: Callable[[], Callable[[float], None]]) -> tuple[int, int]:
    """Fork a child that runs ``setup()`` (e.g. opens its timer client), waits for its
    deadline (a float, ``time.time()`` seconds) on a pipe, runs what ``setup`` returned
    with it, then hangs until killed. Exit 4 on an error, or a :class:`_ChildExit`'s
    code. Returns ``(pid, write end of the pipe)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(r)
        return pid, w
    code = 3
    try:
        os.close(w)
        signal.alarm(int(max_wait) + 30)  # fallback: never outlive a failed server
        run = setup()
        run(float(os.read(r, 64).decode()))
        while True:
            time.sleep(3600)
    except _ChildExit as exc:
        code = exc.code
    except BaseException:
        code = 4
    finally:
        os._exit(code)


def _fork_hung(fifo: str, max_wait: float) -> tuple[int, int]:
    """Fork a child that waits for its deadline on a pipe, then enters torch's
    ``expires`` with that deadline and hangs inside it. Returns ``(pid, write end of
    the pipe)``."""

    expires, client_cls = _torch_timer()  # imported here, before the fork

    def setup() -> Callable[[float], None]:
        client = client_cls(fifo)

        def hang(deadline: float) -> None:
            with expires(after=deadline - time.time(), scope="hung", client=client):
                while True:
                    time.sleep(3600)

        return hang

    return _fork_waiting(max_wait, setup)


def _reap_latencies(
    server: _Server, impl: str, count: int, gap: float, max_wait: float
) -> tuple[list[float], list[float], int]:
    """``count`` hung children with deadlines ``gap`` apart; returns the latencies (s)
    from each deadline to the child's death and to the server's kill, and how many were
    not reaped by a signal.

    All children are forked (and, for kelastic, watched) before the first deadline, so
    that this process does nothing but wait on their pidfds while they are reaped."""
    live: dict[int, tuple[int, float]] = {}  # pidfd -> (pid, deadline)
    poller = select.poll()
    latencies: list[float] = []
    deadlines: dict[int, float] = {}
    failed = 0
    children: list[tuple[int, int]] = []
    unreaped: set[int] = set()
    pipes: set[int] = set()
    try:
        for _ in range(count):
            children.append(_fork_hung(server.fifo, max_wait))
            unreaped.add(children[-1][0])
            pipes.add(children[-1][1])
        if impl.startswith("kelastic"):
            server.command("watch " + " ".join(str(pid) for pid, _ in children))
        start = time.time() + 0.3  # every child has entered expires() by then
        for i, (pid, pipe_w) in enumerate(children):
            deadline = start + i * gap
            deadlines[pid] = deadline
            fd = os.pidfd_open(pid)
            live[fd] = (pid, deadline)
            poller.register(fd, select.POLLIN)
            os.write(pipe_w, repr(deadline).encode())
            os.close(pipe_w)
            pipes.discard(pipe_w)
        while live:
            for fd, _ in poller.poll(200):
                dead_at = time.time()
                pid, deadline = live.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                unreaped.discard(pid)
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                    latencies.append(dead_at - deadline)
                else:
                    failed += 1
            for fd, (pid, deadline) in list(live.items()):
                if time.time() > deadline + max_wait:
                    kill_pids([pid])
                    unreaped.discard(pid)
                    poller.unregister(fd)
                    os.close(fd)
                    del live[fd]
                    failed += 1
    finally:
        kill_pids(sorted(unreaped))
        for fd in [*live, *pipes]:
            os.close(fd)
    kills = server.kill_times()
    to_kill = [kills[pid] - deadline for pid, deadline in deadlines.items() if pid in kills]
    return latencies, to_kill, failed


def _kill_floor(count: int, release: bool = False) -> list[float]:
    """The same kind of child (forked from this torch-importing process), killed directly:
    the part of the latency that is the kernel tearing the process down plus the pidfd
    wake-up, which no timer server can remove (``release``: then ``process_mrelease``
    from here, as the kelastic server does)."""
    from kelastic_sidecar.timer import release_memory

    samples = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            try:
                signal.alarm(30)
                while True:
                    time.sleep(3600)
            finally:
                os._exit(3)
        fd = os.pidfd_open(pid)
        try:
            time.sleep(0.05)
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            if release:
                release_memory(pid)
            poller.poll(5000)
            samples.append(time.time() - killed)
        finally:
            os.close(fd)
            kill_pids([pid])
    return samples


def reap(quick: bool) -> CaseResult:
    """Deadline of ``expires(after=X)`` in a hung child -> child dead (pidfd), per server.

    torch at max_interval 0.1 and kelastic run in alternating chunks (both servers up),
    so that load from elsewhere on the machine hits both alike."""
    result = CaseResult("timer_reap")
    group = "expires() deadline -> hung child dead"
    group_kill = "expires() deadline -> kill sent (server's own clock)"
    torch01, ours, plain, torch10 = (
        "torch FileTimerServer max_interval=0.1",
        "kelastic TimerServer",
        "kelastic TimerServer without process_mrelease",
        "torch FileTimerServer default (10 s)",
    )
    chunks = 1 if quick else 4
    plan = [
        (torch01, "torch", 0.1, 8 if quick else 10, 0.13),
        (ours, "kelastic", None, 10 if quick else 15, 0.05),
        (plain, "kelastic-norelease", None, 5 if quick else 8, 0.05),
    ]
    dead: dict[str, list[float]] = {}
    killed: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kelastic-bench-")))
        servers = {
            side: stack.enter_context(_server(impl, iv, tmp)) for side, impl, iv, _, _ in plan
        }
        for chunk in range(chunks):
            for side, impl, _, count, gap in plan:
                log(f"timer_reap: {side}: {count} hung children ({chunk + 1}/{chunks})")
                d, k, f = _reap_latencies(servers[side], impl, count, gap, max_wait=25.0)
                dead.setdefault(side, []).extend(d)
                killed.setdefault(side, []).extend(k)
                failures[side] = failures.get(side, 0) + f
        if not quick:  # the default interval takes ~10 s per reap round
            log(f"timer_reap: {torch10}: 24 hung children")
            with _server("torch", 10.0, tmp) as server:
                d, k, f = _reap_latencies(server, "torch", 24, 0.43, max_wait=25.0)
            dead[torch10], killed[torch10], failures[torch10] = d, k, f
    for side in dead:
        failed = failures[side]
        note = f"{failed} children not reaped within 25 s" if failed else ""
        ms = [x * 1000 for x in dead[side]]
        result.rows.append(Row("timer_reap", group, side, "ms", ms, ref=side == torch01, note=note))
    for side in killed:
        ms = [x * 1000 for x in killed[side]]
        result.rows.append(Row("timer_reap", group_kill, side, "ms", ms, ref=side == torch01))
    _torch_timer()  # the floor's children carry torch like the hung ones
    for release, side in ((False, "kernel + harness"), (True, "same + process_mrelease")):
        floor = _kill_floor(5 if quick else 20, release)
        result.rows.append(
            Row("timer_reap", "floor: kill(SIGKILL) -> child dead, no server", side,
                "ms", [x * 1000 for x in floor])
        )  # fmt: skip
    mine = next(r for r in result.rows if r.side == ours and r.group == group)
    theirs = next(r for r in result.rows if r.ref and r.group == group)
    mine_k = next(r for r in result.rows if r.side == ours and r.group == group_kill)
    theirs_k = next(r for r in result.rows if r.ref and r.group == group_kill)
    med, p99 = median(mine.samples), percentile(mine.samples, 99)
    full = failures[ours] == 0
    result.checks += [
        Check("timer_reap", "median <= 10 ms", f"{med:.2f} ms", med <= 10 and full),
        Check("timer_reap", "p99 <= 50 ms", f"{p99:.2f} ms", p99 <= 50 and full),
        Check(
            "timer_reap",
            ">= 10x better than torch at max_interval 0.1 (median, deadline -> dead)",
            f"{median(theirs.samples) / med:.1f}x",
            median(theirs.samples) >= 10 * med,
        ),
        Check(
            "timer_reap",
            "(same, server side: deadline -> kill sent)",
            f"{median(theirs_k.samples) / median(mine_k.samples):.0f}x",
            median(theirs_k.samples) >= 10 * median(mine_k.samples),
        ),
    ]
    return result


# -------------------------------------------------------------------------- throughput


def _fork_client(fifo: str, go_r: int, out_w: int, duration: float) -> int:
    _, client_cls = _torch_timer()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        client = client_cls(fifo)
        os.read(go_r, 1)
        ok = errors = other = 0
        end = time.monotonic() + duration
        scope = f"step-{os.getpid()}"
        while time.monotonic() < end:
            for release in (False, True):
                try:
                    if release:
                        client.release(scope)
                    else:
                        client.acquire(scope, time.time() + 600)
                    ok += 1
                except BlockingIOError:
                    errors += 1
                except Exception:
                    other += 1
        os.write(out_w, json.dumps({"ok": ok, "errors": errors, "other": other}).encode())
    except BaseException:
        code = 4
    finally:
        os._exit(code)


#: Seconds between a flood hang's acquire and its deadline.
_FLOOD_HANG_AFTER = 0.2


def _fork_flood_hang(fifo: str, max_wait: float, report_w: int) -> tuple[int, int]:
    """Fork a child that reads its deadline from a pipe, acquires a timer for it with
    torch's client ``_FLOOD_HANG_AFTER`` s before (retrying while the pipe is full, as
    a worker that wants its hang covered would), writes to ``report_w`` how many of its
    attempts raised ``BlockingIOError``, then hangs. Exit 5: the acquire never got
    through before the deadline. Returns ``(pid, write end of the pipe)``."""

    _, client_cls = _torch_timer()  # imported here, before the fork

    def setup() -> Callable[[float], None]:
        client = client_cls(fifo)

        def acquire(deadline: float) -> None:
            time.sleep(max(0.0, deadline - _FLOOD_HANG_AFTER - time.time()))
            refused = 0
            while True:
                try:
                    client.acquire("flood_hang", deadline)
                    break
                except BlockingIOError:
                    refused += 1
                    if time.time() > deadline:
                        raise _ChildExit(5) from None
            os.write(report_w, f"{refused}\n".encode())

        return acquire

    return _fork_waiting(max_wait, setup)


class _HangWatch:
    """Hung children armed during a flood: when each died after its deadline."""

    def __init__(self, server: _Server, impl: str, count: int, max_wait: float) -> None:
        self._report_r, report_w = os.pipe()
        os.set_blocking(self._report_r, False)
        try:
            self.children = [
                _fork_flood_hang(server.fifo, max_wait, report_w) for _ in range(count)
            ]
        finally:
            os.close(report_w)
        if impl.startswith("kelastic"):
            server.command("watch " + " ".join(str(pid) for pid, _ in self.children))
        self.latencies: list[float] = []
        self.refused: list[int] = []
        self.deadlines: dict[int, float] = {}
        self.failed = 0
        self._max_wait = max_wait
        self._thread: threading.Thread | None = None

    def arm(self, first: float, last: float) -> None:
        """Give the children deadlines spread over ``first..last`` and start waiting."""
        n = len(self.children)
        deadlines = self.deadlines
        for i, (pid, pipe_w) in enumerate(self.children):
            deadlines[pid] = first + (last - first) * i / max(1, n - 1)
            os.write(pipe_w, repr(deadlines[pid]).encode())
            os.close(pipe_w)
        self._thread = threading.Thread(target=self._wait, args=(deadlines,), daemon=True)
        self._thread.start()

    def _wait(self, deadlines: dict[int, float]) -> None:
        poller = select.poll()
        live = {}
        for pid in deadlines:
            fd = os.pidfd_open(pid)
            live[fd] = pid
            poller.register(fd, select.POLLIN)
        end = max(deadlines.values()) + self._max_wait
        while live and time.time() < end:
            for fd, _ in poller.poll(100):
                dead_at = time.time()
                pid = live.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                    self.latencies.append(dead_at - deadlines[pid])
                else:
                    self.failed += 1
        kill_pids(list(live.values()))
        self.failed += len(live)
        for fd in live:
            os.close(fd)

    def join(self) -> None:
        """Wait for the children's fate; a child not reaped in time is killed and counted.
        Then :attr:`refused` holds each child's ``BlockingIOError`` count."""
        if self._thread is not None:
            self._thread.join()
        else:
            kill_pids([pid for pid, _ in self.children])
        data = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._report_r, 4096):
                data += chunk
        os.close(self._report_r)
        self.refused = [int(x) for x in data.split()]


def _throughput_once(
    server: _Server, impl: str, k: int, duration: float, hangs: int
) -> dict[str, Any]:
    import psutil

    go_r, go_w = os.pipe()
    outs: list[tuple[int, int]] = []  # (pid, read end)
    hang = _HangWatch(server, impl, hangs, max_wait=10.0)
    try:
        for _ in range(k):
            out_r, out_w = os.pipe()
            pid = _fork_client(server.fifo, go_r, out_w, duration)
            os.close(out_w)
            outs.append((pid, out_r))
            server.command(f"watch {pid}")  # a worker: its requests count for step times
        time.sleep(0.2)  # let the children settle
        proc = psutil.Process(server.proc.pid)
        before = server.stats()["requests"]
        cpu0 = sum(proc.cpu_times()[:2])
        t0 = time.monotonic()
        os.write(go_w, b"g" * k)
        now = time.time()  # the hangs are armed while the flood runs
        hang.arm(now + 0.3 + _FLOOD_HANG_AFTER, now + duration - 0.1)
        counts = {"ok": 0, "errors": 0, "other": 0}
        for pid, out_r in outs:
            os.waitpid(pid, 0)
            raw = os.read(out_r, 4096)
            if raw:
                for key, value in json.loads(raw).items():
                    counts[key] += value
            else:
                counts["other"] += 1
        wall = time.monotonic() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        processed = server.stats()["requests"] - before
        outs_pids = []
    except BaseException:
        outs_pids = [pid for pid, _ in outs]
        raise
    finally:
        kill_pids(outs_pids)
        hang.join()
        for _, out_r in outs:
            os.close(out_r)
        os.close(go_r)
        os.close(go_w)
    kills = server.kill_times()
    return {
        "sent_per_s": counts["ok"] / duration,
        "processed_per_s": processed / wall,
        "errors": counts["errors"],
        "other_errors": counts["other"],
        "server_cpu_pct": 100 * cpu / wall,
        "server_cpu_us_per_req": 1e6 * cpu / processed if processed else float("nan"),
        "hang_ms": [x * 1000 for x in hang.latencies],
        "hang_kill_ms": [
            (kills[pid] - t) * 1000 for pid, t in hang.deadlines.items() if pid in kills
        ],
        "hang_failed": hang.failed,
        "hang_refused": hang.refused,
    }


def _fork_bulk_flooder(fifo: str, go_r: int, duration: float, base: int) -> int:
    """Fork a hostile writer: whole ``PIPE_BUF`` chunks of far-future acquires naming
    other pids, written as fast as the pipe takes them (a forged-timer flood)."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        far = time.time() + 3600
        lines = [
            json.dumps(
                {"version": 1, "pid": base + n, "scope_id": "forged",
                 "expiration_time": far, "signal": 9}
            ).encode() + b"\n"
            for n in range(100_000)  # distinct: each is a new timer (70,000 filled a table)
        ]  # fmt: skip
        chunks, chunk = [], b""
        for line in lines:
            if len(chunk) + len(line) > select.PIPE_BUF:
                chunks.append(chunk)
                chunk = b""
            chunk += line
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.read(go_r, 1)
        end = time.monotonic() + duration
        while time.monotonic() < end:
            for chunk in chunks:
                with contextlib.suppress(BlockingIOError):
                    os.write(fd, chunk)  # <= PIPE_BUF: all of it or nothing
    except BaseException:
        code = 4
    finally:
        os._exit(code)


def _bulk_flood_once(
    server: _Server, impl: str, writers: int, duration: float, hangs: int
) -> dict[str, Any]:
    go_r, go_w = os.pipe()
    hang = _HangWatch(server, impl, hangs, max_wait=10.0)
    pids: list[int] = []
    try:
        pids = [
            _fork_bulk_flooder(server.fifo, go_r, duration, 1_000_000 * (i + 1))
            for i in range(writers)
        ]
        time.sleep(0.2)
        os.write(go_w, b"g" * writers)
        now = time.time()
        hang.arm(now + 0.3 + _FLOOD_HANG_AFTER, now + duration - 0.1)
        for pid in pids:
            os.waitpid(pid, 0)
        pids = []
    finally:
        kill_pids(pids)
        hang.join()
        os.close(go_r)
        os.close(go_w)
    kills = server.kill_times()
    return {
        "hang_ms": [x * 1000 for x in hang.latencies],
        "hang_kill_ms": [
            (kills[pid] - t) * 1000 for pid, t in hang.deadlines.items() if pid in kills
        ],
        "hang_failed": hang.failed,
        "hang_refused": hang.refused,
    }


def _bulk_rows(result: CaseResult, sides: list[tuple[str, str, float | None, bool]],
               runs: dict[str, list[dict[str, Any]]], writers: int) -> None:  # fmt: skip
    """Rows and checks of the forged-timer flood: hangs armed during it."""
    group = f"{writers} hostile writers flooding forged timers: hang deadline ->"
    for side, _, _, ref in sides:
        unreaped = sum(r["hang_failed"] for r in runs[side])
        note = f"{unreaped} hung children not reaped within 10 s" if unreaped else ""
        for what, key in (("kill sent", "hang_kill_ms"), ("hung child dead", "hang_ms")):
            samples = [x for r in runs[side] for x in r[key]]
            result.rows.append(
                Row("timer_throughput", f"{group} {what}", side, "ms", samples, ref=ref,
                    note=note if what == "hung child dead" else "")
            )  # fmt: skip
            if what == "kill sent":
                result.rows.append(
                    Row("timer_throughput",
                        f"{writers} hostile writers: BlockingIOError before a torch "
                        "client's acquire got through", side, "errors",
                        [x for r in runs[side] for x in r["hang_refused"]], ref=ref)
                )  # fmt: skip
            if side == "kelastic TimerServer":
                p99 = percentile(samples, 99) if samples else float("inf")
                result.checks.append(
                    Check(
                        "timer_throughput",
                        f"hang armed during the forged-timer flood: deadline -> {what} "
                        "p99 <= 50 ms, every hang reaped",
                        f"{p99:.1f} ms over {len(samples)} hangs, {unreaped} not reaped",
                        p99 <= 50 and unreaped == 0,
                    )
                )


#: The side of kelastic's timer server without the step-time view (stragglers).
STEPS_OFF = "kelastic TimerServer, step times off"


def throughput(quick: bool) -> CaseResult:
    """K client processes looping acquire/release with torch's FileTimerClient."""
    result = CaseResult("timer_throughput")
    ks = (1, 4) if quick else (1, 4, 16)
    reps, duration = (1, 1.0) if quick else (3, 2.0)
    hangs = 3 if quick else 6  # armed during each run's flood
    sides: list[tuple[str, str, float | None, bool]] = [
        ("torch FileTimerServer max_interval=0.1", "torch", 0.1, True)
    ]
    sides.append(("kelastic TimerServer", "kelastic", None, False))
    if not quick:  # the step-time view's cost (issue: step time with it on <= 1.01x off)
        sides.append((STEPS_OFF, "kelastic", None, False))
    raw: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        # Both servers up; the sides alternate run by run, so that load from elsewhere on
        # the machine hits both alike.
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kelastic-bench-")))
        servers = {side: stack.enter_context(_server(impl, iv, tmp, side != STEPS_OFF))
                   for side, impl, iv, _ in sides}  # fmt: skip
        for k in ks:
            log(f"timer_throughput: K={k}: {reps} runs of {duration} s per side, alternating")
            for _ in range(reps):
                for side, impl, _, _ in sides:
                    run = _throughput_once(servers[side], impl, k, duration, hangs)
                    raw.setdefault((side, k), []).append(run)
        log(f"timer_throughput: forged-timer flood, {reps} runs of {duration} s per side")
        bulk: dict[str, list[dict[str, Any]]] = {}
        for _ in range(reps):
            for side, impl, _, _ in sides:
                run = _bulk_flood_once(servers[side], impl, 2, duration, hangs)
                bulk.setdefault(side, []).append(run)
    for k in ks:
        for side, _, _, ref in sides:
            runs = raw[(side, k)]
            other = sum(r["other_errors"] for r in runs)
            note = f"K={k}: {other:.0f} other client errors" if other else ""
            extra = {"runs": [{x: v for x, v in r.items() if "hang_" not in x} for r in runs]}
            unreaped = sum(r["hang_failed"] for r in runs)
            result.rows += [
                Row(
                    "timer_throughput",
                    f"K={k} hang armed during the flood: deadline -> hung child dead",
                    side,
                    "ms",
                    [x for r in runs for x in r["hang_ms"]],
                    ref=ref,
                    note=f"{unreaped} hung children not reaped within 10 s" if unreaped else "",
                ),
                Row(
                    "timer_throughput",
                    f"K={k} hang armed during the flood: deadline -> kill sent (server's clock)",
                    side,
                    "ms",
                    [x for r in runs for x in r["hang_kill_ms"]],
                    ref=ref,
                ),
                Row(
                    "timer_throughput",
                    f"K={k} requests/s (acquire+release, client side)",
                    side,
                    "req/s",
                    [r["sent_per_s"] for r in runs],
                    better="higher",
                    ref=ref,
                    note=note,
                    extra=extra,
                ),
                Row(
                    "timer_throughput",
                    f"K={k} requests/s read by the server",
                    side,
                    "req/s",
                    [r["processed_per_s"] for r in runs],
                    better="higher",
                    ref=ref,
                ),
                Row(
                    "timer_throughput",
                    f"K={k} client errors (BlockingIOError) per run",
                    side,
                    "errors",
                    [r["errors"] for r in runs],
                    ref=ref,
                ),
                Row(
                    "timer_throughput",
                    f"K={k} server CPU",
                    side,
                    "% of a core",
                    [r["server_cpu_pct"] for r in runs],
                    ref=ref,
                ),
                Row(
                    "timer_throughput",
                    f"K={k} server CPU per request read",
                    side,
                    "us",
                    [r["server_cpu_us_per_req"] for r in runs],
                    ref=ref,
                ),
            ]
    _bulk_rows(result, sides, bulk, 2)
    ours = "kelastic TimerServer"
    theirs = sides[0][0]
    if not quick:  # a step is one acquire and release here: the view's worst case
        ratios = {k: median([r["sent_per_s"] for r in raw[(STEPS_OFF, k)]])
                  / median([r["sent_per_s"] for r in raw[(ours, k)]]) for k in ks}  # fmt: skip
        # one ratio per K moves by +-3 % from run to run on this machine, either way: the
        # geometric mean over the K's is the measure, each K's ratio is shown
        pooled = math.prod(ratios.values()) ** (1 / len(ratios))
        shown = ", ".join(f"K={k} {v:.3f}x" for k, v in ratios.items())
        result.checks.append(Check("timer_throughput", "step time with the step-time view on "
                                   "<= 1.01x off (timer-only steps; geometric mean over K)",
                                   f"{pooled:.3f}x ({shown})", pooled <= 1.01))  # fmt: skip
    for k in ks:
        mine = median([r["sent_per_s"] for r in raw[(ours, k)]])
        ref_rate = median([r["sent_per_s"] for r in raw[(theirs, k)]])
        errs = sum(r["errors"] + r["other_errors"] for r in raw[(ours, k)])
        result.checks += [
            Check(
                "timer_throughput",
                f">= torch's requests/s at K={k}",
                f"{mine:,.0f} vs {ref_rate:,.0f} req/s",
                mine >= ref_rate,
            ),
            Check("timer_throughput", f"zero client errors at K={k}", f"{errs:.0f}", errs == 0),
        ]
        unreaped = sum(r["hang_failed"] for r in raw[(ours, k)])
        for what, key in (("kill sent", "hang_kill_ms"), ("hung child dead", "hang_ms")):
            hang_ms = [x for r in raw[(ours, k)] for x in r[key]]
            p99 = percentile(hang_ms, 99) if hang_ms else float("inf")
            result.checks.append(
                Check(
                    "timer_throughput",
                    f"hang armed during the K={k} flood: deadline -> {what} p99 <= 50 ms, "
                    "every hang reaped",
                    f"{p99:.1f} ms over {len(hang_ms)} hangs, {unreaped} not reaped",
                    p99 <= 50 and unreaped == 0,
                )
            )
    return result
