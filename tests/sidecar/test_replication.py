"""The sidecars' checkpoint replicas (``spec.checkpoint.replicas``) with real slot files,
real replica servers on loopback and a real etcd: each node sends its ranks' newest
committed slot to the next node of the round, records the replicas it holds and where it
serves them, and a node that lost its slots gets its ranks' agreed step from whoever holds
it before its workers start (the ``peer`` tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kelastic import contract
from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.scan import verified_steps
from kelastic.etcd_values.checkpoints import CheckpointsDoc, RestoreTier
from kelastic_etcd import EtcdClient
from kelastic_sidecar.checkpoints import RoundCheckpoints, read_records
from kelastic_sidecar.config import ReplicationSettings, SidecarConfig
from kelastic_sidecar.rendezvous import RendezvousInfo
from kelastic_sidecar.replica import REPLICA_DIR_NAME
from kelastic_sidecar.replication import Replication, ring_order, ring_peer

from .test_sidecar_config import GOOD

SETTINGS = ReplicationSettings(replicas=1, every=1, rate=0, port=0, max_slot_bytes=64 << 20)
TOKEN = "0123456789abcdef0123456789abcdef"


def _save(directory: Path, rank: int, steps: range) -> None:
    directory.mkdir(exist_ok=True)
    with CheckpointStore(directory, rank=rank, job="uid") as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((300_000,), float(step)), "rank": rank},
                      blocking=True)  # fmt: skip


def _doc(endpoint: str = "127.0.0.1:1") -> CheckpointsDoc:
    return CheckpointsDoc("uid", {}, 1.0, (), {}, endpoint, TOKEN if endpoint else "")


def test_the_peer_is_the_next_node_of_the_round_that_serves() -> None:
    records: dict[str, CheckpointsDoc | None] = {
        "a": _doc("10.0.0.1:29610"), "b": _doc("[fd00::2]:29610"), "c": _doc()
    }  # fmt: skip
    nodes = ("a", "b", "c")
    peers = [ring_peer(RendezvousInfo(1, g, 3, nodes), records, "uid") for g in range(3)]
    assert [(p.node, p.address) if p else None for p in peers] == [
        ("b", ("fd00::2", 29610)), ("c", ("127.0.0.1", 1)), ("a", ("10.0.0.1", 29610))]  # fmt: skip
    assert ring_peer(RendezvousInfo(1, 0, 1, ("a",)), records, "uid") is None  # alone
    no_server = {**records, "b": _doc("")}
    assert ring_peer(RendezvousInfo(1, 0, 3, nodes), no_server, "uid") is None
    assert ring_peer(RendezvousInfo(1, 0, 3, nodes), {**records, "b": None}, "uid") is None
    assert ring_peer(RendezvousInfo(1, 0, 3, nodes), records, "another-run") is None


class Node:
    """One node's sidecar part: its slot folder, its replication and its round part."""

    def __init__(self, store: EtcdClient, name: str, root: Path,
                 settings: ReplicationSettings = SETTINGS) -> None:  # fmt: skip
        self.name, self.dir = name, root / name
        self.dir.mkdir()
        cfg = SidecarConfig.from_env(GOOD | {contract.ENV_POD_NAME: name,
                                             contract.ENV_JOB_UID: "uid"})  # fmt: skip
        self.replication = Replication(settings, "uid", self.dir, "127.0.0.1", poll=None)
        self.part = RoundCheckpoints(store, contract.Keys(cfg.prefix), cfg,
                                     replication=self.replication)  # fmt: skip
        self.part.start()

    def replicate(self) -> list[tuple[int, int]]:
        """A pass of each thread: snapshot the due steps, send them."""
        self.replication.snapshot_once()
        return self.replication.replicate_once()

    def at(self, monkeypatch: pytest.MonkeyPatch) -> RoundCheckpoints:
        monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(self.dir))
        return self.part


@pytest.fixture
def nodes(store: EtcdClient, tmp_path: Path):  # type: ignore[no-untyped-def]
    made: dict[str, Node] = {}

    def make(name: str, settings: ReplicationSettings = SETTINGS) -> Node:
        made[name] = Node(store, name, tmp_path, settings)
        return made[name]

    yield make
    for node in made.values():
        node.part.close()


def _round(monkeypatch: pytest.MonkeyPatch, round_: int, order: tuple[Node, ...],
           ) -> dict[str, dict[str, str]]:  # fmt: skip
    names = tuple(n.name for n in order)
    for n in order:
        n.at(monkeypatch).before_rendezvous(stopped=True)
    envs = {}
    for rank, n in enumerate(order):
        env = n.at(monkeypatch).worker_env(
            RendezvousInfo(round_, rank, len(order), names), 1, False
        )
        assert env is not None
        envs[n.name] = env
    return envs


