"""A save the trainer returned from is kept when the trainer dies before its commit ends
(kelastic.checkpoint.commit): the next holder of the rank's lock commits the staged slot,
and nothing else: not a slot killed mid-staging, not one of another boot, not one a live
writer still commits, not one of a history a restore abandoned.

Each case kills a real saver process (tests/workers/checkpoint_saver.py) with SIGKILL at
the moment named, then reads the folder as the sidecar does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint._slotfile import SlotFile
from kelastic.checkpoint.commit import Finished, finish_staged, mark_dirty, mark_staged
from kelastic.checkpoint.discard import discard_newer
from kelastic.checkpoint.due import marker_path
from kelastic.checkpoint.scan import verified_steps
from kelastic.checkpoint.slot_format import (
    HEADER_SIZE,
    STAGED_OFFSET,
    SlotFormatError,
    decode_header,
    encode_header,
    encode_staged,
    staged_header_crc,
)
from kelastic.checkpoint.store import SLOTS, slot_path

from .test_checkpoint import SAVER
from .test_checkpoint import _loaded_step as _loaded

JOB = "crash"  # the saver's job


def _killed(directory: Path, mode: str, line: str) -> None:
    """Run the saver in ``mode`` until it prints ``line`` after step 1's commit, then
    SIGKILL it."""
    proc = subprocess.Popen([sys.executable, str(SAVER), str(directory), mode, str(1 << 18)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        assert proc.stdout.readline().strip() == line
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _slot_of(directory: Path, step: int) -> Path:
    for slot in range(SLOTS):
        path = slot_path(directory, 0, slot)
        if path.exists() and decode_header(path.read_bytes()[:HEADER_SIZE],
                                           file_size=path.stat().st_size).step == step:  # fmt: skip
            return path
    raise AssertionError(f"no slot holds step {step}")


def test_a_save_killed_before_its_commit_is_committed_by_the_next_lock_holder(
    tmp_path: Path,
) -> None:
    _killed(tmp_path, "staged", "staged 2")
    assert _loaded(tmp_path) == 1  # not committed yet: a reader takes step 1
    assert verified_steps(tmp_path, JOB) == {0: (1,)}
    done = finish_staged(tmp_path, JOB)
    assert [(f.rank, f.step) for f in done] == [(0, 2)]
    assert done[0].seq == 2  # after step 1's commit, as the writer's own would have been
    assert verified_steps(tmp_path, JOB) == {0: (2, 1)}
    assert _loaded(tmp_path) == 2
    assert finish_staged(tmp_path, JOB) == []  # once


def test_a_commit_cut_after_its_header_is_finished_too(tmp_path: Path) -> None:
    # the dead commit rewrote the header with the table's crc: the staged word still binds
    _killed(tmp_path, "commit", "committing")
    assert [f.step for f in finish_staged(tmp_path, JOB)] == [2]
    assert _loaded(tmp_path) == 2


def _tears(old: bytes, new: bytes) -> list[bytes]:
    """Every header a copy of ``new`` over ``old`` cut by a SIGKILL may leave: each
    prefix of ``new`` over ``old`` (a forward copy) and each suffix (a backward one)."""
    differ = [i for i in range(len(old)) if old[i] != new[i]]
    cuts = range(differ[0] + 1, differ[-1] + 1)
    tears = [new[:k] + old[k:] for k in cuts] + [old[:k] + new[k:] for k in cuts]
    return list(dict.fromkeys(tears))  # cuts between equal bytes tear alike: once each


def test_a_commit_cut_within_its_header_rewrite_is_finished_too(tmp_path: Path) -> None:
    """A SIGKILL during the commit's header copy (386 bytes) leaves the table crc and the
    header crc torn, so the header fails its crc; the staged word binds every other
    field, so the finisher commits it as staged. Every tear of the copy is crafted."""
    _killed(tmp_path, "staged", "staged 2")
    path = _slot_of(tmp_path, 2)
    pristine = path.read_bytes()
    staged = decode_header(pristine[:HEADER_SIZE], file_size=len(pristine))
    committed, _ = encode_header(replace(staged, table_crc=0x5EED1234, seq=0, header_crc=0))
    tears = _tears(pristine[: len(committed)], committed)
    assert len(tears) >= 8, len(tears)  # the two crcs: at least 4 bytes each
    for torn in tears:
        path.write_bytes(torn + pristine[len(torn) :])
        with pytest.raises(SlotFormatError, match="crc"):
            decode_header(torn, file_size=len(pristine))
        assert [f.step for f in finish_staged(tmp_path, JOB)] == [2], torn.hex()
        assert _loaded(tmp_path) == 2
    path.write_bytes(pristine[:HEADER_SIZE] + b"\xff" + pristine[HEADER_SIZE + 1 :])
    assert [f.step for f in finish_staged(tmp_path, JOB)] == [2]  # the table: recomputed


def test_a_torn_header_whose_fields_the_staged_word_does_not_bind_commits_nothing(
    tmp_path: Path,
) -> None:
    _killed(tmp_path, "staged", "staged 2")
    path = _slot_of(tmp_path, 2)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x01  # the round field: the commit never writes it, the staged word binds it
    path.write_bytes(bytes(raw))
    assert finish_staged(tmp_path, JOB) == []
    assert _loaded(tmp_path) == 1


def test_a_save_killed_while_it_staged_is_not_committed(tmp_path: Path) -> None:
    _killed(tmp_path, "stage", "staging")
    assert finish_staged(tmp_path, JOB) == []
    assert _loaded(tmp_path) == 1


def test_a_live_writer_keeps_its_staged_slot_to_itself(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(SAVER), str(tmp_path), "staged", str(1 << 18)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        assert proc.stdout.readline().strip() == "staged 2"
        assert finish_staged(tmp_path, JOB) == []  # its lock is held: it commits itself
        assert proc.poll() is None  # and it kept its lock: still alive, untouched
    finally:
        proc.kill()
        proc.wait()
    assert [f.step for f in finish_staged(tmp_path, JOB)] == [2]


def test_a_staged_word_of_another_boot_commits_nothing(tmp_path: Path) -> None:
    _killed(tmp_path, "staged", "staged 2")
    path = _slot_of(tmp_path, 2)
    with open(path, "r+b") as fh:
        h = decode_header(fh.read(HEADER_SIZE), file_size=path.stat().st_size)
        fh.seek(STAGED_OFFSET)
        fh.write(encode_staged(2, staged_header_crc(h), b"another-boot-id"))
    assert finish_staged(tmp_path, JOB) == []
    assert _loaded(tmp_path) == 1


@pytest.mark.parametrize("word", [bytes(16), b"\xff" * 16, b"\x02" + bytes(15)])
def test_a_crafted_or_torn_staged_word_commits_nothing(tmp_path: Path, word: bytes) -> None:
    _killed(tmp_path, "staged", "staged 2")
    path = _slot_of(tmp_path, 2)
    with open(path, "r+b") as fh:
        fh.seek(STAGED_OFFSET)
        fh.write(word)
    assert finish_staged(tmp_path, JOB) == []
    assert _loaded(tmp_path) == 1


def test_a_staged_step_a_restore_abandoned_is_dropped_not_committed(tmp_path: Path) -> None:
    _killed(tmp_path, "staged", "staged 2")
    assert discard_newer(tmp_path, JOB, 1) == []  # the job agreed on step 1: 2 is abandoned
    assert finish_staged(tmp_path, JOB) == []
    assert _loaded(tmp_path) == 1


def test_a_staged_step_older_than_a_committed_one_is_left_uncommitted(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path, job=JOB) as ckpt:
        for step in (5, 6):
            ckpt.save(step, {"w": [torch.full((8,), float(step))], "step": step}, blocking=True)
    path = _slot_of(tmp_path, 5)  # step 5's slot, made to look staged and uncommitted
    f = SlotFile(path, writable=True)
    try:
        h = decode_header(f.read(0, HEADER_SIZE), file_size=f.size)
        mark_dirty(f)
        mark_staged(f, h)
    finally:
        f.close()
    assert finish_staged(tmp_path, JOB) == []
    assert path.read_bytes()[STAGED_OFFSET : STAGED_OFFSET + 16] == bytes(16)  # cleared
    assert verified_steps(tmp_path, JOB) == {0: (6,)}


def test_a_finished_step_due_for_persistence_is_marked(tmp_path: Path) -> None:
    _killed(tmp_path, "staged", "staged 2")
    done = finish_staged(tmp_path, JOB, persist_every=2)
    assert done == [Finished(0, done[0].slot, 2, 2)]
    assert marker_path(tmp_path, 0, done[0].slot).read_text() == "2"


def test_the_ranks_next_store_commits_it_at_open_without_a_sidecar(tmp_path: Path) -> None:
    _killed(tmp_path, "staged", "staged 2")
    with CheckpointStore(tmp_path, job=JOB) as ckpt:
        got = ckpt.load()
        assert got is not None and got[0] == 2
        ckpt.save(3, {"w": [torch.full((8,), 3.0)], "step": 3}).wait()
    assert _loaded(tmp_path) == 3
    assert verified_steps(tmp_path, JOB) == {0: (3, 2, 1)}


def test_another_jobs_staged_slot_is_left_alone(tmp_path: Path) -> None:
    _killed(tmp_path, "staged", "staged 2")
    assert finish_staged(tmp_path, "another-job") == []
    assert finish_staged(tmp_path / "missing", JOB) == []
    assert [f.step for f in finish_staged(tmp_path, JOB)] == [2]


def test_a_due_marker_that_cannot_be_written_leaves_the_commit_standing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _killed(tmp_path, "staged", "staged 2")
    for slot in range(SLOTS):  # a folder where each marker would go: its rename fails
        marker_path(tmp_path, 0, slot).mkdir()
    assert [f.step for f in finish_staged(tmp_path, JOB, persist_every=2)] == [2]
    assert "cannot mark step 2 due for persistence" in caplog.text
    assert _loaded(tmp_path) == 2
