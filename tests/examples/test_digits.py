"""The README's first command: the digits DDP job survives a killed and a hung worker."""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kelastic.checkpoint.persist import complete_steps
from kelastic_operator.local.etcd import free_port
from tests.localrun import KelasticRun

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples" / "digits" / "elasticjob.yaml"


def _readme_fault_args() -> list[str]:
    """The ``--fault`` flags of the README's first command, so test and README agree."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if "kelastic run examples/digits" in x and "pip" in x]
    return line.split("elasticjob.yaml", 1)[1].split()


@pytest.mark.slow
def test_digits_survives_a_kill_and_a_hang_and_reaches_90_percent(tmp_path: Path) -> None:
    args = _readme_fault_args()
    assert any(a.startswith("kill:") for a in args) and any(a.startswith("hang:") for a in args)
    run = KelasticRun(MANIFEST, *args, workdir=tmp_path / "runs")
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "round 0: world size 4 (2 nodes x 2)" in out
    assert "fault: SIGKILL rank 1" in out and "fault: SIGSTOP rank 2" in out
    assert re.search(
        r"restart 1/3: worker_failure: rank 1 on digits-\d \(round \d+\) killed by SIGKILL", out
    )
    # the stopped worker is named, not a peer whose timer expired while waiting for it:
    # reaped by its own timer when stopped inside a step, else (stopped between two steps,
    # holding no timer) named by its process state
    assert re.search(
        r"restart 2/3: hang: rank 2 on digits-1 \(round \d+\)( killed by SIGKILL: timer "
        r"'train_step' expired; reaped by the timer server; (main thread at \S+train\.py:\d+ "
        r"in [\w.<>]+ \(stacks in \S+\)|stacks unavailable: [^(]+)|: stopped \(process state T\) "
        r"outside any timer[;:]? .*?) \(it was stopped, not waiting on a peer\)",
        out,
    ), out
    # every rank saved every step in memory: a restart restores the step the sidecars
    # agreed on, mid-epoch, not the last epoch on disk (no step lost); the disk only when
    # the ranks share no step (a rank killed mid-commit may be two steps behind)
    restores = re.findall(r"round (\d+): the workers restore checkpoint step (\d+) from memory "
                          r"\(4 ranks; slots checked in \d+\.\d+ s\)", out)  # fmt: skip
    unrestored = re.findall(r"round \d+: no checkpoint step every one of the 4 ranks holds", out)
    assert restores and len(restores) + len(unrestored) >= 2, out
    assert [int(step) for _, step in restores] == sorted(int(step) for _, step in restores)
    resumed = re.findall(r"resumed from checkpoint: epoch \d+ step \d+ \(in memory, update "
                         r"(\d+), loaded in \d+\.\d{3} s; restart \d\)", out)  # fmt: skip
    assert {step for _, step in restores} <= set(resumed), out
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert "job succeeded" in out
    # the sidecars persisted every 200th step to the claim's folder in torch DCP's format
    # (spec.checkpoint.persist, keep 2): the newest loads with plain DCP, no kelastic
    (root,) = (tmp_path / "runs").glob("digits-*/volumes/digits-checkpoints/kelastic-checkpoints")
    steps = complete_steps(root)
    assert len(steps) == 2 and all(s % 200 == 0 for s in steps), steps
    dcp_to_torch_save(str(root / f"step-{steps[0]}" / "rank-3"), str(tmp_path / "step.pt"))
    state = torch.load(tmp_path / "step.pt", weights_only=False)
    assert state["updates"] == steps[0] and state["model"] and state["opt"], sorted(state)
    assert run.strays() == []


@pytest.mark.slow
def test_digits_with_warm_start_restarts_from_the_zygote(tmp_path: Path) -> None:
    """``--warm-start``: the restarted workers are forked by the zygote and training resumes."""
    args = ("--warm-start", "--fault", "kill:rank=1,after=3", "--status-interval", "1")
    run = KelasticRun(MANIFEST, *args, workdir=tmp_path / "runs")
    assert run.wait(600) == 0, run.output
    out = run.output
    assert "warm start: workers fork from a process that preloads torch, " in out
    assert "warm start is off" not in out  # no fallback to cold start was logged
    assert re.search(r"restart 1/3: worker_failure: rank 1 on digits-\d", out), out
    assert "resumed from checkpoint" in out
    # Every worker of both attempts was forked warm (2 replicas x 2 workers per attempt).
    after_restart = out.split("restart 1/3", 1)[1]
    assert re.search(r"restarts 1/3, 4 warm-started workers", after_restart), out
    acc = [float(x) for x in re.findall(r"final test accuracy (\d\.\d+)", out)]
    assert acc and acc[-1] >= 0.90, out
    assert run.strays() == []


@contextlib.contextmanager
def _drained_fifo(path: Path) -> Iterator[None]:
    """A timer FIFO nobody serves but that is read (the workers' ``expires`` writes go
    nowhere): stands in for the sidecar's timer server."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR)  # a reader (and a writer: never EOF) for the test's life
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if select.select([fd], [], [], 0.1)[0]:
                os.read(fd, 65536)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        os.close(fd)


