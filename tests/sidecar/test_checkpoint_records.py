"""The sidecars' checkpoint records in a real etcd: each node publishes its slots'
verified committed steps, every node agrees on the same restorable step from them."""

from __future__ import annotations

from pathlib import Path

import torch

from kelastic import contract
from kelastic.checkpoint import CheckpointStore
from kelastic.etcd_values.checkpoints import decode_checkpoints
from kelastic_etcd import EtcdClient
from kelastic_sidecar.checkpoints import agree, publish_record


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
    _save(a, 0, range(1, 6))  # rank 0 on node a: 5, 4
    _save(b, 1, range(1, 5))  # rank 1 on node b was killed before it committed 5: 4, 3
    assert publish_record(store, keys, "a", a, "uid").ranks == {0: (5, 4)}
    publish_record(store, keys, "b", b, "uid")
    got = store.get(keys.checkpoint("b"))
    assert got is not None and decode_checkpoints(got[0], "k").ranks == {1: (4, 3)}
    for _ in range(2):  # every node computes the same from the same records
        assert agree(store, keys, ("a", "b"), 1, "uid") == 4
    assert agree(store, keys, ("b", "a"), 1, "uid") is None  # group ranks swapped
    assert agree(store, keys, ("a", "b"), 1, "another-run") is None
    assert agree(store, keys, ("a", "b", "c"), 1, "uid") is None  # c has no record


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
