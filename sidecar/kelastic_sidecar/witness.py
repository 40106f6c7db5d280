"""What is read of a node's workers as a round ends, before they are stopped (the stop
ends a stopped worker, and what it was doing with it): plain functions over the attempt's
pids and reaps, reading ``/proc`` and the workers' stacks through an :class:`EvidenceSource`
(the timer server's collector).

- :func:`observe`: each worker's process state, and the stacks of the stopped ones that
  were not reaped: a worker stopped between two timers holds none, and only its state
  names it (:func:`~kelastic_sidecar.round_end.stopped_failure` decides with it).
- :func:`where_ranks_were`: where each worker was as a round hung (issue 23's evidence
  from every rank, not only the reaped one): a reaped worker's stacks as its reap read
  them, the others' read now, each with its process state.
- :func:`publish`: that evidence into etcd for the operator, on a thread of its own (a
  stalled etcd must not delay the recovery); :class:`HangSink`: where the attempt monitor
  sends what it found (the evidence, and a stopped worker that should be the round's
  charge: :meth:`~kelastic_sidecar.restart_budget.RestartBudget.amend`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kelastic.etcd_values import CorruptValueError, encode_hang
from kelastic.hang_where import HangWhere, RankWhere
from kelastic_etcd import EtcdClient, EtcdError

from .round_end import DEAD_STATES, STOPPED_STATE, LiveStates, RoundOf
from .timer import ReapEvent, process_state

if TYPE_CHECKING:  # annotations only
    from .failure import Failure
    from .hang_evidence import Evidence

__all__ = ["NO_HANG_SINK", "EvidenceSource", "HangSink", "observe", "publish", "where_ranks_were"]
log = logging.getLogger("kelastic_sidecar.witness")

#: Where a worker was when its stacks were not read (none read, none at its reap).
NOT_READ = "stacks not read"


class HangSink(Protocol):
    """Where the attempt monitor's findings on a hung round go besides the log and
    ``/status`` (:class:`kelastic_sidecar.wiring.HangReports`); neither call may block on
    etcd."""

    def where(self, where: HangWhere) -> object:
        """Where each worker was (for the operator: :func:`publish`)."""
        ...

    def stopped(self, failure: Failure) -> object:
        """A worker of ours was stopped in a round a peer restarted: the round's charge
        should name it."""
        ...


class _Nowhere:
    """A :class:`HangSink` that sends nothing anywhere."""

    def where(self, where: HangWhere) -> None:
        """Drop it."""

    def stopped(self, failure: Failure) -> None:
        """Drop it."""


#: The sink of an attempt monitor given none (tests, tools).
NO_HANG_SINK: HangSink = _Nowhere()


class EvidenceSource(Protocol):
    """Reads workers' stacks (:meth:`kelastic_sidecar.timer.TimerServer.evidence`)."""

    def evidence(self, pids: Sequence[int]) -> dict[int, Evidence]:
        """pid -> its stacks, read in parallel within the collector's budget."""
        ...


def observe(
    source: EvidenceSource, pids: Mapping[int, int], reaped: Mapping[int, ReapEvent]
) -> LiveStates:
    """The live process states of ``pids`` (local rank -> pid; ``""`` once gone), and the
    stacks of those stopped (``T``) and not in ``reaped`` (pid -> reap)."""
    states = {pid: process_state(pid) for pid in pids.values()}
    stopped = [p for p, s in states.items() if s == STOPPED_STATE and p not in reaped]
    found = source.evidence(stopped) if stopped else {}
    return LiveStates(states, {pid: ev.line() for pid, ev in found.items()})


def where_ranks_were(
    source: EvidenceSource, round_: RoundOf, pids: Mapping[int, int],
    reaped: Mapping[int, ReapEvent], seen: LiveStates | None = None,
) -> HangWhere:  # fmt: skip
    """Where each worker of ``pids`` (local rank -> pid) was as ``round_`` hung: a reaped
    one's stacks and state as its reap (in ``reaped``) read them, a stopped one's as
    :func:`observe` read them before (``seen``: the attempt's readings, not read twice),
    the others' read now (``T``: stopped, the likely culprit; ``S``: sleeping, e.g. in a
    collective).

    A worker found dead (:data:`~.round_end.DEAD_STATES`) by its reap or now, but read
    alive before (in ``seen``), is shown as it was then: a stopped worker killed before
    the evidence is gathered (its own timer's reap not yet taken, or its group stopped)
    is a zombie now (``Z``, its stacks unreadable), yet it is the one that held its
    peers up."""
    seen = seen or LiveStates()
    live = [pid for pid in pids.values() if pid not in reaped]
    states = {pid: process_state(pid) for pid in live}
    todo = [pid for pid in live if pid not in seen.evidence and states[pid] not in DEAD_STATES]
    evidence = source.evidence(todo) if todo else {}
    found = {pid: ev.line() for pid, ev in evidence.items()}
    ranks: list[RankWhere] = []
    for local_rank, pid in sorted(pids.items()):
        reap = reaped.get(pid)
        read = reap.evidence if reap is not None else evidence.get(pid)
        if reap is not None:
            state = reap.state
            where = reap.evidence.line() if reap.evidence is not None else None
        else:
            state, where = states.get(pid, ""), found.get(pid)
        before = seen.states.get(pid, "")
        if state in DEAD_STATES and before not in DEAD_STATES:  # dead now, alive then
            state, where = before, seen.evidence.get(pid) or where
        elif reap is None:
            where = seen.evidence.get(pid) or where
        rank = round_.rank(local_rank)
        collectives = read.collectives if read is not None else ()  # its flight record's
        ranks.append(
            RankWhere(
                rank, local_rank, pid, state, reap is not None, where or NOT_READ, collectives
            )
        )
    return HangWhere(round_.round, round_.node, tuple(ranks))


def publish(store: EtcdClient, key: str, where: HangWhere) -> threading.Thread:
    """Write ``where`` at ``key`` (:meth:`kelastic.contract.Keys.hang`, by its one codec,
    :mod:`kelastic.etcd_values.hangs`) for the operator, on a daemon thread so that the
    caller (the round's end, before the workers are stopped) never waits on etcd. A put
    that fails is logged: the evidence stays in the log and ``/status``.

    Returns:
        The started thread (tests join it).
    """

    def put() -> None:
        try:
            store.put(key, encode_hang(where))
        except (EtcdError, CorruptValueError) as exc:
            log.warning("cannot publish the hang evidence of round %d: %s", where.round, exc)

    thread = threading.Thread(target=put, name="kelastic-publish-hang", daemon=True)
    thread.start()
    return thread
