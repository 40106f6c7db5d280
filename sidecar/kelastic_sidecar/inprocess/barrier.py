"""The termination barrier across the nodes of a round (NVIDIA's, kept in etcd instead of
rank 0's store): a node whose local ranks all left the aborted iteration writes its
ready key ``inprocess/ready/<m>/<node>`` (naming the port its group rank 0 would serve
the next store on), and when every node of the round wrote one, each sends its ranks the
``go``. A part of the :class:`~.machine.RestartMachine` (loop thread only); the verdict is
the pure :func:`~.round.barrier_verdict`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kelastic.sockaddr import free_port
from kelastic_etcd import EtcdError, EtcdLeaseNotFound

from .record import IterationRecordError, ReadyRecord, encode_ready
from .round import Phase, barrier_verdict

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
    """

    def __init__(self, carry: CarryRung) -> None:
        self._carry = carry
        self.published: list[str] = []

    def publish(self, m: Node) -> None:
        """Every local rank passed the termination barrier: write our ready key, then
        check the barrier with the keys read in the same request."""
        ctx = m.ctx
        assert ctx is not None
        if self._carry.holding:
            return
        key = m.keys.inprocess_ready(m.iteration, m.node)
        prefix = m.keys.inprocess_ready_prefix(m.iteration)
        try:
            port = self._carry.master_port(m, ctx)
            port = free_port(ctx.pod_ip) if port is None else port
            value = encode_ready(ReadyRecord(ctx.group_rank, ctx.pod_ip, port, ctx.round))
            try:
                snap = m.store.put_read({key: value}, [prefix], ctx.lease_id())
            except EtcdLeaseNotFound:
                snap = m.store.put_read({key: value}, [prefix])
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
        """``go`` when every node of the round wrote its ready key of the iteration."""
        ctx = m.ctx
        assert ctx is not None
        if self._carry.holding:
            return
        verdict = barrier_verdict(values, m.keys.inprocess_ready_prefix(m.iteration), ctx)
        for error in verdict.corrupt:
            m.metrics.corrupt_values.labels(source="inprocess_ready").inc()
            log.error("%s", error)
        if verdict.master is not None:
            m.go(ctx, verdict.master)
