"""Goodput: a 2 nodes x 2 workers gloo DDP job (:mod:`bench._step_train`) with one worker
SIGKILLed every 20 s for 2 minutes (quick: every 12 s for 36 s); the productive-time ratio
is the time rank 0 spent in completed training steps / wall time, over the window that
starts at the job's first step on all ranks.

torch side: two ``torchrun`` agents on localhost (c10d rendezvous, unshared store, as in
:mod:`bench.mttr`). kelastic side: ``kelastic run`` with 2 replicas. The trainer keeps no
checkpoint, so the ratio counts recovery time only, not recomputed steps (the same for
both sides).
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from .common import (
    CaseResult,
    Check,
    Row,
    child_env,
    log,
    median,
    read_events,
    start_kelastic,
    start_torchrun_pair,
)
from .hang import TRAIN, dump_logs, kill_workers, stop_session
from .hang import wait_generation as _wait


def _start_torchrun(tmp: Path, events: Path) -> list[subprocess.Popen[bytes]]:
    env = child_env(BENCH_EVENTS=str(events))
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    env.pop("TORCHELASTIC_ENABLE_FILE_TIMER", None)
    return start_torchrun_pair(tmp, "goodput", TRAIN, env, max_restarts=100)


def productive_time(steps: list[dict[str, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by the completed steps ``{"t0", "t1"}`` (rank 0's
    steps do not overlap; a step cut by the window counts in part)."""
    return sum(max(0.0, min(e["t1"], end) - max(e["t0"], start)) for e in steps)


def _rank1_worker(
    roots: list[subprocess.Popen[bytes]], train: Path = TRAIN
) -> psutil.Process | None:
    """The running ``train`` process with ``RANK=1`` among the descendants of ``roots``
    (whether or not it has reached its first step yet)."""
    for root in roots:
        try:
            procs = psutil.Process(root.pid).children(recursive=True)
        except psutil.Error:
            continue
        for proc in procs:
            try:
                if (
                    proc.environ().get("RANK") == "1"
                    and any(str(train) in part for part in proc.cmdline())
                    and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                ):
                    return proc
            except psutil.Error:
                continue
    return None


def _run(
    procs: list[subprocess.Popen[bytes]], events: Path, duration: float, every: float
) -> dict[str, Any]:
    generation = _wait(events, set(), 4, 120.0)
    start = max(e["t"] for e in generation)
    end = start + duration
    kills: list[float] = []
    skipped = 0
    next_kill = start + every
    while next_kill < end - 1e-6:
        time.sleep(max(0.0, next_kill - time.time()))
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the job exited")
        victim = _rank1_worker(procs)
        while victim is None and time.time() < next_kill + every / 2:
            time.sleep(0.05)  # between two generations: kill the next rank 1 once it runs
            victim = _rank1_worker(procs)
        if victim is None:
            skipped += 1
            log("goodput: no rank 1 worker running at kill time; skipped")
        else:
            try:
                victim.kill()
            except psutil.Error:
                skipped += 1
                continue
            kills.append(time.time())
            log(f"goodput: kill {len(kills)} at +{kills[-1] - start:.1f} s (pid {victim.pid})")
        next_kill += every
    time.sleep(max(0.0, end - time.time()) + 0.3)
    steps = [e for e in read_events(events) if e.get("ev") == "step"]
    productive = productive_time(steps, start, end)
    # recovery per kill: kill -> first step of a rank-0 process started after the kill
    recoveries = []
    for killed_at in kills:
        before = {e["pid"] for e in steps if e["t0"] < killed_at}
        after = [e["t1"] for e in steps if e["t0"] > killed_at and e["pid"] not in before]
        if after and min(after) < end:
            recoveries.append(min(after) - killed_at)
    return {
        "ratio": productive / duration,
        "productive_s": productive,
        "wall_s": duration,
        "steps": float(sum(1 for e in steps if start < e["t1"] <= end)),
        "kills": float(len(kills)),
        "skipped_kills": float(skipped),
        "recoveries": recoveries,
    }


def goodput(quick: bool) -> CaseResult:
    result = CaseResult("goodput")
    duration, every = (36.0, 12.0) if quick else (120.0, 20.0)
    group = f"SIGKILL of 1 worker every {every:.0f} s for {duration:.0f} s (2x2 gloo DDP)"
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            log(f"goodput: torchrun, 2 agents: {duration:.0f} s, a kill every {every:.0f} s")
            events = tmp / "torch-goodput.jsonl"
            procs = _start_torchrun(tmp, events)
            try:
                measured["torch"] = _run(procs, events, duration, every)
            finally:
                for proc in procs:
                    stop_session(proc, signal.SIGTERM)
                kill_workers(events)
            log(f"goodput: kelastic run, 2 replicas: {duration:.0f} s")
            events = tmp / "kelastic-goodput.jsonl"
            proc = start_kelastic(tmp, "goodput", TRAIN, 2, 2, events)
            try:
                measured["kelastic"] = _run([proc], events, duration, every)
            finally:
                stop_session(proc, signal.SIGINT)
                kill_workers(events)
        except Exception:
            dump_logs(tmp)
            raise
    for key, side, ref in (
        ("torch", "torchrun c10d, 2 agents", True),
        ("kelastic", "kelastic run, 2 replicas", False),
    ):
        m = measured[key]
        note = (
            f"{m['productive_s']:.1f} s in steps of {m['wall_s']:.0f} s wall, "
            f"{m['steps']:.0f} steps, {m['kills']:.0f} kills"
            + (f" ({m['skipped_kills']:.0f} skipped)" if m["skipped_kills"] else "")
        )
        log(f"goodput: {side}: ratio {m['ratio']:.3f} ({note})")
        result.rows.append(
            Row(
                "goodput",
                f"{group}: productive time / wall time",
                side,
                "ratio",
                [m["ratio"]],
                better="higher",
                ref=ref,
                note=note,
                extra=dict(m),
            )
        )
    for key, side, ref in (
        ("torch", "torchrun c10d, 2 agents", True),
        ("kelastic", "kelastic run, 2 replicas", False),
    ):
        result.rows.append(
            Row(
                "goodput",
                "kill -> first step of the restarted rank 0",
                side,
                "s",
                list(measured[key]["recoveries"]),
                ref=ref,
            )
        )
    theirs, ours = measured["torch"]["ratio"], measured["kelastic"]["ratio"]
    result.checks.append(
        Check(
            "goodput",
            "productive-time ratio: kelastic higher than torchrun",
            f"{ours:.3f} vs {theirs:.3f} (median recovery "
            f"{median(measured['kelastic']['recoveries']):.2f} s vs "
            f"{median(measured['torch']['recoveries']):.2f} s)",
            ours > theirs,
        )
    )
    return result
