"""The dynamic rendezvous state, pure and etcd-free.

:class:`RendezvousState` (JSON with a ``version`` field, validated by
:func:`decode_state`; never pickle) and its transitions (torch's ``_RendezvousStateHolder``
semantics: participants, wait list, redundancy list, last call, close, the epilogue of
removing a participant). The *steps* a handler takes towards joining, exiting, leaving or
closing, and :func:`~kelastic_sidecar.rendezvous.steps.evaluate_round`, are
:mod:`kelastic_sidecar.rendezvous.steps`; :mod:`kelastic_sidecar.rendezvous.handler` runs them
against etcd.

The bytes of the state in etcd are the one codec's (:mod:`kelastic.etcd_values.rendezvous`:
its bounds, its version, shared with the operator's reader); :func:`encode_state` and
:func:`decode_state` convert this module's :class:`RendezvousState` to and from its
document, and the codec's errors to the rendezvous' own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kelastic import etcd_values
from kelastic.etcd_values import StateDoc

from ..vocabulary import CheckReason

log = logging.getLogger("kelastic_sidecar.rendezvous")


#: Seconds after a join timeout during which a node still tries to remove itself (torch's value).
ROLLBACK_PERIOD = 5.0
#: Longest single wait, seconds: a safety net under the event-driven wake-ups.
MAX_WAIT = 30.0
#: Most join requests one state write applies (:func:`admit_requests`). Each costs the
#: write's etcd transaction a compare and a delete, and etcd refuses a transaction with
#: more than ``--max-txn-ops`` (default 128) compares or operations; the rest are applied
#: by the next write.
MAX_ADMITTED_PER_WRITE = 100


HEALTHY = CheckReason.HEALTHY
NODES_WAITING = CheckReason.NODES_WAITING
PARTICIPANT_LOST = CheckReason.PARTICIPANT_LOST
PARTICIPANT_LEFT = CheckReason.PARTICIPANT_LEFT
CLOSED = CheckReason.CLOSED
ROUND_ADVANCED = CheckReason.ROUND_ADVANCED
LEASE_LOST = CheckReason.LEASE_LOST


# ---------------------------------------------------------------------------- errors


class RendezvousError(Exception):
    """Base class of rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed (e.g. the restart budget is spent).

    Attributes:
        reason: the reason given to :meth:`EtcdRendezvousHandler.close`, if any.
    """

    def __init__(self, message: str, reason: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class RendezvousTimeoutError(RendezvousError):
    """An operation did not finish in time (join, leave, close)."""


class RendezvousStateError(RendezvousError):
    """The state in etcd is corrupt or belongs to something else."""


class CorruptStateError(RendezvousStateError):
    """The state in etcd cannot be used by any reader: not bounded JSON, a missing or
    ill-typed field, a number out of range, inconsistent contents. Unlike a state of
    another version or run (a plain :class:`RendezvousStateError`), overwriting it with
    a fresh state loses nothing."""


# ---------------------------------------------------------------------- public types


@dataclass(frozen=True)
class RendezvousSettings:
    """Settings of one job's rendezvous (torch's ``RendezvousSettings``/``RendezvousTimeout``).

    Attributes:
        run_id: the run id (the job UID); stored in the state and checked on read.
        min_nodes: fewest nodes a round may complete with (>= 1).
        max_nodes: most nodes a round admits (>= ``min_nodes``).
        join_timeout: seconds :meth:`EtcdRendezvousHandler.next_rendezvous` may take.
        last_call_timeout: seconds a round waits for more nodes once ``min_nodes`` joined.
        close_timeout: seconds ``close`` and ``leave`` may take.
        lease_ttl: seconds (integer) a node stays alive in etcd without a keep-alive.
        incarnation: this node's Pod uid (``""`` outside Kubernetes): a round is not
            joined once the operator fenced it (:meth:`kelastic.contract.Keys.fenced`).

    Raises:
        ValueError: a bound or timeout is out of range.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    lease_ttl: int = 10
    incarnation: str = ""

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})"
            )
        for name in ("join_timeout", "last_call_timeout", "close_timeout"):
            value = getattr(self, name)
            if not value > 0 or math.isinf(value):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.lease_ttl < 1:
            raise ValueError(f"lease_ttl must be >= 1 s, got {self.lease_ttl}")


@dataclass(frozen=True)
class RendezvousInfo:
    """A completed round, as seen by one node.

    Attributes:
        round: the round number.
        group_rank: this node's rank in the round (0 .. group_world_size - 1).
        group_world_size: the number of nodes in the round.
        participants: node names ordered by group rank.
    """

    round: int
    group_rank: int
    group_world_size: int
    participants: tuple[str, ...]


