"""The rendezvous steps: what a node does next towards joining, exiting, leaving or closing,
and whether a running round can go on. Pure and etcd-free.

A step looks at the (sanitized) :class:`~kelastic_sidecar.rendezvous.state.RendezvousState`
and decides the :class:`Action` to take and the state to write (torch's
``_RendezvousJoinOp``, ``_RendezvousExitOp``, ``_RendezvousCloseOp``, apart from its
``_RendezvousState``, as here): :func:`join_step`, :func:`exit_step`, :func:`leave_step`,
:func:`close_step`, :func:`admit_requests` (join requests applied by a write) and
:func:`evaluate_round`. The state and its transitions are
:mod:`kelastic_sidecar.rendezvous.state`'s; :mod:`kelastic_sidecar.rendezvous.executor` runs
the steps against etcd.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kelastic.etcd_values import is_name

from ..vocabulary import DEPARTURE_REJOIN, DEPARTURE_SUCCEEDED
from .finished import finished_in, finished_reason
from .state import (
    CLOSED,
    HEALTHY,
    LEASE_LOST,
    MAX_ADMITTED_PER_WRITE,
    NODES_WAITING,
    PARTICIPANT_LEFT,
    PARTICIPANT_LOST,
    ROUND_ADVANCED,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RoundCheck,
    add_participant,
    add_to_redundancy_list,
    add_to_wait_list,
    mark_closed,
    mark_complete,
    name_order,
    remove_participant,
    remove_waiter,
)

__all__ = [
    "Action",
    "Clock",
    "Step",
    "admit_requests",
    "close_step",
    "evaluate_round",
    "exit_step",
    "join_step",
    "leave_step",
]

# A step looks at the (sanitized) state and decides what to do next, like torch's
# _RendezvousJoinOp & co. The handler writes WRITE states, waits on WAIT, stops on FINISH.


class Action(enum.Enum):
    """What a step asks the handler to do."""

    FINISH = "finish"
    WAIT = "wait"
    WRITE = "write"
    ERROR_CLOSED = "error_closed"
    ERROR_TIMEOUT = "error_timeout"


@dataclass(frozen=True)
class Clock:
    """Time as a step sees it.

    Attributes:
        now: wall-clock seconds (``time.time()``), compared with state deadlines.
        timed_out: the operation's deadline has passed.
        rollback_over: the rollback period after the deadline has passed too.
    """

    now: float
    timed_out: bool = False
    rollback_over: bool = False


@dataclass(frozen=True)
class Step:
    """A step's decision.

    Attributes:
        action: what to do.
        state: the state to write (``WRITE`` only).
        wake_at: wall-clock time to look again even without a change (``WAIT``).
        untimed: the wait is not bounded by the operation's deadline (redundant nodes).
        restart_timer: start the operation's timeout afresh (left the redundancy list).
        note: what happened, for the log.
    """

    action: Action
    state: RendezvousState | None = None
    wake_at: float | None = None
    untimed: bool = False
    restart_timer: bool = False
    note: str = ""


def _write(state: RendezvousState, note: str, **kw: Any) -> Step:
    return Step(Action.WRITE, state=state, note=note, **kw)


def join_step(
    state: RendezvousState, clock: Clock, *, node: str, settings: RendezvousSettings
) -> Step:
    """Next move of ``node`` joining the rendezvous (torch's ``_RendezvousJoinOp``)."""
    if state.closed:
        return Step(Action.ERROR_CLOSED)
    if node in state.redundancy_list:
        if len(state.participants) >= settings.max_nodes:
            return Step(Action.WAIT, untimed=True)
        return _write(remove_waiter(state, node), "left the redundancy list", restart_timer=True)
    is_participant = node in state.participants
    if state.complete and is_participant:
        return Step(Action.FINISH)
    if clock.timed_out:
        if not clock.rollback_over:
            if is_participant:
                return _write(
                    remove_participant(state, node, settings, "timeout"),
                    f"timed out; left forming round {state.round}",
                )
            if node in state.wait_list:
                return _write(remove_waiter(state, node), "timed out; left the wait list")
        return Step(Action.ERROR_TIMEOUT)
    if state.complete:
        if node in state.wait_list:
            return Step(Action.WAIT)
        if len(state.participants) < settings.max_nodes:
            return _write(add_to_wait_list(state, node), f"waits for round {state.round + 1}")
        return _write(
            add_to_redundancy_list(state, node),
            f"is redundant: round {state.round} is at max_nodes={settings.max_nodes}",
        )
    if not is_participant:
        new = add_participant(state, node, settings, clock.now)
        note = f"joined round {state.round}"
        if new.complete:
            note += " (max_nodes reached: round complete)"
        return _write(new, note)
    if len(state.participants) < settings.min_nodes:
        return Step(Action.WAIT)
    if state.deadline is None:  # defensive: the last call should have started at min_nodes
        return _write(
            dataclasses.replace(state, deadline=clock.now + settings.last_call_timeout),
            "started the last call",
        )
    if state.deadline <= clock.now:
        return _write(mark_complete(state), f"completed round {state.round} (last call over)")
    return Step(Action.WAIT, wake_at=state.deadline)


def admit_requests(
    state: RendezvousState,
    requesters: Iterable[str],
    clock: Clock,
    *,
    settings: RendezvousSettings,
    limit: int = MAX_ADMITTED_PER_WRITE,
) -> tuple[RendezvousState, tuple[str, ...]]:
    """Apply the pending join requests of other nodes to ``state``, as each would itself.

    A node that joins announces it (a join request in etcd) before it writes the state;
    whoever writes the state for its own join applies the other requests too, so that
    many nodes joining at once need a few writes, not one each. For each requester not
    yet in the state (participants, wait or redundancy list), in :func:`name_order`,
    this applies what :func:`join_step` would write for it when not timed out: join the
    forming round (the round completes at ``max_nodes``; later ones go to the
    redundancy list), or wait for the next round. A requester withdraws its request
    before it acts on its own timeout, so the requester's own clock is not needed.
    Nothing is applied to a closed rendezvous, and at most ``limit`` requests per call
    (see :data:`MAX_ADMITTED_PER_WRITE`). A request whose node name no state may hold
    (empty, or over 1024 characters: :func:`kelastic.etcd_values.is_name`; forged) is
    never applied: the state's strict writer would refuse the state.

    Returns:
        the new state and the requesters applied (in the order applied).
    """
    admitted: list[str] = []
    for node in sorted(set(requesters), key=name_order):
        if state.closed or len(admitted) >= limit:
            break
        if node in state.participants or node in state.wait_list or node in state.redundancy_list:
            continue
        if not is_name(node):
            continue
        step = join_step(state, Clock(now=clock.now), node=node, settings=settings)
        if step.action is Action.WRITE and step.state is not None:
            state = step.state
            admitted.append(node)
    return state, tuple(admitted)


def exit_step(
    state: RendezvousState, clock: Clock, *, node: str, settings: RendezvousSettings
) -> Step:
    """Leave the current round before joining the next (torch's ``_RendezvousExitOp``)."""
    if node not in state.participants:
        return Step(Action.FINISH)
    if clock.timed_out:
        return Step(Action.ERROR_TIMEOUT)
    return _write(
        remove_participant(state, node, settings, DEPARTURE_REJOIN),
        f"exited round {state.round} to re-rendezvous",
    )


def leave_step(
    state: RendezvousState,
    clock: Clock,
    *,
    node: str,
    settings: RendezvousSettings,
    reason: str,
) -> Step:
    """Leave the rendezvous for good, recording ``reason`` for the peers. A participant
    of a complete round that leaves ``succeeded`` (every worker of its exited 0) also
    closes the rendezvous as *finished* (:func:`~.finished.finished_reason`, torch's agent
    closing it after success): the round's other participants finish theirs
    (:func:`evaluate_round`), but no node forms a new round to train again (found on two
    real nodes: a node back from a partition just after its peer finished the training
    formed a round alone and trained the last epochs again from a persisted step)."""
    if node in state.participants:
        new = remove_participant(state, node, settings, reason)
        if reason == DEPARTURE_SUCCEEDED and state.complete:
            new = mark_closed(new, finished_reason(node, state.round))
    elif node in state.wait_list or node in state.redundancy_list:
        new = remove_waiter(state, node)
    else:
        return Step(Action.FINISH)
    if clock.timed_out:
        return Step(Action.ERROR_TIMEOUT)
    return _write(new, f"left the rendezvous ({reason})")


def close_step(state: RendezvousState, clock: Clock, *, reason: dict[str, Any] | None) -> Step:
    """Close the rendezvous (torch's ``_RendezvousCloseOp``)."""
    if state.closed:
        return Step(Action.FINISH)
    if clock.timed_out:
        return Step(Action.ERROR_TIMEOUT)
    return _write(mark_closed(state, reason), f"closed the rendezvous: {reason}")


def evaluate_round(
    state: RendezvousState, info: RendezvousInfo, node: str, *, lease_lost: bool
) -> RoundCheck:
    """Decide whether the round described by ``info`` can go on (see :class:`RoundCheck`)."""
    departures = tuple(sorted((n, r) for n, r in state.departed.items() if n in info.participants))
    if state.closed:
        done = finished_in(state.closed_reason)
        if done is None or done[1] != info.round:
            return RoundCheck(False, CLOSED, departures=departures)
        if not lease_lost:
            # the training finished in this round on another node: this one finishes its
            # own (no scale-up, no new round; a peer that fails now fails the round alone)
            return RoundCheck(True, HEALTHY, (), departures)
    if lease_lost:
        return RoundCheck(False, LEASE_LOST, (node,), departures)
    if state.round != info.round:
        return RoundCheck(False, ROUND_ADVANCED, departures=departures)
    gone = [n for n in info.participants if n not in state.participants]
    lost = tuple(sorted(n for n in gone if n not in state.departed))
    if lost:
        return RoundCheck(False, PARTICIPANT_LOST, lost, departures)
    # A peer that finished its work ("succeeded") does not disturb the round: the others
    # finish theirs. Any other departure (rejoin, scale_down, shutdown) ends the round.
    left = tuple(sorted(n for n in gone if state.departed[n] != DEPARTURE_SUCCEEDED))
    if left:
        return RoundCheck(False, PARTICIPANT_LEFT, left, departures)
    if state.wait_list:
        return RoundCheck(False, NODES_WAITING, tuple(sorted(state.wait_list)), departures)
    return RoundCheck(True, HEALTHY, (), departures)
