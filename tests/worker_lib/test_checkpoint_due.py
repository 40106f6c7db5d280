"""Steps due for persistence (``kelastic.checkpoint.due``): the writer marks each step that
is a multiple of ``persist_every``, keeps off marked slots, never overwrites its newest
step, and drops the oldest marker only when it must; stale and malformed markers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kelastic import contract
from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.due import clear, due_markers, every_from_env, mark_due, pick_target


@pytest.mark.parametrize(
    ("seqs", "due", "target", "dropped"),
    [
        ([0, 0, 0], [False] * 3, 0, None),  # fresh: the first slot
        ([1, 2, 3], [False] * 3, 0, None),  # the oldest
        ([1, 2, 3], [True, False, False], 1, None),  # off the marked one
        ([1, 2, 3], [True, True, False], 0, 0),  # only the newest is free: drop the oldest
        ([4, 2, 3], [False, True, True], 1, 1),  # the newest is slot 0
        ([0, 2, 3], [True, False, False], 1, None),
        ([5, 6, 4], [False, False, True], 0, None),
    ],
)
def test_the_target_keeps_off_due_slots_and_the_newest_step(
    seqs: list[int], due: list[bool], target: int, dropped: int | None
) -> None:
    assert pick_target(seqs, due) == (target, dropped)


def _store(folder: Path, every: int) -> CheckpointStore:
    return CheckpointStore(folder, rank=2, job="j", world_size=4, persist_every=every)


def test_a_store_marks_the_due_steps_and_keeps_them(tmp_path: Path) -> None:
    with _store(tmp_path, 5) as ckpt:
        for step in range(1, 10):
            ckpt.save(step, {"w": torch.full((8,), float(step))}, blocking=True)
        held = sorted(s.step for s in ckpt.slots())
    # 5 was never overwritten though 9 saves went through three slots
    assert held == [5, 8, 9]
    assert [(m.rank, m.slot, m.step) for m in due_markers(tmp_path)] == [(2, 1, 5)]


def test_with_two_steps_pending_the_oldest_marker_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kelastic.checkpoint.store")
    with _store(tmp_path, 1) as ckpt:  # every step due, no sidecar to persist them
        for step in range(1, 6):
            ckpt.save(step, {"w": torch.full((8,), float(step))}, blocking=True)
        held = sorted(s.step for s in ckpt.slots())
        assert ckpt.load() is not None and ckpt.load()[0] == 5  # type: ignore[index]
    assert held == [3, 4, 5]  # the training never waited: the oldest marks were dropped
    assert "is still due for persistence and is needed" in caplog.text
    assert sorted(m.step for m in due_markers(tmp_path)) == [3, 4, 5]


def test_without_persistence_markers_are_ignored(tmp_path: Path) -> None:
    mark_due(tmp_path, 2, 0, 7)  # a marker left by another run's settings
    with _store(tmp_path, 0) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.ones(2)}, blocking=True)
        assert sorted(s.step for s in ckpt.slots()) == [2, 3, 4]


def test_a_marker_on_an_uncommitted_slot_is_cleared_at_open(tmp_path: Path) -> None:
    with _store(tmp_path, 2) as ckpt:
        ckpt.save(2, {"w": torch.ones(2)}, blocking=True)
    mark_due(tmp_path, 2, 1, 4)  # slot 1 was never committed: stale
    with _store(tmp_path, 2):
        pass
    assert [(m.slot, m.step) for m in due_markers(tmp_path)] == [(0, 2)]
    clear(tmp_path, 2, 0)
    clear(tmp_path, 2, 0)  # twice: nothing happens
    assert due_markers(tmp_path) == []


def test_markers_that_are_no_steps_read_as_none(tmp_path: Path) -> None:
    for name, text in [("rank-0.slot0.due", ""), ("rank-1.slot1.due", "x1"),
                       ("rank-2.slot2.due", "9" * 40), ("rank-3.slot0.due", "-4"),
                       ("rank-4.slot0.due", "12")]:  # fmt: skip
        (tmp_path / name).write_text(text)
    (tmp_path / "rank-01.slot0.due").write_text("1")  # not a marker's name
    (tmp_path / ".rank-5.slot0.due.77").write_text("1")  # a marker being written
    got = {m.rank: m.step for m in due_markers(tmp_path)}
    assert got == {0: None, 1: None, 2: None, 3: None, 4: 12}
    assert due_markers(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("raw", "every"),
    [("", 0), ("25", 25), ("0", 0), ("-1", 0), ("1e3", 0), ("9" * 30, 0), ("10000000000", 0)],
)
def test_every_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, every: int
) -> None:
    monkeypatch.setenv(contract.ENV_CHECKPOINT_PERSIST_EVERY, raw)
    assert every_from_env() == every
