"""Goodput with checkpoints: the 2 nodes x 2 workers gloo DDP job of :mod:`bench.goodput`,
now with state to lose (:mod:`bench._ckpt_train`: a step counter, the model and its
optimizer, plus ``BENCH_CKPT_MB`` of state standing for a larger model's), one worker
SIGKILLed every 20 s for 2 minutes (quick: every 12 s for 36 s), each restart resuming
from its checkpoint. Every side runs under ``kelastic run`` (2 replicas, warm start, no
in-process restart), so that the sides differ only in their checkpoint:

- kelastic's memory checkpoint every step, and every 10 steps (``spec.checkpoint.memory``;
  the restart loads the step every rank committed, from the node's own slots);
- ``torch.save`` by rank 0 every N steps to a file, loaded by every rank at the start
  (N = 50 and 200: about 3 s and 12 s of steps).

Per side: *progress*, the steps the job advanced over the window (its step counter at the
end minus at the start: steps done again after a restart count once), per second of wall
time; the work lost per kill (the last step every rank completed before the kill, its
save returned, minus the step the restart resumed from); the save's cost shows in the
step rate between kills. Targets
(issue's point 7): work lost after a process crash 0 steps with the memory checkpoint;
its progress per second above ``torch.save``'s.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from .common import REPO, CaseResult, Check, Row, log, median, read_events, start_kelastic
from .goodput import _rank1_worker
from .hang import dump_logs, stop_session

TRAIN = REPO / "bench" / "_ckpt_train.py"
#: MiB of extra state per rank (a larger model's, saved and loaded by every side).
STATE_MB = 16
#: ``spec.checkpoint`` of the memory side: 3 slots per rank x 2 ranks of ~16 MiB, and room.
MEMORY_SPEC = "  checkpoint:\n    memory: 256Mi\n"


def _rank0(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's step events (the job's progress and step time)."""
    return [e for e in events if e.get("ev") == "step" and e.get("rank") == 0]


