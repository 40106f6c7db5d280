"""In-process restart: time from a fault to every rank of a 2 nodes x 2 workers gloo DDP
job stepping again, side by side in one run.

(a) one rank raises inside the training function (SIGUSR1 -> exception): kelastic's
    in-process restart vs NVIDIA's ``nvidia_resiliency_ext.inprocess.Wrapper`` (under
    torchrun, its documented set-up; its process group's timeout lowered to 3 s, its best
    case: ranks blocked in a collective are released only by that timeout) vs torchft
    (below) vs kelastic's warm process restart vs torchrun.
(b) one worker is SIGKILLed: kelastic's hybrid rung (survivors restart in process, the
    dead rank starts again as a process) vs kelastic with a spare rank per node
    (``spareRanks: 1``: a waiting spare takes the dead rank's place, no process start; a
    new spare is forked meanwhile; a kill before it is ready falls back to the hybrid
    rung) vs torchft vs kelastic's warm process restart vs torchrun.
torchft, on (a) and (b) (:mod:`bench._torchft_train`, torchft's DDP example): 4 replica
    groups of one worker under ``torchrun --standalone`` each, a lighthouse
    (``min_replicas`` 1, its wait for stragglers and heartbeat timeout lowered to 1 s)
    and 3 s timeouts of its Manager and ``ProcessGroupGloo`` (its best case, as NVRx's
    3 s is): a raise ends the rank's process as in torchft's examples; the dead rank's
    torchrun starts it again, it heals from a peer, and the others step without it
    meanwhile; the sample is the time until all 4 step together again.
(c) one rank hangs (SIGUSR2: no step, no ``ping``): kelastic's soft-timeout abort; the
    sample is the time from the hang to all ranks stepping again, minus the soft timeout.

All other sides run :mod:`bench._inprocess_train`. Targets: (a) <= 0.3 s median,
<= 0.05x torchrun, >= 10x faster than NVRx; (b) <= 0.5x kelastic warm; (c) <= 0.3 s past
the soft timeout.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import sysconfig
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
    save_partial,
    spawn_logged,
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
    """``kelastic run`` of the 2 x 2 job; each rank's moments go to ``<name>.probe.jsonl``
    (see :func:`_phases`)."""
    events = tmp / f"{name}.jsonl"
    spec = IN_PROCESS + (f"    spareRanks: {spares}\n" if spares else "")
    env = {"BENCH_WRAP": "kelastic", "BENCH_PROBE": str(tmp / f"{name}.probe.jsonl")}
    proc = start_kelastic(
        tmp, name, TRAIN, 2, 2, events, warm=True, max_restarts=100,
        extra_spec=spec if in_process else "", extra_env=env,
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


#: The moments of an in-process restart, each a row of (a): the probe's name (``step``:
#: the first-step event, the sample's end) and what it says.
PHASES = (
    ("left", "every rank left the function"),
    ("entered", "every rank entered it again (the restart's own part ends)"),
    ("group", "every rank's init_process_group returned"),
    ("ddp", "every rank's DDP(model) returned"),
    ("step", "every rank's first step done (the sample)"),
)


def _phases(tmp: Path, name: str) -> dict[str, list[float]]:
    """Where the time of each in-process restart of the side ``name`` went: per restart
    into iteration ``i`` (rank 1 raising in ``i - 1``), seconds from rank 1 leaving the
    function (its raise: at once, in its signal handler) until every rank reached each
    moment of :data:`PHASES`; a restart whose moments are not all known is left out."""
    moments: dict[tuple[int, int], dict[str, float]] = {}
    for path, default in ((tmp / f"{name}.probe.jsonl", ""), (tmp / f"{name}.jsonl", "step")):
        for e in read_events(path):
            what = str(e.get("what", default))
            moments.setdefault((int(e["iteration"]), int(e["rank"])), {}).setdefault(what, e["t"])
    out: dict[str, list[float]] = {what: [] for what, _ in PHASES}
    for i in sorted({it for it, _ in moments if it > 0}):
        raised = moments.get((i - 1, 1), {}).get("left")
        row: dict[str, float] = {}
        for what, _ in PHASES:
            of = i - 1 if what == "left" else i
            at = [moments.get((of, r), {}).get(what) for r in range(4)]
            known = [t for t in at if t is not None]
            if raised is not None and len(known) == 4:
                row[what] = max(known) - raised
        if len(row) == len(PHASES):
            for what, took in row.items():
                out[what].append(took)
    return out


TORCHFT_TRAIN = REPO / "bench" / "_torchft_train.py"
#: torchft's lighthouse as its examples start it (``--min_replicas 1 --quorum_tick_ms
#: 100``), the wait for stragglers and the heartbeat timeout lowered to 1 s (defaults 60
#: and 5 s): its best case
LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "1000",
              "--heartbeat_timeout_ms", "1000"]  # fmt: skip


def _lighthouse(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    """torchft's lighthouse (the wheel's ``torchft_lighthouse``, its Rust server) on a
    free loopback port, its log to a file; returns it and its address once it listens."""
    import socket

    from kelastic_operator.local.etcd import free_port

    port = free_port()
    # the console script the wheel installs beside this interpreter: its Rust argument
    # parser reads the process's own argv, so it cannot be started through ``python -c``
    script = Path(sysconfig.get_path("scripts")) / "torchft_lighthouse"
    args = [str(script), "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE]
    proc = spawn_logged(args, child_env(), tmp / f"lighthouse-{name}.log", tmp)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _teardown([proc], signal.SIGTERM)
                what = f"torchft's lighthouse did not start (exit {proc.poll()})"
                raise RuntimeError(what) from None
            time.sleep(0.05)


def _torchft(tmp: Path, name: str, sig: int, count: int) -> list[float]:
    """4 replica groups of one worker, each under ``torchrun --standalone`` (which starts
    its worker again), and a lighthouse: torchft's DDP set-up."""
    lighthouse, address = _lighthouse(tmp, name)
    events = tmp / f"{name}.jsonl"
    procs = [lighthouse]
    try:
        for replica in range(4):
            env = child_env(BENCH_EVENTS=str(events), REPLICA_GROUP_ID=str(replica),
                            NUM_REPLICA_GROUPS="4", TORCHFT_LIGHTHOUSE=address)  # fmt: skip
            env.pop("TORCHELASTIC_TIMER_FILE", None)
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchft's Manager uses it
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "1", "--max-restarts", "50", "--monitor-interval",
                    "0.1", str(TORCHFT_TRAIN)]  # fmt: skip
            procs.append(spawn_logged(args, env, tmp / f"torchft-{name}-{replica}.log", tmp))
        return _faults(events, procs[1:], sig, count)
    finally:
        _teardown(procs, signal.SIGTERM)


