"""Hang recovery: a worker stops (SIGSTOP) inside ``expires(after=2)`` -> the first step
of the resumed job on all ranks. One node x 2 gloo DDP workers running
:mod:`bench._step_train`.

torch side: ``torchrun --standalone`` with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (its
``FileTimerServer`` at max_interval 0.1, workers on torch's ``FileTimerClient``). After it
reaps the hung worker the server sends the same signal to its own process, the agent
(``FileTimerServer._reap_worker(os.getpid(), ...)``; the other worker then fails with
"FileTimerServer is not available"), so torchrun does not resume by itself: an outer
supervisor (this benchmark, polling every 20 ms: a best case for any real one) relaunches
it, and the sample is the time until the relaunched torchrun's first step. kelastic
side: ``kelastic run`` with 1 replica, cold and with ``--warm-start``, which resumes by
itself (sidecar timer server reaps, launcher restarts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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
    spawn_logged,
    start_kelastic,
)

TRAIN = REPO / "bench" / "_step_train.py"
#: the trainer's ``expires(after=...)``: a hung worker is reaped this long after its step began
STEP_TIMEOUT = 2.0


def fresh_generation(path: Path, known: set[int], world: int) -> list[dict[str, Any]] | None:
    """The ``start`` events of all ``world`` ranks from pids not in ``known``, or None."""
    fresh = {
        e["rank"]: e for e in read_events(path) if e.get("ev") == "start" and e["pid"] not in known
    }
    return list(fresh.values()) if len(fresh) == world else None


def wait_generation(
    path: Path, known: set[int], world: int, timeout: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        generation = fresh_generation(path, known, world)
        if generation is not None:
            return generation
        time.sleep(0.02)
    raise TimeoutError(f"the job did not (re)start all {world} ranks within {timeout:.0f} s")


def kill_workers(events: Path) -> None:
    """SIGKILL every trainer process ``events`` names that is still alive (orphans of a
    dead torchrun are no longer its descendants)."""
    import psutil

    for pid in {e["pid"] for e in read_events(events)}:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if any(str(TRAIN) in part for part in proc.cmdline()):
                proc.kill()


def stop_session(proc: subprocess.Popen[bytes], sig: int, graceful: bool = True) -> None:
    """``sig`` to ``proc`` and its descendants (SIGKILL after 15 s), then SIGKILL to its
    session (process group)."""
    from .mttr import _teardown

    if graceful:
        _teardown([proc], sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(5)


def _rank_pid(generation: list[dict[str, Any]], rank: int) -> int:
    return int(next(e["pid"] for e in generation if e["rank"] == rank))


def _torchrun(tmp: Path, hangs: int, settle: float) -> tuple[list[float], list[str]]:
    events = tmp / "torch-hang.jsonl"
    env = child_env(BENCH_EVENTS=str(events), BENCH_TIMER="torch")
    env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
    env.pop("TORCHELASTIC_TIMER_FILE", None)  # torchrun picks a fresh FIFO per launch
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", "50", "--monitor-interval", "0.1", str(TRAIN)]  # fmt: skip
    launches: list[subprocess.Popen[bytes]] = []
    notes: list[str] = []

    def launch() -> subprocess.Popen[bytes]:
        proc = spawn_logged(args, env, tmp / f"torchrun-hang-{len(launches)}.log", tmp)
        launches.append(proc)
        return proc

    samples = []
    try:
        proc = launch()
        generation = wait_generation(events, set(), 2, 120.0)
        known = {e["pid"] for e in generation}
        for i in range(hangs):
            time.sleep(settle)  # steady training
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited (code {proc.returncode}) before the hang")
            os.kill(_rank_pid(generation, 1), signal.SIGSTOP)
            stopped_at = time.time()
            deadline = time.monotonic() + 90.0
            while (fresh := fresh_generation(events, known, 2)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("torchrun did not resume within 90 s after a hang")
                if proc.poll() is not None:  # the outer relaunch
                    died = time.time() - stopped_at
                    code = proc.returncode
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                    notes.append(f"agent died ({how}) {died:.2f} s after the hang")
                    log(f"hang: torchrun died ({how}) {died:.2f} s after the hang; relaunching")
                    stop_session(proc, signal.SIGKILL, graceful=False)
                    kill_workers(events)
                    proc = launch()
                time.sleep(0.02)
            generation = fresh
            known |= {e["pid"] for e in generation}
            samples.append(max(e["t"] for e in generation) - stopped_at)
            log(f"hang: torchrun {i + 1}/{hangs}: resumed after {samples[-1]:.2f} s")
        return samples, notes
    finally:
        for proc in launches:
            stop_session(proc, signal.SIGTERM)
        kill_workers(events)


def _kelastic(tmp: Path, hangs: int, settle: float, warm: bool) -> list[float]:
    name = "hang-warm" if warm else "hang"
    events = tmp / f"kelastic-{name}.jsonl"
    proc = start_kelastic(tmp, name, TRAIN, 1, 2, events, warm=warm)
    samples = []
    try:
        generation = wait_generation(events, set(), 2, 120.0)
        known = {e["pid"] for e in generation}
        for i in range(hangs):
            time.sleep(settle)
            if proc.poll() is not None:
                raise RuntimeError(f"kelastic run exited (code {proc.returncode})")
            os.kill(_rank_pid(generation, 1), signal.SIGSTOP)  # what --fault hang does
            stopped_at = time.time()
            generation = wait_generation(events, known, 2, 90.0)
            known |= {e["pid"] for e in generation}
            samples.append(max(e["t"] for e in generation) - stopped_at)
            log(f"hang: kelastic {i + 1}/{hangs}: resumed after {samples[-1]:.2f} s")
        return samples
    finally:
        stop_session(proc, signal.SIGINT)
        kill_workers(events)


def dump_logs(tmp: Path) -> None:
    for name in sorted(os.listdir(tmp)):
        if name.endswith(".log"):
            log(f"--- {name}:\n" + (tmp / name).read_text(errors="replace")[-2000:])


def hang(quick: bool) -> CaseResult:
    result = CaseResult("hang_recovery")
    hangs, settle = (1, 0.3) if quick else (3, 1.0)
    group = "worker SIGSTOPped inside expires(after=2) (1x2 gloo DDP) -> first resumed step"
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            log(f"hang: torchrun + FileTimerServer, outer relaunch: {hangs} hangs")
            theirs, notes = _torchrun(tmp, hangs, settle)
            log(f"hang: kelastic run: {hangs} hangs")
            ours = _kelastic(tmp, hangs, settle, warm=False)
            log(f"hang: kelastic run --warm-start: {hangs} hangs")
            warm = _kelastic(tmp, hangs, settle, warm=True)
        except Exception:
            dump_logs(tmp)
            raise
    died = sum(n.startswith("agent died") for n in notes)
    how = "; ".join(sorted({n.split(") ")[0] + ")" for n in notes}))
    note = (
        f"TORCHELASTIC_ENABLE_FILE_TIMER=1: the agent died with its timer server after "
        f"{died} of {hangs} hangs ({how}), so torchrun needs an outer relaunch (here an "
        "ideal one: 20 ms polling, no backoff); the samples include the 2 s expires() deadline"
        if died
        else "torchrun resumed by itself"
    )
    result.rows.append(
        Row(
            "hang_recovery",
            group,
            "torchrun + file timer, outer relaunch",
            "s",
            theirs,
            ref=True,
            note=note,
            extra={"events": notes},
        )
    )
    result.rows.append(Row("hang_recovery", group, "kelastic run (resumes by itself)", "s", ours))
    result.rows.append(
        Row("hang_recovery", group, "kelastic run --warm-start (resumes by itself)", "s", warm)
    )
    t = median(theirs)
    for what, samples in (("", ours), (" with --warm-start", warm)):
        k = median(samples)
        result.checks.append(
            Check(
                "hang_recovery",
                f"resumes by itself; <= 0.5x torchrun + outer relaunch (median){what}",
                f"{k:.2f} s vs {t:.2f} s = {k / t:.2f}x (after the 2 s deadline: "
                f"{k - STEP_TIMEOUT:.2f} s vs {t - STEP_TIMEOUT:.2f} s = "
                f"{(k - STEP_TIMEOUT) / (t - STEP_TIMEOUT):.2f}x)",
                k <= 0.5 * t,
            )
        )
    return result
