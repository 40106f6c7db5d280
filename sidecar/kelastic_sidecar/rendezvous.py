"""kelastic's dynamic rendezvous on etcd.

The semantics are torch's ``DynamicRendezvousHandler``
(``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``): the job goes through
*rounds*; nodes join the current round as *participants* until ``max_nodes`` joined,
or until the *last call* (``last_call_timeout`` seconds after ``min_nodes`` joined)
ends; then the round is *complete* and ranks are assigned by sorting the node names
(:func:`name_order`: numbers compare as numbers, so ``job-2`` ranks before ``job-10``). A
node arriving at a complete round waits on the *wait list* (when the round is below
``max_nodes``; the participants then re-rendezvous to let it in) or on the *redundancy
list* (at ``max_nodes``; it gets in when a participant goes away). A participant that
re-rendezvouses first *exits* the round; when the last participant of a complete round
has left, the round number goes up and the next round forms. A *closed* rendezvous
admits nobody.

Differences from torch, each for a reason (DESIGN.md, "Rendezvous"):

- the state is JSON with a ``version`` field, validated strictly on read
  (:func:`decode_state`); never pickle;
- waiting is event-driven (etcd watches on the state key and the alive prefix);
- liveness is an etcd lease per node: a node writes ``Keys.alive(node)`` bound to its
  lease before it touches the state, and any node that reads the state removes the
  participants and waiters whose alive key is gone (:func:`sanitize`), in the same
  compare-and-set as its own change;
- graceful departures (:meth:`EtcdRendezvousHandler.leave`, and the exit before a
  re-rendezvous) are recorded for the current round, so peers can tell a node that
  left from one that died (:meth:`EtcdRendezvousHandler.check_round`).

The state machine is pure: :class:`RendezvousState` plus the transition and step
functions below, unit-testable without etcd. :class:`EtcdRendezvousHandler` runs the
steps against etcd. Deadlines in the state are wall-clock seconds (``time.time()``);
operation timeouts are measured with ``time.monotonic()``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kelastic.contract import Keys

from .etcd_backend import EtcdRendezvousBackend
from .etcd_store import EtcdLeaseNotFoundError, EtcdStore, EtcdUnavailableError, Lease

log = logging.getLogger("kelastic_sidecar.rendezvous")

#: Version of the JSON state this module reads and writes.
STATE_VERSION = 1
#: Seconds after a join timeout during which a node still tries to remove itself (torch's value).
ROLLBACK_PERIOD = 5.0
#: Longest single wait, seconds: a safety net under the event-driven wake-ups.
MAX_WAIT = 30.0

#: Departure reason recorded when a participant exits a round to re-rendezvous.
DEPARTURE_REJOIN = "rejoin"
#: Departure of a node whose workers all exited 0: its peers carry on.
DEPARTURE_SUCCEEDED = "succeeded"

# RoundCheck reasons
HEALTHY = ""
NODES_WAITING = "nodes_waiting"
PARTICIPANT_LOST = "participant_lost"
PARTICIPANT_LEFT = "participant_left"
CLOSED = "closed"
ROUND_ADVANCED = "round_advanced"
LEASE_LOST = "lease_lost"


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
        reason: ``""`` when healthy, else the most severe of ``"closed"``,
            ``"lease_lost"``, ``"round_advanced"``, ``"participant_lost"``,
            ``"participant_left"``, ``"nodes_waiting"``.
        nodes: the nodes the reason is about (lost, left or waiting; sorted).
        departures: ``(node, reason)`` of the participants that left gracefully
            (``"succeeded"``, ``"scale_down"``, ``"shutdown"``, ``"rejoin"``, ...).
    """

    healthy: bool
    reason: str
    nodes: tuple[str, ...] = ()
    departures: tuple[tuple[str, str], ...] = ()


