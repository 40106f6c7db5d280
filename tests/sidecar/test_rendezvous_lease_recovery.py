"""A round survives its nodes' leases expiring while etcd was away:
nodes on a real etcd, leases let expire as an etcd stall longer than the TTL does."""

from __future__ import annotations

import time

from kelastic_sidecar.rendezvous.handler import RECOVERY_GRACE, EtcdRendezvousHandler
from tests.conftest import wait_for
from tests.sidecar.test_rendezvous import Cluster, cluster, join_all, settings

__all__ = ["cluster"]  # the fixture, used by name


def _expire(*nodes: EtcdRendezvousHandler) -> None:
    """Let the nodes' leases expire at etcd, as when etcd stalls past the TTL."""
    for node in nodes:
        assert node.state.lease is not None
        node.state.lease.stop_keep_alive()


def _alive(c: Cluster) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in c.admin.get_prefix(c.keys.alive_prefix)}


def test_a_round_whose_leases_all_expired_goes_on(cluster: Cluster) -> None:
    s = settings(min_nodes=2, max_nodes=2, lease_ttl=1)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, info_b = join_all([a, b])
    _expire(a, b)
    wait_for(lambda: _alive(cluster) == set(), 20, what="both alive keys gone")
    check = a.check_round(info_a)  # a takes a new lease; b gets a grace to do the same
    assert check.healthy, check
    assert _alive(cluster) == {"a"} and not a.lease_lost
    assert b.check_round(info_b).healthy
    assert _alive(cluster) == {"a", "b"}
    state = cluster.state()
    assert state.round == info_a.round and set(state.participants) == {"a", "b"}
    assert not a.take_recheck()  # within the grace
    wait_for(a.take_recheck, s.lease_ttl + RECOVERY_GRACE + 5, what="the grace to end")
    assert a.check_round(info_a).healthy and b.check_round(info_b).healthy
    assert not a.take_recheck()  # once


def test_a_node_that_did_not_come_back_is_lost_after_the_grace(cluster: Cluster) -> None:
    s = settings(min_nodes=1, max_nodes=2, lease_ttl=1, last_call_timeout=0.2)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, _ = join_all([a, b])
    _expire(a, b)
    wait_for(lambda: _alive(cluster) == set(), 20, what="both alive keys gone")
    recovered = time.monotonic()
    assert a.check_round(info_a).healthy  # b might still come back
    wait_for(a.take_recheck, s.lease_ttl + RECOVERY_GRACE + 5, what="the grace to end")
    assert time.monotonic() - recovered >= s.lease_ttl + RECOVERY_GRACE - 0.5
    check = a.check_round(info_a)
    assert (check.reason, check.nodes) == ("participant_lost", ("b",))


def test_an_alive_key_deleted_under_a_live_lease_is_a_removal(cluster: Cluster) -> None:
    # The operator (or kelastic run) takes a node out by deleting its alive key: the node
    # must not write it back.
    s = settings(min_nodes=1, max_nodes=2, lease_ttl=2, last_call_timeout=0.2)
    a, b = cluster.node("a", s), cluster.node("b", s)
    info_a, info_b = join_all([a, b])
    cluster.admin.delete(cluster.keys.alive("b"))
    assert not b.check_round(info_b).healthy  # out of the round, as before
    assert _alive(cluster) == {"a"}  # and its alive key not written back
    assert a.check_round(info_a).reason in ("participant_lost", "round_advanced")
