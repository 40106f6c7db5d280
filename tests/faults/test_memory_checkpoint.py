"""A worker killed in a job that checkpoints every step in memory (``kelastic.checkpoint``)
restarts from the node's own slots: every rank loads the same step (the one the sidecars
agreed on through etcd), no older than the last step every rank had committed.

Real ``kelastic run`` with ``spec.checkpoint.memory`` (each Pod's memory-backed volume, a
folder in ``/dev/shm`` locally, allocated in full by its sidecar at start): embedded etcd,
two sidecars, launchers and
``tests/workers/memory_checkpoint.py`` workers (2 x 2 gloo ranks in lockstep, each step
saved with ``blocking=True`` so that ``saved N`` means committed).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.localrun import KelasticRun, write_job

WORKER = Path(__file__).resolve().parents[1] / "workers" / "memory_checkpoint.py"


def _job(path: Path, memory: str, **env: str) -> Path:
    job = write_job(path, name="memckpt", replicas=2, nproc=2, command=["python", str(WORKER)],
                    env={"STEPS_MAX": "40", **env})  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {"memory": memory}
    job.write_text(yaml.safe_dump(doc))
    return job


def test_a_killed_worker_restarts_every_rank_from_one_agreed_step(tmp_path: Path) -> None:
    job = _job(tmp_path / "job.yaml", "64Mi")  # each Pod's volume: a folder in /dev/shm
    run = KelasticRun(job, "--fault", "kill:rank=1,after=1", workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    sidecar_logs = "".join(p.read_text() for p in (tmp_path / "runs").glob(
        "memckpt-*/pods/memckpt-*/kelastic-sidecar.log"))  # fmt: skip
    assert sidecar_logs.count(f"{64 << 20} bytes allocated and written") == 2, sidecar_logs
    assert not list(Path("/dev/shm").glob("kelastic-memckpt-*"))  # removed with the Pods
    out = run.lines
    assert "fault: SIGKILL rank 1 after 1s" in run.output
    assert "job succeeded" in run.output
    restored = [(int(m.group(1)), m.group(2), i) for i, line in enumerate(out)
                if (m := re.match(r"^\[(\d+)\]: restored (\S+) in", line))]  # fmt: skip
    assert sorted(r for r, _, _ in restored[:4]) == [0, 1, 2, 3], run.output
    assert {step for _, step, _ in restored[:4]} == {"none"}  # a fresh start: nothing saved
    after = restored[4:]
    groups = [after[i : i + 4] for i in range(0, len(after), 4)]  # one per restart
    assert groups and all(sorted(r for r, _, _ in g) == [0, 1, 2, 3] for g in groups), after
    for group in groups:  # one step on every rank, each time
        assert len({step for _, step, _ in group}) == 1, group
    step = int(groups[0][0][1])
    assert all(int(g[0][1]) >= step for g in groups[1:]), groups  # never older
    first_restored = min(i for _, _, i in after)
    saved: dict[int, int] = {}  # rank -> its last "saved N" before the restart
    for line in out[:first_restored]:
        if m := re.match(r"^\[(\d+)\]: saved (\d+)$", line):
            saved[int(m.group(1))] = int(m.group(2))
    assert sorted(saved) == [0, 1, 2, 3], run.output
    # saved N printed: N committed on that rank; in lockstep every rank committed at
    # least the lowest of them, so the agreed step is never older
    assert min(saved.values()) <= step <= max(saved.values()) + 1, (step, saved)
    assert step > 0
    # kelastic run says it, once per round, from the sidecars' agreement; not at the start
    said = [line for line in out if "checkpoint step" in line]
    assert said and re.search(
        rf"round \d+: the workers restore checkpoint step {step} from memory \(4 ranks; "
        r"slots checked in \d+\.\d{3} s\)", said[0]), said  # fmt: skip
    assert not any("round 0:" in line for line in said), said
    # and how long the slowest rank's load took, once all four loaded (their records)
    loads = [m for line in out if (m := re.search(
        rf"round \d+: all 4 ranks loaded step {step} from memory, the slowest in (\d+\.\d{{3}}) s",
        line))]  # fmt: skip
    assert loads, run.output
    print(f"\nMEMORY-CHECKPOINT kill: restored step {step} on 4 ranks, last saved {saved}, "
          f"slowest load {loads[0].group(1)} s")  # fmt: skip
    assert run.strays() == []


def test_a_volume_the_node_cannot_back_fails_the_job_at_once_naming_the_size(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path / "job.yaml", "999Ti")
    run = KelasticRun(job, workdir=tmp_path / "runs")
    assert run.wait(120) == 1, run.output
    needed = 999 << 40
    assert "its kelastic sidecar exited with code 2" in run.output, run.output
    assert f"the checkpoint volume ({needed} bytes, spec.checkpoint.memory) is unusable" in (
        run.output
    )
    assert f"{needed} more bytes" in run.output
    assert not any("restored" in line for line in run.lines)  # no worker ever ran
    assert not list(Path("/dev/shm").glob("kelastic-memckpt-*"))
    assert run.strays() == []


def test_a_slot_gone_bad_after_the_agreement_fails_its_load_and_the_next_round_agrees_again(
    tmp_path: Path,
) -> None:
    """Rank 2's slot of the agreed step flips a bit between the sidecars' agreement and
    its load: its load fails (not None while its peers load that step: a mixed restore),
    the round fails, and the next round's records no longer hold that step on rank 2's
    node: every rank restores one older step, checked by each worker."""
    job = _job(tmp_path / "job.yaml", "64Mi", CKPT_FLIP_RANK="2")
    run = KelasticRun(job, "--fault", "kill:rank=1,after=1", workdir=tmp_path / "runs")
    assert run.wait() == 0, run.output
    out = run.output
    flipped = re.search(r"^\[2\]: flipped a byte of step (\d+)$", out, re.MULTILINE)
    assert flipped is not None, out
    bad = int(flipped.group(1))
    assert re.search(rf"rank 2 cannot load the agreed checkpoint step {bad} from memory "
                     r"\(.*crc32", out), out  # fmt: skip
    agreed = [
        int(s) for s in re.findall(r"the workers restore checkpoint step (\d+) from memory", out)
    ]
    assert agreed[:2] == [bad, bad - 1], (agreed, out)
    restored = re.findall(r"^\[(\d)\]: restored (\S+) in", out, re.MULTILINE)
    assert sorted(r for r, s in restored if s == str(bad - 1)) == ["0", "1", "2", "3"], restored
    assert "job succeeded" in out and run.strays() == []