TORCHFT_SIDE = "torchft {} (4 replica groups of 1, lighthouse; torchrun restarts the dead one)"


def _anchor(result: CaseResult, tmp: Path, group: str, module: str, side: str, dist: str,
            fn: Callable[[], list[float]]) -> list[float] | None:  # fmt: skip
    """Another project's side: its row says what it is not measured for when its package
    is not installed or its import fails here; ``side`` gets the installed version."""
    from importlib.metadata import version

    try:
        importlib.import_module(module)
        label = side.format(version(dist))
    except Exception as exc:  # ImportError, PackageNotFoundError, its import failing here
        label = side.format("").replace("  ", " ")
        why = f"not measured: {type(exc).__name__}: {exc} (pip install '.[bench]')"[:300]
        log(f"inprocess: {group}: {label}: {why}")
        result.rows.append(Row("inprocess", group, label, "s", [], status=why))
        save_partial(result)
        return None
    return _run(result, tmp, group, label, fn)


def _run(result: CaseResult, tmp: Path, group: str, side: str,
         fn: Callable[[], list[float]], ref: bool = False) -> list[float] | None:  # fmt: skip
    log(f"inprocess: {group}: {side}")
    try:
        samples = fn()
    except Exception as exc:
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".log"):
                log(f"--- {name}:\n" + (tmp / name).read_text()[-3000:])
        why = f"failed: {type(exc).__name__}: {exc}"[:300]
        result.rows.append(Row("inprocess", group, side, "s", [], ref=ref, status=why))
        result.checks.append(Check("inprocess", f"{side} ran", why, False))
        save_partial(result)
        return None
    result.rows.append(Row("inprocess", group, side, "s", samples, ref=ref))
    save_partial(result)
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
        phases_a = _phases(tmp, "a-inproc") if ours_a else None
        if phases_a is not None:
            _phase_rows(result, phases_a)
        nvrx_a = tft_a = tft_b = None
        if not quick:
            nvrx_a = _anchor(
                result, tmp, a, "nvidia_resiliency_ext.inprocess", "NVRx {} Wrapper (torchrun)",
                "nvidia-resiliency-ext",
                lambda: _torchrun(tmp, "a-nvrx", usr1, min(n, 3), wrap="nvrx"),
            )  # fmt: skip
            tft_a = _anchor(result, tmp, a, "torchft", TORCHFT_SIDE, "torchft",
                            lambda: _torchft(tmp, "a-torchft", usr1, min(n, 3)))  # fmt: skip
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
            tft_b = _anchor(result, tmp, b, "torchft", TORCHFT_SIDE, "torchft",
                            lambda: _torchft(tmp, "b-torchft", kill, 3))  # fmt: skip
        c = f"(c) rank 1 hangs -> all stepping, minus the {SOFT_TIMEOUT:g} s soft timeout"
        ours_c = _run(result, tmp, c, "kelastic in-process (soft timeout)",
                      lambda: _kelastic(tmp, "c-soft", usr2, min(n, 3), in_process=True,
                                        minus=SOFT_TIMEOUT))  # fmt: skip
    if ours_a and torch_a:
        m, t = median(ours_a), median(torch_a)
        result.checks.append(Check("inprocess", "(a) <= 0.3 s median", f"{m:.3f} s", m <= 0.3))
        if phases_a is not None:
            result.checks.append(_floor_check(m, phases_a))
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
    for group, ours, theirs in (("(a)", ours_a, tft_a), ("(b)", ours_b, tft_b)):
        if ours and theirs:
            m, f = median(ours), median(theirs)
            result.checks.append(
                Check("inprocess", f"{group} vs torchft", f"{m:.3f} s vs {f:.2f} s = {m / f:.3f}x",
                      m < f)
            )  # fmt: skip
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


