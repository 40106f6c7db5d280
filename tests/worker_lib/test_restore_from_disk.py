"""The disk tier of a restore: the job's steps complete on its persistence folder as a
sidecar records them (:func:`kelastic.checkpoint.persist.persisted_steps`: this job's
only, a crafted marker passed over), and a rank's load of the agreed step from there
(:func:`kelastic.checkpoint.load` with ``$KELASTIC_CHECKPOINT_TIER=disk``: torch DCP's
reader, no template, no process group). Real slots, real persistence, real torch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import CheckpointError, CheckpointRestoreError, CheckpointStore, persist
from kelastic.checkpoint.dcp_format import RawTensor, flatten, int_key_paths
from kelastic.checkpoint.from_disk import load_persisted
from kelastic.checkpoint.persist import (
    COMPLETE,
    INT_KEYS,
    RANK_INFO,
    complete_steps,
    persisted_steps,
)

JOB = "job-disk"


def _state(rank: int, step: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    nested = [torch.full((2,), float(step)), "x"]
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rank": rank, "loss": math.nan, "nested": nested}  # fmt: skip


def _persist(tmp_path: Path, step: int, world: int, job: str = JOB) -> Path:
    """Every rank of a ``world`` saves ``step``; the sidecar persists each: the root."""
    slots, root = tmp_path / f"slots-{job}", tmp_path / "persist"
    slots.mkdir(exist_ok=True)
    for rank in range(world):
        with CheckpointStore(slots, rank=rank, job=job, world_size=world, round=2) as store:
            store.save(step, _state(rank, step), blocking=True)
        persist.persist(slots, rank, job, step, root)
    return root


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and len(a) == len(b)
            and all(_same(v, b[k] if k in b else b[str(k)]) for k, v in a.items())
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_the_persisted_steps_are_this_jobs_complete_ones_with_their_world(tmp_path: Path) -> None:
    root = _persist(tmp_path, 10, world=2)
    _persist(tmp_path, 20, world=2)
    _persist(tmp_path, 30, world=2, job="another-job")  # a folder reused by another job
    (root / "step-40").mkdir()  # begun, never complete
    assert complete_steps(root) == [30, 20, 10]
    assert persisted_steps(root, JOB) == [(20, 2), (10, 2)]
    assert persisted_steps(root, "another-job") == [(30, 2)]
    assert persisted_steps(tmp_path / "nowhere", JOB) == []


@pytest.mark.parametrize(
    "marker",
    [
        b"",
        b"not json",
        b"[" * 5000 + b"]" * 5000,  # deeper than json's recursion: must not raise
        b'{"job": "job-disk", "step": 20, "world_size": 0}',
        b'{"job": "job-disk", "step": 20, "world_size": 2147483648}',
        b'{"job": "job-disk", "step": 20, "world_size": 2.0}',
        b'{"job": "job-disk", "step": 21, "world_size": 2}',  # another step's marker
        b'{"job": "job-disk", "step": 20, "world_size": 2' + b" " * 5000 + b"}",  # too large
    ],
)
def test_a_crafted_complete_marker_is_passed_over(tmp_path: Path, marker: bytes) -> None:
    root = _persist(tmp_path, 20, world=2)
    (root / "step-20" / COMPLETE).write_bytes(marker)
    assert persisted_steps(root, JOB) == []


def test_a_crafted_rank_record_never_completes_a_step_nor_raises(tmp_path: Path) -> None:
    """``kelastic.json`` of a rank folder is read to check the step is of one history;
    thousands of nested brackets there (the volume is the user's) used to raise
    RecursionError out of the persistence."""
    slots, root = tmp_path / "slots", tmp_path / "persist"
    slots.mkdir()
    for rank in range(2):
        with CheckpointStore(slots, rank=rank, job=JOB, world_size=2, round=1) as store:
            store.save(5, {"w": torch.ones(3)}, blocking=True)
    assert not persist.persist(slots, 0, JOB, 5, root).completed_step
    (root / "step-5" / "rank-0" / RANK_INFO).write_bytes(b"[" * 4000 + b"]" * 4000)
    assert not persist.persist(slots, 1, JOB, 5, root).completed_step
    assert complete_steps(root) == []


def test_each_rank_loads_its_own_part_of_the_step_without_a_template(tmp_path: Path) -> None:
    root = _persist(tmp_path, 7, world=3)
    for rank in range(3):
        got = load_persisted(7, rank, root)
        assert got is not None and got[0] == 7
        expected = _state(rank, 7)
        state = got[1]
        assert _same(dict(expected["model"]), state["model"])
        # the optimizer's int keys come back as ints (DCP alone gives "0", "1")
        assert list(state["optim"]["state"]) == [0, 1]
        assert _same(expected["optim"]["state"], state["optim"]["state"])
        assert state["optim"]["param_groups"][0]["lr"] == 0.1
        assert (state["step"], state["rank"]) == (7, rank) and math.isnan(state["loss"])
        assert _same(expected["nested"], state["nested"])
        # what a training script does with it: the optimizer gets its moments back
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(state["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.load_state_dict(state["optim"])
        assert len(opt.state) == 2 and all("exp_avg" in v for v in opt.state.values())


def test_int_keys_are_listed_where_dcp_rebuilds_them() -> None:
    t = RawTensor("float32", (1,), bytes(4))  # a tensor as the sidecar reads it from a slot
    state = {"optim": {"state": {0: {"m": t}, 3: {"m": t}}}, 5: t, True: 1,
             "walked": [t, {7: t}], "plain": [1, 2], "mixed": [1, {9: 2}],
             "pair": ({4: t},)}  # fmt: skip
    # a list holding a tensor or a mapping is walked, as DCP's flattening walks it; a
    # plain list and a tuple are one item each (pickled whole: their keys stay ints)
    paths = int_key_paths(state)
    assert paths == [["optim", "state", "0"], ["optim", "state", "3"], ["5"],
                     ["walked", 1, "7"], ["mixed", 1, "9"]]  # fmt: skip
    items = [i.path for i in flatten(state)]
    assert all(any(item[: len(p)] == tuple(p) for item in items) for p in paths)


def test_what_cannot_be_loaded_fails_the_load_and_says_why(tmp_path: Path) -> None:
    root = _persist(tmp_path, 7, world=2)
    (root / "step-7" / "rank-1" / "__0_0.distcp").write_bytes(b"torn")  # a volume fault
    for (step, rank, folder), why in {
        (7, 0, None): r"\$KELASTIC_CHECKPOINT_PERSIST_DIR is not set",
        (8, 0, root): r".*step-8 is not complete",  # pruned, or never complete
        (7, 1, root): r".*rank-1: CheckpointException",
        (7, 5, root): r".*rank-5: ",  # no such rank folder
    }.items():
        said = rf"rank {rank} cannot load the agreed checkpoint step {step} from disk \({why}"
        with pytest.raises(CheckpointRestoreError, match=said):
            load_persisted(step, rank, folder)
    assert load_persisted(7, 0, root)[0] == 7


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        (b"{}", "not a list"),
        (b"[[]]", "is not a path"),
        (b'[["optim", 1.5, "0"]]', "is not a path"),
        (b'[["optim", "state", "x"]]', "is not an int key"),
        (b'[["optim", "state", 0]]', "is not an int key"),
        (b'[["nowhere", "0"]]', "no mapping at"),
        (b'[["step", "0"]]', "no mapping at"),  # an int, not a mapping
        (b"[" * 5000 + b"]" * 5000, ""),
        (b"[1" + b",1" * 40_000_000 + b"]", ""),  # over the bound
    ],
)
def test_a_crafted_int_keys_file_fails_the_load_clearly(
    tmp_path: Path, keys: bytes, why: str
) -> None:
    root = _persist(tmp_path, 7, world=1)
    (root / "step-7" / "rank-0" / INT_KEYS).write_bytes(keys)
    with pytest.raises(CheckpointRestoreError, match=f"its {INT_KEYS}: .*{why}"):
        load_persisted(7, 0, root)


def test_load_takes_the_agreed_step_from_the_agreed_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _persist(tmp_path, 7, world=2)
    memory = tmp_path / "memory"
    memory.mkdir()
    with CheckpointStore(memory, rank=1, job=JOB, world_size=2) as store:
        store.save(9, {"from": "memory"}, blocking=True)  # a newer step in memory
    for name, value in ((contract.RANK, "1"), (contract.TORCHELASTIC_RUN_ID, JOB),
                        (contract.ENV_CHECKPOINT_DIR, str(memory)),
                        (contract.ENV_CHECKPOINT_PERSIST_DIR, str(root)),
                        (contract.ENV_CHECKPOINT_STEP, "7"),
                        (contract.ENV_CHECKPOINT_TIER, contract.CHECKPOINT_TIER_DISK)):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(checkpoint, "_default", None)
    got = checkpoint.load()
    assert got is not None and got[0] == 7 and got[1]["rank"] == 1
    monkeypatch.setenv(contract.ENV_CHECKPOINT_TIER, contract.CHECKPOINT_TIER_MEMORY)
    monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, "9")
    assert checkpoint.load() == (9, {"from": "memory"})
    monkeypatch.delenv(contract.ENV_CHECKPOINT_TIER)  # an older sidecar: memory
    assert checkpoint.load() == (9, {"from": "memory"})
    for bad in ("DISK", "tape", " disk"):
        monkeypatch.setenv(contract.ENV_CHECKPOINT_TIER, bad)
        with pytest.raises(CheckpointError, match="is not a tier"):
            checkpoint.load()
    checkpoint.default_store().close()


def test_the_complete_marker_names_what_the_record_needs(tmp_path: Path) -> None:
    root = _persist(tmp_path, 3, world=1)
    doc = json.loads((root / "step-3" / COMPLETE).read_text())
    assert (doc["job"], doc["step"], doc["world_size"]) == (JOB, 3, 1)
