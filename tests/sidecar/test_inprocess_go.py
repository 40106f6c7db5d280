"""The termination barrier's one writer of the ``go``: group rank 0's node alone watches
the ready keys and writes ``inprocess/go/<m>``; every node goes at that key. Real etcd,
real coordinators, ranks played by clients of the real socket."""

from __future__ import annotations

from typing import Any

from kelastic import contract
from kelastic.inprocess_messages import Abort, GiveUp, Go
from kelastic_etcd import EtcdClient, EtcdUnavailable
from kelastic_sidecar.inprocess.record import ReadyRecord, decode_ready, encode_ready
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import make_node, sample
from tests.sidecar.test_inprocess_coordinator import AB, _restart


def _watches_ready_keys(node: Any) -> bool:
    return any("/inprocess/ready/" in k for k in node.coordinator._watching)


def test_group_rank_0_alone_watches_the_ready_keys_and_writes_the_go(
    store: EtcdClient, job_prefix: str
) -> None:
    keys = contract.Keys(job_prefix)
    with (
        make_node("node-a", store, job_prefix, "127.0.0.1") as a,
        make_node("node-b", store, job_prefix, "127.0.0.2") as b,
    ):
        a.begin(1, 0, AB)
        b.begin(1, 1, AB)
        wait_for(lambda: _watches_ready_keys(a), 10, what="group rank 0 watching the ready keys")
        assert not _watches_ready_keys(b)
        b.ranks[0].fault(0)
        gos = _restart((a, b), 1)
        got = store.get(keys.inprocess_go(1))
        assert got is not None
        master = decode_ready(got[0])
        assert (master.group_rank, master.addr, master.round) == (0, "127.0.0.1", 1)
        assert {g.env[contract.MASTER_PORT] for g in gos} == {str(master.port)}
        # the next round swaps the nodes' ranks: b is group rank 0, the watches follow
        for r in (*a.ranks, *b.ranks):
            r.close()
        a.begin(2, 1, ("node-b", "node-a"))
        b.begin(2, 0, ("node-b", "node-a"))
        wait_for(lambda: _watches_ready_keys(b) and not _watches_ready_keys(a), 10,
                 what="the watches to follow the new group rank 0")  # fmt: skip
        a.ranks[1].fault(1)
        gos = _restart((a, b), 2)
        got = store.get(keys.inprocess_go(2))
        assert got is not None
        second = decode_ready(got[0])
        assert (second.group_rank, second.addr, second.round) == (0, "127.0.0.2", 2)
        assert {(g.env[contract.MASTER_ADDR], g.env[contract.MASTER_PORT]) for g in gos} == {
            ("127.0.0.2", str(second.port))}  # fmt: skip
        assert {g.env[contract.RANK] for g in gos} == {"0", "1", "2", "3"}


def test_a_follower_goes_only_at_a_go_of_its_round_from_group_rank_0(
    store: EtcdClient, job_prefix: str
) -> None:
    """Node b (group rank 1) with no coordinator for group rank 0: the test plays it,
    writing a's ready key and crafted ``go`` values. A corrupt one is counted and not
    gone on, one of another round or group rank is ignored, a good one is gone on."""
    keys = contract.Keys(job_prefix)
    with make_node("node-b", store, job_prefix, "127.0.0.2") as b:
        b.begin(3, 1, AB)
        store.put(
            keys.inprocess_ready(1, "node-a"), encode_ready(ReadyRecord(0, "10.9.9.9", 4321, 3))
        )
        b.ranks[0].fault(0)
        for r in b.ranks:
            assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
            r.ready(1)
        wait_for(lambda: store.get(keys.inprocess_ready(1, "node-b")) is not None, 10,
                 what="b's ready key")  # fmt: skip
        go = keys.inprocess_go(1)
        source = {"source": "inprocess_go"}
        store.put(go, b'{"group_rank": 0, "addr": "10.9.9.9", "port": 1e999, "round": 3}')
        wait_for(lambda: sample(b.metrics, "kelastic_corrupt_values_total", **source) == 1, 10,
                 what="the corrupt go counted")  # fmt: skip
        store.put(go, encode_ready(ReadyRecord(0, "10.9.9.9", 4321, 2)))  # the ended round's
        store.put(go, encode_ready(ReadyRecord(1, "10.9.9.9", 4321, 3)))  # not group rank 0
        b.flush()
        wait_for(lambda: b.coordinator._view.get(go, (b"", 0))[0].startswith(b'{"group_rank":1'),
                 10, what="the last crafted go seen")  # fmt: skip
        b.flush()
        assert all(not r.got[1:] for r in b.ranks), [r.got for r in b.ranks]  # no go yet
        assert (b.coordinator.status() or {})["phase"] == "barrier"
        store.put(go, encode_ready(ReadyRecord(0, "10.9.9.9", 4321, 3)))
        for r in b.ranks:
            msg = r.expect(Go)
            assert isinstance(msg, Go) and msg.iteration == 1
            assert (msg.env[contract.MASTER_ADDR], msg.env[contract.MASTER_PORT]) == (
                "10.9.9.9", "4321")  # fmt: skip
        assert sample(b.metrics, "kelastic_corrupt_values_total", **source) == 1


class _GoRefused:
    """The real client, but a ``put`` of a ``go`` key fails as if etcd were away."""

    def __init__(self, store: EtcdClient) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        if "/inprocess/go/" in key:
            raise EtcdUnavailable("127.0.0.1:1", "injected: the go not written")
        self._store.put(key, value, lease)


def test_group_rank_0_unable_to_write_the_go_gives_up_in_process(
    store: EtcdClient, job_prefix: str
) -> None:
    """The go cannot be written: group rank 0's ranks are told to give up at once (the
    process path), as when a ready key cannot be written; the other nodes' barrier ends
    at its timeout or with the round."""
    with make_node("solo", _GoRefused(store), job_prefix) as n:  # type: ignore[arg-type]
        n.begin(1, 0, ("solo",))
        n.ranks[0].fault(0)
        for r in n.ranks:
            assert r.expect(Abort).iteration == 1  # type: ignore[attr-defined]
            r.ready(1)
        for r in n.ranks:
            give_up = r.expect(GiveUp)
            assert "cannot write the termination barrier's go" in give_up.reason  # type: ignore[attr-defined]
            assert "injected" in give_up.reason  # type: ignore[attr-defined]
        assert store.get(contract.Keys(job_prefix).inprocess_go(1)) is None