@dataclass(frozen=True)
class RoundCheck:
    """Whether a completed round can go on (:meth:`EtcdRendezvousHandler.check_round`).

    Attributes:
        healthy: True when nothing calls for a re-rendezvous.
        reason: :attr:`CheckReason.HEALTHY` (``""``) when healthy, else the most severe
            of ``closed``, ``lease_lost``, ``round_advanced``, ``participant_lost``,
            ``participant_left``, ``nodes_waiting`` (:class:`CheckReason`).
        nodes: the nodes the reason is about (lost, left or waiting; sorted).
        departures: ``(node, reason)`` of the participants that left gracefully
            (``"succeeded"``, ``"scale_down"``, ``"shutdown"``, ``"rejoin"``, ...).
    """

    healthy: bool
    reason: CheckReason
    nodes: tuple[str, ...] = ()
    departures: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        """A reason given as its string value becomes the :class:`CheckReason`.

        Raises:
            ValueError: ``reason`` is no :class:`CheckReason` value.
        """
        object.__setattr__(self, "reason", CheckReason(self.reason))


# ----------------------------------------------------------------------------- state


@functools.lru_cache(maxsize=4096)
def name_order(node: str) -> tuple[tuple[str | int, ...], str]:
    """Sort key of node names: digit runs compare as numbers (``job-2`` < ``job-10``).

    Deterministic and total (ties broken by the plain name), so every node computes
    the same ranks from the same participants.
    """
    parts = re.split(r"(\d+)", node)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), node


@dataclass(frozen=True)
class RendezvousState:
    """The shared state of a rendezvous (torch's ``_RendezvousState``, as JSON).

    Attributes:
        run_id: the run it belongs to.
        round: the current round.
        complete: whether the current round is complete (ranks assigned).
        deadline: wall-clock time (s) the last call ends, once ``min_nodes`` joined.
        closed: no node may join any more.
        closed_reason: why it was closed (a JSON object), when given.
        participants: node -> rank of the current round (ranks are 0 until complete).
        wait_list: nodes waiting for the next round.
        redundancy_list: nodes waiting while the round is at ``max_nodes``.
        departed: node -> reason, participants that left the complete round gracefully.
        lost: participants removed from the complete round because their lease was gone.

    Treat instances as immutable: the functions below return new states.
    """

    run_id: str
    round: int = 0
    complete: bool = False
    deadline: float | None = None
    closed: bool = False
    closed_reason: dict[str, Any] | None = None
    participants: dict[str, int] = field(default_factory=dict)
    wait_list: frozenset[str] = frozenset()
    redundancy_list: frozenset[str] = frozenset()
    departed: dict[str, str] = field(default_factory=dict)
    lost: frozenset[str] = frozenset()

    def ranked(self) -> tuple[str, ...]:
        """Participants ordered by rank (by :func:`name_order` before the round completes)."""
        return tuple(sorted(self.participants, key=lambda n: (self.participants[n], name_order(n))))


def encode_state(state: RendezvousState) -> bytes:
    """Serialize ``state`` to the JSON stored in etcd, deterministic, by the one codec of
    the value (:func:`kelastic.etcd_values.encode_state`).

    Raises:
        RendezvousStateError: ``state`` is outside the codec's bounds (a transition let in
            what no reader accepts); nothing is written.
    """
    doc: StateDoc = {
        "run_id": state.run_id, "round": state.round, "complete": state.complete,
        "deadline": state.deadline, "closed": state.closed, "closed_reason": state.closed_reason,
        "participants": state.participants, "departed": state.departed,
        "wait_list": list(state.wait_list), "redundancy_list": list(state.redundancy_list),
        "lost": list(state.lost),
    }  # fmt: skip
    try:
        return etcd_values.encode_state(doc)
    except etcd_values.CorruptValueError as exc:
        raise RendezvousStateError(f"refusing to write the state: {exc}") from None


def decode_state(raw: bytes, *, run_id: str | None = None, where: str = "state") -> RendezvousState:
    """Parse and strictly validate a state written by :func:`encode_state`, by the one
    codec of the value (:func:`kelastic.etcd_values.decode_state`: its bounds, its
    version; hostile input bounded before it is parsed or used).

    Args:
        raw: the bytes read from etcd.
        run_id: when given, the state must belong to this run.
        where: the etcd key, for error messages.

    Raises:
        CorruptStateError: (a :class:`RendezvousStateError`) not JSON, over a bound, a
            missing/unknown/ill-typed field, or inconsistent contents (e.g. a node both
            participant and waiting).
        RendezvousStateError: another version, or another run (when ``run_id`` is
            given). Never another exception, whatever ``raw`` holds.
    """
    try:
        doc = etcd_values.decode_state(raw, run_id=run_id, where=where)
    except etcd_values.CorruptValueError as exc:
        raise CorruptStateError(str(exc)) from None
    except etcd_values.ForeignValueError as exc:
        raise RendezvousStateError(str(exc)) from None
    return RendezvousState(
        run_id=doc["run_id"],
        round=doc["round"],
        complete=doc["complete"],
        deadline=doc["deadline"],
        closed=doc["closed"],
        closed_reason=doc["closed_reason"],
        participants=doc["participants"],
        wait_list=frozenset(doc["wait_list"]),
        redundancy_list=frozenset(doc["redundancy_list"]),
        departed=doc["departed"],
        lost=frozenset(doc["lost"]),
    )


