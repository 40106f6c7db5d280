"""The termination barrier across the nodes of a round (NVIDIA's, kept in etcd instead of
rank 0's store): a node whose local ranks all left the aborted iteration writes its
ready key ``inprocess/ready/<m>/<node>`` (naming the port its group rank 0 would serve
the next store on); the round's group rank 0 watches those keys and, once every node of
the round wrote one, writes the iteration's ``go`` key ``inprocess/go/<m>`` (its own ready
value: the ``MASTER_ADDR``/``PORT``); every node watches that one key and sends its ranks
the ``go`` when it appears.

One writer of the ``go``, so that a restart of N nodes costs etcd O(N) watch events: N
ready keys to one watcher, one ``go`` to N. When every node watched every ready key (as
before), each restart sent N^2 events (65,536 at 256 nodes, 16M at 4,096), and 256
nodes did not pass the barrier within 90 s here. If group rank 0's node dies before its
``go``, its lease ends the round, as a lost node does (the node-change rung or the
process path); the barrier timeout bounds the rest.

A part of the :class:`~.machine.RestartMachine` (loop thread only); the verdicts are
the pure :func:`~.round.barrier_verdict` and :func:`~.round.go_verdict`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kelastic.sockaddr import free_port
from kelastic_etcd import EtcdError, EtcdLeaseNotFound

from .record import IterationRecordError, ReadyRecord, encode_ready
from .round import Phase, RoundContext, barrier_verdict, go_verdict

if TYPE_CHECKING:  # annotations only
    from .carry import CarryRung
    from .parts import Node

__all__ = ["TerminationBarrier"]

log = logging.getLogger("kelastic_sidecar.inprocess")


class TerminationBarrier:
    """One node's side of the termination barrier (see the module doc).

    Args:
        carry: the carry rung: while it holds the ranks between rounds, no ready key is
            written and no ``go`` sent (the ended round's ranks and world are gone); a
            carried iteration's key names the round's master port.

    Attributes:
        published: our ready keys, oldest first (the older ones are deleted with the
            next write).
        said: the ``go`` keys we wrote as group rank 0, oldest first (likewise).
    """

    def __init__(self, carry: CarryRung) -> None:
        self._carry = carry
        self.published: list[str] = []
        self.said: list[str] = []
        self._said_for: tuple[int, int] | None = None  # (iteration, round) of our last go

    def publish(self, m: Node) -> None:
        """Every local rank passed the termination barrier: write our ready key, then
        check the barrier with what is read in the same request (group rank 0: every
        ready key of the iteration; the others: the ``go`` key alone)."""
        ctx = m.ctx
        assert ctx is not None
        if self._carry.holding:
            return
        key = m.keys.inprocess_ready(m.iteration, m.node)
        reads = [m.keys.inprocess_go(m.iteration)]
        if ctx.group_rank == 0:
            reads.append(m.keys.inprocess_ready_prefix(m.iteration))
        try:
            port = self._carry.master_port(m, ctx)
            port = free_port(ctx.pod_ip) if port is None else port
            value = encode_ready(ReadyRecord(ctx.group_rank, ctx.pod_ip, port, ctx.round))
            try:
                snap = m.store.put_read({key: value}, reads, ctx.lease_id())
            except EtcdLeaseNotFound:
                snap = m.store.put_read({key: value}, reads)
            for old in set(self.published) - {key}:
                m.store.delete(old)
        except (EtcdError, OSError, IterationRecordError) as exc:
            m.give_up_all(f"cannot write the termination barrier key: {exc}")
            return
        self.published = [key]
        m.phase = Phase.BARRIER
        log.info("iteration %d: ready; waiting for %d nodes", m.iteration, ctx.group_world_size)
        self.check(m, snap.values)

    def check(self, m: Node, values: Mapping[str, tuple[bytes, int]]) -> None:
        """The keys of our iteration changed (``values``: the ``go`` key and, for group
        rank 0, the ready keys): group rank 0 writes the ``go`` once every node of the
        round is ready; every node in the barrier goes once the ``go`` is there."""
        ctx = m.ctx
        if ctx is None or self._carry.holding:
            return
        if ctx.group_rank == 0:
            self._lead(m, ctx, values)
            return
        if m.phase != Phase.BARRIER:
            return
        master, error = go_verdict(values, m.keys.inprocess_go(m.iteration), ctx)
        if error is not None:  # no go then: the barrier timeout gives up
            m.metrics.corrupt_values.labels(source="inprocess_go").inc()
            log.error("%s", error)
        if master is not None:
            m.go(ctx, master)

    def _lead(self, m: Node, ctx: RoundContext, values: Mapping[str, tuple[bytes, int]]) -> None:
        """Group rank 0: write the ``go`` when every node is ready, and go. Also while
        our ranks run (fresh workers of a round whose held nodes wait: the carry rung's
        announce)."""
        if m.phase not in (Phase.BARRIER, Phase.RUNNING):
            return
        verdict = barrier_verdict(values, m.keys.inprocess_ready_prefix(m.iteration), ctx)
        for error in verdict.corrupt:
            m.metrics.corrupt_values.labels(source="inprocess_ready").inc()
            log.error("%s", error)
        master = verdict.master
        if master is None:
            return
        if self._said_for != (m.iteration, ctx.round):
            key = m.keys.inprocess_go(m.iteration)
            try:
                try:
                    m.store.put(key, encode_ready(master), ctx.lease_id())
                except EtcdLeaseNotFound:
                    m.store.put(key, encode_ready(master))
                for old in set(self.said) - {key}:
                    m.store.delete(old)
            except (EtcdError, IterationRecordError) as exc:
                why = f"cannot write the termination barrier's go: {exc}"
                if m.phase == Phase.BARRIER:
                    m.give_up_all(why)
                else:  # our ranks run on; the nodes waiting give up at their timeout
                    log.error("iteration %d: %s", m.iteration, why)
                return
            self.said, self._said_for = [key], (m.iteration, ctx.round)
        if m.phase == Phase.BARRIER:
            m.go(ctx, master)
