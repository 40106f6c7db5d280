"""A replicated checkpoint state (``spec.checkpoint.stateLayout: Replicated``: every rank
saves the same state, as under DDP): a world that grew or was renumbered still restores,
each rank without the agreed step adopting another rank's copy: from its node, from a
peer's sidecar (real replica servers on loopback, a real etcd), or from a step persisted
by a smaller world. The agreement's table, the adoption of a slot, the disk's source
folder, and the sidecars end to end; a sharded state in the same rounds restores none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import CheckpointError, CheckpointStore, persist
from kelastic.checkpoint.adopt import adopt_slot
from kelastic.checkpoint.from_disk import load_persisted, source_rank
from kelastic.checkpoint.scan import committed_slots, verified_steps
from kelastic.checkpoint.slot_format import HEADER_SIZE, decode_header
from kelastic.checkpoint.store import slot_path
from kelastic.etcd_values.checkpoints import (
    CheckpointsDoc,
    RestoreTier,
    replicated_sources,
    replicated_step,
    restore_of,
)
from kelastic_etcd import EtcdClient
from kelastic_sidecar.checkpoints import RoundCheckpoints
from kelastic_sidecar.config import ConfigError, ReplicationSettings, SidecarConfig
from kelastic_sidecar.rendezvous import RendezvousInfo
from kelastic_sidecar.replication import Replication
from tests.worker_lib.test_checkpoint_agree import _held

from .test_sidecar_config import GOOD

SERVE_ONLY = ReplicationSettings(replicas=0, every=1, rate=0, port=0, max_slot_bytes=64 << 20)


# ------------------------------------------------------------------ the agreement


@pytest.mark.parametrize(
    ("records", "replicated", "sharded"),
    [
        # the world grew from a (ranks 0, 1) to a and b: b holds nothing, a serves
        ({"a": _held({0: (5, 4), 1: (5, 4)}), "b": _held({})}, (5, RestoreTier.PEER),
         (None, RestoreTier.NONE)),
        # ... and when a serves nothing, b cannot get it: none either way
        ({"a": _held({0: (5,), 1: (5,)}, serves=False), "b": _held({})},
         (None, RestoreTier.NONE), (None, RestoreTier.NONE)),
        # renumbered: each node holds steps of other ranks than it runs now: memory
        ({"a": _held({2: (7, 6), 3: (7,)}, serves=False),
          "b": _held({0: (6,), 1: (6,)}, serves=False)},
         (6, RestoreTier.MEMORY), (None, RestoreTier.NONE)),
        # ... and when a serves its newer step, b fetches it: the peer's 7
        ({"a": _held({2: (7, 6), 3: (7,)}), "b": _held({0: (6,), 1: (6,)})},
         (7, RestoreTier.PEER), (None, RestoreTier.NONE)),
        # ... a replica on the node counts as a copy on the node
        ({"a": _held({0: (9,)}), "b": _held({}, {0: (9,)}, serves=False)},
         (9, RestoreTier.MEMORY), (None, RestoreTier.NONE)),
        # a step persisted by a world of 2 restores a world of 4 (a mod-2 folder each)
        ({"a": _held({}, persisted=((8, 2),)), "b": _held({}, persisted=((8, 2),))},
         (8, RestoreTier.DISK), (None, RestoreTier.NONE)),
        # the peer's newer step beats the disk's
        ({"a": _held({0: (9,)}, persisted=((8, 2),)), "b": _held({}, persisted=((8, 2),))},
         (9, RestoreTier.PEER), (None, RestoreTier.NONE)),
        # another run's copies count for nothing
        ({"a": _held({0: (5,), 1: (5,)}, job="old"), "b": _held({})},
         (None, RestoreTier.NONE), (None, RestoreTier.NONE)),
    ],
)  # fmt: skip
def test_a_replicated_state_restores_what_a_sharded_one_cannot(
    records: dict[str, CheckpointsDoc | None],
    replicated: tuple[int | None, RestoreTier],
    sharded: tuple[int | None, RestoreTier],
) -> None:
    got = restore_of(1, records, ("a", "b"), 2, "j", replicated=True)
    assert (got.step, got.tier) == replicated
    got = restore_of(1, records, ("a", "b"), 2, "j")
    assert (got.step, got.tier) == sharded


def test_the_sources_of_a_replicated_step_serve_it_in_their_slots_first() -> None:
    records = {
        "a": _held({}, {4: (12,)}),
        "b": _held({3: (12, 11), 1: (12,)}),
        "c": _held({0: (12,)}, serves=False),
        "d": _held({0: (12,)}, job="old"),
        "e": None,
    }
    names = ["a", "b", "c", "d", "e"]
    assert [(n, r) for n, _, r in replicated_sources(records, names, "j", 12)] == [
        ("b", 1), ("a", 4)]  # fmt: skip
    assert [(n, r) for n, _, r in replicated_sources(records, names, "j", 11)] == [("b", 3)]
    assert replicated_sources(records, names, "j", 10) == []
    assert replicated_step(records, (), "j") is None
    assert replicated_step(records, ["b", "c"], "j") == 12
    assert replicated_step(records, ["b", "e"], "j") is None
    assert replicated_step(records, ["b", "e"], "j", served=True) == 12


# ------------------------------------------------------------------ a slot adopted


def _save(directory: Path, rank: int, steps: range, job: str = "uid", world: int = 0) -> None:
    directory.mkdir(exist_ok=True)
    with CheckpointStore(directory, rank=rank, job=job, world_size=world) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((300_000,), float(step)), "saver": rank},
                      blocking=True)  # fmt: skip


def _slot_of(directory: Path, rank: int, step: int) -> Path:
    for s in committed_slots(directory, "uid"):
        if (s.rank, s.step) == (rank, step):
            return slot_path(directory, rank, s.slot)
    raise AssertionError(f"no slot of rank {rank} holds step {step}")


def _load(directory: Path, rank: int, step: int) -> dict[str, Any]:
    with CheckpointStore(directory, rank=rank, job="uid") as ckpt:
        got = ckpt.load(step=step)
    assert got is not None, f"rank {rank} cannot load step {step}"
    return dict(got[1])


def test_a_rank_adopts_another_ranks_slot_and_loads_it_as_its_own(tmp_path: Path) -> None:
    _save(tmp_path, 0, range(1, 4))
    _save(tmp_path, 5, range(7, 9))  # rank 5 holds newer steps of another history
    source = _slot_of(tmp_path, 0, 2)
    before = source.read_bytes()
    size = adopt_slot(source, slot_path(tmp_path, 5, 2), 5, "uid", 2)
    assert size == len(before) and source.read_bytes() == before  # the source untouched
    state = _load(tmp_path, 5, 2)
    assert state["saver"] == 0 and bool(state["w"].eq(2.0).all())
    assert verified_steps(tmp_path, "uid")[5] == (8, 7, 2)
    seqs = {s.step: s.seq for s in committed_slots(tmp_path, "uid") if s.rank == 5}
    assert seqs[2] > max(seqs[7], seqs[8])  # the adopted step is the rank's newest
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_slot_that_is_not_the_step_asked_for_is_refused_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 0, range(1, 3))
    dest = slot_path(tmp_path, 1, 0)
    with pytest.raises(CheckpointError, match=r"holds step 2 of job 'uid'.*not step 3"):
        adopt_slot(_slot_of(tmp_path, 0, 2), dest, 1, "uid", 3)
    with pytest.raises(CheckpointError, match="not step 2 of 'other'"):
        adopt_slot(_slot_of(tmp_path, 0, 2), dest, 1, "other", 2)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\xff" * 5000)
    with pytest.raises(CheckpointError, match="is not a slot"):
        adopt_slot(garbage, dest, 1, "uid", 2)
    garbage.write_bytes(b"KELCKPT")
    with pytest.raises(CheckpointError, match="no whole header"):
        adopt_slot(garbage, dest, 1, "uid", 2)
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_adopted_copy_whose_payload_went_bad_fails_the_load(tmp_path: Path) -> None:
    """The adoption checks the header only: the rank's load checks every chunk."""
    _save(tmp_path, 0, range(1, 2))
    source = _slot_of(tmp_path, 0, 1)
    raw = bytearray(source.read_bytes())
    lay = decode_header(bytes(raw[:HEADER_SIZE]), file_size=len(raw)).layout
    raw[lay.payload_offset + lay.payload_len - 7] ^= 0xFF  # the payload's last bytes
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    adopt_slot(bad, slot_path(tmp_path, 1, 0), 1, "uid", 1)
    with CheckpointStore(tmp_path, rank=1, job="uid") as ckpt:
        assert ckpt.load(step=1) is None
        assert any("crc32" in why or "manifest" in why for _, why in ckpt.skipped), ckpt.skipped


