"""Checkpoint replicas on a peer node (``spec.checkpoint.replicas: 1``) in a real
``kelastic run``: 2 x 2 gloo ranks saving every step in memory, no persistence volume.
Each sidecar sends its ranks' newest committed slot to the other node's sidecar while the
training goes on. When a whole node is lost (its sidecar SIGKILLed: the Pod fails, its
memory volume goes with it, a new Pod comes with empty slots), the new node's ranks
restore from the peer that holds their replicas, and every rank loads one step: the
``peer`` tier, where without replicas nothing but a fresh start was left.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import yaml

from kelastic import contract
from tests.localrun import KelasticRun, write_job

WORKER = Path(__file__).resolve().parents[1] / "workers" / "memory_checkpoint.py"


def _job(path: Path, steps: int, replicas: int) -> Path:
    job = write_job(path, name="replicas", replicas=2, nproc=2, command=["python", str(WORKER)],
                    env={"STEPS_MAX": str(steps)})  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {"memory": "64Mi", "replicas": replicas, "replicateEverySteps": 5}
    job.write_text(yaml.safe_dump(doc))
    return job


def _lose_a_node(run: KelasticRun, at: str) -> None:
    """SIGKILL replicas-1's sidecar once some rank printed ``at``; wait for the job."""
    deadline = time.monotonic() + 120
    while not run.has(at):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output
        time.sleep(0.05)
    (sidecar,) = [p for p in run.processes("kelastic_sidecar")
                  if p.environ().get(contract.ENV_POD_NAME) == "replicas-1"]  # fmt: skip
    sidecar.kill()


def test_a_lost_node_restores_its_ranks_from_the_peer_that_holds_their_replicas(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path / "job.yaml", 60, replicas=1)
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        _lose_a_node(run, "saved 25")
        assert run.wait() == 0, run.output
    finally:
        if run.proc.poll() is None:
            run.interrupt()
    out = run.output
    restored = re.findall(r"round (\d+): the workers restore checkpoint step (\d+) from (\w+)", out)
    assert restored, out
    _, step, tier = restored[-1]
    assert tier == "peer" and int(step) >= 15 and int(step) % 5 == 0, out
    loads = re.findall(r"^\[(\d+)\]: restored (\d+) in", out, re.MULTILINE)
    assert sorted(r for r, s in loads if s == step) == ["0", "1", "2", "3"], loads
    assert re.search(rf"all 4 ranks loaded step {step} from peer, the slowest in \d", out), out
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob(
        "replicas-*/pods/replicas-*/kelastic-sidecar.log"))  # fmt: skip
    assert re.search(rf"rank \d's step {step} from replicas-\d \(\d+ bytes in", logs), logs
    print("\nPEER RESTORE: " + "; ".join(line for line in run.lines if "restore" in line))
    assert run.strays() == []


def test_without_replicas_a_lost_node_leaves_no_step_every_rank_holds(tmp_path: Path) -> None:
    """The same loss with ``replicas: 0``: the new node's slots are empty and nobody holds
    its ranks' steps, so the round restores none (the test above fails without the peer
    tier the same way)."""
    job = _job(tmp_path / "job.yaml", 40, replicas=0)
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        _lose_a_node(run, "saved 15")
        assert run.wait() == 0, run.output
    finally:
        if run.proc.poll() is None:
            run.interrupt()
    assert "no checkpoint step every one of the 4 ranks holds" in run.output, run.output
    assert "from peer" not in run.output
    assert run.strays() == []
