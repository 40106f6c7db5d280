"""The record of each rank's load (``rank-<R>.restored``, :mod:`kelastic.checkpoint.restored`):
written by ``load()`` once the agreed step is loaded, read by the sidecar for its
``/status``; a file that is not exactly a record (the trainer's volume: user code writes
there) says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.restored import (
    MAX_BYTES,
    Restored,
    decode_restored,
    read_restored,
    restored_path,
    write_restored,
)


def test_a_record_round_trips_and_only_its_round_is_read(tmp_path: Path) -> None:
    write_restored(tmp_path, Restored(3, 7, 120, contract.CHECKPOINT_TIER_DISK, 1.25))
    write_restored(tmp_path, Restored(1, 7, 120, contract.CHECKPOINT_TIER_MEMORY, 0.0))
    write_restored(tmp_path, Restored(0, 6, 110, contract.CHECKPOINT_TIER_MEMORY, 0.5))
    assert read_restored(tmp_path, 7) == [
        Restored(1, 7, 120, "memory", 0.0), Restored(3, 7, 120, "disk", 1.25)]  # fmt: skip
    assert read_restored(tmp_path, 6) == [Restored(0, 6, 110, "memory", 0.5)]
    write_restored(tmp_path, Restored(0, 7, 120, "memory", 0.25))  # its next round replaces it
    assert [r.rank for r in read_restored(tmp_path, 7)] == [0, 1, 3]
    assert read_restored(tmp_path / "nowhere", 7) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"null",
        b"[]",
        b'{"round": 7, "step": 120, "tier": "memory"}',
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": 1, "x": 1}',
        b'{"round": 7, "step": 120, "tier": "tape", "seconds": 1}',
        b'{"round": 7, "step": 120, "tier": ["memory"], "seconds": 1}',  # the fuzzer's find
        b'{"round": 7, "step": 120, "tier": {"a": 1}, "seconds": 1}',
        b'{"round": -1, "step": 120, "tier": "memory", "seconds": 1}',
        b'{"round": 7, "step": 1e400, "tier": "memory", "seconds": 1}',
        b'{"round": 7, "step": ' + b"9" * 5000 + b', "tier": "memory", "seconds": 1}',
        b'{"round": 7, "step": true, "tier": "memory", "seconds": 1}',
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": NaN}',
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": -0.5}',
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": 86401}',
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": false}',
        b"[" * 300 + b"]" * 300,
        b'{"round": 7, "step": 120, "tier": "memory", "seconds": 1}' + b" " * MAX_BYTES,
        b"\xff\xfe",
    ],
)
def test_a_file_that_is_not_a_record_says_nothing(tmp_path: Path, raw: bytes) -> None:
    assert decode_restored(raw, 2) is None
    restored_path(tmp_path, 2).write_bytes(raw)
    assert read_restored(tmp_path, 7) == []


def test_a_record_outside_the_bounds_is_not_written(tmp_path: Path) -> None:
    for bad in (Restored(0, -1, 1, "memory", 0.1), Restored(0, 1, 1, "tape", 0.1),
                Restored(0, 1, 1, "memory", float("nan")),
                Restored(0, 1, 2**60, "disk", 1.0)):  # fmt: skip
        with pytest.raises(ValueError, match="not a restore record"):
            write_restored(tmp_path, bad)
    assert list(tmp_path.iterdir()) == []


def test_load_records_what_it_loaded_for_the_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointStore(tmp_path, rank=2, job="j") as store:
        store.save(5, {"w": torch.ones(3)}, blocking=True)
    for name, value in ((contract.RANK, "2"), (contract.TORCHELASTIC_RUN_ID, "j"),
                        (contract.ENV_CHECKPOINT_DIR, str(tmp_path)),
                        (contract.KELASTIC_ROUND, "4"),
                        (contract.ENV_CHECKPOINT_STEP, "5")):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(checkpoint, "_default", None)
    try:
        got = checkpoint.load()
        assert got is not None and got[0] == 5
        [record] = read_restored(tmp_path, 4)
        assert (record.rank, record.step, record.tier) == (2, 5, "memory")
        assert 0 <= record.seconds < 60
        # no agreed step (a fresh start, no sidecar): nothing to record
        restored_path(tmp_path, 2).unlink()
        monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, contract.CHECKPOINT_STEP_NONE)
        assert checkpoint.load() is None
        monkeypatch.delenv(contract.ENV_CHECKPOINT_STEP)
        assert checkpoint.load() is not None
        assert not restored_path(tmp_path, 2).exists()
    finally:
        checkpoint.default_store().close()
