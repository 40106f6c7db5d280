"""Network preflight: what a round's check (``spec.preflight.network``) adds before its
workers start, at N nodes on gloo (the issue's target: <= 1 s at N = 8).

kelastic's side: N checker processes (``python -m kelastic.netcheck``, one per node, as
the launchers run them) started ahead and left to import torch (the launcher starts its
checker when it connects and when a round ends, so the import overlaps the rendezvous),
then given one round's params at once. The sample is the time from the params written to
the last verdict read: the group's forming, the all-reduce of 4 MiB against the default
floors, the verdict. Every verdict must say passed (a failed or inconclusive one is the
row's status).

torch's side, in the same run and the same way (started ahead, then one go): N
processes that form a gloo group over a ``TCPStore`` and all-reduce the same 4 MiB once:
what any gloo job pays at its start anyway, the floor under a gloo check. The ratio says
how much more the check's measuring (warm-ups, timed repetitions, the agreement on the
numbers) costs than that floor.

All processes of a side run on this machine over loopback: the numbers are the check's
own cost (its collectives and bookkeeping on shared cores), not a network's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence

import psutil

from .common import CaseResult, Check, Row, child_env, log, median

#: The issue's target, seconds, at :data:`NODES` nodes.
TARGET = 1.0
NODES = 8

#: torch's side: a gloo group and one all-reduce of the same payload, after one go line.
TORCH_SIDE = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    rank, world, port, size = map(int, sys.stdin.readline().split())
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout,
                          wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(torch.zeros(size // 4, dtype=torch.float32))
    dist.destroy_process_group()
    print("done", flush=True)
    """
)


def _start(n: int, args: Sequence[str]) -> list[subprocess.Popen[str]]:
    pipe, quiet = subprocess.PIPE, subprocess.DEVNULL
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            text=True,
            env=child_env(),
            stdin=pipe,
            stdout=pipe,
            stderr=quiet,
        )
        for _ in range(n)
    ]
    _wait_idle(procs)
    return procs


def _wait_idle(procs: Sequence[subprocess.Popen[str]], timeout: float = 120.0) -> None:
    """Until every process sleeps with its CPU time unchanged over 0.3 s: its import done,
    blocked on its stdin (the launcher's idle checker)."""
    handles = [psutil.Process(p.pid) for p in procs]
    deadline = time.monotonic() + timeout
    last: list[float] = [-1.0] * len(handles)
    while time.monotonic() < deadline:
        now = [sum(h.cpu_times()[:2]) for h in handles]
        if now == last and all(h.status() == psutil.STATUS_SLEEPING for h in handles):
            return
        last = now
        time.sleep(0.3)
    raise TimeoutError(f"the processes did not go idle within {timeout:g} s")


def _go(procs: Sequence[subprocess.Popen[str]], lines: Sequence[str]) -> tuple[float, list[str]]:
    """Write each its line at once; (seconds until the last answered, the answers)."""
    started = time.perf_counter()
    for proc, line in zip(procs, lines, strict=True):
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.close()
    answers = []
    for proc in procs:
        assert proc.stdout is not None
        answers.append(proc.stdout.readline().strip())
    took = time.perf_counter() - started
    for proc in procs:
        proc.wait(timeout=60)
    return took, answers


def _kelastic_round(n: int, round_: int) -> tuple[float, str]:
    from kelastic.netcheck import Params, Setting, decode_verdict, encode_params
    from kelastic.sockaddr import free_port

    setting = Setting()  # the defaults a job gets with `network: {}`
    port = free_port()
    procs = _start(n, ["-m", "kelastic.netcheck"])
    lines = [encode_params(Params(round_, r, n, "127.0.0.1", port, setting.timeout_s,
                                  setting.floors)) for r in range(n)]  # fmt: skip
    took, answers = _go(procs, lines)
    verdicts = [decode_verdict(a) for a in answers]
    bad = [v for v in verdicts if not v.passed]
    status = f"not passed: {bad[0].failed or bad[0].inconclusive}" if bad else ""
    v = verdicts[0]
    log(f"  kelastic round {round_}: {took:.3f} s (latency {v.latency_s * 1e3:.2f} ms, "
        f"bandwidth {v.bandwidth_bps / 1e6:.0f} MB/s){' ' + status if status else ''}")  # fmt: skip
    return took, status


def _torch_round(n: int) -> float:
    from kelastic.netcheck import Floors
    from kelastic.sockaddr import free_port

    port, size = free_port(), Floors().size_bytes
    procs = _start(n, ["-c", TORCH_SIDE])
    took, answers = _go(procs, [f"{r} {n} {port} {size}" for r in range(n)])
    if answers != ["done"] * n:
        raise RuntimeError(f"torch's side answered {answers}")
    log(f"  torch round: {took:.3f} s")
    return took


def preflight(quick: bool = False) -> CaseResult:
    """The case: ``rounds`` rounds of each side at ``NODES`` nodes (quick: 4 nodes, 3)."""
    n, rounds = (4, 3) if quick else (NODES, 5)
    result = CaseResult("preflight")
    ours: list[float] = []
    theirs: list[float] = []
    statuses: list[str] = []
    log(f"preflight: {rounds} rounds of {n} checkers, each side")
    for r in range(rounds):
        took, status = _kelastic_round(n, r)
        ours.append(took)
        statuses += [status] if status else []
        theirs.append(_torch_round(n))
    group = f"network check of a round, N = {n} (gloo, loopback)"
    result.rows.append(Row("preflight", group, "torch: gloo group + one all-reduce", "s",
                           theirs, ref=True))  # fmt: skip
    result.rows.append(Row("preflight", group, "kelastic: network check (default floors)", "s",
                           ours, status="; ".join(statuses[:1])))  # fmt: skip
    if not quick:
        value = median(ours)
        met = value <= TARGET and not statuses
        target = f"check per round <= {TARGET:g} s at N = {n}"
        result.checks.append(Check("preflight", target, f"{value:.3f} s median", met))
    return result
