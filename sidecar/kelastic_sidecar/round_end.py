"""How a round ended for this node: pure classification of the supervisor's inputs.

The supervisor (:mod:`kelastic_sidecar.supervisor`) monitors a round until something
ends it: every local worker exited 0, a worker failed or hung, the rendezvous changed
(nodes waiting, a participant lost or left, closed), or the launcher went away. This
module decides *what* that something means, as :class:`RoundEnd` (a
:class:`RoundEndKind` and, for a failure, its root cause as a
:class:`~kelastic_sidecar.failure.Failure`); the supervisor decides what to *do* about
it (stop the workers, charge the restart budget, rejoin, finish).

Everything here is a function of its arguments (a :class:`Failure` stamps its own
time, or takes its fault's when that is believable): no etcd, no processes, no logging
(import-linter keeps it so). It is tested
like ``reconcile``, with tables of inputs (``tests/sidecar/test_round_end.py``). The inputs
it reads are described structurally (:class:`ReapLike`, :class:`CheckLike`), so it
needs neither the timer server nor the rendezvous handler.

Over ~400 lines because every way a round ends is decided here side by side (a check, an
exit, a stopped culprit, a lost peer, a closed rendezvous), on the same input types and
tested as one table: split, each cause's precedence over the others would be spread
over modules.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kelastic import contract
from kelastic.control_messages import Exited

from .failure import (
    CAUSE_HANG,
    CAUSE_NODE_LOST,
    CAUSE_OOM,
    CAUSE_PEER,
    CAUSE_SCALE,
    CAUSE_START_FAILURE,
    CAUSE_WORKER_FAILURE,
    NOT_STARTED_EXIT_CODES,
    Failure,
)
from .vocabulary import DEPARTURE_REJOIN, CheckReason

__all__ = [
    "DEAD_STATES",
    "STOPPED_STATE",
    "CheckLike",
    "LiveStates",
    "ReapLike",
    "RoundEnd",
    "RoundEndKind",
    "RoundOf",
    "blame_lost_peer",
    "classify_check",
    "classify_exit",
    "closed_outcome",
    "explain_worker_failure",
    "lost_peer",
    "stopped_failure",
]

#: Departures that end a round without spending the restart budget: a scale-down, a
#: disruption of the Pod (an eviction, a preemption: :data:`kelastic.contract.
#: DEPARTURE_DISRUPTION`), and a peer exiting to re-rendezvous (its own failure, if any,
#: was charged by that peer).
PLANNED_DEPARTURES = frozenset({*contract.OPERATOR_DEPARTURES, DEPARTURE_REJOIN})


class RoundEndKind(enum.Enum):
    """How monitoring one round ended."""

    #: every local worker exited 0
    SUCCEEDED = "succeeded"
    #: a worker failed or hung, or a peer node was lost: charge the budget, rejoin
    FAILED = "failed"
    #: the round must re-form at no cost (scale event, a peer's restart)
    RESTART = "restart"
    #: the rendezvous was closed (the job failed or is over)
    CLOSED = "closed"
    #: the trainer container's launcher disconnected
    LAUNCHER_LOST = "launcher_lost"
    #: this node was taken out of the job (scale-down, its Pod going away)
    REMOVED = "removed"


@dataclass(frozen=True)
class RoundEnd:
    """How monitoring one round ended.

    Attributes:
        kind: what happened.
        failure: the root cause, for :attr:`RoundEndKind.FAILED`.
        reason: for ``RESTART`` the restart's cause (``CAUSE_SCALE``, ``CAUSE_PEER``);
            for ``REMOVED`` the node's departure reason (may be empty).
        departed: for ``RESTART``, the peers that left the round on purpose
            (:data:`PLANNED_DEPARTURES`), sorted; their workers' connections close, so ours
            may fail first (:func:`explain_worker_failure`).
    """

    kind: RoundEndKind
    failure: Failure | None = None
    reason: str = ""
    departed: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoundOf:
    """The round as this node sees it: enough to name a failed worker's global rank."""

    node: str
    round: int
    group_rank: int
    nproc: int

    def rank(self, local_rank: int) -> int:
        """The global rank of a local rank of this node."""
        return self.group_rank * self.nproc + local_rank


