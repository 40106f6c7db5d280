"""Recovery (MTTR): SIGKILL one worker of a 2 nodes x 2 workers gloo DDP job -> the first
DDP step of the restarted group on all four ranks.

torch side: two ``torchrun`` agents on localhost (``--rdzv-backend c10d``,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the unshared store; the default shared store can
hang on restart, pytorch/pytorch#135712). kelastic side: ``kelastic run`` with 2
replicas, cold (each attempt starts new interpreters, as torchrun does) and with
``--warm-start`` (workers forked from a zygote that imported torch and DDP's lazy
imports). All run :mod:`bench._mttr_train`; one job per side, killed several times in a
row (each kill costs one restart of the budget).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import (
    REPO,
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

TRAIN = REPO / "bench" / "_mttr_train.py"


def _wait_generation(path: Path, known_pids: set[int], timeout: float) -> list[dict[str, Any]]:
    """Wait until all 4 ranks reported a first step from a pid not in ``known_pids``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = {e["rank"]: e for e in read_events(path) if e["pid"] not in known_pids}
        if len(fresh) == 4:
            return list(fresh.values())
        time.sleep(0.02)
    raise TimeoutError(f"the job did not (re)start all 4 ranks within {timeout:.0f} s")


def _descendants(pids: list[int]) -> list[Any]:
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            procs += [parent, *parent.children(recursive=True)]
    return procs


def _teardown(procs: list[subprocess.Popen[bytes]], sig: int) -> None:
    """Signal our job's processes, then SIGKILL every descendant still alive."""
    import psutil

    tree = _descendants([p.pid for p in procs])
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    tree += _descendants([p.pid for p in procs if p.poll() is None])
    _, alive = psutil.wait_procs(tree, timeout=3)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _measure(
    procs: list[subprocess.Popen[bytes]], events: Path, kills: int, start_timeout: float
) -> list[float]:
    generation = _wait_generation(events, set(), start_timeout)
    known = {e["pid"] for e in generation}
    samples = []
    for i in range(kills):
        time.sleep(1.0)  # a few steps of steady training
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the job exited")
        victim = next(e for e in generation if e["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.time()
        generation = _wait_generation(events, known, 60.0)
        known |= {e["pid"] for e in generation}
        samples.append(max(e["t"] for e in generation) - killed_at)
        log(f"mttr: kill {i + 1}/{kills}: all ranks stepping again after {samples[-1]:.2f} s")
    return samples


def _torchrun(tmp: Path, kills: int) -> list[float]:
    events = tmp / "torch-events.jsonl"
    env = child_env(BENCH_EVENTS=str(events))
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    procs = []
    try:
        procs = start_torchrun_pair(tmp, "mttr", TRAIN, env, max_restarts=50)
        return _measure(procs, events, kills, 120.0)
    finally:
        _teardown(procs, signal.SIGTERM)


def _kelastic(tmp: Path, kills: int, warm: bool = False) -> list[float]:
    side = "warm" if warm else "cold"
    events = tmp / f"kelastic-{side}-events.jsonl"
    proc = start_kelastic(tmp, f"mttr-{side}", TRAIN, 2, 2, events, warm=warm, max_restarts=50)
    try:
        return _measure([proc], events, kills, 120.0)
    finally:
        _teardown([proc], signal.SIGINT)


def mttr(quick: bool) -> CaseResult:
    result = CaseResult("recovery_mttr")
    kills = 1 if quick else 4
    group = "SIGKILL of 1 worker (2x2 gloo DDP) -> first step on all ranks"
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        for side, fn, ref in (
            ("torchrun c10d, unshared store", _torchrun, True),
            ("kelastic run", _kelastic, False),
            ("kelastic run --warm-start", functools.partial(_kelastic, warm=True), False),
        ):
            log(f"mttr: {side}: {kills} kills")
            try:
                samples = fn(tmp, kills)
            except Exception:
                for name in sorted(os.listdir(tmp)):
                    if name.endswith(".log"):
                        log(f"--- {name}:\n" + (tmp / name).read_text()[-2000:])
                raise
            result.rows.append(Row("recovery_mttr", group, side, "s", samples, ref=ref))
    theirs, ours, warm = (median(r.samples) for r in result.rows)
    for what, value, target in (("", ours, 0.5), (" with --warm-start", warm, 0.25)):
        result.checks.append(
            Check(
                "recovery_mttr",
                f"<= {target}x torchrun (median){what}",
                f"{value:.2f} s vs {theirs:.2f} s = {value / theirs:.2f}x",
                value <= target * theirs,
            )
        )
    return result
