"""The sidecars' checkpoint records in a real etcd: each node publishes its slots'
verified committed steps, every node agrees on the same restorable step from them, and
says what each round restores (``/status``, metrics)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kelastic import contract
from kelastic.checkpoint import CheckpointStore, persist
from kelastic.checkpoint.due import due_markers
from kelastic.checkpoint.restored import Restored, write_restored
from kelastic.checkpoint.scan import verified_steps
from kelastic.etcd_values.checkpoints import (
    CheckpointsDoc,
    decode_checkpoints,
    encode_checkpoints,
    restore_of,
)
from kelastic_etcd import EtcdClient, EtcdError
from kelastic_sidecar.checkpoints import RoundCheckpoints, publish_record, read_records
from kelastic_sidecar.config import SidecarConfig
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.rendezvous import RendezvousInfo
from kelastic_sidecar.timer import TimerStats
from kelastic_sidecar.wiring import restore_reporter

from .test_sidecar_config import GOOD


def agree(store: EtcdClient, keys: contract.Keys, participants: tuple[str, ...], nproc: int,
          job: str) -> int | None:  # fmt: skip
    """The step every sidecar computes for a round of ``participants`` (what
    ``worker_env`` gives the workers)."""
    return restore_of(0, read_records(store, keys, participants), participants, nproc, job).step


def _save(directory: Path, rank: int, steps: range) -> None:
    directory.mkdir(exist_ok=True)
    with CheckpointStore(directory, rank=rank, job="uid") as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((1000,), float(step))}, blocking=True)


def test_two_nodes_agree_on_the_step_both_committed(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    keys = contract.Keys(job_prefix)
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, 0, range(1, 6))  # rank 0 on node a: 5, 4, 3
    _save(b, 1, range(1, 5))  # rank 1 on node b was killed before it committed 5: 4, 3, 2
    assert publish_record(store, keys, "a", a, "uid").ranks == {0: (5, 4, 3)}
    publish_record(store, keys, "b", b, "uid")
    got = store.get(keys.checkpoint("b"))
    assert got is not None and decode_checkpoints(got[0], "k").ranks == {1: (4, 3, 2)}
    for _ in range(2):  # every node computes the same from the same records
        assert agree(store, keys, ("a", "b"), 1, "uid") == 4
    assert agree(store, keys, ("b", "a"), 1, "uid") is None  # group ranks swapped
    assert agree(store, keys, ("a", "b"), 1, "another-run") is None
    assert agree(store, keys, ("a", "b", "c"), 1, "uid") is None  # c has no record


_STAGED_THEN_HANG = """
import sys, time, torch
from kelastic.checkpoint import CheckpointStore, commit
directory, rank, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ckpt = CheckpointStore(directory, rank=rank, job="uid")
for step in range(1, last):
    ckpt.save(step, {"w": torch.full((1000,), float(step))}, blocking=True)
def never(payload, chunk_size):
    while True:
        time.sleep(60)
