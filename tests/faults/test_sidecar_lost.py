"""Fault matrix: a node's sidecar SIGKILLed mid-training.

Local mode treats it as a lost Pod, as the operator does: the node leaves the
rendezvous at once (the restart is charged to the lost node, not to the connection
resets its peers see), the Pod is replaced within ``podReplacement``, and the job's
result is the job's, whatever the dead Pod's launcher exited with.
"""

from __future__ import annotations

import itertools
import re
import signal
import time
from pathlib import Path

import pytest

from kelastic import contract
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "elasticjob.yaml"


def _sidecar_of(run: KelasticRun, pod: str) -> object:
    for proc in run.processes("kelastic_sidecar"):
        if proc.environ().get(contract.ENV_POD_NAME) == pod:
            return proc
    raise AssertionError(f"no sidecar of {pod}:\n{run.output}")


def test_a_killed_sidecar_is_a_lost_pod_replaced_and_the_job_succeeds(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=1, max_replicas=2, max_restarts=3,
        env={"STEPS_MAX": "200", "STEPS_CHECKPOINT": str(ckpt)},
        pod_replacement={"maxReplacements": 2, "backoffSeconds": 0},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    # both nodes past step 20 (rank 0 checkpoints a step before it prints it; the ranks
    # step on their own, so rank 1's step 20 said nothing of rank 0's checkpoint)
    wait_for(lambda: run.has("[0]: step 20") and run.has("[1]: step 20"), 60,
             what="both nodes training")  # fmt: skip
    sidecar = _sidecar_of(run, "steps-1")
    sidecar.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    killed = time.monotonic()
    assert run.wait(180) == 0, run.output
    out = run.output
    assert "steps-1 failed: its kelastic sidecar was killed by SIGKILL: node lost" in out
    assert "replacing steps-1 in 0.0s (replacement 1/2)" in out
    assert "steps-1: replaced (replacement 1)" in out
    assert re.search(r"restart 1/3: node_lost: node on steps-1 \(round \d\)", out), out
    assert "Connection reset" not in out
    assert run.restarts_charged() == 1, out  # the replacement joining is a scale-up: free
    # The replacement joined a later round of two nodes, and the job ran to its end.
    replaced = run.when("steps-1: replaced")
    assert replaced is not None
    rounds = [line for t, line in zip(run.times, run.lines, strict=False) if t > replaced
              and re.search(r"round \d+: world size 2 ", line)]  # fmt: skip
    assert rounds, out
    assert "job succeeded" in out
    # Status lines never showed the dead replica running.
    for t, line in zip(run.times, run.lines, strict=False):
        if killed + 1.0 < t < replaced and line.startswith("[kelastic] status:"):
            assert "[running,running]" not in line, line
    # No checkpoint lost: every restart resumed where the last step left it.
    starts = [int(m.group(1)) for m in re.finditer(r"from_step=(\d+)", out)]
    assert starts[-1] >= 20, starts  # step 20 was reached before the kill
    assert int(ckpt.read_text()) == 200
    lost = run.time_lost(rank=0)  # the node that lived on
    print(f"\nFAULT sidecar-killed: time lost {lost:.2f}s, 1 restart charged (node_lost)")
    assert lost < 30
    assert run.strays() == []


def test_a_lost_pod_past_the_replacement_budget_fails_the_job(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=1, max_replicas=2,
        pod_replacement={"maxReplacements": 0},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    wait_for(lambda: run.has("[1]: step 5"), 60, what="both nodes training")
    _sidecar_of(run, "steps-1").send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    assert run.wait(120) == 1, run.output
    assert (
        "steps-1 failed (its kelastic sidecar was killed by SIGKILL: node lost) and the "
        "pod replacement budget (0) is spent" in run.output
    ), run.output
    assert run.strays() == []


@pytest.mark.slow
def test_a_killed_sidecar_in_ddp_training_is_charged_to_the_lost_node(tmp_path: Path) -> None:
    """The digits DDP job (torch, gloo): the peer's workers see their connections reset
    before the lost node's lease could expire; the restart still names the lost node."""
    run = KelasticRun(DIGITS, workdir=tmp_path / "runs")
    wait_for(lambda: run.has("epoch 3/40"), 300, what="DDP training")
    _sidecar_of(run, "digits-1").send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    assert run.wait(600) == 0, run.output
    out = run.output
    assert re.search(r"restart 1/3: node_lost: node on digits-1 \(round \d\)", out), out
    assert not re.search(r"restart \d/3: worker_failure", out), out
    assert "replacing digits-1 in 10.0s (replacement 1/10)" in out
    assert run.restarts_charged() == 1, out
    assert "resumed from checkpoint" in out
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    epochs = [t for t, line in zip(run.times, run.lines, strict=False) if "epoch " in line
              and "/40 step" in line]  # fmt: skip
    lost = max(b - a for a, b in itertools.pairwise(epochs))
    print(f"\nFAULT sidecar-killed (DDP): longest epoch gap {lost:.1f}s, 1 restart (node_lost)")
    assert run.strays() == []


def test_a_killed_launcher_fails_its_pod_which_is_replaced(tmp_path: Path) -> None:
    """The trainer container dies (its launcher SIGKILLed, its workers with it): the
    sidecar leaves the round (its peer charges the lost node) and the Pod is replaced."""
    ckpt = tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=1, max_replicas=2,
        env={"STEPS_MAX": "150", "STEPS_CHECKPOINT": str(ckpt)},
        pod_replacement={"maxReplacements": 1, "backoffSeconds": 0},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    wait_for(lambda: run.has("[1]: step 10"), 60, what="both nodes training")
    (launcher,) = [p for p in run.processes("kelastic.launch")
                   if "/pods/steps-1/" in p.environ().get(contract.ENV_RUN_DIR, "")]  # fmt: skip
    launcher.send_signal(signal.SIGKILL)
    assert run.wait(180) == 0, run.output
    out = run.output
    assert "steps-1 failed: its trainer was killed by SIGKILL" in out, out
    assert "steps-1: replaced (replacement 1)" in out
    assert re.search(r"restart 1/3: node_lost: node on steps-1 \(round 0\)", out), out
    assert run.restarts_charged() == 1 and int(ckpt.read_text()) == 150
    print(f"\nFAULT launcher-killed: time lost {run.time_lost(rank=0):.2f}s, 1 restart")
    assert run.strays() == []