# ------------------------------------------------------------------ from disk


def test_a_grown_world_loads_a_persisted_replicated_step_from_a_smaller_worlds_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    _save(slots, 0, range(4, 5), job="j", world=2)
    _save(slots, 1, range(4, 5), job="j", world=2)
    for rank in (0, 1):
        persist.persist(slots, rank, "j", 4, root)
    step_dir = root / "step-4"
    assert [source_rank(step_dir, r) for r in range(5)] == [0, 1, 0, 1, 0]
    step, state = load_persisted(4, 3, root, replicated=True)
    assert step == 4 and state["saver"] == 1 and bool(state["w"].eq(4.0).all())
    with pytest.raises(CheckpointError, match="rank-3"):  # a sharded state has no such part
        load_persisted(4, 3, root)
    # through load(): the sidecar's env says the layout
    env = {
        contract.ENV_CHECKPOINT_STEP: "4",
        contract.ENV_CHECKPOINT_TIER: contract.CHECKPOINT_TIER_DISK,
        contract.ENV_CHECKPOINT_PERSIST_DIR: str(root),
        contract.ENV_CHECKPOINT_DIR: str(tmp_path / "none"),
        contract.RANK: "2",
        contract.ENV_CHECKPOINT_LAYOUT: contract.StateLayout.REPLICATED,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got = checkpoint.load()
    assert got is not None and got[0] == 4 and got[1]["saver"] == 0


# ------------------------------------------------------------------ the sidecars


class Node:
    """One node's sidecar part with a replicated state: its slot folder, its server (no
    replicas sent) and its round part."""

    def __init__(self, store: EtcdClient, name: str, root: Path, layout: str) -> None:
        self.name, self.dir = name, root / name
        self.dir.mkdir()
        env = GOOD | {
            contract.ENV_POD_NAME: name,
            contract.ENV_JOB_UID: "uid",
            contract.ENV_NPROC_PER_NODE: "2",
            contract.ENV_CHECKPOINT_LAYOUT: layout,
        }
        self.cfg = SidecarConfig.from_env(env)
        self.replication = Replication(SERVE_ONLY, "uid", self.dir, "127.0.0.1", poll=None)
        self.part = RoundCheckpoints(store, contract.Keys(self.cfg.prefix), self.cfg,
                                     replication=self.replication)  # fmt: skip
        self.part.start()

    def at(self, monkeypatch: pytest.MonkeyPatch) -> RoundCheckpoints:
        monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(self.dir))
        return self.part