@pytest.mark.parametrize("new_first", [False, True], ids=["same-ranks", "ranks-swapped"])
def test_a_node_that_lost_its_slots_restores_its_rank_from_the_peer(
    store: EtcdClient,
    nodes,
    monkeypatch: pytest.MonkeyPatch,
    new_first: bool,  # type: ignore[no-untyped-def]
) -> None:
    a, b = nodes("a"), nodes("b")
    _round(monkeypatch, 0, (a, b))  # a fresh start: each learns its peer's endpoint
    _save(a.dir, 0, range(1, 6))
    _save(b.dir, 1, range(1, 6))
    assert a.replicate() == [(0, 5)]  # a's rank 0 to b
    assert b.replicate() == [(1, 5)]  # b's rank 1 to a
    assert a.replicate() == []  # acknowledged: nothing again
    assert a.replication.lag() == 0 and a.replication.acked == {0: 5}
    # each holds its own snapshot and the other's replica
    assert verified_steps(a.dir / REPLICA_DIR_NAME, "uid") == {0: (5,), 1: (5,)}
    assert verified_steps(b.dir / REPLICA_DIR_NAME, "uid") == {0: (5,), 1: (5,)}
    _save(a.dir, 0, range(6, 8))  # a newer step: only it is sent
    assert a.replication.lag() == 2
    assert a.replicate() == [(0, 7)]
    assert verified_steps(b.dir / REPLICA_DIR_NAME, "uid") == {0: (7, 5), 1: (5,)}
    # b is lost with its slots and its replicas; c comes in its place with none
    b.part.close()
    c = nodes("c")
    order = (c, a) if new_first else (a, c)
    envs = _round(monkeypatch, 1, order)
    records = read_records(store, contract.Keys(a.part._cfg.prefix), ("a", "c"))
    assert records["a"] is not None and records["a"].replicas == {0: (7, 5), 1: (5,)}
    assert records["a"].endpoint == a.replication.endpoint
    assert {n: e[contract.ENV_CHECKPOINT_STEP] for n, e in envs.items()} == {"a": "5", "c": "5"}
    assert {e[contract.ENV_CHECKPOINT_TIER] for e in envs.values()} == {"memory"}
    for n in (a, c):
        status = n.part.status()
        assert status is not None and (status["step"], status["tier"]) == (5, "peer")
    # the new node's rank came over the network; a's, when the ranks swapped, was its
    # own replica copied in (ranks swapped: c runs rank 0, from a's own slots)
    c_rank = 0 if new_first else 1
    fetched = c.part.status()["fetched"]  # type: ignore[index]
    assert fetched["ranks"] == 1 and fetched["bytes"] > 1_000_000, fetched
    a_fetched = a.part.status()["fetched"]  # type: ignore[index]
    assert (a_fetched is not None) is new_first, a_fetched
    for node, rank in ((c, c_rank), (a, 1 - c_rank)):
        with CheckpointStore(node.dir, rank=rank, job="uid") as ckpt:
            got = ckpt.load(step=5)
        assert got is not None and got[1]["rank"] == rank
        assert bool(got[1]["w"].eq(5.0).all())
    # a's steps 6 and 7 belong to a history the job abandoned: dropped, in its snapshots
    # as well as its own slots; its rank's step 5 goes to its new peer, c
    assert max(verified_steps(a.dir, "uid")[1 - c_rank]) == 5
    assert max(verified_steps(a.dir / REPLICA_DIR_NAME, "uid")[0]) == 5
    assert a.replicate() == [(1 - c_rank, 5)]
    assert 5 in verified_steps(c.dir / REPLICA_DIR_NAME, "uid")[1 - c_rank]


def test_a_source_that_fails_is_passed_over(
    store: EtcdClient,
    nodes,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    _round(monkeypatch, 0, (a, b, c))  # the ring: a -> b -> c -> a
    for rank, node in enumerate((a, b, c)):
        _save(node.dir, rank, range(1, 4))
    for node in (a, b, c):
        assert len(node.replicate()) == 1
    # a is lost; d comes in as group rank 1: rank 1's step 3 is in b's slots (first) and
    # in c's replicas; b's server stops answering (its record still names it)
    a.part.close()
    d = nodes("d")
    b.replication.server.close()
    envs = _round(monkeypatch, 1, (b, d, c))
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"3"}
    fetched = d.part.status()["fetched"]  # type: ignore[index]
    assert fetched is not None and fetched["ranks"] == 1
    assert d.part.fetched[0].source == "c"  # b refused: c's replica
    assert verified_steps(d.dir, "uid") == {1: (3,)}
    assert b.part.fetched[0].source == "b"  # rank 0: b's own replica of a's, copied in
    assert verified_steps(b.dir, "uid")[0] == (3,)