# ----------------------------------------------------------------------------- state


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
    """Serialize ``state`` to the JSON stored in etcd (deterministic)."""
    doc = {
        "version": STATE_VERSION,
        "run_id": state.run_id,
        "round": state.round,
        "complete": state.complete,
        "deadline": state.deadline,
        "closed": state.closed,
        "closed_reason": state.closed_reason,
        "participants": dict(sorted(state.participants.items())),
        "wait_list": sorted(state.wait_list),
        "redundancy_list": sorted(state.redundancy_list),
        "departed": dict(sorted(state.departed.items())),
        "lost": sorted(state.lost),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


_FIELDS = frozenset(
    {
        "version",
        "run_id",
        "round",
        "complete",
        "deadline",
        "closed",
        "closed_reason",
        "participants",
        "wait_list",
        "redundancy_list",
        "departed",
        "lost",
    }
)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(doc: Mapping[str, Any], name: str, where: str) -> frozenset[str]:
    value = doc[name]
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise RendezvousStateError(f"{where}: '{name}' must be a list of node names")
    if len(set(value)) != len(value):
        raise RendezvousStateError(f"{where}: '{name}' lists a node twice")
    return frozenset(value)


def decode_state(raw: bytes, *, run_id: str | None = None, where: str = "state") -> RendezvousState:
    """Parse and strictly validate a state written by :func:`encode_state`.

    Args:
        raw: the bytes read from etcd.
        run_id: when given, the state must belong to this run.
        where: the etcd key, for error messages.

    Raises:
        RendezvousStateError: not JSON, another version, a missing/unknown/ill-typed
            field, or inconsistent contents (e.g. a node both participant and waiting).
    """
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RendezvousStateError(f"{where}: not JSON ({exc}): {raw[:80]!r}") from exc
    if not isinstance(doc, dict):
        raise RendezvousStateError(f"{where}: not a JSON object: {raw[:80]!r}")
    if doc.get("version") != STATE_VERSION:
        raise RendezvousStateError(
            f"{where}: state version {doc.get('version')!r}, this kelastic reads {STATE_VERSION}"
        )
    missing, unknown = _FIELDS - doc.keys(), doc.keys() - _FIELDS
    if missing or unknown:
        raise RendezvousStateError(
            f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
        )
    if not isinstance(doc["run_id"], str) or not doc["run_id"]:
        raise RendezvousStateError(f"{where}: 'run_id' must be a non-empty string")
    if run_id is not None and doc["run_id"] != run_id:
        raise RendezvousStateError(
            f"{where}: belongs to run {doc['run_id']!r}, not {run_id!r} (stale or shared key?)"
        )
    if not _is_int(doc["round"]) or doc["round"] < 0:
        raise RendezvousStateError(f"{where}: 'round' must be an integer >= 0")
    for name in ("complete", "closed"):
        if not isinstance(doc[name], bool):
            raise RendezvousStateError(f"{where}: '{name}' must be true or false")
    deadline = doc["deadline"]
    if deadline is not None and (
        not isinstance(deadline, int | float) or isinstance(deadline, bool)
    ):
        raise RendezvousStateError(f"{where}: 'deadline' must be a number or null")
    if doc["closed_reason"] is not None and not isinstance(doc["closed_reason"], dict):
        raise RendezvousStateError(f"{where}: 'closed_reason' must be an object or null")
    participants = doc["participants"]
    if not isinstance(participants, dict) or not all(
        isinstance(n, str) and n and _is_int(r) and r >= 0 for n, r in participants.items()
    ):
        raise RendezvousStateError(f"{where}: 'participants' must map node names to ranks >= 0")
    departed = doc["departed"]
    if not isinstance(departed, dict) or not all(
        isinstance(n, str) and n and isinstance(r, str) for n, r in departed.items()
    ):
        raise RendezvousStateError(f"{where}: 'departed' must map node names to reasons")
    wait_list = _names(doc, "wait_list", where)
    redundancy = _names(doc, "redundancy_list", where)
    lost = _names(doc, "lost", where)
    members = set(participants)
    if members & wait_list or members & redundancy or wait_list & redundancy:
        raise RendezvousStateError(f"{where}: a node is listed both as participant and waiting")
    ranks = list(participants.values())
    if doc["complete"] and len(set(ranks)) != len(ranks):
        raise RendezvousStateError(f"{where}: ranks of a complete round must be distinct")
    return RendezvousState(
        run_id=doc["run_id"],
        round=doc["round"],
        complete=doc["complete"],
        deadline=float(deadline) if deadline is not None else None,
        closed=doc["closed"],
        closed_reason=doc["closed_reason"],
        participants=dict(participants),
        wait_list=wait_list,
        redundancy_list=redundancy,
        departed=dict(departed),
        lost=lost,
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
    state: RendezvousState, alive: Iterable[str], settings: RendezvousSettings
) -> tuple[RendezvousState, tuple[str, ...]]:
    """Remove participants and waiters that have no alive key (their lease is gone).

    Returns:
        the new state and the removed nodes (sorted).
    """
    live = set(alive)
    dead = sorted((set(state.participants) | state.wait_list | state.redundancy_list) - live)
    new = state
    for node in dead:
        if node in new.participants:
            new = remove_participant(new, node, settings, departure=None)
        else:
            new = remove_waiter(new, node)
    return new, tuple(dead)


# ---------------------------------------------------------------------------- steps
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
    """Leave the rendezvous for good, recording ``reason`` for the peers."""
    if node in state.participants:
        new = remove_participant(state, node, settings, reason)
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
        return RoundCheck(False, CLOSED, departures=departures)
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


# --------------------------------------------------------------------------- handler


@dataclass
class _Operation:
    """A running handler operation (join, exit, leave, close)."""

    what: str
    step_fn: Callable[[RendezvousState, Clock], Step]
    timeout: float  # seconds
    deadline: float  # time.monotonic()
    need_alive: bool
    untimed: bool = False  # the last step waits without a deadline (redundant node)


@dataclass(frozen=True)
class _View:
    """A sanitized state as read from etcd."""

    state: RendezvousState
    token: int | None  # mod_revision of the state key; None when there is none yet
    alive: frozenset[str]
    revision: int  # store revision of the read


class EtcdRendezvousHandler:
    """Runs the dynamic rendezvous for one node against etcd.

    Args:
        store: the etcd client.
        keys: the job's key layout (state at ``keys.rdzv_state``, liveness under
            ``keys.alive_prefix``).
        node: this node's name (the Pod name); unique in the job, no ``/``.
        settings: the rendezvous settings.

    Thread-safe: ``check_round``/``wait_for_change`` may run in another thread than
    ``next_rendezvous``. etcd failures that outlast the store's timeout propagate as
    :class:`~kelastic_sidecar.etcd_store.EtcdUnavailableError`.
    """

    def __init__(
        self, store: EtcdStore, keys: Keys, node: str, settings: RendezvousSettings
    ) -> None:
        if not node or "/" in node:
            raise ValueError(f"node name must be non-empty and contain no '/': {node!r}")
        self._store = store
        self._keys = keys
        self.node = node
        self.settings = settings
        self._backend = EtcdRendezvousBackend(store, keys.rdzv_state, name="kelastic")
        self._watch = [keys.rdzv_state, keys.alive_prefix]
        self._lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self._shut_down = False
        self._op_lock = threading.Lock()  # one state-changing operation at a time
        self._cursor = 0  # store revision up to which wait_for_change has reported
        self._cursor_lock = threading.Lock()

    # ------------------------------------------------------------------ public API

    @property
    def lease_lost(self) -> bool:
        """True when this node's lease was lost (expired, or revoked by :meth:`shutdown`)."""
        lease = self._lease
        return lease is not None and lease.lost

    def next_rendezvous(self) -> RendezvousInfo:
        """Exit the current round if in one, then join the next and wait until it completes.

        Blocks up to ``join_timeout`` seconds (not counting time on the redundancy list).

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousTimeoutError: the round did not complete within ``join_timeout``.
            RendezvousStateError: the state in etcd is corrupt.
            EtcdUnavailableError: etcd stayed unreachable.
        """
        started = time.monotonic()
        with self._op_lock:
            timeout = self.settings.join_timeout
            self._run(
                "exit",
                functools.partial(exit_step, node=self.node, settings=self.settings),
                timeout,
                need_alive=True,
            )
            view = self._run(
                "join",
                functools.partial(join_step, node=self.node, settings=self.settings),
                timeout,
                need_alive=True,
            )
            self._advance(view.revision)  # the caller knows the round as of this read
        state = view.state
        order = state.ranked()
        info = RendezvousInfo(
            round=state.round,
            group_rank=state.participants[self.node],
            group_world_size=len(order),
            participants=order,
        )
        log.info(
            "%s: round %d complete in %.3fs: group rank %d of %d (%s)",
            self.node, info.round, time.monotonic() - started, info.group_rank,
            info.group_world_size, ", ".join(order),
        )  # fmt: skip
        return info

    def num_nodes_waiting(self) -> int:
        """Number of nodes on the wait list (torch's ``num_nodes_waiting``); sanitizes first."""
        return len(self._sync().state.wait_list)

    def check_round(self, info: RendezvousInfo) -> RoundCheck:
        """Check the round ``info`` came from; dead nodes are removed first (see :func:`sanitize`).

        Unhealthy when the rendezvous is closed, our lease is lost, the round advanced,
        a participant of ``info`` is gone (``participant_lost``: lease gone;
        ``participant_left``: departed via :meth:`leave` or to re-rendezvous), or
        nodes wait for the next round.
        """
        view = self._sync()
        self._advance(view.revision)  # the caller learns everything up to this read
        lease_lost = self.lease_lost or self.node not in view.alive
        return evaluate_round(view.state, info, self.node, lease_lost=lease_lost)

    def wait_for_change(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until the state or any alive key changes.

        Changes are counted from the state last returned by :meth:`next_rendezvous` or
        :meth:`check_round`, or reported by this method, so none is missed between a
        :meth:`check_round` and this call.

        Returns:
            True on a change, False on timeout.
        """
        with self._cursor_lock:
            since = self._cursor
        if since == 0:
            since = self._store.read([self._keys.rdzv_state]).revision
            self._advance(since)
        changed = self._store.wait_change(self._watch, since, timeout)
        if changed:
            self._advance(self._store.read([self._keys.rdzv_state]).revision)
        return changed

    def leave(self, reason: str) -> None:
        """Leave the rendezvous gracefully (``"succeeded"``, ``"scale_down"``, ``"shutdown"``).

        Removes this node from the participants and waiting lists and records
        ``reason`` in the state until the round advances, so peers report
        ``participant_left``, not ``participant_lost``. Keeps the lease (see
        :meth:`shutdown`).

        Raises:
            RendezvousTimeoutError: not done within ``close_timeout``.
        """
        if not reason:
            raise ValueError("a departure needs a reason")
        with self._op_lock:
            step = functools.partial(
                leave_step, node=self.node, settings=self.settings, reason=reason
            )
            self._run("leave", step, self.settings.close_timeout)

    def close(self, reason: dict[str, Any]) -> None:
        """Close the rendezvous for the whole job; ``reason`` (a JSON object) is stored.

        Every node's :meth:`next_rendezvous` then raises :class:`RendezvousClosedError`
        and :meth:`check_round` reports ``closed``. A second close keeps the first reason.

        Raises:
            ValueError: ``reason`` is not JSON-serializable.
            RendezvousTimeoutError: not done within ``close_timeout``.
        """
        json.dumps(reason, allow_nan=False)  # fail here, not in the middle of a write
        with self._op_lock:
            self._run(
                "close",
                functools.partial(close_step, reason=dict(reason)),
                self.settings.close_timeout,
            )

    def closed_reason(self) -> dict[str, Any] | None:
        """The reason the rendezvous was closed (``{}`` if none given); ``None`` while open."""
        state = self._sync().state
        if not state.closed:
            return None
        return dict(state.closed_reason or {})

    def shutdown(self) -> None:
        """Stop the keep-alive and revoke the lease: the alive key vanishes at once.

        Does not change the state: peers see this node as lost unless it called
        :meth:`leave` before. Final: a later :meth:`next_rendezvous` raises
        :class:`RendezvousError`. Idempotent; an unreachable etcd is logged, and the
        lease then expires after ``lease_ttl`` seconds.
        """
        with self._lease_lock:
            self._shut_down = True
            lease = self._lease
        if lease is None:
            return
        try:
            lease.revoke()
        except EtcdUnavailableError as exc:
            log.warning(
                "%s: cannot revoke lease %x (%s); it expires by its TTL", self.node, lease.id, exc
            )

    # -------------------------------------------------------------------- internals

    def _advance(self, revision: int) -> None:
        with self._cursor_lock:
            self._cursor = max(self._cursor, revision)

    def _ensure_alive(self) -> None:
        """Hold a live lease and write our alive key bound to it."""
        with self._lease_lock:
            if self._shut_down:
                raise RendezvousError(f"{self.node}: the rendezvous handler was shut down")
            value = json.dumps(
                {
                    "node": self.node,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": time.time(),
                }
            ).encode()
            for _ in range(3):
                lease = self._lease
                if lease is None or lease.lost:
                    if lease is not None:
                        log.warning("%s: lease %x lost; taking a new one", self.node, lease.id)
                    lease = self._lease = self._store.grant_lease(self.settings.lease_ttl)
                try:
                    self._store.put(self._keys.alive(self.node), value, lease=lease.id)
                    return
                except EtcdLeaseNotFoundError:
                    lease.stop_keep_alive()
                    self._lease = None
            raise RendezvousError(f"{self.node}: cannot keep an etcd lease alive")

    def _read(self) -> _View:
        snap = self._store.read(self._watch)
        alive = frozenset(
            key[len(self._keys.alive_prefix) :]
            for key in snap.values
            if key.startswith(self._keys.alive_prefix)
        )
        got = snap.values.get(self._keys.rdzv_state)
        if got is None:
            state, token = RendezvousState(run_id=self.settings.run_id), None
        else:
            state = decode_state(got[0], run_id=self.settings.run_id, where=self._keys.rdzv_state)
            token = got[1]
        return _View(state, token, alive, snap.revision)

    def _write(self, view: _View, new: RendezvousState) -> bool:
        """Compare-and-set ``new`` over ``view``; False when someone wrote first."""
        result = self._backend.set_state(encode_state(new), view.token)
        return result is not None and result[2]

    def _sync(self) -> _View:
        """Read the state and write back the removal of dead nodes, if any."""
        while True:
            view = self._read()
            clean, dead = sanitize(view.state, view.alive, self.settings)
            if not dead:
                return view
            if self._write(view, clean):
                self._log_dead(view.state, dead)

    def _log_dead(self, state: RendezvousState, dead: tuple[str, ...]) -> None:
        log.warning(
            "%s: removed %s from round %d of %s: etcd lease gone (node dead or cut off)",
            self.node, ", ".join(dead), state.round, self.settings.run_id,
        )  # fmt: skip

    def _run(
        self,
        what: str,
        step_fn: Callable[[RendezvousState, Clock], Step],
        timeout: float,
        *,
        need_alive: bool = False,
    ) -> _View:
        """Drive ``step_fn`` until it finishes: read, sanitize, decide, write or wait.

        An etcd outage is ridden out until the operation's deadline (for a redundant
        node, for ``timeout`` seconds of outage); then its error propagates.

        Returns:
            the view the step finished on.

        Raises:
            RendezvousClosedError / RendezvousTimeoutError: as the step decides.
            EtcdUnavailableError: etcd stayed unreachable, see above.
        """
        op = _Operation(what, step_fn, timeout, time.monotonic() + timeout, need_alive)
        outage_since: float | None = None
        while True:
            try:
                view = self._turn(op)
            except EtcdUnavailableError as exc:
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    log.warning("%s: %s: etcd unavailable (%s); retrying", self.node, what, exc)
                limit = outage_since + timeout if op.untimed else op.deadline
                if now >= limit:
                    raise
                time.sleep(min(0.5, limit - now))
                continue
            if outage_since is not None:
                log.info("%s: %s: etcd reachable again", self.node, what)
                outage_since = None
            if view is not None:
                return view

    def _turn(self, op: _Operation) -> _View | None:
        """One read-decide-act cycle of ``op``; the view once the step finishes."""
        view = self._read()
        if op.need_alive and (self.node not in view.alive or self.lease_lost):
            self._ensure_alive()
            return None
        state, dead = sanitize(view.state, view.alive, self.settings)
        mono = time.monotonic()
        clock = Clock(
            now=time.time(),
            timed_out=mono > op.deadline,
            rollback_over=mono > op.deadline + ROLLBACK_PERIOD,
        )
        step = op.step_fn(state, clock)
        op.untimed = step.untimed
        if step.action is Action.WRITE and step.state is not None and step.state != state:
            if self._write(view, step.state):
                if dead:
                    self._log_dead(view.state, dead)
                log.info("%s: %s", self.node, step.note)
                if step.restart_timer:
                    op.deadline = time.monotonic() + op.timeout
            return None  # look again at what we (or the winner) wrote
        if dead:
            if self._write(view, state):
                self._log_dead(view.state, dead)
            return None
        if step.action is Action.FINISH:
            return view
        if step.action is Action.ERROR_CLOSED:
            reason = state.closed_reason
            raise RendezvousClosedError(
                f"rendezvous {self.settings.run_id} is closed"
                + (f": {json.dumps(reason)}" if reason else ""),
                reason,
            )
        if step.action is Action.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(
                f"{self.node}: {op.what} did not finish within {op.timeout:.1f}s "
                f"(round {state.round}: {len(state.participants)} of "
                f"min {self.settings.min_nodes}/max {self.settings.max_nodes} nodes, "
                f"complete={state.complete})"
            )
        self._wait(view.revision, step, op.deadline)
        return None

    def _wait(self, revision: int, step: Step, deadline: float) -> None:
        limits = [MAX_WAIT]
        if not step.untimed:
            mono = time.monotonic()
            end = deadline if mono <= deadline else deadline + ROLLBACK_PERIOD
            limits.append(end - mono)
        if step.wake_at is not None:
            limits.append(step.wake_at - time.time())
        timeout = max(min(limits), 0.0) + 0.005  # a hair past the deadline being waited for
        self._store.wait_change(self._watch, revision, timeout)
