"""A round as the in-process coordinator sees it, and the termination barrier's verdict
(pure: no etcd, no sockets, no threads).

:class:`RoundContext` is what the supervisor hands the coordinator per rendezvous round;
:func:`barrier_verdict` reads the ready keys of an iteration (NVIDIA's termination
barrier, ``nvidia_resiliency_ext.inprocess``, kept in etcd instead of rank 0's
store), :func:`go_verdict` the ``go`` key group rank 0 writes once it saw them all, and
:func:`go_env` builds the env a rank re-enters the function with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from kelastic import contract
from kelastic.inprocess_messages import CAUSE_SOFT_TIMEOUT

from ..failure import CAUSE_HANG, CAUSE_NODE_LOST, CAUSE_SCALE, CAUSE_WORKER_FAILURE
from .phase import Phase
from .record import (
    IterationRecord,
    IterationRecordError,
    ReadyRecord,
    decode_ready,
)

__all__ = [
    "BarrierVerdict",
    "Phase",
    "RoundContext",
    "barrier_verdict",
    "cause_label",
    "go_env",
    "go_verdict",
    "restart_log_line",
]

#: Most corrupt ready keys described in a :class:`BarrierVerdict`.
_MAX_ERRORS: Final = 16


@dataclass(frozen=True)
class RoundContext:
    """What the coordinator needs of a rendezvous round (from the supervisor).

    Attributes:
        round: the round number.
        group_rank: this node's rank in the round.
        group_world_size: nodes in the round.
        nproc: local ranks of this node.
        envs: local rank -> the env the ``assign`` gave that worker.
        pod_ip: this node's address (``MASTER_ADDR`` when it is group rank 0).
        participants: node names by group rank (empty: unknown; then any node's ready
            key counts by the group rank it states).
        lease_id: returns this node's rendezvous lease id (None: none held); the ready
            keys are bound to it.
        master: the round's ``MASTER_ADDR``/``MASTER_PORT`` (published by its group rank
            0, in every ``assign``); a restart carried into this round goes on to it
            (:mod:`~kelastic_sidecar.inprocess.carry`). None: unknown.
    """

    round: int
    group_rank: int
    group_world_size: int
    nproc: int
    envs: Mapping[int, Mapping[str, str]]
    pod_ip: str
    participants: tuple[str, ...] = ()
    lease_id: Callable[[], int | None] = field(default=lambda: None, compare=False)
    master: tuple[str, int] | None = None


@dataclass(frozen=True)
class BarrierVerdict:
    """What the ready keys of an iteration say.

    Attributes:
        master: group rank 0's ready value once every node of the round is ready (its
            ``addr``/``port`` are the iteration's ``MASTER_ADDR``/``PORT``); else None.
        ready: group ranks ready so far.
        corrupt: one message per corrupt value (at most 16).
    """

    master: ReadyRecord | None
    ready: frozenset[int]
    corrupt: tuple[str, ...] = ()


def barrier_verdict(
    values: Mapping[str, tuple[bytes, int]], prefix: str, ctx: RoundContext
) -> BarrierVerdict:
    """Whether every node of ``ctx``'s round passed the termination barrier.

    Args:
        values: key -> ``(value, mod_revision)`` read under ``prefix`` (other keys are
            ignored).
        prefix: :meth:`kelastic.contract.Keys.inprocess_ready_prefix` of the iteration.
        ctx: the round.

    A key counts when its value decodes (:func:`~.record.decode_ready`), its
    ``round`` is the round's (or unstated), its group rank is in the round, and, when the
    participants are known, the key's node is the one of that group rank: a key left by
    an earlier round, or by a node not in this one, never counts.
    """
    by_rank: dict[int, ReadyRecord] = {}
    corrupt: list[str] = []
    for key, (raw, _) in values.items():
        if not key.startswith(prefix):
            continue
        try:
            ready = decode_ready(raw, key)
        except IterationRecordError as exc:
            corrupt.append(str(exc))
            continue
        if ready.round not in (-1, ctx.round) or ready.group_rank >= ctx.group_world_size:
            continue
        if ctx.participants and ctx.participants[ready.group_rank] != key[len(prefix) :]:
            continue
        by_rank[ready.group_rank] = ready
    complete = len(by_rank) >= ctx.group_world_size
    master = by_rank.get(0) if complete else None
    return BarrierVerdict(master, frozenset(by_rank), tuple(corrupt[:_MAX_ERRORS]))


def go_verdict(
    values: Mapping[str, tuple[bytes, int]], key: str, ctx: RoundContext
) -> tuple[ReadyRecord | None, str | None]:
    """Whether group rank 0 of ``ctx``'s round said ``go`` for the iteration of ``key``
    (:meth:`kelastic.contract.Keys.inprocess_go`).

    Args:
        values: key -> ``(value, mod_revision)``; only ``key`` is read.
        key: the iteration's ``go`` key.
        ctx: the round.

    Returns:
        ``(master, error)``: the value (group rank 0's ready value: the iteration's
        ``MASTER_ADDR``/``PORT``) when it decodes and names this round and group rank 0,
        else None; ``error``: why a value present was corrupt (None when it was not).
        A ``go`` of another round (a node carried into the next round meets the ended
        round's) is None without an error.
    """
    got = values.get(key)
    if got is None:
        return None, None
    try:
        master = decode_ready(got[0], key)
    except IterationRecordError as exc:
        return None, str(exc)
    if master.round != ctx.round or master.group_rank != 0:
        return None, None
    return master, None


def go_env(
    ctx: RoundContext, local_rank: int, master: ReadyRecord, iteration: int
) -> dict[str, str]:
    """The env a local rank enters ``iteration`` with: the round's (ranks unchanged),
    ``MASTER_ADDR``/``MASTER_PORT`` from group rank 0's ready key (a fresh port per
    iteration: a restarted iteration never meets a stale c10d store), and
    ``KELASTIC_INPROCESS_ITERATION``. With checkpoints, no agreed step
    (:func:`kelastic.contract.without_restore`): a process that starts with this env (a
    dead rank started again, the hybrid rung) joins peers that hold the state in process,
    and its node's slots may have moved past the step agreed at the round's start (its
    load would fail: ``kelastic.checkpoint.CheckpointRestoreError``)."""
    env = dict(ctx.envs.get(local_rank, {}))
    env[contract.MASTER_ADDR] = master.addr
    env[contract.MASTER_PORT] = str(master.port)
    env[contract.ENV_INPROCESS_ITERATION] = str(iteration)
    return contract.without_restore(env)


def restart_log_line(record: IterationRecord, max_restarts: int) -> str:
    """The sidecar's log line for an abort into ``record.iteration``: a fault says the
    restart it spends (``in-process restart 2/10 (iteration 3): rank 1 exception: ...
    (node n-0)``); a round change that is no fault (``membership``) spends none and says
    so (``in-process round change (iteration 4): ...``), as ``kelastic run`` does."""
    if record.cause == contract.INPROCESS_CAUSE_MEMBERSHIP:
        return f"in-process round change (iteration {record.iteration}): {record.message}"
    return (
        f"in-process restart {record.restarts}/{max_restarts} (iteration {record.iteration}):"
        f" rank {record.rank} {record.cause}: {record.message} (node {record.node})"
    )


def cause_label(cause: str) -> str:
    """The ``cause`` of ``kelastic_restarts_total{level="inprocess"}`` for a fault's cause:
    the process restarts' vocabulary (``soft_timeout`` and ``hang`` are a ``hang``, every
    other cause a ``worker_failure``), so that ``sum by (cause)`` stays one set of values;
    the fault's own cause is in the record and ``/status``. A dead worker's record says
    ``worker_died`` (a ``worker_failure``) or ``hang`` (reaped, or killed at the hard
    timeout: :func:`~kelastic_sidecar.inprocess.hybrid_verdicts.death_cause`). A round change
    carried in process (:mod:`~kelastic_sidecar.inprocess.carry`) is a ``node_lost`` or,
    when no fault (``membership``), a ``scale``."""
    if cause in (CAUSE_NODE_LOST, contract.INPROCESS_CAUSE_MEMBERSHIP):
        return CAUSE_NODE_LOST if cause == CAUSE_NODE_LOST else CAUSE_SCALE
    return CAUSE_HANG if cause in (CAUSE_SOFT_TIMEOUT, CAUSE_HANG) else CAUSE_WORKER_FAILURE