def test_a_step_no_peer_could_give_is_not_agreed_on_again(
    store: EtcdClient,
    nodes,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """A source the network refuses every time (a NetworkPolicy closing the port, say)
    costs one round: the node that could not fetch lists the step ``unfetchable``, and
    the next round agrees on another step or tier instead of failing the same way until
    the restart budget is spent."""
    a, b = nodes("a"), nodes("b")
    _round(monkeypatch, 0, (a, b))
    _save(a.dir, 0, range(1, 6))
    _save(b.dir, 1, range(1, 6))
    assert a.replicate() == [(0, 5)] and b.replicate() == [(1, 5)]
    b.part.close()  # b is lost; c comes in its place
    c = nodes("c")
    a.replication.server.close()  # a's record still names its port: refused from now on
    envs = _round(monkeypatch, 1, (a, c))
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"5"}  # the peer's
    assert c.part.fetched == [] and c.part.unfetchable == [5]
    assert a.part.unfetchable == []  # a needed nothing from a peer
    envs = _round(monkeypatch, 2, (a, c))  # c's record now says so: 5 is not the peer's
    record = read_records(store, contract.Keys(c.part._cfg.prefix), ("c",))["c"]
    assert record is not None and record.unfetchable == (5,)
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"none"}
    status = c.part.status()
    assert status is not None and status["tier"] == RestoreTier.NONE.value
    # the job trains again from none: its new steps 1..5 are another history, so the
    # mark goes with the agreement that left them behind
    assert c.part.unfetchable == []


def test_a_replica_gone_bad_is_not_agreed_on(
    store: EtcdClient,
    nodes,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    a, b = nodes("a"), nodes("b")
    _round(monkeypatch, 0, (a, b))
    _save(a.dir, 0, range(1, 3))
    _save(b.dir, 1, range(1, 3))
    assert a.replicate() == [(0, 2)]
    assert b.replicate() == [(1, 2)]
    # a's replica of rank 1 goes bad at rest: a's scan drops it from a's record, and
    # with b gone nobody holds rank 1's step 2: the round restores none (never mixed)
    replica = next((a.dir / REPLICA_DIR_NAME).glob("rank-1.slot*"))
    raw = bytearray(replica.read_bytes())
    raw[-100] ^= 0xFF
    replica.write_bytes(bytes(raw))
    b.part.close()
    c = nodes("c")
    envs = _round(monkeypatch, 1, (a, c))
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"none"}
    status = c.part.status()
    assert status is not None and status["tier"] == RestoreTier.NONE.value and status["held"]