class ReapLike(Protocol):
    """What classification reads of a reap (``kelastic_sidecar.timer.ReapEvent``: the timer
    server's, or the in-process hard timeout's kill; ``why`` says which)."""

    @property
    def scope_id(self) -> str: ...
    @property
    def signal(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def why(self) -> str: ...


class CheckLike(Protocol):
    """What classification reads of a round check (the rendezvous' ``RoundCheck``)."""

    @property
    def healthy(self) -> bool: ...
    @property
    def reason(self) -> CheckReason: ...
    @property
    def nodes(self) -> tuple[str, ...]: ...
    @property
    def departures(self) -> tuple[tuple[str, str], ...]: ...


def classify_check(check: CheckLike, node: str, round_: int) -> RoundEnd | None:
    """What a rendezvous check means for this node's round; None while it is healthy.

    - ``closed``: :attr:`RoundEndKind.CLOSED`;
    - this node among the nodes that left or were lost: ``REMOVED`` (the operator took
      it out), with its departure reason;
    - a participant lost (its liveness key is gone): ``FAILED``, ``CAUSE_NODE_LOST``;
    - participants that left without a planned departure (:data:`PLANNED_DEPARTURES`):
      ``FAILED``, ``CAUSE_NODE_LOST`` naming them (a disruption: Pod deleted, preempted);
    - otherwise ``RESTART``: ``CAUSE_SCALE`` for nodes waiting or planned departures,
      ``CAUSE_PEER`` for the rest (lease lost, round advanced).
    """
    if check.healthy:
        return None
    if check.reason is CheckReason.CLOSED:
        return RoundEnd(RoundEndKind.CLOSED)
    if node in check.nodes and check.reason in (
        CheckReason.PARTICIPANT_LEFT,
        CheckReason.PARTICIPANT_LOST,
    ):
        # The operator removed this node from the round (scale-down, or its Pod is
        # going away): stop here instead of rejoining.
        return RoundEnd(RoundEndKind.REMOVED, reason=dict(check.departures).get(node, ""))
    if check.reason is CheckReason.PARTICIPANT_LOST:
        return RoundEnd(
            RoundEndKind.FAILED,
            Failure(
                cause=CAUSE_NODE_LOST,
                node=", ".join(check.nodes),
                round=round_,
                message="its liveness key is gone (lease expired or node removed)",
            ),
        )
    if check.reason is CheckReason.PARTICIPANT_LEFT:
        departures = dict(check.departures)
        unplanned = {
            n: departures.get(n, "?")
            for n in check.nodes
            if departures.get(n) not in PLANNED_DEPARTURES
        }
        if unplanned:
            # A node stopped in mid-round without being scaled down (Pod deleted,
            # preempted, drained): a disruption, charged like a lost node.
            return RoundEnd(
                RoundEndKind.FAILED,
                Failure(
                    cause=CAUSE_NODE_LOST,
                    node=", ".join(sorted(unplanned)),
                    round=round_,
                    message="left the round: "
                    + ", ".join(f"{n} ({r})" for n, r in sorted(unplanned.items())),
                ),
            )
    reason = {
        CheckReason.NODES_WAITING: CAUSE_SCALE,
        CheckReason.PARTICIPANT_LEFT: CAUSE_SCALE,
    }.get(check.reason, CAUSE_PEER)
    departed = tuple(sorted(check.nodes)) if check.reason is CheckReason.PARTICIPANT_LEFT else ()
    return RoundEnd(RoundEndKind.RESTART, reason=reason, departed=departed)


#: The process state of a worker stopped by job control (``SIGSTOP``, ``SIGTSTP``). A
#: tracer's stop (``t``: py-spy reading stacks, a debugger) is named only when the worker
#: was reaped in it: live, it may be the evidence collection itself.
STOPPED_STATE = "T"


@dataclass(frozen=True)
class LiveStates:
    """What the caller read of the attempt's workers before any was stopped (the stop ends
    a stopped worker, and its state with it).

    Attributes:
        states: pid -> process state letter (``/proc/<pid>/stat``); missing: not read.
        evidence: pid -> the stacks' line (``Evidence.line()``: ``main thread at
            <file>:<line> in <function> (stacks in <path>)``) of a worker found stopped.
    """

    states: Mapping[int, str] = field(default_factory=dict)
    evidence: Mapping[int, str] = field(default_factory=dict)

    def then(self, newer: LiveStates) -> LiveStates:
        """These readings updated by ``newer``'s, except where ``newer`` found a worker
        dead (:data:`DEAD_STATES`) that these read alive: how it was while it lived is
        what names a hang (a stopped worker the stop then killed is still the culprit)."""
        states = dict(self.states)
        evidence = dict(self.evidence)
        for pid, state in newer.states.items():
            if state not in DEAD_STATES or states.get(pid, "") in DEAD_STATES:
                states[pid] = state
                if pid in newer.evidence:
                    evidence[pid] = newer.evidence[pid]
        return LiveStates(states, evidence)


#: Process states of a worker no longer running its code: ``Z`` (a zombie: dead, not yet
#: waited for), ``X``/``x`` (dead), and empty (gone, or unreadable).
DEAD_STATES = frozenset({"", "Z", "X", "x"})


def stopped_failure(
    round_: RoundOf,
    pids: Mapping[int, int],
    reaped: Mapping[int, ReapLike],
    live: LiveStates | None = None,
    peers_reap: ReapLike | None = None,
) -> Failure | None:
    """The hang of a stopped worker of this node, if any: the root cause of the round's
    hangs, whichever exit is reported first (its peers' timers expire too while they wait
    for it in a collective).

    First a worker the timer server reaped while stopped (``T``/``t``: it has its timer's
    words). Else a worker whose live state is :data:`STOPPED_STATE`: stopped between two
    timers it holds none, so nothing reaps it, and only its state names it.

    Args:
        round_: the round.
        pids: local rank -> pid of the attempt's workers.
        reaped: pid -> reap of the attempt.
        live: the workers' live states and a stopped one's stacks; None: not read.
        peers_reap: the reap of a peer that ended the round (named in the message).
    """
    for local_rank, pid in sorted(pids.items()):
        reap = reaped.get(pid)
        if reap is not None and reap.state in ("T", "t"):
            return _stopped(round_, local_rank, reap.signal, reap.why)
    live = live or LiveStates()
    for local_rank, pid in sorted(pids.items()):
        if pid not in reaped and live.states.get(pid) == STOPPED_STATE:
            why = f"stopped (process state {STOPPED_STATE}) outside any timer"
            if pid in live.evidence:
                why += f"; {live.evidence[pid]}"
            if peers_reap is None:
                why += "; the round ended"
            else:
                why += f"; its peers' timers expired waiting on it: {peers_reap.why}"
            return _stopped(round_, local_rank, None, why)
    return None


def _stopped(round_: RoundOf, local_rank: int, signal: int | None, why: str) -> Failure:
    return Failure(
        cause=CAUSE_HANG,
        node=round_.node,
        round=round_.round,
        rank=round_.rank(local_rank),
        local_rank=local_rank,
        signal=signal,
        message=f"{why} (it was stopped, not waiting on a peer)",
        stopped=True,
    )


def classify_exit(
    round_: RoundOf,
    msg: Exited,
    pids: Mapping[int, int],
    reaped: Mapping[int, ReapLike],
    live: LiveStates | None = None,
) -> Failure:
    """The failure a non-zero exit of a worker of this attempt stands for.

    - the worker was reaped (by the timer server, or killed at the in-process hard
      timeout): ``CAUSE_HANG``, unless a worker of this node was stopped (reaped so, or
      stopped now, holding no timer: :func:`stopped_failure`): that one is the cause;
    - it could not be started (no pid, or an exit code of
      :data:`~kelastic_sidecar.failure.NOT_STARTED_EXIT_CODES`): ``CAUSE_START_FAILURE``;
    - the kernel's OOM killer took it (the launcher's ``oom``): ``CAUSE_OOM``, with the
      launcher's words (its container's memory limit);
    - else ``CAUSE_WORKER_FAILURE``, with its error file's message and its last lines.

    Args:
        round_: the round.
        msg: the launcher's ``exited`` message (its ``exitcode`` is not 0).
        pids: local rank -> pid of the attempt's workers (to find a stopped one).
        reaped: pid -> reap of the attempt.
        live: the workers' live states (see :func:`stopped_failure`); None: not read.
    """
    pid = msg.pid  # None when the worker could not even be started
    reap = reaped.get(pid) if pid is not None else None
    error = msg.error or {}
    message = str(error.get("message") or "")
    if reap is not None:
        # Workers blocked in a collective on a stopped peer are reaped with it: name
        # the stopped one of this node, whichever exit was reported first.
        culprit = stopped_failure(round_, pids, reaped, live, peers_reap=reap)
        if culprit is not None:
            return culprit
        message = reap.why
    cause = CAUSE_HANG if reap is not None else CAUSE_WORKER_FAILURE
    if reap is None and (pid is None or msg.exitcode in NOT_STARTED_EXIT_CODES):
        cause = CAUSE_START_FAILURE  # exec failed, or the command is not there
    elif reap is None and msg.oom:
        cause = CAUSE_OOM
    # Timed when its exception was raised (the error file's fault_time), when believable:
    # a fault re-raised after the sidecar gave up orders before what it caused in peers.
    raised = _believable(error.get("fault_time"))
    failure = Failure(
        cause=cause,
        node=round_.node,
        round=round_.round,
        rank=round_.rank(msg.local_rank),
        local_rank=msg.local_rank,
        exitcode=msg.exitcode,
        signal=msg.signal,
        message=message,
        tail=msg.tail,
    )
    return failure if raised is None else replace(failure, time=raised)


#: Seconds before a failure is seen that its fault may have been raised (an in-process
#: rank re-raises its fault only when its sidecar gives up, within minutes).
FAULT_AGE_LIMIT = 3600.0


def _believable(raised: object) -> float | None:
    """``raised`` when it can be a worker's fault time (a number, not bool, not later than
    now and at most :data:`FAULT_AGE_LIMIT` seconds before it), else None."""
    if isinstance(raised, bool) or not isinstance(raised, (int, float)):
        return None
    now = time.time()
    return float(raised) if now - FAULT_AGE_LIMIT <= raised <= now else None  # NaN: None


def lost_peer(check_end: RoundEnd | None) -> Failure | None:
    """The peer node lost in the round, from a :func:`classify_check` result; else None."""
    lost = check_end.failure if check_end is not None else None
    if check_end is None or check_end.kind is not RoundEndKind.FAILED or lost is None:
        return None
    return lost if lost.cause == CAUSE_NODE_LOST else None


def blame_lost_peer(failure: Failure, lost: Failure | None) -> Failure:
    """The root cause of a worker failure: a peer node lost in the same round when
    there is one (its workers' connections reset, so ours fail first), else ``failure``.

    Args:
        failure: this node's failure.
        lost: the lost peer (:func:`lost_peer`) seen after our workers stopped, or None.
    """
    if failure.cause != CAUSE_WORKER_FAILURE or lost is None:
        return failure
    return replace(lost, message=f"{lost.message}; then {failure.summary()}")


def explain_worker_failure(failure: Failure, check_end: RoundEnd | None) -> RoundEnd:
    """How a round whose worker failed ends, given what the rendezvous says of it after
    our workers stopped (``check_end``: :func:`classify_check`'s result, None: healthy or
    unknown).

    - a peer node lost in the same round: ``FAILED``, the loss the root cause
      (:func:`blame_lost_peer`);
    - a peer that left on purpose (a scale-down, an eviction: :attr:`RoundEnd.departed`):
      ``RESTART`` with ``CAUSE_SCALE``, no charge: its workers stopped, so ours lost their
      connections, as every worker of a collective does when one rank goes;
    - otherwise ``FAILED`` with ``failure``.

    Only a :data:`~kelastic_sidecar.failure.CAUSE_WORKER_FAILURE` is explained: a hang, an
    OOM kill or a launch failure stays the node's own.
    """
    if failure.cause != CAUSE_WORKER_FAILURE or check_end is None:
        return RoundEnd(RoundEndKind.FAILED, failure)
    lost = lost_peer(check_end)
    if lost is not None:
        return RoundEnd(RoundEndKind.FAILED, blame_lost_peer(failure, lost))
    if check_end.kind is RoundEndKind.RESTART and check_end.departed:
        return RoundEnd(RoundEndKind.RESTART, reason=CAUSE_SCALE, departed=check_end.departed)
    return RoundEnd(RoundEndKind.FAILED, failure)


def finished_summary(me: str, node: str, round_: int) -> str:
    """The summary of node ``me`` ending because the rendezvous was closed as finished
    (:func:`kelastic_sidecar.rendezvous.finished_in`: every worker of ``node`` exited 0
    in round ``round_``): it succeeds with nothing left to train (a Pod back from a
    partition, a late scale-up, a replacement after the end: none of them failed)."""
    return (f"succeeded: the training finished on {node} in round {round_}; {me} has "
            "nothing left to train")  # fmt: skip


def closed_outcome(reason: dict[str, Any] | None, max_restarts: int) -> tuple[Failure | None, str]:
    """The root cause and the one-line summary of a job whose rendezvous was closed.

    Args:
        reason: the rendezvous' closed reason: a :meth:`Failure.as_dict` plus
            ``failure_rule`` (a FailJob rule of ``spec.failurePolicy``, named as
            ``rule 0 (FailJob: exit code 42)``), ``not_retried`` (a worker could not be
            started) or ``max_restarts`` (the budget was spent), or anything else a
            closer wrote (None when unknown).
        max_restarts: the job's budget.

    Returns:
        ``(failure or None, summary)``; the summary starts with
        :data:`kelastic.contract.JOB_FAILED_PREFIX`.
    """
    failure = None
    if reason:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            failure = Failure.from_dict(reason)
    if failure is not None and reason and isinstance(reason.get("failure_rule"), str):
        text = (
            f"{contract.JOB_FAILED_PREFIX}: spec.failurePolicy {reason['failure_rule']} "
            f"applies; root cause: {failure.details()}"
        )
    elif failure is not None and reason and reason.get("not_retried"):
        text = (
            f"{contract.JOB_FAILED_PREFIX}: a worker could not be started (not retried); "
            f"root cause: {failure.details()}"
        )
    elif failure is not None:
        text = (
            f"{contract.JOB_FAILED_PREFIX} after {max_restarts} restarts "
            "(budget spent); "
            f"root cause: {failure.details()}"
        )
    else:
        text = f"{contract.JOB_FAILED_PREFIX}: the rendezvous was closed" + (
            f" ({reason})" if reason else ""
        )
    return failure, text
