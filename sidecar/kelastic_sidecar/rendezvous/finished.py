"""A rendezvous closed because the job's training finished: its ``closed_reason``.

torch's agent closes the rendezvous (``shutdown()``) once its worker group succeeded, so
no node forms a round to train again. kelastic closes it as *finished* when a
participant of a complete round leaves ``succeeded``
(:func:`~kelastic_sidecar.rendezvous.steps.leave_step`); the round's other participants
finish their own work (:func:`~kelastic_sidecar.rendezvous.steps.evaluate_round`), and
any node that joins afterwards ends with nothing left to train. Pure, etcd-free.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FINISHED_KEY", "finished_in", "finished_reason"]

#: The ``closed_reason`` key of a rendezvous closed because the job's training finished.
FINISHED_KEY = "finished"


def finished_reason(node: str, round_: int) -> dict[str, Any]:
    """The ``closed_reason`` of a rendezvous closed because every worker of ``node``
    exited 0 in round ``round_``: the training is done (torch's agent closes the
    rendezvous, ``shutdown()``, once its worker group succeeded)."""
    return {FINISHED_KEY: {"node": node, "round": round_}}


def finished_in(reason: object) -> tuple[str, int] | None:
    """``(node, round)`` of a ``closed_reason`` :func:`finished_reason` wrote; None for
    any other (a failure's, a crafted one: the state's codec bounds it, this checks
    the shape)."""
    done = reason.get(FINISHED_KEY) if isinstance(reason, dict) else None
    if not isinstance(done, dict):
        return None
    node, rnd = done.get("node"), done.get("round")
    if not isinstance(node, str) or not isinstance(rnd, int) or isinstance(rnd, bool):
        return None
    return node, rnd