def _phase_rows(result: CaseResult, phases: dict[str, list[float]]) -> None:
    """The rows of (a)'s in-process restart by moment (:func:`_phases`), a group of their
    own (no side of another project to compare with)."""
    group = "(a) kelastic in-process, seconds from rank 1's raise until"
    for what, text in PHASES:
        result.rows.append(Row("inprocess", group, text, "s", phases[what]))
    save_partial(result)


def _floor_check(m: float, phases: dict[str, list[float]]) -> Check:
    """(a) <= 0.03 s median, and where the time goes (medians over the restarts, each
    restart's own differences): the peers leaving the function after the raise (a rank
    inside a C call, the trainer's ``time.sleep`` standing for its compute, leaves only
    when that call returns: no in-process restart can interrupt it sooner), the
    restart's own part (every rank out -> every rank in again), and the function's
    re-entry (a new process group, DDP, a step: the trainer's)."""
    detail = f"{m:.3f} s"
    if phases["step"]:
        left, entered = phases["left"], phases["entered"]
        own = median([e - lft for e, lft in zip(entered, left, strict=True)])
        parts = [median([b - a for a, b in zip(phases[x], phases[y], strict=True)])
                 for x, y in (("entered", "group"), ("group", "ddp"), ("ddp", "step"))]  # fmt: skip
        detail += (f": the peers out of the function {median(left):.3f} s after the raise"
                   f" (the trainer's 0.05 s step sleep, not interruptible), the restart's own"
                   f" part {own:.3f} s, the function's re-entry {sum(parts):.3f} s"
                   f" (init_process_group {parts[0]:.3f}, DDP {parts[1]:.3f}, a step"
                   f" {parts[2]:.3f}): the first and the last are the trainer's floor")  # fmt: skip
    return Check("inprocess", "(a) <= 0.03 s median", detail, m <= 0.03)