@pytest.fixture
def nodes(store: EtcdClient, tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Node] = []

    def make(name: str, layout: str = contract.StateLayout.REPLICATED) -> Node:
        made.append(Node(store, name, tmp_path, layout))
        return made[-1]

    yield make
    for node in made:
        node.part.close()


def _round(monkeypatch: pytest.MonkeyPatch, round_: int,
           order: tuple[Node, ...]) -> dict[str, dict[str, str]]:  # fmt: skip
    names = tuple(n.name for n in order)
    for n in order:
        n.at(monkeypatch).before_rendezvous(stopped=True)
    envs = {}
    for group_rank, n in enumerate(order):
        info = RendezvousInfo(round_, group_rank, len(order), names)
        env = n.at(monkeypatch).worker_env(info, 2, False)
        assert env is not None
        envs[n.name] = env
    return envs


@pytest.mark.parametrize("new_first", [False, True], ids=["appended", "new-node-first"])
def test_a_node_that_joins_a_grown_world_gets_the_step_from_a_peer(
    nodes,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    new_first: bool,
) -> None:
    a = nodes("a")
    _round(monkeypatch, 0, (a,))
    _save(a.dir, 0, range(1, 6))
    _save(a.dir, 1, range(1, 6))
    b = nodes("b")  # the world grows: b holds nothing
    order = (b, a) if new_first else (a, b)
    envs = _round(monkeypatch, 1, order)
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"5"}
    assert {e[contract.ENV_CHECKPOINT_LAYOUT] for e in envs.values()} == {"replicated"}
    for n in (a, b):
        status = n.part.status()
        assert status is not None and (status["step"], status["tier"]) == (5, "peer")
    b_ranks = (0, 1) if new_first else (2, 3)
    a_ranks = (2, 3) if new_first else (0, 1)
    fetched = b.part.status()["fetched"]  # type: ignore[index]
    assert fetched["ranks"] == 2 and 1_000_000 < fetched["bytes"] < 2_000_000, fetched  # once
    for node, ranks in ((b, b_ranks), (a, a_ranks)):
        for rank in ranks:
            state = _load(node.dir, rank, 5)
            assert state["saver"] in (0, 1) and bool(state["w"].eq(5.0).all())
    assert not [p for p in b.dir.iterdir() if p.name.startswith(".")]


