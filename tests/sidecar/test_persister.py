"""The sidecar's persistence of the checkpoint slots (``kelastic_sidecar.persister``):
which steps, when, retention, failures; its settings from the environment. The steps it
writes load with plain ``torch.distributed.checkpoint``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kelastic import contract
from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.due import due_markers
from kelastic.checkpoint.from_disk import load_persisted
from kelastic.checkpoint.persist import Persisted, complete_steps, persisted_steps
from kelastic.checkpoint.scan import CommittedSlot, committed_slots
from kelastic_sidecar.config import ConfigError, PersistSettings, SidecarConfig
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.persister import Persister, node_steps
from kelastic_sidecar.timer import TimerStats
from kelastic_sidecar.wiring import persister_of
from tests.conftest import wait_for

from .test_sidecar_config import GOOD

JOB = "uid"


def _save(slots: Path, rank: int, steps: range, *, world: int = 2, round_: int = 1,
          job: str = JOB, every: int = 0) -> None:  # fmt: skip
    slots.mkdir(exist_ok=True)
    with CheckpointStore(slots, rank=rank, job=job, world_size=world, round=round_,
                         persist_every=every) as ckpt:  # fmt: skip
        for step in steps:
            ckpt.save(step, {"w": torch.full((100,), float(step)), "step": step}, blocking=True)


def _slot(rank: int, step: int, round_: int = 1) -> CommittedSlot:
    return CommittedSlot(rank, step % 3, step, round_, 2, step + 1)


@pytest.mark.parametrize(
    ("slots", "steps"),
    [
        ([], []),
        ([_slot(0, 3), _slot(0, 4), _slot(0, 5)], [5, 4, 3]),
        ([_slot(0, 3), _slot(0, 4), _slot(0, 5), _slot(1, 2), _slot(1, 3), _slot(1, 4)], [4, 3]),
        ([_slot(0, 7), _slot(1, 1)], []),  # nothing in common
        # rank 1 of an earlier round (not this node's any more) is not waited for
        ([_slot(0, 8, round_=2), _slot(0, 9, round_=2), _slot(1, 3, round_=1)], [9, 8]),
    ],
    ids=["empty", "one-rank", "lagging-rank", "none-in-common", "rank-of-an-old-round"],
)
def test_the_steps_every_rank_of_the_node_holds(
    slots: list[CommittedSlot], steps: list[int]
) -> None:
    assert node_steps(slots) == steps


def test_the_poll_persists_every_due_step_and_gives_the_slots_back(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    _save(slots, 0, range(1, 6), every=2)  # holds 4 and 2 (due, kept off) and 5
    _save(slots, 1, range(1, 5), every=2)  # holds 4 and 2 (due) and 3
    assert sorted((m.rank, m.step) for m in due_markers(slots)) == [(0, 2), (0, 4), (1, 2), (1, 4)]
    seen: list[Persisted] = []
    p = Persister(PersistSettings(root, every_steps=2), JOB, slots,
                  on_persisted=lambda done, _s: seen.append(done))  # fmt: skip
    assert p.poll() == 4
    assert complete_steps(root) == [4, 2] and p.last_step == 4
    assert due_markers(slots) == []  # the slots are the writer's again
    assert [d.completed_step for d in seen] == [False, True, False, True]
    assert p.poll() is None  # nothing due
    template = {"w": torch.zeros(100), "step": 0}
    dcp.load(template, checkpoint_id=str(root / "step-4" / "rank-1"), no_dist=True)
    assert template["step"] == 4 and template["w"].eq(4.0).all()
    assert Persister(PersistSettings(root, every_steps=0), JOB, slots).poll() is None


def test_a_replicated_state_is_persisted_once_as_rank_0(tmp_path: Path) -> None:
    """Every rank's state is the same: one copy on the shared volume, complete alone; the
    other ranks' marked slots go back to the writer unwritten; a rank of a larger world
    loads rank 0's folder."""
    slots, root = tmp_path / "slots", tmp_path / "persist"
    for rank in (0, 1):
        _save(slots, rank, range(1, 5), world=4, every=2)
    seen: list[Persisted] = []
    p = Persister(PersistSettings(root, every_steps=2), JOB, slots, replicated=True,
                  on_persisted=lambda done, _s: seen.append(done))  # fmt: skip
    assert p.poll() == 4
    assert complete_steps(root) == [4, 2] and due_markers(slots) == []
    assert [(d.path.name, d.completed_step) for d in seen] == [("rank-0", True)] * 2
    assert sorted(q.name for q in (root / "step-4").iterdir()) == ["COMPLETE", "rank-0"]
    assert persisted_steps(root, JOB) == [(4, 4), (2, 4)]
    got = load_persisted(4, 7, root, replicated=True)  # a world of 8 now: rank 7
    assert got[1]["step"] == 4 and bool(got[1]["w"].eq(4.0).all())
    # at a stop: rank 0's node writes what it holds; a node without rank 0 writes nothing
    other = tmp_path / "other-node"
    for rank in (2, 3):
        _save(other, rank, range(5, 8), world=4)
    assert Persister(PersistSettings(root, every_steps=0), JOB, other, replicated=True
                     ).at_stop(time.monotonic() + 60) == []  # fmt: skip
    assert complete_steps(root) == [4, 2]
    _save(slots, 0, range(5, 8), world=4)
    _save(slots, 1, range(5, 8), world=4)
    stop = Persister(PersistSettings(root, every_steps=0, keep=5), JOB, slots, replicated=True)
    assert stop.at_stop(time.monotonic() + 60) == [7, 6, 5]
    assert not (root / "step-7" / "rank-1").exists()