# ----------------------------------------------------------------------- transitions
# Pure functions: each returns a new state. Names follow torch's _DistributedRendezvousOpExecutor.


def add_participant(
    state: RendezvousState, node: str, settings: RendezvousSettings, now: float
) -> RendezvousState:
    """``node`` joins the forming round; the last call starts at ``min_nodes``; at
    ``max_nodes`` the round completes at once."""
    participants = {**state.participants, node: 0}
    new = dataclasses.replace(
        state,
        participants=participants,
        wait_list=state.wait_list - {node},
        redundancy_list=state.redundancy_list - {node},
    )
    if len(participants) == settings.min_nodes:
        new = dataclasses.replace(new, deadline=now + settings.last_call_timeout)
    if len(participants) >= settings.max_nodes:
        new = mark_complete(new)
    return new


def add_to_wait_list(state: RendezvousState, node: str) -> RendezvousState:
    """``node`` waits for the next round (the complete round is below ``max_nodes``)."""
    return dataclasses.replace(
        state, wait_list=state.wait_list | {node}, redundancy_list=state.redundancy_list - {node}
    )


def add_to_redundancy_list(state: RendezvousState, node: str) -> RendezvousState:
    """``node`` waits while the complete round is at ``max_nodes``."""
    return dataclasses.replace(state, redundancy_list=state.redundancy_list | {node})


def remove_waiter(state: RendezvousState, node: str) -> RendezvousState:
    """Take ``node`` off the wait and redundancy lists."""
    return dataclasses.replace(
        state, wait_list=state.wait_list - {node}, redundancy_list=state.redundancy_list - {node}
    )


def remove_participant(
    state: RendezvousState, node: str, settings: RendezvousSettings, departure: str | None
) -> RendezvousState:
    """Remove ``node`` from the participants (torch's ``_remove_participant_epilogue``).

    From a complete round the departure is recorded: ``departure`` (a graceful reason)
    in ``departed``, or ``None`` (dead) in ``lost``; once the last participant is gone
    the round number goes up and the next round forms (records cleared). From a forming
    round below ``min_nodes`` the last call is cancelled.
    """
    participants = {n: r for n, r in state.participants.items() if n != node}
    new = dataclasses.replace(state, participants=participants)
    if state.complete:
        if departure is None:
            new = dataclasses.replace(new, lost=new.lost | {node})
        else:
            new = dataclasses.replace(new, departed={**new.departed, node: departure})
        if not participants:
            new = dataclasses.replace(
                new, complete=False, round=state.round + 1, departed={}, lost=frozenset()
            )
    elif len(participants) < settings.min_nodes:
        new = dataclasses.replace(new, deadline=None)
    return new


def mark_complete(state: RendezvousState) -> RendezvousState:
    """Complete the round: ranks by :func:`name_order`, last call over, records cleared."""
    ranks = {node: rank for rank, node in enumerate(sorted(state.participants, key=name_order))}
    return dataclasses.replace(
        state, complete=True, deadline=None, participants=ranks, departed={}, lost=frozenset()
    )


def mark_closed(state: RendezvousState, reason: dict[str, Any] | None) -> RendezvousState:
    """Close the rendezvous (keeps the first reason when already closed)."""
    if state.closed:
        return state
    return dataclasses.replace(state, closed=True, closed_reason=reason)


def sanitize(
    state: RendezvousState,
    alive: Iterable[str],
    settings: RendezvousSettings,
    departing: Mapping[str, str] | None = None,
) -> tuple[RendezvousState, tuple[str, ...]]:
    """Remove participants and waiters that have no alive key (their lease is gone).

    A removed participant with a departure notice (``departing``: node -> reason, written
    by the operator before a scale-down) is recorded as departed with that reason, not as
    lost.

    Returns:
        the new state and the removed nodes (sorted).
    """
    notices = departing or {}
    live = set(alive)
    dead = sorted((set(state.participants) | state.wait_list | state.redundancy_list) - live)
    new = state
    for node in dead:
        if node in new.participants:
            new = remove_participant(new, node, settings, departure=notices.get(node))
        else:
            new = remove_waiter(new, node)
    return new, tuple(dead)