def test_a_renumbered_world_restores_from_each_nodes_own_copies(
    nodes,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = nodes("a"), nodes("b")
    _round(monkeypatch, 0, (a, b))
    for node, ranks in ((a, (0, 1)), (b, (2, 3))):
        for rank in ranks:
            _save(node.dir, rank, range(1, 4))
    envs = _round(monkeypatch, 1, (b, a))  # b now runs ranks 0, 1 and a ranks 2, 3
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"3"}
    for node, ranks in ((b, (0, 1)), (a, (2, 3))):
        status = node.part.status()
        assert status is not None and (status["step"], status["tier"]) == (3, "memory")
        assert status["fetched"]["bytes"] == 0, status["fetched"]  # type: ignore[index]
        for rank in ranks:
            assert bool(_load(node.dir, rank, 3)["w"].eq(3.0).all())


def test_a_sharded_state_in_a_grown_world_restores_none(
    nodes,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = nodes("a", contract.StateLayout.SHARDED)
    _round(monkeypatch, 0, (a,))
    _save(a.dir, 0, range(1, 3))
    _save(a.dir, 1, range(1, 3))
    b = nodes("b", contract.StateLayout.SHARDED)
    envs = _round(monkeypatch, 1, (a, b))
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"none"}
    assert not any(contract.ENV_CHECKPOINT_LAYOUT in e for e in envs.values())
    assert verified_steps(b.dir, "uid") == {}


def test_the_layout_variable_is_checked_and_serves_the_slots_without_replicas() -> None:
    cfg = SidecarConfig.from_env(GOOD | {contract.ENV_CHECKPOINT_LAYOUT: "replicated"})
    assert cfg.layout is contract.StateLayout.REPLICATED
    assert cfg.replication is not None and cfg.replication.replicas == 0
    assert cfg.replication.port == contract.DEFAULT_REPLICA_PORT
    cfg = SidecarConfig.from_env(GOOD)
    assert cfg.layout is contract.StateLayout.SHARDED and cfg.replication is None
    with pytest.raises(ConfigError, match="KELASTIC_CHECKPOINT_LAYOUT must be one of "
                       "sharded, replicated, not 'Replicated'"):  # fmt: skip
        SidecarConfig.from_env(GOOD | {contract.ENV_CHECKPOINT_LAYOUT: "Replicated"})


def test_the_failure_domain_variable_is_a_label_value_or_refused() -> None:
    env = GOOD | {contract.ENV_FAILURE_DOMAIN: "eu-west-1a"}
    assert SidecarConfig.from_env(env).failure_domain == "eu-west-1a"
    assert SidecarConfig.from_env(GOOD).failure_domain == ""  # unknown: group-rank ring
    assert SidecarConfig.from_env(GOOD | {contract.ENV_FAILURE_DOMAIN: ""}).failure_domain == ""
    for bad in ("-a", "a b", "z" * 64, "a/b"):
        with pytest.raises(ConfigError, match=r"KELASTIC_FAILURE_DOMAIN=.* is not a label value"):
            SidecarConfig.from_env(GOOD | {contract.ENV_FAILURE_DOMAIN: bad})


def test_a_serve_only_replication_starts_no_thread(tmp_path: Path) -> None:
    replication = Replication(SERVE_ONLY, "uid", tmp_path, "127.0.0.1")
    replication.start()
    try:
        assert replication.server.address[1] > 0
        assert not any(t.is_alive() for t in replication._threads)
    finally:
        replication.close()
