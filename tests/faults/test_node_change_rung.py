"""The node-change rung with real processes: ``kelastic run`` of a 2 x 2 job
with in-process restart on, real etcd, sidecars and launchers. A node lost (its sidecar
SIGKILLed: the Pod fails and is replaced 3 s later) ends the round; the surviving node's
workers stay: they restart in process into the next round (the same pids, a new iteration,
world size 2), and again when the replacement joins (world size 4); only the new node's
workers start as processes. No process restart is charged, no stray process is left."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import yaml

from kelastic import contract
from tests.conftest import wait_for
from tests.localrun import WORKERS, KelasticRun, write_job

START = re.compile(r"^\[(\d)\]:? ?pid (\d+) start iteration (\d+)$", re.M)
ENTER = re.compile(r"^\[(\d)\]:? ?pid (\d+) enter iteration (\d+)$", re.M)


STEPPED = re.compile(r"^\[(\d)\]:? ?pid (\d+) stepped iteration (\d+)$", re.M)


def _job(tmp: Path, worker: str = "wrapped_steps.py") -> tuple[Path, Path]:
    stop = tmp / "stop"
    job = write_job(
        tmp / "job.yaml", replicas=2, nproc=2, min_replicas=1, max_replicas=2, max_restarts=3,
        command=["python", str(WORKERS / worker)],
        env={"STEPS_STOP_FILE": str(stop)},
        pod_replacement={"maxReplacements": 2, "backoffSeconds": 3},
    )  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["inProcess"] = {"enabled": True, "maxRestarts": 10,
                                "softTimeoutSeconds": 10, "hardTimeoutSeconds": 20}  # fmt: skip
    job.write_text(yaml.safe_dump(doc))
    return job, stop


def _sidecar_logs(runs: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(runs.glob("*/pods/*/kelastic-sidecar.log")))


def _sidecar_of(run: KelasticRun, pod: str) -> object:
    for proc in run.processes("kelastic_sidecar"):
        if proc.environ().get(contract.ENV_POD_NAME) == pod:
            return proc
    raise AssertionError(f"no sidecar of {pod}:\n{run.output}")


def test_a_lost_node_and_its_replacement_keep_the_survivors_processes(tmp_path: Path) -> None:
    job, stop = _job(tmp_path)
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", workdir=runs)
    try:
        wait_for(lambda: len(ENTER.findall(run.output)) >= 4, 120, what="4 ranks in iteration 0")
        wait_for(lambda: run.has("[3]: step 10"), 60, what="both nodes stepping")
        survivors = {int(r): int(p) for r, p, _ in START.findall(run.output) if int(r) < 2}
        _sidecar_of(run, "steps-1").send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        wait_for(lambda: run.has("steps-1: replaced"), 120, what="the replacement")

        def entered_by_all(it: int) -> bool:
            ranks = {int(r) for r, _, i in ENTER.findall(run.output) if int(i) == it}
            return ranks >= {0, 1, 2, 3}

        def newest() -> int:
            return max(int(i) for _, _, i in ENTER.findall(run.output))

        wait_for(lambda: newest() >= 2 and entered_by_all(newest()), 120,
                 what="every rank of the new round in one iteration")  # fmt: skip
        wait_for(lambda: run.has("in-process round change (iteration 2)"), 60,
                 what="kelastic run naming the round change")  # fmt: skip
        run.finish(stop, rank=0, more=10)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{run.output}\n{_sidecar_logs(runs)}") from None
    finally:
        run.interrupt()
    out, logs = run.output, _sidecar_logs(runs)
    # The survivors' processes ran from start to end: one start each, and they entered
    # the function again in process for every round change.
    starts = {int(r): [] for r in range(4)}
    for r, p, _ in START.findall(out):
        starts[int(r)].append(int(p))
    for rank, pid in survivors.items():
        assert starts[rank] == [pid], (rank, starts, out)
        entered = [int(i) for r, p, i in ENTER.findall(out) if int(r) == rank]
        assert entered[0] == 0 and len(entered) >= 2 and entered == sorted(entered), entered
        assert {int(p) for r, p, _ in ENTER.findall(out) if int(r) == rank} == {pid}
    assert re.search(r"iteration \d+: node steps-1 lost: its liveness key is gone .*; every "
                     r"local rank waits for the next round's go", logs), logs  # fmt: skip
    assert "carried over" in logs, logs
    # What kelastic run says: the lost node (one in-process restart spent, the survivors
    # alone in a round of world size 2), then the replacement joining (none spent).
    assert re.search(r"in-process restart 1/10 \(iteration 1\): node_lost: node steps-1 lost: "
                     r"its liveness key is gone .*; stepping again after \d", out), out  # fmt: skip
    assert re.search(r"round \d+: world size 2 \(1 nodes x 2\)", out), out
    assert re.search(r"in-process round change \(iteration 2\): the round ended \(scale\); "
                     r"stepping again after \d", out), out  # fmt: skip
    assert run.restarts_charged() == 0, out  # no process restart: the rung took the loss
    assert "job succeeded" in out
    assert run.strays() == []


def test_a_lost_node_in_ddp_training_keeps_the_survivors_processes(tmp_path: Path) -> None:
    """The same with gloo DDP (``tests/workers/wrapped_ddp.py``): the survivors are in an
    all-reduce with the lost node's ranks when it dies; the broken collective is a fault
    of the running iteration, the lost node then carries that restart into the next
    round, and the survivors step again in process with the new world."""
    job, stop = _job(tmp_path, worker="wrapped_ddp.py")
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--in-process", workdir=runs)
    try:

        def stepped_by(ranks: set[int]) -> int | None:
            """The newest iteration every rank of ``ranks`` stepped in."""
            found: dict[int, set[int]] = {}
            for r, _, it in STEPPED.findall(run.output):
                found.setdefault(int(it), set()).add(int(r))
            done = [it for it, rs in found.items() if rs >= ranks]
            return max(done, default=None)

        wait_for(lambda: stepped_by({0, 1, 2, 3}) == 0, 120, what="4 ranks stepping")
        survivors = {int(r): int(p) for r, p, _ in START.findall(run.output) if int(r) < 2}
        _sidecar_of(run, "steps-1").send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        wait_for(lambda: (stepped_by({0, 1, 2, 3}) or 0) >= 1 and run.has("steps-1: replaced"),
                 180, what="every rank stepping after the replacement")  # fmt: skip
        stop.touch()
        assert run.wait(120) == 0
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{run.output}\n{_sidecar_logs(runs)}") from None
    finally:
        run.interrupt()
    out = run.output
    for rank, pid in survivors.items():  # one process each, from start to end
        assert [int(p) for r, p, _ in START.findall(out) if int(r) == rank] == [pid], out
    assert "carried over" in _sidecar_logs(runs)
    assert run.restarts_charged() == 0, out
    assert "job succeeded" in out
    assert run.strays() == []
