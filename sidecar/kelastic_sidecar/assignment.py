"""The ``assign`` message of an attempt: each local worker's environment (pure).

Global ranks come from the group rank and the workers per node; MASTER_ADDR/PORT are
the round's (published by group rank 0); the rest is torch elastic's worker
environment (:mod:`kelastic.contract`) plus kelastic's round and timer token.
"""

from __future__ import annotations

from collections.abc import Mapping

from kelastic import contract
from kelastic.control_messages import Assign, WorkerAssignment

__all__ = ["build_assign"]


def build_assign(
    *,
    attempt: int,
    round_: int,
    group_rank: int,
    group_world_size: int,
    nproc: int,
    master: tuple[str, int],
    run_id: str,
    restart_count: int,
    max_restarts: int,
    tokens: Mapping[int, str],
    extra_env: Mapping[str, str] | None = None,
) -> Assign:
    """The ``assign`` for ``nproc`` local workers of this node.

    Args:
        attempt: the attempt number.
        round_: the rendezvous round.
        group_rank: this node's rank in the round.
        group_world_size: nodes in the round.
        nproc: workers per node.
        master: ``(MASTER_ADDR, MASTER_PORT)``.
        run_id: ``TORCHELASTIC_RUN_ID`` (the job's uid).
        restart_count: restarts spent so far (``TORCHELASTIC_RESTART_COUNT``).
        max_restarts: the budget (``TORCHELASTIC_MAX_RESTARTS``).
        tokens: local rank -> the worker's timer token.
        extra_env: more variables for every worker (e.g. the agreed checkpoint step,
            ``KELASTIC_CHECKPOINT_STEP``).
    """
    world = group_world_size * nproc
    workers = []
    for local_rank in range(nproc):
        rank = group_rank * nproc + local_rank
        env = {
            contract.RANK: rank,
            contract.LOCAL_RANK: local_rank,
            contract.WORLD_SIZE: world,
            contract.LOCAL_WORLD_SIZE: nproc,
            contract.GROUP_RANK: group_rank,
            contract.GROUP_WORLD_SIZE: group_world_size,
            contract.ROLE_RANK: rank,
            contract.ROLE_WORLD_SIZE: world,
            contract.ROLE_NAME: contract.DEFAULT_ROLE,
            contract.MASTER_ADDR: master[0],
            contract.MASTER_PORT: master[1],
            contract.TORCHELASTIC_RUN_ID: run_id,
            contract.TORCHELASTIC_RESTART_COUNT: restart_count,
            contract.TORCHELASTIC_MAX_RESTARTS: max_restarts,
            contract.KELASTIC_ROUND: round_,
            contract.KELASTIC_TIMER_TOKEN: tokens[local_rank],
            # The c10d store is created by rank 0 from MASTER_ADDR/PORT, not by us.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            **(extra_env or {}),
        }
        workers.append(WorkerAssignment(local_rank, {k: str(v) for k, v in env.items()}))
    return Assign(attempt=attempt, round=round_, workers=tuple(workers))
