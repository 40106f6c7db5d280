"""In-process restart: time from a fault to every rank of a 2 nodes x 2 workers gloo DDP
job stepping again, side by side in one run.

(a) one rank raises inside the training function (SIGUSR1 -> exception): kelastic's
    in-process restart vs NVIDIA's ``nvidia_resiliency_ext.inprocess.Wrapper`` (under
    torchrun, its documented set-up; its process group's timeout lowered to 3 s, its best
    case: ranks blocked in a collective are released only by that timeout) vs kelastic's
    warm process restart vs torchrun.
(b) one worker is SIGKILLed: kelastic's hybrid rung (survivors restart in process, the
    dead rank starts again as a process) vs kelastic with a spare rank per node
    (``spareRanks: 1``: a waiting spare takes the dead rank's place, no process start; a
    new spare is forked meanwhile; a kill before it is ready falls back to the hybrid
    rung) vs kelastic's warm process restart vs torchrun.
(c) one rank hangs (SIGUSR2: no step, no ``ping``): kelastic's soft-timeout abort; the
    sample is the time from the hang to all ranks stepping again, minus the soft timeout.

All sides run :mod:`bench._inprocess_train`. Targets: (a) <= 0.3 s median,
<= 0.05x torchrun, >= 10x faster than NVRx; (b) <= 0.5x kelastic warm; (c) <= 0.3 s past
the soft timeout.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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
from .mttr import _teardown

TRAIN = REPO / "bench" / "_inprocess_train.py"
#: soft timeout of case (c), seconds
SOFT_TIMEOUT = 2.0
IN_PROCESS = f"""  inProcess:
    enabled: true
    maxRestarts: 1000
    softTimeoutSeconds: {SOFT_TIMEOUT}
    hardTimeoutSeconds: 30
"""


def _generation(events: Path, since: float, timeout: float) -> dict[int, dict[str, float]]:
    """The first-step events of all 4 ranks written after ``since`` (a new generation:
    new processes or a new in-process iteration)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh: dict[int, dict[str, float]] = {}
        for e in read_events(events):
            if e["t"] > since:
                fresh.setdefault(int(e["rank"]), e)
        if len(fresh) == 4:
            return fresh
        time.sleep(0.01)
    raise TimeoutError(f"not all 4 ranks stepped again within {timeout:.0f} s")


def _faults(
    events: Path, procs: list[subprocess.Popen[bytes]], sig: int, count: int, minus: float = 0.0
) -> list[float]:
    """Send ``sig`` to rank 1 ``count`` times, one after the other; the samples in s."""
    gen = _generation(events, 0.0, 180.0)
    samples = []
    for i in range(count):
        time.sleep(1.0)  # steady training
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the job exited")
        at = time.time()
        os.kill(int(gen[1]["pid"]), sig)
        gen = _generation(events, at, 90.0)
        samples.append(max(e["t"] for e in gen.values()) - at - minus)
        log(f"inprocess: fault {i + 1}/{count}: all ranks stepping again after "
            f"{samples[-1] + minus:.3f} s")  # fmt: skip
    return samples


def _kelastic(tmp: Path, name: str, sig: int, count: int, *, in_process: bool,
              minus: float = 0.0, spares: int = 0) -> list[float]:  # fmt: skip
    events = tmp / f"{name}.jsonl"
    spec = IN_PROCESS + (f"    spareRanks: {spares}\n" if spares else "")
    proc = start_kelastic(
        tmp, name, TRAIN, 2, 2, events, warm=True, max_restarts=100,
        extra_spec=spec if in_process else "", extra_env={"BENCH_WRAP": "kelastic"},
    )  # fmt: skip
    try:
        return _faults(events, [proc], sig, count, minus)
    finally:
        _teardown([proc], signal.SIGINT)


def _torchrun(tmp: Path, name: str, sig: int, count: int, wrap: str = "none") -> list[float]:
    events = tmp / f"{name}.jsonl"
    env = child_env(BENCH_EVENTS=str(events), BENCH_WRAP=wrap)
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    procs = start_torchrun_pair(tmp, name, TRAIN, env, max_restarts=0 if wrap == "nvrx" else 50)
    try:
        return _faults(events, procs, sig, count)
    finally:
        _teardown(procs, signal.SIGTERM)


def _nvrx_missing() -> str | None:
    try:
        importlib.import_module("nvidia_resiliency_ext.inprocess")
    except Exception as exc:  # ImportError, or its import failing on this machine
        return f"{type(exc).__name__}: {exc} (pip install '.[bench]')"
    return None


def _run(result: CaseResult, tmp: Path, group: str, side: str,
         fn: Callable[[], list[float]], ref: bool = False) -> list[float] | None:  # fmt: skip
    log(f"inprocess: {group}: {side}")
    try:
        samples = fn()
    except Exception as exc:
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".log"):
                log(f"--- {name}:\n" + (tmp / name).read_text()[-3000:])
        result.checks.append(Check("inprocess", f"{side} ran", f"{type(exc).__name__}: {exc}",
                                   False))  # fmt: skip
        return None
    result.rows.append(Row("inprocess", group, side, "s", samples, ref=ref))
    return samples