def _plain_env(tmp_path: Path, fifo: Path, **extra: str) -> dict[str, str]:
    """The env of two plain ``train.py`` processes (no sidecar, no kelastic variables)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KELASTIC_", "TORCHELASTIC"))}
    path = os.pathsep.join([str(ROOT / "worker_lib"), base.get("PYTHONPATH", "")])
    return base | {"PYTHONPATH": path, "TORCHELASTIC_TIMER_FILE": str(fifo),
                   "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2",
                   "CHECKPOINT_DIR": str(tmp_path / "ckpt"), **extra}  # fmt: skip


def _plain_run(base: dict[str, str], epochs: int, world: int = 2) -> list[str]:
    """Run ``train.py --epochs N`` as ranks 0..world-1 with ``base``; their outputs."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(MANIFEST.parent / "train.py"), "--epochs", str(epochs)],
            env={
                **base,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "MASTER_PORT": port,
                "WORLD_SIZE": str(world),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


@pytest.mark.slow
def test_the_wrapped_training_function_runs_once_without_in_process(tmp_path: Path) -> None:
    """No sidecar, no ``KELASTIC_INPROCESS``: ``kelastic.inprocess.Wrapper`` calls the
    training function once (iteration 0) on each of 2 plain processes; they start from the
    same parameters, train, checkpoint, and a second run resumes from the checkpoint."""
    fifo = tmp_path / "timer.fifo"
    base = _plain_env(tmp_path, fifo)

    def run(epochs: int) -> list[str]:
        return _plain_run(base, epochs)

    with _drained_fifo(fifo):
        first = run(2)
        line = re.compile(
            r"^iteration 0: params sha256 ([0-9a-f]{8}) \(epoch 0, step 0, from rank 0\)$", re.M
        )
        digests = [line.findall(out) for out in first]
        assert digests[0] and digests[0] == digests[1], first
        assert "iteration 1" not in "".join(first)  # called once
        assert "epoch 2/2" in first[0] and "final test accuracy" in first[0]
        again = run(3)
        # a run started after the last epoch's checkpoint (a Pod replaced as the job ended,
        # seen on the real node) trains nothing and still reports the model's accuracy
        done = run(3)
    assert "resumed from checkpoint: epoch 1 done" in again[0], again
    resumed = r"^iteration 0: params sha256 [0-9a-f]{8} \(epoch 2, step 0, from rank 0\)$"
    assert re.search(resumed, again[1], re.M), again
    assert "epoch 3/3" in again[0]
    assert "resumed from checkpoint: epoch 2 done" in done[0] and "epoch 3/3" not in done[0]
    last_epoch = re.findall(r"test_acc (\d\.\d+)", again[0])[-1]
    assert re.findall(r"final test accuracy (\S+)", done[0]) == [last_epoch], done[0]


@pytest.mark.slow
def test_a_restore_at_an_epochs_last_step_does_not_end_that_epoch_twice(tmp_path: Path) -> None:
    """Two plain processes with the memory checkpoint folder (no sidecar: each rank loads
    its own newest step): the last step of epoch 2 is the newest saved, so a second run
    resumes at that epoch's end; rank 0 finished it (its disk checkpoint says so) and
    does not print ``epoch 2`` again (the real-node partition test once saw it twice).
    A third run, one rank alone, goes on with the step two ranks saved at the end of
    epoch 3: the epoch they ended is not trained again (step 44 of 2 ranks is the
    epoch's end; as step 44 of 89 it was half an epoch, trained and printed twice)."""
    fifo = tmp_path / "timer.fifo"
    (tmp_path / "memory").mkdir()
    base = _plain_env(tmp_path, fifo, KELASTIC_CHECKPOINT_DIR=str(tmp_path / "memory"))

    def run(epochs: int) -> str:
        return _plain_run(base, epochs)[0]

    with _drained_fifo(fifo):
        first = run(2)
        again = run(3)
        (alone,) = _plain_run(base, 4, world=1)
    assert "epoch 2/2" in first
    assert re.search(r"resumed from checkpoint: epoch 1 step \d+ \(in memory", again), again
    assert "epoch 2/3" not in again and "epoch 3/3" in again, again
    # one rank goes on with what two saved: epoch 3 ended in their world stays ended
    assert "world size 2 -> 1: epoch 2 goes on at step 89 (step 44 of 2 ranks" in alone, alone
    assert "epoch 3/4" not in alone and "epoch 4/4" in alone, alone


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (3, 2), (2, 3), (1, 4), (2, 2)])
def test_a_new_world_goes_on_with_the_epochs_samples_where_the_old_one_stopped(
    before: int, after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore in another world size (a node lost, a scale-up) goes on from the samples
    the saved step had taken, not from the same step index, which means other samples in
    another world (4 ranks at step 10 took 40 batches, 2 ranks at step 10 only 20: an
    epoch kept as it was skips or repeats whole batches). Fewer than ``after`` batches are
    seen twice; none is skipped. Uses the example's own sharding."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_train", MANIFEST.parent / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train)  # its dataclass looks itself up
    spec.loader.exec_module(train)
    n, batch, seed, epoch = 1437, 16, 0, 3  # the example's training split and batch size
    old_steps, new_steps = n // (before * batch), n // (after * batch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    for step in (1, 5, old_steps // 2, old_steps - 1, old_steps):
        taken: list[int] = []
        for r in range(before):
            taken += train.shard(n, seed, epoch, r, before)[: step * batch].tolist()
        assert sorted(taken) == sorted(perm[: step * before * batch])  # a prefix of the order
        goes_on = train.resume_step(step, before, after, n, batch)
        assert 0 <= goes_on <= new_steps
        if step == old_steps:  # the old world ended the epoch: the new one does not redo it
            assert goes_on == new_steps
            continue
        rest: list[int] = []
        for r in range(after):
            mine = train.shard(n, seed, epoch, r, after)
            rest += mine[goes_on * batch : new_steps * batch].tolist()
        # none skipped
        assert set(perm[: new_steps * after * batch]) <= set(taken) | set(rest), step
        again = set(taken) & set(rest)
        assert len(again) < after * batch, (step, len(again))  # under one step's batches
    assert train.resume_step(7, 0, after, n, batch) == 7  # the saving world unknown: as saved
