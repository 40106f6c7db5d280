"""SIGKILLs of the writer at random moments of a persistence (issue 21, point 8's
persistence part): a rank's folder on disk is whole or absent, a step is complete only
with every rank whole, and the next write after a kill cleans what the killed one left
and completes the step; each complete step loads with plain torch DCP.

The writer is a real process running :func:`kelastic.checkpoint.persist.persist` (what the
sidecar's thread runs, without torch) over real slots of two ranks (about 16 MiB each, so
a write takes tens of milliseconds); it is killed at a uniformly random moment between its
start and a little past the time a whole write takes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.persist import COMPLETE, RANK_INFO, complete_steps

REPO = Path(__file__).resolve().parents[2]
JOB = "kills"
STEP = 7
ELEMENTS = 4 << 20  # float32: 16 MiB per rank
CYCLES = 40

WRITER = """
import sys
from pathlib import Path
from kelastic.checkpoint.persist import persist
slots, rank, root = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
print("go", flush=True)
persist(slots, rank, "kills", 7, root)
print("done", flush=True)
"""


def _env() -> dict[str, str]:
    paths = [str(REPO / "worker_lib"), str(REPO)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _write(slots: Path, rank: int, root: Path, kill_after: float | None) -> tuple[bool, float]:
    """Run a writer; SIGKILL it ``kill_after`` seconds after it starts persisting. Whether
    it finished before the kill, and the seconds from its start to its end."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(slots), str(rank), str(root)],
                            stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "go"
    started = time.monotonic()
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    return proc.returncode == 0, time.monotonic() - started


def _check(root: Path) -> None:
    """The invariants: whole or absent, complete only when whole."""
    step_dir = root / f"step-{STEP}"
    if not step_dir.exists():
        return
    whole = []
    for rank in (0, 1):
        folder = step_dir / f"rank-{rank}"
        if not folder.exists():
            continue
        names = sorted(p.name for p in folder.iterdir())
        assert names == [".metadata", "__0_0.distcp", RANK_INFO], names
        assert json.loads((folder / RANK_INFO).read_text())["step"] == STEP
        template = {"w": torch.zeros(ELEMENTS), "rank": -1}
        dcp.load(template, checkpoint_id=str(folder), no_dist=True)
        assert template["rank"] == rank and bool(template["w"].eq(float(rank)).all())
        whole.append(rank)
    if (step_dir / COMPLETE).exists():
        assert whole == [0, 1]


def test_a_writer_killed_anywhere_leaves_whole_folders_or_none(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    slots.mkdir()
    for rank in (0, 1):
        with CheckpointStore(slots, rank=rank, job=JOB, world_size=2, round=1) as ckpt:
            ckpt.save(STEP, {"w": torch.full((ELEMENTS,), float(rank)), "rank": rank},
                      blocking=True)  # fmt: skip
    ok, whole = _write(slots, 0, tmp_path / "timing", None)
    assert ok
    rng = random.Random(int(os.environ.get("KELASTIC_TEST_SEED", "21")))
    kills = finished = streak = 0
    for _ in range(CYCLES):
        # a rank not written yet: every cycle is a real write; both whole and no COMPLETE
        # (a kill between the last rename and the marker): a write of either completes it
        absent = [r for r in (0, 1) if not (root / f"step-{STEP}" / f"rank-{r}").exists()]
        done, took = _write(slots, rng.choice(absent or [0, 1]), root, rng.uniform(0, whole * 1.2))
        if done:  # a finished write says how long one takes now (the first, cold, is slower)
            finished, streak, whole = finished + 1, 0, took
        else:
            kills, streak = kills + 1, streak + 1
        if streak >= 6:  # the machine slowed (CI's load): the writes outlast the window
            whole, streak = whole * 1.5, 0
        _check(root)
        if (root / f"step-{STEP}" / COMPLETE).exists():  # start over: more kills mid-write
            shutil.rmtree(root / f"step-{STEP}")
    # after the kills, one clean write per rank cleans what they left and completes
    for rank in (0, 1):
        assert _write(slots, rank, root, None)[0]
    _check(root)
    assert complete_steps(root) == [STEP]
    left = [p.name for p in (root / f"step-{STEP}").iterdir() if p.name.startswith(".")]
    assert left == [], left
    print(f"\nPERSIST-KILLS: {kills} writers killed mid-write, {finished} finished first, "
          f"a whole write {whole:.3f} s")  # fmt: skip
    assert kills >= CYCLES // 4 and finished >= 2, (kills, finished)