def _first_step(events: Path, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = _rank0(read_events(events))
        if steps:
            return float(steps[0]["t1"])
        time.sleep(0.05)
    raise TimeoutError(f"no step within {timeout:.0f} s")


def _lost(events: list[dict[str, Any]], kills: list[float]) -> list[float]:
    """Per kill: the last step every rank completed before it (each rank's latest step
    event before the kill; the lowest of them) minus the step the next rank 0 process
    resumed from (0 when nothing was done again). A step one rank finished and the killed
    rank never did is not counted: the job had not done it."""
    steps = [e for e in events if e.get("ev") == "step"]
    resumed = [e for e in events if e.get("ev") == "resumed"]
    first_step = {e["pid"]: e["t1"] for e in reversed(steps)}  # each pid's first step time
    ranks = {e["rank"] for e in steps}
    out = []
    for killed_at in kills:
        latest: dict[int, dict[str, Any]] = {}
        for e in steps:
            if e["t1"] < killed_at and (e["rank"] not in latest or
                                        e["t1"] > latest[e["rank"]]["t1"]):  # fmt: skip
                latest[e["rank"]] = e
        later = [e for e in resumed if first_step.get(e["pid"], 0.0) > killed_at]
        if latest and set(latest) == ranks and later:
            done = min(int(e["step"]) for e in latest.values())
            nxt = min(later, key=lambda e: first_step[e["pid"]])
            out.append(float(max(0, done - int(nxt["step"]))))
    return out


def _side(tmp: Path, name: str, env: dict[str, str], spec: str, duration: float,
          every: float) -> dict[str, Any]:  # fmt: skip
    events = tmp / f"{name}.jsonl"
    env = {"BENCH_CKPT_MB": str(STATE_MB), **env}
    proc = start_kelastic(tmp, name, TRAIN, 2, 2, events, warm=True, max_restarts=100,
                          extra_spec=spec, extra_env=env)  # fmt: skip
    try:
        start = _first_step(events, 180.0)
        end = start + duration
        kills: list[float] = []
        next_kill = start + every
        while next_kill < end - 1e-6:
            time.sleep(max(0.0, next_kill - time.time()))
            if proc.poll() is not None:
                raise RuntimeError("the job exited")
            victim = _rank1_worker([proc], TRAIN)
            while victim is None and time.time() < next_kill + every / 2:
                time.sleep(0.05)
                victim = _rank1_worker([proc], TRAIN)
            if victim is not None:
                try:
                    victim.kill()
                    kills.append(time.time())
                    log(f"goodput_checkpoint: {name}: kill {len(kills)} at +"
                        f"{kills[-1] - start:.1f} s")  # fmt: skip
                except psutil.Error:
                    pass
            next_kill += every
        time.sleep(max(0.0, end - time.time()) + 0.3)
    finally:
        stop_session(proc, signal.SIGINT)
    events_list = read_events(events)
    steps = _rank0(events_list)
    at_start = max((e["step"] for e in steps if e["t1"] <= start), default=0)
    at_end = max((e["step"] for e in steps if e["t1"] <= end), default=at_start)
    times = [e["t1"] - e["t0"] for e in steps if start < e["t1"] <= end]
    return {"progress": (at_end - at_start) / duration, "steps": float(at_end - at_start),
            "lost": _lost(events_list, kills), "kills": float(len(kills)),
            "step_s": median(times) if times else 0.0}  # fmt: skip


def goodput_checkpoint(quick: bool) -> CaseResult:
    """Run the sides (quick: the memory side and ``torch.save`` every 50, shorter)."""
    result = CaseResult("goodput_checkpoint")
    duration, every = (36.0, 12.0) if quick else (120.0, 20.0)
    group = f"progress, steps/s: 2x2 gloo DDP, a worker SIGKILLed every {every:.0f} s"
    sides: list[tuple[str, str, dict[str, str], str, bool]] = [
        ("torch50", "torch.save every 50 steps (rank 0, to a file)", {"BENCH_CKPT": "torch:50"},
         "", True),
        ("memory", "kelastic memory checkpoint every step", {"BENCH_CKPT": "memory"},
         MEMORY_SPEC, False),
    ]  # fmt: skip
    if not quick:
        sides.insert(1, ("torch200", "torch.save every 200 steps (rank 0, to a file)",
                         {"BENCH_CKPT": "torch:200"}, "", False))  # fmt: skip
        sides.append(("memory10", "kelastic memory checkpoint every 10 steps",
                      {"BENCH_CKPT": "memory:10"}, MEMORY_SPEC, False))  # fmt: skip
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        for key, label, env, spec, ref in sides:
            log(f"goodput_checkpoint: {label}: {duration:.0f} s, a kill every {every:.0f} s")
            env = {**env, "BENCH_CKPT_PATH": str(tmp / f"{key}.pt")}
            try:
                m = _side(tmp, key, env, spec, duration, every)
            except Exception as exc:
                dump_logs(tmp)
                why = f"failed: {type(exc).__name__}: {exc}"[:300]
                result.rows.append(Row("goodput_checkpoint", group, label, "steps/s", [],
                                       better="higher", ref=ref, status=why))  # fmt: skip
                continue
            measured[key] = m
            lost = m["lost"]
            note = (f"{m['steps']:.0f} steps in {duration:.0f} s, {m['kills']:.0f} kills, steps "
                    f"done again per kill: {', '.join(f'{x:.0f}' for x in lost) or '-'}, step "
                    f"{m['step_s'] * 1000:.0f} ms")  # fmt: skip
            log(f"goodput_checkpoint: {label}: {m['progress']:.2f} steps/s ({note})")
            row = Row("goodput_checkpoint", group, label, "steps/s", [m["progress"]],
                      better="higher", ref=ref, note=note)  # fmt: skip
            result.rows.append(row)
    mem, torch50 = measured.get("memory"), measured.get("torch50")
    if mem is not None:
        worst = max(mem["lost"], default=0.0)
        result.checks.append(Check("goodput_checkpoint", "memory checkpoint: work lost per "
                                   "process crash 0 steps", f"at most {worst:.0f} steps "
                                   f"({len(mem['lost'])} kills)", worst == 0.0 and
                                   bool(mem["lost"])))  # fmt: skip
    if mem is not None and torch50 is not None:
        ratio = mem["progress"] / torch50["progress"] if torch50["progress"] else 0.0
        result.checks.append(Check("goodput_checkpoint", "memory checkpoint: progress above "
                                   "torch.save every 50 steps", f"{mem['progress']:.2f} vs "
                                   f"{torch50['progress']:.2f} steps/s = {ratio:.2f}x",
                                   ratio > 1.0))  # fmt: skip
    return result
