"""Checkpoints persisted by the sidecars (``spec.checkpoint.persist``) in a real ``kelastic
run``: 2 x 2 gloo ranks saving every step in memory; each multiple of ``everySteps`` is
written to the shared volume in torch DCP's format while training goes on, and what the
slots hold when the job is stopped (Ctrl-C: every Pod's sidecar gets SIGTERM) is written
too. Each complete step loads with plain ``torch.distributed.checkpoint``, no kelastic.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from kelastic import contract
from kelastic.checkpoint.persist import complete_steps
from tests.localrun import KelasticRun, write_job

WORKER = Path(__file__).resolve().parents[1] / "workers" / "memory_checkpoint.py"


def _job(path: Path, steps: int, persist: dict[str, object]) -> Path:
    job = write_job(path, name="persist", replicas=2, nproc=2, command=["python", str(WORKER)],
                    env={"STEPS_MAX": str(steps)})  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {"memory": "64Mi", "persist": {"volume": "shared", **persist}}
    doc["spec"]["template"]["spec"]["volumes"] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": "persisted"}}
    ]
    job.write_text(yaml.safe_dump(doc))
    return job


def _root(runs: Path) -> Path:
    found = list(runs.glob("persist-*/volumes/persisted/kelastic-checkpoints"))
    assert len(found) == 1, list(runs.rglob("*"))[:50]
    return found[0]


def _load(root: Path, step: int, rank: int) -> dict[str, object]:
    """Rank ``rank``'s state of ``step`` as a user loads it: plain DCP into a template."""
    state: dict[str, object] = {
        "model": {"w": torch.zeros(4096), "b": torch.zeros(16)}, "step": -1, "rank": -1,
    }  # fmt: skip
    dcp.load(state, checkpoint_id=str(root / f"step-{step}" / f"rank-{rank}"), no_dist=True)
    return state


def test_every_due_step_is_persisted_while_training_and_loads_with_plain_dcp(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path / "job.yaml", 40, {"everySteps": 10, "keep": 2})
    run = KelasticRun(job, workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    root = _root(tmp_path / "runs")
    assert complete_steps(root) == [40, 30], sorted(p.name for p in root.iterdir())
    for rank in range(4):
        state = _load(root, 40, rank)
        assert state["step"] == 40 and state["rank"] == rank
        model = state["model"]
        assert isinstance(model, dict) and bool(model["w"].eq(40.0).all())
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob(
        "persist-*/pods/persist-*/kelastic-sidecar.log"))  # fmt: skip
    assert "checkpoint step 40 of rank" in logs and "; the step is complete" in logs, logs
    assert "persistence: removed" in logs  # steps 10 and 20, past keep 2
    assert run.strays() == []


def test_a_stopped_job_persists_what_its_slots_hold(tmp_path: Path) -> None:
    job = _job(tmp_path / "job.yaml", 100_000, {"everySteps": 0, "keep": 3})
    run = KelasticRun(job, workdir=tmp_path / "runs")
    deadline = time.monotonic() + 120
    while not run.has("saved 20"):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output
        time.sleep(0.05)
    run.interrupt()
    saved: dict[int, int] = {}
    for line in run.lines:
        if m := re.match(r"^\[(\d+)\]: saved (\d+)$", line):
            saved[int(m.group(1))] = int(m.group(2))
    root = _root(tmp_path / "runs")
    complete = complete_steps(root)
    assert complete, sorted(p.name for p in root.rglob("*"))
    newest = complete[0]
    # in lockstep every rank committed at least the lowest last "saved"; the newest step
    # every rank held at the stop is complete on disk
    assert min(saved.values()) - 1 <= newest <= max(saved.values()) + 1, (newest, saved)
    for rank in range(4):
        state = _load(root, newest, rank)
        assert state["step"] == newest and state["rank"] == rank
    logs = [p.read_text() for p in (tmp_path / "runs").glob(
        "persist-*/pods/persist-*/kelastic-sidecar.log")]  # fmt: skip
    assert len(logs) == 2 and all("persisted at stop in" in log for log in logs), logs
    print(f"\nPERSIST at stop: complete {complete}, last saved {saved}")
    assert run.strays() == []


def test_a_replaced_pod_restores_every_rank_from_the_persisted_step(tmp_path: Path) -> None:
    """Point 5's disk tier: persist-1's sidecar is SIGKILLed mid-training; its Pod fails
    and is replaced with new, empty slots, so no step is in every rank's memory. Both
    nodes saw the same steps complete on the shared volume and agree on the newest: all
    four ranks load it from disk (torch DCP, through ``kelastic.checkpoint.load()``, each
    checking it holds that step of its own rank) and train on to the end."""
    job = _job(tmp_path / "job.yaml", 60, {"everySteps": 10, "keep": 3})
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        deadline = time.monotonic() + 120
        while not run.has("saved 25"):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.output
            time.sleep(0.05)
        (sidecar,) = [p for p in run.processes("kelastic_sidecar")
                      if p.environ().get(contract.ENV_POD_NAME) == "persist-1"]  # fmt: skip
        sidecar.kill()
        assert run.wait() == 0, run.output
    finally:
        if run.proc.poll() is None:
            run.interrupt()
    out = run.output
    restored = re.findall(r"round (\d+): the workers restore checkpoint step (\d+) from (\w+)", out)
    assert restored, out
    _, step, tier = restored[-1]
    assert tier == "disk" and int(step) % 10 == 0 and int(step) >= 20, out
    # every rank of the new round loaded that step (its worker checks what it loaded)
    loads = re.findall(r"^\[(\d+)\]: restored (\d+) in", out, re.MULTILINE)
    assert sorted(r for r, s in loads if s == step) == ["0", "1", "2", "3"], loads
    assert re.search(rf"all 4 ranks loaded step {step} from disk, the slowest in \d", out), out
    replaced = re.search(r"(\d+) Pod replacements?", out)
    assert replaced is not None and int(replaced.group(1)) >= 1, out
    print("\nDISK RESTORE: " + "; ".join(line for line in run.lines if "restore" in line))
    assert run.strays() == []
