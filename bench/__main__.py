"""``python -m bench all|NAME... [--quick] [--out results.json]``: kelastic vs torch.

Each case runs in its own Python process (a fresh interpreter: no threads or sockets
left over from another case, fork-safe), one case at a time, and prints its progress
on stderr. The markdown table goes to stdout; ``--out`` gets the raw samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import CaseResult, child_env, log, table

#: name -> (module, function, time limit of the full run in seconds, quick limit)
CASES: dict[str, tuple[str, str, float, float]] = {
    "timer_reap": ("bench.timer_cases", "reap", 180, 40),
    "timer_throughput": ("bench.timer_cases", "throughput", 180, 40),
    "rdzv_join": ("bench.rdzv_cases", "join", 600, 90),
    "rdzv_rejoin": ("bench.rdzv_cases", "rejoin", 300, 90),
    "rdzv_scale": ("bench.rdzv_cases", "scale", 400, 120),
    "sidecar_footprint": ("bench.footprint", "footprint", 150, 40),
    "recovery_mttr": ("bench.mttr", "mttr", 420, 240),
    "hang_recovery": ("bench.hang", "hang", 300, 150),
    "hang_evidence": ("bench.hang_evidence", "hang_evidence", 300, 150),
    "goodput": ("bench.goodput", "goodput", 420, 200),
    "goodput_checkpoint": ("bench.goodput_ckpt", "goodput_checkpoint", 600, 200),
    "operator_scale": ("bench.operator_scale", "operator_scale", 1200, 300),
    "operator_idle": ("bench.operator_scale", "operator_idle", 1200, 300),
    "inprocess": ("bench.inprocess", "inprocess", 1800, 300),
    "checkpoint": ("bench.checkpoint", "checkpoint", 900, 120),
    "preflight": ("bench.preflight", "preflight", 600, 150),
}
#: left out of ``all --quick`` (each starts real DDP jobs); run them by name
NOT_QUICK = {
    "rdzv_scale",
    "recovery_mttr",
    "hang_recovery",
    "hang_evidence",
    "goodput",
    "goodput_checkpoint",
    "operator_scale",
    "operator_idle",
    "inprocess",
    "checkpoint",  # 100 MiB and 1 GiB state dicts; quick: 16 MiB, ~25 s
    "preflight",  # starts 8 torch processes a round, each side
}


def _run_child(name: str, quick: bool, out: str, window: float | None) -> int:
    """In the case's own process: run it and write its :class:`CaseResult` as JSON."""
    import importlib

    from . import common

    common.PARTIAL_OUT = out  # rows written as they are measured; this file at the end
    module, func, _, _ = CASES[name]
    started = time.monotonic()
    kwargs: dict[str, Any] = {"quick": quick}
    if window is not None and name == "sidecar_footprint":
        kwargs["window"] = window
    try:
        result = getattr(importlib.import_module(module), func)(**kwargs)
    except Exception as exc:  # reported as an error row; the suite goes on
        import traceback

        traceback.print_exc()
        result = CaseResult(name, error=f"{type(exc).__name__}: {exc}")
    result.seconds = time.monotonic() - started
    Path(out).write_text(json.dumps(result.to_json()))
    return 0


def _kill_case(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a case's process, its process group, and every process it started in a
    session of its own (the jobs and agents of the DDP cases), found before the kill:
    none is left to load the next case; then remove the data folders of the embedded
    etcds they ran (their owner's pid is dead now)."""
    import contextlib
    import signal

    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.wait()
    psutil.wait_procs(tree, timeout=5)
    # an embedded etcd's data folder (~120 MB) outlives a case killed mid-way: remove it
    from kelastic_operator.local.etcd import sweep_dead_data_dirs

    sweep_dead_data_dirs()


def _run_case(name: str, quick: bool, window: float | None) -> CaseResult:
    _, _, limit, quick_limit = CASES[name]
    limit = quick_limit if quick else limit
    if os.environ.get("BENCH_CASE_LIMIT"):  # a shorter limit, as the smoke test sets one
        limit = float(os.environ["BENCH_CASE_LIMIT"])
    if window is not None and name == "sidecar_footprint":
        limit += window
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        args = [sys.executable, "-m", "bench", "--child", name, "--child-out", out]
        if quick:
            args.append("--quick")
        if window is not None:
            args += ["--window", str(window)]
        started = time.monotonic()
        proc = subprocess.Popen(args, env=child_env(), start_new_session=True)
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            _kill_case(proc)
            error = f"time limit of {limit:.0f} s exceeded"
            if not os.path.exists(out):
                return CaseResult(name, error=error)
            result = CaseResult.from_json(json.loads(Path(out).read_text()))
            result.error = error + f" (the {len(result.rows)} rows measured before it are kept)"
            result.seconds = time.monotonic() - started
            return result
        except BaseException:
            _kill_case(proc)
            raise
        if not os.path.exists(out):
            return CaseResult(name, error=f"case process exited with code {proc.returncode}")
        result = CaseResult.from_json(json.loads(Path(out).read_text()))
        result.seconds = time.monotonic() - started
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="kelastic vs torch.distributed.elastic, measured side by side in one run.",
    )
    parser.add_argument("cases", nargs="*", default=["all"], help=f"all, or: {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="smoke mode: few, short repetitions")
    parser.add_argument("--out", help="write the raw samples (JSON) here")
    parser.add_argument(
        "--window", type=float, help="sidecar_footprint window, s (default 60; quick 5)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _run_child(args.child, args.quick, args.child_out, args.window)
    if "all" in args.cases:
        names = [n for n in CASES if not (args.quick and n in NOT_QUICK)]
    else:
        names = args.cases
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    started = time.monotonic()
    results: list[CaseResult] = []
    for name in names:
        log(f"case {name} ({'quick' if args.quick else 'full'})")
        result = _run_case(name, args.quick, args.window)
        error = f" ERROR {result.error}" if result.error else ""
        log(f"case {name} done in {result.seconds:.1f} s{error}")
        results.append(result)
    took = time.monotonic() - started
    import torch

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (
        f"kelastic bench ({'quick' if args.quick else 'full'}), {when}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{took:.0f} s"
    )
    print(header + "\n")
    print(table(results))
    if args.out:
        doc = {
            "header": header,
            "quick": args.quick,
            "seconds": took,
            "cases": [r.to_json() for r in results],
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