def test_a_malformed_or_stale_marker_is_removed(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    _save(slots, 0, range(1, 3), world=1, every=2)
    (slots / "rank-0.slot0.due").write_text("not a step")
    (slots / "rank-0.slot2.due").write_text("99")  # a step the slot does not hold
    p = Persister(PersistSettings(root, every_steps=2), JOB, slots)
    assert p.poll() == 2
    assert complete_steps(root) == [2] and due_markers(slots) == []


def test_at_stop_every_held_step_is_persisted_newest_first_and_old_ones_pruned(
    tmp_path: Path,
) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    for rank in (0, 1):
        _save(slots, rank, range(1, 6))
    p = Persister(PersistSettings(root, every_steps=0, keep=2), JOB, slots)
    assert p.at_stop(time.monotonic() + 60) == [5, 4, 3]
    assert complete_steps(root) == [5, 4]  # step 3 was pruned once 5 and 4 were complete
    assert not (root / "step-3").exists()
    assert (
        Persister(PersistSettings(root, on_stop=False), JOB, slots).at_stop(time.monotonic() + 60)
        == []
    )
    late = Persister(PersistSettings(tmp_path / "other"), JOB, slots)
    assert late.at_stop(time.monotonic() - 1) == []
    assert not (tmp_path / "other").exists()


def test_the_thread_persists_while_training_saves(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    slots.mkdir()
    p = Persister(PersistSettings(root, every_steps=10, keep=3), JOB, slots)
    p.start()
    try:
        # steps of ~1 ms, far faster than the poll: the due steps are kept for it
        with CheckpointStore(slots, rank=0, job=JOB, world_size=1, round=1,
                             persist_every=10) as ckpt:  # fmt: skip
            for step in range(1, 301):
                ckpt.save(step, {"w": torch.full((100,), float(step))})
                time.sleep(0.001)
        wait_for(lambda: 300 in complete_steps(root), 30, what="step 300 persisted")
    finally:
        p.close()
    kept = complete_steps(root)
    # keep 3, each a due step; a due step the 0.2 s poll had not reached when a third
    # was due was given back to the writer (the trainer never waits)
    assert len(kept) == 3 and kept[0] == 300 and all(k % 10 == 0 for k in kept), kept


def _wired(root: Path, every: str, slots: Path) -> tuple[Persister, SidecarMetrics]:
    """The sidecar's persister as wiring builds it from the environment, over ``slots``."""
    cfg = SidecarConfig.from_env(GOOD | {
        contract.ENV_CHECKPOINT_PERSIST_DIR: str(root),
        contract.ENV_CHECKPOINT_PERSIST_EVERY: every,
    })  # fmt: skip
    metrics = SidecarMetrics(TimerStats)
    p = persister_of(cfg, metrics)
    assert p is not None
    p.slots = slots
    return p, metrics


def test_a_failure_is_logged_and_counted_and_the_poll_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slots = tmp_path / "slots"
    _save(slots, 0, range(1, 3), world=1, job=GOOD[contract.ENV_JOB_UID])
    blocked = tmp_path / "persist"
    blocked.write_text("a file where the folder should be")
    _save(slots, 0, range(3, 5), world=1, job=GOOD[contract.ENV_JOB_UID], every=2)
    p, metrics = _wired(blocked, "1", slots)
    caplog.set_level(logging.ERROR, logger="kelastic_sidecar.persister")
    assert p.poll() is None and p.last_step is None
    assert "rank 0, step 4: [Errno 20] Not a directory" in caplog.text
    assert metrics.registry.get_sample_value("kelastic_checkpoint_persist_failures_total") == 1
    assert due_markers(slots) == []  # given back even though not persisted
    blocked.unlink()
    _save(slots, 0, range(5, 7), world=1, job=GOOD[contract.ENV_JOB_UID], every=2)
    assert p.poll() == 6 and complete_steps(blocked) == [6]


def test_the_metrics_count_what_was_persisted(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    _save(slots, 0, range(1, 4), world=1, job=GOOD[contract.ENV_JOB_UID], every=3)
    p, metrics = _wired(tmp_path / "persist", "3", slots)
    assert p.poll() == 3
    get = metrics.registry.get_sample_value
    assert get("kelastic_checkpoint_persisted_step") == 3
    assert get("kelastic_checkpoint_persist_seconds_count") == 1
    assert persister_of(SidecarConfig.from_env(GOOD), metrics) is None


def test_the_settings_come_from_the_environment() -> None:
    cfg = SidecarConfig.from_env(GOOD | {
        contract.ENV_CHECKPOINT_PERSIST_DIR: "/var/run/kelastic-persist/jobs",
        contract.ENV_CHECKPOINT_PERSIST_EVERY: "50",
        contract.ENV_CHECKPOINT_PERSIST_ON_STOP: "0",
        contract.ENV_CHECKPOINT_PERSIST_KEEP: "7",
    })  # fmt: skip
    assert cfg.persist == PersistSettings(Path("/var/run/kelastic-persist/jobs"), 50, False, 7)
    assert SidecarConfig.from_env(GOOD).persist is None
    defaults = SidecarConfig.from_env(GOOD | {contract.ENV_CHECKPOINT_PERSIST_DIR: "/p"}).persist
    assert defaults == PersistSettings(Path("/p"), 0, True, contract.DEFAULT_PERSIST_KEEP)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({contract.ENV_CHECKPOINT_PERSIST_DIR: "relative/dir"}, "must be an absolute path"),
        ({contract.ENV_CHECKPOINT_PERSIST_EVERY: "-1"}, "PERSIST_EVERY must be 0..1000000000"),
        ({contract.ENV_CHECKPOINT_PERSIST_EVERY: "1e9"}, "not a valid int"),
        ({contract.ENV_CHECKPOINT_PERSIST_EVERY: "9" * 40}, "PERSIST_EVERY must be 0.."),
        ({contract.ENV_CHECKPOINT_PERSIST_KEEP: "0"}, "PERSIST_KEEP must be 1..1000"),
    ],
    ids=["relative", "negative", "float", "huge", "keep-zero"],
)
def test_bad_settings_are_a_configuration_error(override: dict[str, str], message: str) -> None:
    env = GOOD | {contract.ENV_CHECKPOINT_PERSIST_DIR: "/p"} | override
    with pytest.raises(ConfigError, match=message):
        SidecarConfig.from_env(env)


def test_committed_slots_read_headers_only_and_skip_junk(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    _save(slots, 3, range(1, 3), world=4)
    (slots / "rank-9.slot0").write_bytes(b"short")
    (slots / "rank-8.slot1").write_bytes(bytes(8192))  # zeros: no header
    (slots / "rank-7.slot9").write_bytes(b"x")  # not a slot index
    (slots / "notes.txt").write_text("hi")
    got = committed_slots(slots, JOB)
    assert sorted((s.rank, s.step, s.world_size) for s in got) == [(3, 1, 4), (3, 2, 4)]
    assert committed_slots(slots, "another") == []
    assert committed_slots(tmp_path / "missing", JOB) == []
