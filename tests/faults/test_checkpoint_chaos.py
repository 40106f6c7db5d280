"""Random SIGKILLs of workers, sidecars and whole Pods of a training job (issue 21 point 8,
the job's view): ``kelastic run``, 2 x 2 gloo ranks checkpointing every step in memory,
with replicas on the peer node (``replicas: 1``, every 5 steps) and persistence every 10
steps. Each time the job trains again after the last fault, one of three faults strikes
at a random moment: a worker (a process restart: every rank from its own slots), a
sidecar (its Pod fails and is replaced: a node lost with its memory volume) or every
process of a Pod at once. Every restore must be of one step on all four ranks (the
worker checks what it loaded: that step's values, its own rank; each sidecar records its
ranks' loads), and never older than the rules allow: a process restart restores the
step every rank committed; a node loss restores at least the due step the lost node's
peer acknowledged (read from its ``/status`` just before the kill) when the survivor
still keeps that step among its two snapshots; with nothing acknowledged yet it may
restore none (a node lost in the first moments of a history).

``KELASTIC_TEST_CHAOS`` sets the number of faults (default 9).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from kelastic import contract
from tests.localrun import KelasticRun, write_job

WORKER = Path(__file__).resolve().parents[1] / "workers" / "memory_checkpoint.py"
FAULTS = int(os.environ.get("KELASTIC_TEST_CHAOS", "9"))
EVERY = 5  # replicateEverySteps
STEPS = 2000
SAVED = re.compile(r"^\[(\d+)\]: saved (\d+)$")
RESTORED = re.compile(r"^\[(\d+)\]: restored (\w+) in")
ROUND = re.compile(
    r"round (\d+): (?:the workers restore checkpoint step (\d+) from (\w+)|"
    r"no checkpoint step every one)"
)


def _job(path: Path) -> Path:
    job = write_job(path, name="chaos", replicas=2, nproc=2, max_restarts=100,
                    command=["python", str(WORKER)], env={"STEPS_MAX": str(STEPS)},
                    pod_replacement={"maxReplacements": 100, "backoffSeconds": 0.5,
                                     "maxBackoffSeconds": 1})  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {
        "memory": "64Mi", "replicas": 1, "replicateEverySteps": EVERY,
        "persist": {"volume": "shared", "everySteps": 10, "keep": 2},
    }  # fmt: skip
    doc["spec"]["template"]["spec"]["volumes"] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": "persisted"}}
    ]
    job.write_text(yaml.safe_dump(doc))
    return job


def _last_saved(lines: list[str]) -> dict[int, int]:
    saved: dict[int, int] = {}
    for line in lines:
        if m := SAVED.match(line):
            saved[int(m.group(1))] = int(m.group(2))
    return saved


def _since_restore(lines: list[str]) -> list[str]:
    """The lines after the last worker's ``restored`` line: the current run's steps."""
    last = max((i for i, line in enumerate(lines) if RESTORED.match(line)), default=-1)
    return lines[last + 1 :]


def _training_again(run: KelasticRun, since: int) -> None:
    """Wait until every rank restored after line ``since`` and then every rank saved."""
    deadline = time.monotonic() + 120
    while True:
        later = list(run.lines[since:])
        restored = {m.group(1) for line in later if (m := RESTORED.match(line))}
        if len(restored) == 4 and len(_last_saved(_since_restore(later))) == 4:
            return
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output[-5000:]
        time.sleep(0.05)


def _replication(run: KelasticRun, pod: str) -> dict[str, Any]:
    """Pod ``pod``'s sidecar's ``/status`` ``checkpoint.replication`` (empty: none yet)."""
    (sidecar,) = [p for p in run.processes("kelastic_sidecar")
                  if p.environ().get(contract.ENV_POD_NAME) == pod]  # fmt: skip
    port = sidecar.environ()[contract.ENV_HTTP_PORT]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as resp:
            doc = json.load(resp)
    except OSError:
        return {}
    return ((doc.get("checkpoint") or {}).get("replication")) or {}


def _guaranteed(run: KelasticRun, victim: str, survivor: str) -> int | None:
    """The step a loss of ``victim`` must restore at least, waiting up to 10 s for the
    peer to acknowledge a due step of both its ranks: that step, when the survivor's
    newest snapshot is at most one interval newer (it keeps two, so it holds that step
    too); None when nothing is guaranteed (none acknowledged yet, or the survivor is
    further ahead: its snapshots may have moved past every step the replicas hold)."""
    deadline = time.monotonic() + 10
    acked: dict[str, int] = {}
    while len(acked) < 2 and time.monotonic() < deadline:
        acked = _replication(run, victim).get("acked") or {}
        time.sleep(0.05)
    snapped = _replication(run, survivor).get("snapshotted") or {}
    if len(acked) < 2 or len(snapped) < 2:
        return None
    floor = min(acked.values())
    return floor if max(snapped.values()) - floor <= EVERY else None


def _pod_processes(run: KelasticRun, pod: str) -> list[psutil.Process]:
    """Every process of Pod ``pod``: its sidecar, launcher and workers (its run folder)."""
    (sidecar,) = [p for p in run.processes("kelastic_sidecar")
                  if p.environ().get(contract.ENV_POD_NAME) == pod]  # fmt: skip
    folder = sidecar.environ()[contract.ENV_RUN_DIR]
    return [p for p in run.processes() if p.environ().get(contract.ENV_RUN_DIR) == folder]


@pytest.mark.timeout(120 + 12 * FAULTS)  # about 6 s a fault
def test_random_kills_of_workers_sidecars_and_pods_always_restore_one_step(
    tmp_path: Path,
) -> None:
    run = KelasticRun(_job(tmp_path / "job.yaml"), workdir=tmp_path / "runs")
    rng = random.Random(int(os.environ.get("KELASTIC_TEST_SEED", "21")))
    # (kind, line index, lowest last-saved step, the step a node loss must restore at least)
    faults: list[tuple[str, int, int, int | None]] = []
    try:
        _training_again(run, 0)
        while len(faults) < FAULTS:
            time.sleep(rng.uniform(0.2, 1.5))
            saved = _last_saved(_since_restore(list(run.lines)))  # this history's steps
            kind = rng.choice(["worker", "sidecar", "pod"])
            pod = rng.choice(["chaos-0", "chaos-1"])
            other = "chaos-1" if pod == "chaos-0" else "chaos-0"
            floor = None if kind == "worker" else _guaranteed(run, pod, other)
            since = len(run.lines)
            if kind == "worker":
                workers = [p for p in run.processes(str(WORKER))
                           if "kelastic.launch" not in " ".join(p.cmdline())]  # fmt: skip
                rng.choice(workers).kill()
            elif kind == "sidecar":
                (sidecar,) = [p for p in _pod_processes(run, pod) if "kelastic_sidecar" in
                              " ".join(p.cmdline())]  # fmt: skip
                sidecar.kill()
            else:
                for proc in _pod_processes(run, pod):
                    proc.kill()
            faults.append((kind, since, min(saved.values()), floor))
            _training_again(run, since)
        assert max(_last_saved(run.lines).values()) < STEPS, "the job ended before the faults"
        run.interrupt()  # Ctrl-C: the job is stopped, as a user would
    finally:
        if run.proc.poll() is None:
            run.interrupt()
        (tmp_path / "run.out").write_text(run.output)  # what a failure is read from
    out = run.output
    assert not re.search(r"holds (step|tensors of another step)", out), out[-5000:]
    # every fault's recovery: one step, every rank loaded it, no older than allowed
    told = []
    for kind, since, lowest, floor in faults:
        later = "\n".join(run.lines[since:])
        restore = ROUND.search(later)
        assert restore is not None, (kind, tmp_path / "run.out")
        loads = [m.group(2) for line in run.lines[since:] if (m := RESTORED.match(line))][:4]
        if restore.group(2) is None:  # none: only a node lost before any replica's ack
            assert kind != "worker" and floor is None, (kind, lowest, tmp_path / "run.out")
            assert loads == ["none"] * 4, (kind, loads, tmp_path / "run.out")
            told.append(f"{kind}: saved {lowest} -> none (nothing acknowledged yet)")
            continue
        step, tier = int(restore.group(2)), restore.group(3)
        assert loads == [str(step)] * 4, (kind, step, loads, tmp_path / "run.out")
        if kind == "worker":  # every rank committed the lowest step it printed
            assert step >= lowest and tier == "memory", (kind, tier, step, lowest)
        elif floor is not None:  # the acknowledged replica and the survivor's snapshot
            assert step >= floor, (kind, tier, step, floor, tmp_path / "run.out")
        told.append(f"{kind}: saved {lowest} -> {step} from {tier} (floor {floor})")
    kinds = {k: sum(1 for f in faults if f[0] == k) for k in ("worker", "sidecar", "pod")}
    tiers = [m.group(3) or "none" for m in ROUND.finditer(out)]
    print(f"\nCHAOS: {len(faults)} faults {kinds}; restores by tier "
          f"{ {t: tiers.count(t) for t in sorted(set(tiers))} }; " + "; ".join(told))  # fmt: skip
    assert run.strays() == []
