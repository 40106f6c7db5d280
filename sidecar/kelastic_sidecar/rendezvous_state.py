"""The dynamic rendezvous state machine, pure and etcd-free.

:class:`RendezvousState` (JSON with a ``version`` field, validated by
:func:`decode_state`; never pickle), its transitions (torch's ``_RendezvousStateHolder``
semantics: participants, wait list, redundancy list, last call, close, the epilogue of
removing a participant), the *steps* a handler takes towards joining, exiting, leaving or
closing (:func:`join_step` ... each returns the :class:`Action` to take and the new
state), and :func:`evaluate_round`, which tells a running round whether it can go on.
:mod:`kelastic_sidecar.rendezvous` runs these against etcd.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kelastic._safejson import UnsafeJSONError, loads_bounded

log = logging.getLogger("kelastic_sidecar.rendezvous")


#: Version of the JSON state this module reads and writes.
STATE_VERSION = 1
#: Seconds after a join timeout during which a node still tries to remove itself (torch's value).
ROLLBACK_PERIOD = 5.0
#: Longest single wait, seconds: a safety net under the event-driven wake-ups.
MAX_WAIT = 30.0
#: Most join requests one state write applies (:func:`admit_requests`). Each costs the
#: write's etcd transaction a compare and a delete, and etcd refuses a transaction with
#: more than ``--max-txn-ops`` (default 128) compares or operations; the rest are applied
#: by the next write.
MAX_ADMITTED_PER_WRITE = 100

# Bounds of a decoded state (:func:`decode_state`): anything beyond is corrupt or hostile.
#: Largest state accepted, bytes (etcd's default request limit is 1.5 MiB).
MAX_STATE_BYTES = 2 * 1024 * 1024
#: Highest round number (2**53: exact as a float, so every JSON reader agrees on it).
MAX_ROUND = 2**53
#: Highest rank of a node.
MAX_RANK = 2**20
#: Longest node name, run id or departure reason, characters.
MAX_NAME_LEN = 1024
#: Latest deadline accepted, seconds since the epoch (year 5138).
MAX_DEADLINE = 1e11

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


def _is_name(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_LEN


def _names(doc: Mapping[str, Any], name: str, where: str) -> frozenset[str]:
    value = doc[name]
    if not isinstance(value, list) or not all(_is_name(n) for n in value):
        raise CorruptStateError(f"{where}: '{name}' must be a list of node names")
    if len(set(value)) != len(value):
        raise CorruptStateError(f"{where}: '{name}' lists a node twice")
    return frozenset(value)


def _deadline(value: object, where: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CorruptStateError(f"{where}: 'deadline' must be a number or null")
    if not 0 <= value <= MAX_DEADLINE:  # loads_bounded already refused NaN and infinities
        raise CorruptStateError(f"{where}: 'deadline' {value!r} is out of range")
    return float(value)


def decode_state(raw: bytes, *, run_id: str | None = None, where: str = "state") -> RendezvousState:
    """Parse and strictly validate a state written by :func:`encode_state`.

    Hostile input is bounded before it is parsed or used: at most
    :data:`MAX_STATE_BYTES` bytes nested at most 32 deep, integers of at most 19 digits,
    finite numbers only; ``round`` <= :data:`MAX_ROUND`, ranks <= :data:`MAX_RANK`,
    ``deadline`` in ``0..MAX_DEADLINE`` seconds since the epoch, names and reasons of
    1..:data:`MAX_NAME_LEN` characters.

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
        doc = loads_bounded(raw, max_bytes=MAX_STATE_BYTES)
    except UnsafeJSONError as exc:
        raise CorruptStateError(f"{where}: {exc}: {raw[:80]!r}") from None
    if not isinstance(doc, dict):
        raise CorruptStateError(f"{where}: not a JSON object: {raw[:80]!r}")
    version = doc.get("version")
    if not _is_int(version) or version < 1:
        raise CorruptStateError(f"{where}: no state version: {raw[:80]!r}")
    if version != STATE_VERSION:
        raise RendezvousStateError(
            f"{where}: state version {version}, this kelastic reads {STATE_VERSION}"
        )
    missing, unknown = _FIELDS - doc.keys(), doc.keys() - _FIELDS
    if missing or unknown:
        raise CorruptStateError(
            f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)[:10]}"
        )
    if not _is_name(doc["run_id"]):
        raise CorruptStateError(f"{where}: 'run_id' must be a non-empty string")
    if run_id is not None and doc["run_id"] != run_id:
        raise RendezvousStateError(
            f"{where}: belongs to run {doc['run_id']!r}, not {run_id!r} (stale or shared key?)"
        )
    if not _is_int(doc["round"]) or not 0 <= doc["round"] <= MAX_ROUND:
        raise CorruptStateError(f"{where}: 'round' must be an integer in 0..{MAX_ROUND}")
    for name in ("complete", "closed"):
        if not isinstance(doc[name], bool):
            raise CorruptStateError(f"{where}: '{name}' must be true or false")
    deadline = _deadline(doc["deadline"], where)
    if doc["closed_reason"] is not None and not isinstance(doc["closed_reason"], dict):
        raise CorruptStateError(f"{where}: 'closed_reason' must be an object or null")
    participants = doc["participants"]
    if not isinstance(participants, dict) or not all(
        _is_name(n) and _is_int(r) and 0 <= r <= MAX_RANK for n, r in participants.items()
    ):
        raise CorruptStateError(
            f"{where}: 'participants' must map node names to ranks in 0..{MAX_RANK}"
        )
    departed = doc["departed"]
    if not isinstance(departed, dict) or not all(
        _is_name(n) and isinstance(r, str) and len(r) <= MAX_NAME_LEN for n, r in departed.items()
    ):
        raise CorruptStateError(f"{where}: 'departed' must map node names to reasons")
    wait_list = _names(doc, "wait_list", where)
    redundancy = _names(doc, "redundancy_list", where)
    lost = _names(doc, "lost", where)
    members = set(participants)
    if members & wait_list or members & redundancy or wait_list & redundancy:
        raise CorruptStateError(f"{where}: a node is listed both as participant and waiting")
    ranks = list(participants.values())
    if doc["complete"] and len(set(ranks)) != len(ranks):
        raise CorruptStateError(f"{where}: ranks of a complete round must be distinct")
    return RendezvousState(
        run_id=doc["run_id"],
        round=doc["round"],
        complete=doc["complete"],
        deadline=deadline,
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
    (see :data:`MAX_ADMITTED_PER_WRITE`).

    Returns:
        the new state and the requesters applied (in the order applied).
    """
    admitted: list[str] = []
    for node in sorted(set(requesters), key=name_order):
        if state.closed or len(admitted) >= limit:
            break
        if node in state.participants or node in state.wait_list or node in state.redundancy_list:
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