def test_after_a_node_loss_the_newest_due_step_both_nodes_kept_is_restored(
    store: EtcdClient,
    nodes,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """Every 5 steps. a trained on to 23 and snapshotted 15 and 20; b's last replica to
    reach a was 15 when b was lost at 17. a's slots hold 21..23 only: without its
    snapshots, a's ranks and b's replicas would share no step (what the first version,
    sending the newest step of each rank, found in most node losses). They share 15."""
    every5 = ReplicationSettings(replicas=1, every=5, rate=0, port=0, max_slot_bytes=64 << 20)
    a, b = nodes("a", every5), nodes("b", every5)
    _round(monkeypatch, 0, (a, b))
    for end in (11, 16):  # lockstep to 15: both snapshot and send 10, then 15
        _save(a.dir, 0, range(end - 5, end))
        _save(b.dir, 1, range(end - 5, end))
        assert a.replicate() == [(0, end - 1)]
        assert b.replicate() == [(1, end - 1)]
    _save(b.dir, 1, range(16, 18))
    for end in (21, 24):  # a runs ahead; its due step 20 passes through its slots
        _save(a.dir, 0, range(end - 5 if end == 21 else 21, end))
        a.replicate()
    assert a.replication.snapped == {0: 20}
    b.part.close()  # b is lost at 17, its 20 never made
    c = nodes("c", every5)
    envs = _round(monkeypatch, 1, (a, c))
    assert {e[contract.ENV_CHECKPOINT_STEP] for e in envs.values()} == {"15"}
    assert (a.part.status() or {})["tier"] == "peer"
    assert [f.source for f in a.part.fetched] == ["a"]  # its own snapshot of 15, copied in
    assert [f.source for f in c.part.fetched] == ["a"]  # b's replica of 15, fetched
    for node, rank in ((a, 0), (c, 1)):
        with CheckpointStore(node.dir, rank=rank, job="uid") as ckpt:
            got = ckpt.load(step=15)
        assert got is not None and bool(got[1]["w"].eq(15.0).all())


def test_a_due_step_overwritten_before_its_snapshot_is_skipped(
    store: EtcdClient,
    nodes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    every5 = ReplicationSettings(replicas=1, every=5, rate=0, port=0, max_slot_bytes=64 << 20)
    a = nodes("a", every5)
    _save(a.dir, 0, range(1, 9))  # 5 has left the slots (6, 7, 8): nothing to snapshot
    assert a.replication.snapshot_once() == []
    _save(a.dir, 0, range(9, 11))
    assert a.replication.snapshot_once() == [(0, 10)]
    assert a.replication.snapshot_once() == []  # taken once
    assert verified_steps(a.dir / REPLICA_DIR_NAME, "uid") == {0: (10,)}


def _zoned(domains: dict[str, str]) -> dict[str, CheckpointsDoc | None]:
    return {n: CheckpointsDoc("uid", {}, 1.0, (), {}, "", "", domain=d) for n, d in domains.items()}


def _same_zone_pairs(ring: list[str], zone: dict[str, str]) -> int:
    return sum(zone[a] == zone[b] for a, b in zip(ring, ring[1:] + ring[:1], strict=True))


@pytest.mark.parametrize("n", range(2, 8))
def test_the_ring_puts_neighbours_in_other_zones_wherever_the_round_allows(n: int) -> None:
    """Every multiset of zones over n nodes (group-rank order shuffled by the seeds):
    the ring has the fewest same-zone neighbours any ring of those nodes can have (found
    by trying every ring), every node once (each holds one peer's replicas), and the same
    ring for every sidecar."""
    import itertools
    import random

    for counts in {tuple(sorted(c, reverse=True)) for c in itertools.product(range(n + 1), repeat=3)
                   if sum(c) == n}:  # fmt: skip
        zones = [z for z, c in zip("abc", counts, strict=True) for _ in range(c)]
        random.Random(n * 100 + sum(counts[:1])).shuffle(zones)
        nodes = tuple(f"n{i}" for i in range(n))
        zone = dict(zip(nodes, zones, strict=True))
        ring = ring_order(nodes, _zoned(zone), "uid")
        assert sorted(ring) == sorted(nodes)
        best = min(_same_zone_pairs([nodes[0], *p], zone)
                   for p in itertools.permutations(nodes[1:]))  # fmt: skip
        assert _same_zone_pairs(ring, zone) == best == max(0, 2 * max(counts) - n), (zone, ring)
        peers = {ring_peer(RendezvousInfo(1, g, n, nodes), {
            k: CheckpointsDoc("uid", {}, 1.0, (), {}, "10.0.0.1:1", TOKEN, domain=v)
            for k, v in zone.items()}, "uid").node for g in range(n)}  # type: ignore[union-attr]  # fmt: skip
        assert peers == set(nodes)  # a ring: each node is one node's peer


def test_without_zones_the_ring_is_group_rank_order() -> None:
    nodes = ("c", "a", "b")
    assert ring_order(nodes, _zoned({"a": "", "b": "", "c": ""}), "uid") == ["c", "a", "b"]
    assert ring_order(nodes, {}, "uid") == ["c", "a", "b"]  # no records: unknown zones
    one_zone = _zoned({"a": "z", "b": "z", "c": "z"})
    assert ring_order(nodes, one_zone, "uid") == ["c", "a", "b"]
    # another run's record says nothing of this node's zone: c's is unknown, not y, so
    # the three zones ("", y, z) each get one node and every pair crosses zones
    other = {**_zoned({"a": "y", "b": "z"}), "c": CheckpointsDoc("old", domain="y")}
    assert ring_order(nodes, other, "uid") == ["c", "b", "a"]
    # c and a in y, b in z: y's two on the even places, z's between them (one pair, a to
    # c, shares a zone: the fewest three nodes in two zones allow)
    same = {**other, "c": CheckpointsDoc("uid", domain="y")}
    assert ring_order(nodes, same, "uid") == ["c", "b", "a"]