commit.chunk_checksums = never  # the commit of the last save never ends
ckpt.save(last, {"w": torch.full((1000,), float(last))})
print("staged", flush=True)
time.sleep(600)
"""


def test_a_save_a_killed_worker_returned_from_is_committed_and_recorded(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    keys = contract.Keys(job_prefix)
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, 0, range(1, 6))
    b.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _STAGED_THEN_HANG, str(b), "1", "5"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "staged"
        proc.send_signal(signal.SIGKILL)  # its save of step 5 returned; its commit had not
    finally:
        proc.kill()
        proc.wait()
    assert verified_steps(b, "uid") == {1: (4, 3)}  # step 2's slot was being written
    publish_record(store, keys, "a", a, "uid")
    assert publish_record(store, keys, "b", b, "uid", persist_every=5).ranks == {1: (5, 4, 3)}
    assert agree(store, keys, ("a", "b"), 1, "uid") == 5  # no step lost to the kill
    assert [m.step for m in due_markers(b)] == [5]  # due for persistence, as its writer's


def test_a_corrupt_or_empty_record_agrees_on_none(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    keys = contract.Keys(job_prefix)
    _save(tmp_path / "a", 0, range(1, 3))
    publish_record(store, keys, "a", tmp_path / "a", "uid")
    store.put(keys.checkpoint("b"), b'{"version":1,"job":"uid","ranks":{"1":[1,2]},"time":1}')
    assert agree(store, keys, ("a", "b"), 1, "uid") is None
    # a node without slots (a new Pod: an empty folder, or none) records none
    assert publish_record(store, keys, "b", tmp_path / "missing", "uid").ranks == {}
    assert agree(store, keys, ("a", "b"), 1, "uid") is None
    assert agree(store, keys, ("a",), 1, "uid") == 2


def _round_part(store: EtcdClient, node: str, metrics: SidecarMetrics) -> RoundCheckpoints:
    cfg = SidecarConfig.from_env(GOOD | {contract.ENV_POD_NAME: node, contract.ENV_JOB_UID: "uid"})
    return RoundCheckpoints(store, contract.Keys(cfg.prefix), cfg,
                            on_check=metrics.checkpoint.check.observe,
                            on_restore=restore_reporter(metrics))  # fmt: skip


def test_each_round_says_what_its_workers_restore_and_counts_it(
    store: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The supervisor's part: the record before the rendezvous, the step at the start of
    # the workers, both in /status (what kelastic run prints) and in the metrics.
    metrics = {n: SidecarMetrics(lambda: TimerStats()) for n in "ab"}
    part = {n: _round_part(store, n, metrics[n]) for n in "ab"}
    sample = metrics["a"].registry.get_sample_value
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()

    def on(node: str) -> RoundCheckpoints:  # the node's own slot folder, as in its Pod
        monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path / node))
        return part[node]

    def start(round_: int, nodes: tuple[str, ...]) -> dict[str, str | None]:
        for n in nodes:
            on(n).before_rendezvous(stopped=True)
        envs = {}
        for rank, n in enumerate(nodes):
            env = on(n).worker_env(RendezvousInfo(round_, rank, len(nodes), nodes), 1, False)
            envs[n] = (env or {}).get(contract.ENV_CHECKPOINT_STEP)
        return envs

    # a fresh start: nothing held, nothing counted
    assert start(0, ("a", "b")) == {"a": "none", "b": "none"}
    status = part["a"].status()
    assert status is not None and (status["step"], status["tier"], status["held"]) == (
        None, "none", False)  # fmt: skip
    assert sample("kelastic_checkpoint_restores_total", {"tier": "none"}) == 0
    assert sample("kelastic_checkpoint_check_seconds_count") == 1
    # both committed 4, b not 5: every rank restores 4, from memory
    _save(a, 0, range(1, 6))
    _save(b, 1, range(1, 5))
    assert start(1, ("a", "b")) == {"a": "4", "b": "4"}
    status = part["b"].status()
    assert status is not None
    assert {k: status[k] for k in ("round", "step", "tier", "ranks", "held")} == {
        "round": 1, "step": 4, "tier": "memory", "ranks": 2, "held": True}  # fmt: skip
    assert status["checked_s"] >= 0 and status["time"] > 0
    assert sample("kelastic_checkpoint_restores_total", {"tier": "memory"}) == 1
    assert sample("kelastic_checkpoint_restored_step") == 4
    # a's step 5 belongs to a run the job abandoned: dropped before the workers start
    assert verified_steps(a, "uid") == {0: (4, 3)}
    # b's Pod replaced: its slots are gone, a's are not: none in common, which is counted
    for f in b.iterdir():
        f.unlink()
    assert start(2, ("a", "b")) == {"a": "none", "b": "none"}
    status = part["a"].status()
    assert status is not None and (status["tier"], status["held"]) == ("none", True)
    assert sample("kelastic_checkpoint_restores_total", {"tier": "none"}) == 1
    assert sample("kelastic_checkpoint_restored_step") == 4  # the last one restored
    assert verified_steps(a, "uid") == {}  # the training starts elsewhere: all dropped
    # workers carried in process load nothing: no variable, the last restore stays
    assert on("a").worker_env(RendezvousInfo(3, 0, 2, ("a", "b")), 1, True) is None
    status = part["a"].status()
    assert status is not None and status["round"] == 2


def test_a_replaced_pod_restores_the_persisted_step_with_every_other_rank(
    store: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's Pod is replaced: its slots are new and empty, so no step is in every rank's
    memory; both nodes saw step 4 complete on the job's persistence volume and agree on
    it, from disk, named in the workers' env, ``/status`` and the metrics."""
    disk = tmp_path / "persist"
    env = {contract.ENV_CHECKPOINT_PERSIST_DIR: str(disk), contract.ENV_JOB_UID: "uid"}
    metrics = {n: SidecarMetrics(lambda: TimerStats()) for n in "ab"}
    part = {}
    for n in "ab":
        cfg = SidecarConfig.from_env(GOOD | env | {contract.ENV_POD_NAME: n})
        part[n] = RoundCheckpoints(store, contract.Keys(cfg.prefix), cfg,
                                   on_restore=restore_reporter(metrics[n]))  # fmt: skip
    slots = {n: tmp_path / n for n in "ab"}
    for rank, n in enumerate("ab"):
        slots[n].mkdir()
        with CheckpointStore(slots[n], rank=rank, job="uid", world_size=2, round=0) as ckpt:
            for step in range(1, 6):
                ckpt.save(step, {"w": torch.full((10,), float(step))}, blocking=True)
        for step in (3, 4):  # the slots hold 3, 4, 5
            persist.persist(slots[n], rank, "uid", step, disk)
    for f in slots["b"].iterdir():  # the replacement's slots
        f.unlink()
    nodes = ("a", "b")
    for n in nodes:
        monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(slots[n]))
        part[n].before_rendezvous(stopped=True)
        got = store.get(contract.Keys(part[n]._cfg.prefix).checkpoint(n))
        assert got is not None and decode_checkpoints(got[0], "k").persisted == ((4, 2), (3, 2))
    envs = {}
    for rank, n in enumerate(nodes):
        monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(slots[n]))
        envs[n] = part[n].worker_env(RendezvousInfo(1, rank, 2, nodes), 1, False)
    for n in nodes:
        assert envs[n] == {contract.ENV_CHECKPOINT_STEP: "4",
                           contract.ENV_CHECKPOINT_TIER: contract.CHECKPOINT_TIER_DISK}  # fmt: skip
        status = part[n].status()
        assert status is not None and (status["step"], status["tier"]) == (4, "disk")
        sample = metrics[n].registry.get_sample_value
        assert sample("kelastic_checkpoint_restores_total", {"tier": "disk"}) == 1
    # a's memory steps newer than 4 belong to a history the job abandons: dropped
    assert verified_steps(slots["a"], "uid") == {0: (4, 3)}
    # b's worker loaded step 4 (its record beside the slots): b's /status counts it
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(slots["b"]))
    status = part["b"].status()
    assert status is not None and status["loaded"] is None
    write_restored(slots["b"], Restored(1, 1, 4, contract.CHECKPOINT_TIER_DISK, 0.5))
    write_restored(slots["b"], Restored(7, 0, 2, contract.CHECKPOINT_TIER_MEMORY, 9.0))  # old
    status = part["b"].status()
    assert status is not None and status["loaded"] == {"ranks": 1, "slowest_s": 0.5}