def inprocess(quick: bool) -> CaseResult:
    """Run (a), (b), (c); ``quick``: one fault per side, no NVRx, no (b)."""
    result = CaseResult("inprocess")
    n = 1 if quick else 5
    torch_b = warm_b = ours_b = spare_b = None
    usr1, kill, usr2 = signal.SIGUSR1, signal.SIGKILL, signal.SIGUSR2
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        a = "(a) rank 1 raises -> all ranks stepping"
        torch_a = _run(
            result,
            tmp,
            a,
            "torchrun (process restart)",
            lambda: _torchrun(tmp, "a-torchrun", usr1, min(n, 3)),
            ref=True,
        )
        warm_a = _run(
            result,
            tmp,
            a,
            "kelastic warm process restart",
            lambda: _kelastic(tmp, "a-warm", usr1, min(n, 3), in_process=False),
        )
        ours_a = _run(
            result,
            tmp,
            a,
            "kelastic in-process",
            lambda: _kelastic(tmp, "a-inproc", usr1, n, in_process=True),
        )
        missing = _nvrx_missing()
        nvrx_a = None
        if missing is None and not quick:
            nvrx_a = _run(
                result,
                tmp,
                a,
                "NVRx 0.4.1 Wrapper (torchrun)",
                lambda: _torchrun(tmp, "a-nvrx", usr1, min(n, 3), wrap="nvrx"),
            )
        elif missing is not None:
            log(f"inprocess: NVRx not measured: {missing}")
        b = "(b) rank 1 SIGKILLed -> all ranks stepping"
        if not quick:
            torch_b = _run(
                result,
                tmp,
                b,
                "torchrun (process restart)",
                lambda: _torchrun(tmp, "b-torchrun", kill, 3),
                ref=True,
            )
            warm_b = _run(
                result,
                tmp,
                b,
                "kelastic warm process restart",
                lambda: _kelastic(tmp, "b-warm", kill, 3, in_process=False),
            )
            ours_b = _run(
                result,
                tmp,
                b,
                "kelastic hybrid (in-process + 1 warm start)",
                lambda: _kelastic(tmp, "b-hybrid", kill, n, in_process=True),
            )
            spare_b = _run(
                result,
                tmp,
                b,
                "kelastic spare (in-process + a waiting spare per node)",
                lambda: _kelastic(tmp, "b-spare", kill, n, in_process=True, spares=1),
            )
        c = f"(c) rank 1 hangs -> all stepping, minus the {SOFT_TIMEOUT:g} s soft timeout"
        ours_c = _run(result, tmp, c, "kelastic in-process (soft timeout)",
                      lambda: _kelastic(tmp, "c-soft", usr2, min(n, 3), in_process=True,
                                        minus=SOFT_TIMEOUT))  # fmt: skip
    if ours_a and torch_a:
        m, t = median(ours_a), median(torch_a)
        result.checks.append(Check("inprocess", "(a) <= 0.3 s median", f"{m:.3f} s", m <= 0.3))
        result.checks.append(
            Check(
                "inprocess",
                "(a) <= 0.05x torchrun",
                f"{m:.3f} s vs {t:.2f} s = {m / t:.3f}x",
                m <= 0.05 * t,
            )
        )
    if ours_a and nvrx_a:
        m, v = median(ours_a), median(nvrx_a)
        result.checks.append(
            Check(
                "inprocess",
                "(a) >= 10x faster than NVRx",
                f"{v:.2f} s / {m:.3f} s = {v / m:.1f}x",
                v >= 10 * m,
            )
        )
    if ours_a and warm_a:
        m, w = median(ours_a), median(warm_a)
        result.checks.append(
            Check(
                "inprocess",
                "(a) vs kelastic warm process restart",
                f"{m:.3f} s vs {w:.2f} s = {m / w:.3f}x",
                m < w,
            )
        )
    if not quick and ours_b and warm_b:
        m, w = median(ours_b), median(warm_b)
        detail = f"{m:.2f} s vs {w:.2f} s = {m / w:.2f}x"
        if m > 0.5 * w:  # the obstacle, named
            detail += (" (the dead rank starts at the go: its fork and group init"
                       " follow the barrier, a warm restart's floor too)")  # fmt: skip
        result.checks.append(Check("inprocess", "(b) <= 0.5x kelastic warm", detail, m <= 0.5 * w))
    if not quick and spare_b and warm_b:
        m, w = median(spare_b), median(warm_b)
        text = f"{m:.3f} s vs {w:.2f} s = {m / w:.2f}x"
        result.checks.append(
            Check("inprocess", "(b) with a spare <= 0.5x kelastic warm", text, m <= 0.5 * w)
        )
    if not quick and spare_b and ours_b:
        m, h = median(spare_b), median(ours_b)
        result.checks.append(
            Check(
                "inprocess", "(b) spare vs hybrid", f"{m:.3f} s vs {h:.3f} s = {m / h:.2f}x", m < h
            )
        )
    if not quick and ours_b and torch_b:
        m, t = median(ours_b), median(torch_b)
        result.checks.append(
            Check("inprocess", "(b) vs torchrun", f"{m:.2f} s vs {t:.2f} s = {m / t:.2f}x", m < t)
        )
    if ours_c:
        m = median(ours_c)
        result.checks.append(
            Check("inprocess", "(c) <= soft timeout + 0.3 s", f"soft timeout + {m:.3f} s", m <= 0.3)
        )
    return result