def test_records_etcd_cannot_give_are_no_agreement_on_none(
    store: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd does not answer as the round starts: this node must not agree on "no step"
    (its workers would start afresh while its peers, which read the records, load a
    step: a mixed restore). It raises, drops none of its slots, restores nothing, and
    the supervisor goes back to the rendezvous."""
    _save(tmp_path / "a", 0, range(1, 6))
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path / "a"))
    cfg = SidecarConfig.from_env(GOOD | {contract.ENV_POD_NAME: "a", contract.ENV_JOB_UID: "uid"})
    with EtcdClient(["127.0.0.1:1"], timeout=0.3) as dead:
        part = RoundCheckpoints(dead, contract.Keys(cfg.prefix), cfg)
        with pytest.raises(EtcdError):
            part.worker_env(RendezvousInfo(1, 0, 1, ("a",)), 1, False)
        with pytest.raises(EtcdError):
            read_records(dead, contract.Keys(cfg.prefix), ("a",))
    assert part.status() is None  # no restore said
    assert verified_steps(tmp_path / "a", "uid") == {0: (5, 4, 3)}  # nothing dropped
    # carried in process: nothing to read, nothing raised
    with EtcdClient(["127.0.0.1:1"], timeout=0.3) as dead:
        part = RoundCheckpoints(dead, contract.Keys(cfg.prefix), cfg)
        assert part.worker_env(RendezvousInfo(1, 0, 1, ("a",)), 1, True) is None


def test_a_node_that_carries_its_workers_takes_its_record_back(
    store: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node a's workers go on in process into round 2 (in-process carry) and keep saving;
    node b joins it fresh. a's record of round 1 says step 5 for its rank 0 and, as a
    replica, for rank 1, which a's ranks have left behind: b must not load it (its rank at
    5, a's at 9: a mixed restore). a takes its record back as it carries its workers, so b
    agrees on none."""
    metrics = SidecarMetrics(lambda: TimerStats())
    a, b = _round_part(store, "a", metrics), _round_part(store, "b", metrics)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path / "a"))
    keys = contract.Keys(a._cfg.prefix)
    token = "0123456789abcdef0123456789abcdef"
    old = CheckpointsDoc("uid", {0: (5,)}, 1.0, (), {1: (5,)}, "127.0.0.1:1", token)
    store.put(keys.checkpoint("a"), encode_checkpoints(old))  # round 1's record
    a.before_rendezvous(stopped=False)  # round 2: carried
    assert read_records(store, keys, ("a",))["a"] is None
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path / "b"))
    b.before_rendezvous(stopped=True)
    env = b.worker_env(RendezvousInfo(2, 1, 2, ("a", "b")), 1, False)
    assert env is not None and env[contract.ENV_CHECKPOINT_STEP] == "none"
