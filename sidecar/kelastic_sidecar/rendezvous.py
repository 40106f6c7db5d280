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

Differences from torch, each for a reason (docs/architecture.md, "Rendezvous"):

- the state is JSON with a ``version`` field, validated strictly and within bounds on
  read (:func:`decode_state`); never pickle. A corrupt state (undecodable, out of
  bounds, ill-typed: :class:`CorruptStateError`) is logged, counted
  (:attr:`EtcdRendezvousHandler.corrupt_states`) and read as a fresh state of a round
  above any used before (the etcd revision, or this node's highest round + 1), which
  the next write puts over it by compare-and-set; the round's nodes then re-form.
  A state of another version or run is never overwritten: it raises
  :class:`RendezvousStateError`;
- waiting is event-driven (etcd watches on the state key and the alive prefix);
- liveness is an etcd lease per node: a node writes ``Keys.alive(node)`` bound to its
  lease before it touches the state, and any node that reads the state removes the
  participants and waiters whose alive key is gone (:func:`sanitize`), in the same
  compare-and-set as its own change;
- graceful departures (:meth:`EtcdRendezvousHandler.leave`, and the exit before a
  re-rendezvous) are recorded for the current round, so peers can tell a node that
  left from one that died (:meth:`EtcdRendezvousHandler.check_round`).
- few etcd requests per join, so that many nodes can join at once: every write is one
  transaction that also returns the view after it (after a lost compare-and-set, what
  the winner wrote), so no read follows a write; a joining node writes a *join
  request* (``rdzv/joining/<node>``, bound to its lease) together with its alive key,
  and whoever writes the state for its own join applies the pending requests of the
  others too (:func:`~kelastic_sidecar.rendezvous_state.admit_requests`), in the same
  transaction, which deletes them and fails if one was withdrawn meanwhile. A node
  withdraws its request before it acts on its own join timeout. The requests only
  save writes: each node still writes its own join if nobody admitted it first.

The state machine is pure: :class:`~kelastic_sidecar.rendezvous_state.RendezvousState`
plus the transition and step functions of :mod:`kelastic_sidecar.rendezvous_state`,
unit-testable without etcd. :class:`EtcdRendezvousHandler` runs the
steps against etcd. Deadlines in the state are wall-clock seconds (``time.time()``);
operation timeouts are measured with ``time.monotonic()``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kelastic.contract import Keys

from .etcd_backend import EtcdRendezvousBackend
from .etcd_store import (
    EtcdLeaseNotFoundError,
    EtcdStore,
    EtcdUnavailableError,
    Lease,
    Snapshot,
)
from .etcd_watch import Watcher
from .rendezvous_state import (
    CLOSED,
    DEPARTURE_REJOIN,
    HEALTHY,
    LEASE_LOST,
    MAX_WAIT,
    NODES_WAITING,
    PARTICIPANT_LEFT,
    PARTICIPANT_LOST,
    ROLLBACK_PERIOD,
    ROUND_ADVANCED,
    Action,
    Clock,
    CorruptStateError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RendezvousStateError,
    RendezvousTimeoutError,
    RoundCheck,
    Step,
    admit_requests,
    close_step,
    decode_state,
    encode_state,
    evaluate_round,
    exit_step,
    join_step,
    leave_step,
    sanitize,
)

__all__ = [
    "CLOSED",
    "DEPARTURE_REJOIN",
    "HEALTHY",
    "LEASE_LOST",
    "LEAVE_OUTAGE_TIMEOUT",
    "NODES_WAITING",
    "PARTICIPANT_LEFT",
    "PARTICIPANT_LOST",
    "ROUND_ADVANCED",
    "CorruptStateError",
    "EtcdRendezvousHandler",
    "RendezvousClosedError",
    "RendezvousError",
    "RendezvousInfo",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RoundCheck",
]

log = logging.getLogger("kelastic_sidecar.rendezvous")

#: Seconds :meth:`EtcdRendezvousHandler.leave` rides out an etcd outage.
LEAVE_OUTAGE_TIMEOUT = 5.0
#: Seconds, beyond the lease TTL, that peers get to write their alive key again after an
#: etcd outage that outlasted the TTL (:meth:`EtcdRendezvousHandler.check_round`).
RECOVERY_GRACE = 3.0

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
    request_join: bool = False  # hold a join request while running (next_rendezvous)
    admit: bool = False  # our writes apply the other nodes' join requests too


@dataclass(frozen=True)
class _View:
    """A sanitized state as read from etcd."""

    state: RendezvousState
    token: int | None  # mod_revision of the state key; None when there is none yet
    alive: frozenset[str]
    revision: int  # store revision of the read
    departing: dict[str, str]  # node -> reason of the operator's departure notices
    joining: dict[str, int]  # node -> mod_revision of its pending join request
    # The state came from a watch event, the rest from an earlier read: good for
    # finishing an operation, not for deciding a write (see EtcdRendezvousHandler._wait).
    partial: bool = False


class EtcdRendezvousHandler:
    """Runs the dynamic rendezvous for one node against etcd.

    Args:
        store: the etcd client.
        keys: the job's key layout (state at ``keys.rdzv_state``, liveness under
            ``keys.alive_prefix``).
        node: this node's name (the Pod name); unique in the job, no ``/``.
        settings: the rendezvous settings.
        on_corrupt: called (on the reading thread) with each :class:`CorruptStateError`
            met, after it is logged and counted; for a metric. Keep it quick.

    Attributes:
        corrupt_states: corrupt states read (and replaced on the next write).

    Thread-safe: ``check_round``/``wait_for_change`` may run in another thread than
    ``next_rendezvous``. etcd failures that outlast the store's timeout propagate as
    :class:`~kelastic_sidecar.etcd_store.EtcdUnavailableError`.
    """

    def __init__(
        self,
        store: EtcdStore,
        keys: Keys,
        node: str,
        settings: RendezvousSettings,
        on_corrupt: Callable[[CorruptStateError], None] | None = None,
    ) -> None:
        if not node or "/" in node:
            raise ValueError(f"node name must be non-empty and contain no '/': {node!r}")
        self._store = store
        self._keys = keys
        self.node = node
        self.settings = settings
        self._backend = EtcdRendezvousBackend(store, keys.rdzv_state, name="kelastic")
        # What a waiting node must notice: a state write, a departure notice, and a
        # lease gone (its alive key deleted); a peer's alive key appearing changes
        # nothing by itself (its join request and state write follow).
        self._watch = [keys.rdzv_state, keys.departing_prefix]
        self._watch_gone = [keys.alive_prefix]
        # Join requests: a joining node announces itself here (bound to its lease), and
        # whoever writes the state for its own join applies the others' requests too.
        self._joining_prefix = keys.joining_prefix
        self._joining_key = keys.joining(node)
        self._reads = [
            keys.rdzv_state,
            keys.alive_prefix,
            keys.departing_prefix,
            self._joining_prefix,
        ]
        self._names_only = [keys.alive_prefix, self._joining_prefix]  # values unused
        self._join_requested = False  # our request was written in this next_rendezvous
        self._lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self._announced = False  # our alive key was written at least once
        self._watcher: Watcher | None = None  # created by open()
        self._shut_down = False
        self._op_lock = threading.Lock()  # one state-changing operation at a time
        self._cursor = 0  # store revision up to which wait_for_change has reported
        # After we took a new lease in a round that went on (etcd was away longer than
        # the TTL): until then, a participant's missing alive key does not count.
        self._grace_until = 0.0
        self._recheck_due = False
        self._cursor_lock = threading.Lock()
        self._on_corrupt = on_corrupt
        self.corrupt_states = 0
        self._max_round = -1  # highest round read from a valid state

    # ------------------------------------------------------------------ public API

    @property
    def lease_lost(self) -> bool:
        """True when this node's lease was lost (expired, or revoked by :meth:`shutdown`)."""
        lease = self._lease
        return lease is not None and lease.lost

    def open(self) -> None:
        """Open this node's etcd session ahead of the first rendezvous.

        etcd's session pattern (``concurrency.NewSession``, and ``clientv3``'s one watch
        stream per client): the lease that carries the node's liveness is granted once
        and kept alive in the background, and the watch a waiting node needs (the
        state, departure notices, alive keys deleted) is created once on a long-lived
        stream (:class:`~kelastic_sidecar.etcd_watch.Watcher`). Every round then
        reuses both, so no rendezvous waits for a grant or opens a stream. Call it when
        the node starts (the sidecar does so while its trainer container starts).
        Optional: :meth:`next_rendezvous` opens what is missing itself. Idempotent;
        nothing is written but the lease.

        Raises:
            RendezvousError: the handler was shut down.
            EtcdUnavailableError: etcd stayed unreachable for the store's timeout.
        """
        with self._lease_lock:
            if self._shut_down:
                raise RendezvousError(f"{self.node}: the rendezvous handler was shut down")
            if self._lease is None or self._lease.lost:
                self._lease = self._store.grant_lease(self.settings.lease_ttl)
        self._waiter()

    def _waiter(self) -> Watcher:
        """The session's watcher, created on first use when :meth:`open` was not called."""
        with self._lease_lock:
            if self._shut_down:
                raise RendezvousError(f"{self.node}: the rendezvous handler was shut down")
            if self._watcher is None:
                self._watcher = Watcher(self._store, self._watch, deletions=self._watch_gone)
            return self._watcher

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
            self._join_requested = False
            view: _View | None = None
            try:
                view = self._run(
                    "exit",
                    functools.partial(exit_step, node=self.node, settings=self.settings),
                    timeout,
                    need_alive=True,
                    request_join=True,  # written with the alive key: one request less
                )
                view = self._run(
                    "join",
                    functools.partial(join_step, node=self.node, settings=self.settings),
                    timeout,
                    need_alive=True,
                    request_join=True,
                    admit=True,
                    # what the exit finished on is current: no need to read again
                    view=None if view.partial else view,
                )
            finally:
                if self._join_requested and (view is None or self.node in view.joining):
                    self._withdraw_join_request()
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

        An etcd outage longer than the lease TTL (etcd stalled, or this node cut off from
        it) loses the leases, not the round: when our lease is gone but the round goes
        on with us in it, we take a new lease and write our alive key again, and the
        round stays healthy; for ``lease_ttl + RECOVERY_GRACE`` seconds after that, the
        participants of ``info`` are not removed for a missing alive key (they do the
        same), and :meth:`take_recheck` says when to check again. Only a node that does
        not come back, or that left, ends the round.

        Raises:
            EtcdUnavailableError: etcd stayed unreachable.
            RendezvousError: a new lease could not be kept alive.
            RendezvousStateError: the state in etcd is corrupt.
        """
        view = self._read()
        if self._lease_gone(view):
            if self._still_in(view.state, info):
                # etcd was away longer than the lease TTL (stalled, or cut off from us),
                # and the round goes on without us having left it: take a new lease and
                # write the alive key again instead of stopping the workers. The peers
                # get as long to do the same before a missing alive key counts.
                view = self._ensure_alive()
                self._grace_until = time.monotonic() + self.settings.lease_ttl + RECOVERY_GRACE
                self._recheck_due = False
                log.warning(
                    "%s: lease lost while etcd was away; alive again in round %d, which "
                    "goes on", self.node, info.round,
                )  # fmt: skip
            else:
                self._advance(view.revision)
                return evaluate_round(view.state, info, self.node, lease_lost=True)
        tolerate = info.participants if time.monotonic() < self._grace_until else ()
        view = self._sync(view, tolerate=frozenset(tolerate))
        self._advance(view.revision)  # the caller learns everything up to this read
        lease_lost = self.lease_lost or self.node not in view.alive
        return evaluate_round(view.state, info, self.node, lease_lost=lease_lost)

    def take_recheck(self) -> bool:
        """True once (then False) when the grace after an etcd outage (see
        :meth:`check_round`) is over: call :meth:`check_round` again, so that a peer that
        did not come back is counted lost."""
        if self._recheck_due or self._grace_until == 0.0:
            return False
        if time.monotonic() < self._grace_until:
            return False
        self._recheck_due = True
        return True

    def _lease_gone(self, view: _View) -> bool:
        """Whether our lease is gone: lost by the keep-alive (no refresh for a TTL, or
        etcd said so), or our alive key is missing and etcd says the lease is gone.

        An alive key deleted while our lease lives is the operator taking this node out
        (its Pod is going): that is not a lost lease.
        """
        lease = self._lease
        if lease is None:
            return False
        if lease.lost:
            return True
        return self.node not in view.alive and not lease.check()

    def _still_in(self, state: RendezvousState, info: RendezvousInfo) -> bool:
        """Whether the round of ``info`` goes on with this node in it."""
        return (
            not state.closed
            and state.round == info.round
            and self.node in state.participants
            and self.node not in state.departed
        )

    def wait_for_change(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until the state changes, an alive key goes or
        a departure notice is written (a peer's alive key appearing does not count).

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
        changed = self._waiter().wait(since, timeout)
        if changed:
            self._advance(self._store.read([self._keys.rdzv_state]).revision)
        return changed

    def leave(self, reason: str) -> None:
        """Leave the rendezvous gracefully (``"succeeded"``, ``"scale_down"``, ``"shutdown"``).

        Removes this node from the participants and waiting lists and records
        ``reason`` in the state until the round advances, so peers report
        ``participant_left``, not ``participant_lost``. Keeps the lease (see
        :meth:`shutdown`).

        A departure is a courtesy to the peers (without it they count the node lost
        when its lease expires): an etcd outage is ridden out for at most
        :data:`LEAVE_OUTAGE_TIMEOUT` seconds, so a node that stops while etcd is down
        does not hang on to its Pod for the whole ``close_timeout``.

        Raises:
            RendezvousTimeoutError: not done within ``close_timeout``.
            EtcdUnavailableError: etcd stayed unreachable, see above.
        """
        if not reason:
            raise ValueError("a departure needs a reason")
        with self._op_lock:
            step = functools.partial(
                leave_step, node=self.node, settings=self.settings, reason=reason
            )
            self._run(
                "leave",
                step,
                self.settings.close_timeout,
                outage_timeout=min(self.settings.close_timeout, LEAVE_OUTAGE_TIMEOUT),
            )

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
        """Close the watch, stop the keep-alive and revoke the lease: the alive key vanishes.

        Does not change the state: peers see this node as lost unless it called
        :meth:`leave` before. Final: a later :meth:`next_rendezvous` raises
        :class:`RendezvousError`. Idempotent; an unreachable etcd is logged, and the
        lease then expires after ``lease_ttl`` seconds.
        """
        with self._lease_lock:
            self._shut_down = True
            lease, watcher = self._lease, self._watcher
        if watcher is not None:
            watcher.close()
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

    def _ensure_alive(self, request_join: bool = False) -> _View:
        """Hold a live lease and write our alive key bound to it; the view right after.

        With ``request_join``, our join request is written too. The writes and the read
        are one etcd transaction.
        """
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
                puts = {self._keys.alive(self.node): value}
                if request_join:
                    puts[self._joining_key] = b"join"
                try:
                    snap = self._store.put_read(
                        puts, self._reads, lease=lease.id, keys_only=self._names_only
                    )
                    self._join_requested = self._join_requested or request_join
                    self._announced = True
                    return self._view(snap)
                except EtcdLeaseNotFoundError:
                    lease.stop_keep_alive()
                    self._lease = None
            raise RendezvousError(f"{self.node}: cannot keep an etcd lease alive")

    def _read(self) -> _View:
        return self._view(self._store.read(self._reads, keys_only=self._names_only))

    def _view(self, snap: Snapshot) -> _View:
        """The view of a snapshot of the state key, the alive, departing and joining keys."""
        alive: set[str] = set()
        departing: dict[str, str] = {}
        joining: dict[str, int] = {}
        alive_prefix, departing_prefix = self._keys.alive_prefix, self._keys.departing_prefix
        for key, (raw, revision) in snap.values.items():
            if key.startswith(alive_prefix):
                alive.add(key[len(alive_prefix) :])
            elif key.startswith(self._joining_prefix):
                joining[key[len(self._joining_prefix) :]] = revision
            elif key.startswith(departing_prefix):
                departing[key[len(departing_prefix) :]] = raw.decode(errors="replace")
        got = snap.values.get(self._keys.rdzv_state)
        if got is None:
            state, token = RendezvousState(run_id=self.settings.run_id), None
        else:
            try:
                state = decode_state(
                    got[0], run_id=self.settings.run_id, where=self._keys.rdzv_state
                )
            except CorruptStateError as exc:
                state = self._replacement(exc, snap.revision)
            else:
                self._max_round = max(self._max_round, state.round)
            token = got[1]
        return _View(state, token, frozenset(alive), snap.revision, departing, joining)

    def _replacement(self, exc: CorruptStateError, revision: int) -> RendezvousState:
        """A fresh state to put over a corrupt one. Its round is above every round used
        before: each round took at least one write of the state key, so rounds stay
        below the store's revision (and below this node's highest round + 1)."""
        self.corrupt_states += 1
        fresh = RendezvousState(
            run_id=self.settings.run_id, round=max(revision, self._max_round + 1)
        )
        log.error("%s; replacing it with a fresh state of round %d", exc, fresh.round)
        if self._on_corrupt is not None:
            try:
                self._on_corrupt(exc)
            except Exception:
                log.exception("on_corrupt callback failed")
        return fresh

    def _write(
        self, view: _View, new: RendezvousState, admitted: tuple[str, ...] = ()
    ) -> tuple[bool, _View]:
        """Compare-and-set ``new`` over ``view``: (whether it was written, the view after).

        One etcd transaction: the view after the write, or after a lost write what the
        winner wrote, comes back with it, so no read follows. The join requests of
        ``admitted`` (applied in ``new``) must still be those of ``view`` and are
        deleted with the write, and so is ours once ``new`` lists us.
        """
        require = {self._joining_prefix + n: view.joining[n] for n in admitted}
        delete = list(require)
        listed = new.participants.keys() | new.wait_list | new.redundancy_list
        if self.node in view.joining and self.node in listed:
            delete.append(self._joining_key)
        ok, snap = self._backend.set_state_and_read(
            encode_state(new),
            view.token,
            self._reads[1:],
            keys_only=self._names_only,
            require=require,
            delete=delete,
        )
        return ok, self._view(snap)

    def _request_join(self) -> _View:
        """Write our join request (bound to our lease); the view right after."""
        lease = self._lease
        snap = self._store.put_read(
            {self._joining_key: b"join"},
            self._reads,
            lease=lease.id if lease is not None else None,
            keys_only=self._names_only,
        )
        self._join_requested = True
        return self._view(snap)

    def _withdraw_join_request(self) -> None:
        """Delete our join request (best effort: it goes with our lease anyway).

        It is not written again in this :meth:`next_rendezvous`.
        """
        try:
            self._store.delete(self._joining_key)
        except EtcdUnavailableError as exc:
            log.warning("%s: cannot withdraw the join request (%s)", self.node, exc)

    def _sync(self, view: _View | None = None, tolerate: frozenset[str] = frozenset()) -> _View:
        """Read the state (unless ``view`` is current) and write back the removal of dead
        nodes, if any; the nodes of ``tolerate`` are not removed for a missing alive key."""
        view = self._read() if view is None else view
        while True:
            alive = view.alive | tolerate
            clean, dead = sanitize(view.state, alive, self.settings, view.departing)
            if not dead:
                return view
            before = view.state
            ok, view = self._write(view, clean)
            if ok:
                self._log_dead(before, dead)

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
        request_join: bool = False,
        admit: bool = False,
        view: _View | None = None,
        outage_timeout: float | None = None,
    ) -> _View:
        """Drive ``step_fn`` until it finishes: read, sanitize, decide, write or wait.

        Starts from ``view`` when given (a current view), else from a fresh read; each
        write's transaction returns the next view, so only waits are followed by a read.
        With ``request_join`` our join request is written first (once per
        :meth:`next_rendezvous`) and withdrawn before a timeout is acted on; with
        ``admit`` our writes apply the other nodes' join requests too
        (:func:`~kelastic_sidecar.rendezvous_state.admit_requests`).

        An etcd outage is ridden out until the operation's deadline (for a redundant
        node, for ``timeout`` seconds of outage; with ``outage_timeout``, for at most
        that many seconds of outage); then its error propagates.

        Returns:
            the view the step finished on.

        Raises:
            RendezvousClosedError / RendezvousTimeoutError: as the step decides.
            EtcdUnavailableError: etcd stayed unreachable, see above.
        """
        op = _Operation(what, step_fn, timeout, time.monotonic() + timeout, need_alive)
        op.request_join, op.admit = request_join, admit
        outage_since: float | None = None
        while True:
            try:
                if view is None:
                    if need_alive and not self._announced:  # a first join: no need to look
                        view = self._ensure_alive(request_join and not self._join_requested)
                    else:
                        view = self._read()
                view, finished = self._turn(op, view)
            except EtcdUnavailableError as exc:
                view = None
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    log.warning("%s: %s: etcd unavailable (%s); retrying", self.node, what, exc)
                limit = outage_since + timeout if op.untimed else op.deadline
                if outage_timeout is not None:
                    limit = min(limit, outage_since + outage_timeout)
                if now >= limit:
                    raise
                time.sleep(min(0.5, limit - now))
                continue
            if outage_since is not None:
                log.info("%s: %s: etcd reachable again", self.node, what)
                outage_since = None
            if finished and view is not None:
                return view

    def _turn(self, op: _Operation, view: _View) -> tuple[_View | None, bool]:
        """One decide-act cycle of ``op`` on ``view``.

        Returns:
            ``(view, True)`` once the step finishes; else ``(next view, False)``, the
            next view being ``None`` when it must be read afresh (after a wait).
        """
        wants_request = op.request_join and not self._join_requested
        if op.need_alive and (self.node not in view.alive or self.lease_lost):
            return self._ensure_alive(wants_request), False
        if wants_request:
            return self._request_join(), False
        state, dead = sanitize(view.state, view.alive, self.settings, view.departing)
        clock = self._clock(op)
        if op.request_join and clock.timed_out and self.node in view.joining:
            self._withdraw_join_request()  # first, so that nobody admits us any more
            return None, False
        step = op.step_fn(state, clock)
        op.untimed = step.untimed
        if step.action is Action.WRITE and step.state is not None and step.state != state:
            new: RendezvousState = step.state
            admitted: tuple[str, ...] = ()
            if op.admit and not clock.timed_out:
                requests = [n for n in view.joining if n != self.node and n in view.alive]
                new, admitted = admit_requests(new, requests, clock, settings=self.settings)
            ok, after = self._write(view, new, admitted)
            if ok:
                if dead:
                    self._log_dead(view.state, dead)
                log.info("%s: %s", self.node, step.note)
                if admitted:
                    log.info("%s: admitted %s with it", self.node, ", ".join(admitted))
                if step.restart_timer:
                    op.deadline = time.monotonic() + op.timeout
            return after, False  # look again at what we (or the winner) wrote
        if dead:
            ok, after = self._write(view, state)
            if ok:
                self._log_dead(view.state, dead)
            return after, False
        if step.action is Action.FINISH:
            return view, True
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
        finished = self._wait(op, view, step)
        return finished, finished is not None

    @staticmethod
    def _clock(op: _Operation) -> Clock:
        mono = time.monotonic()
        return Clock(
            now=time.time(),
            timed_out=mono > op.deadline,
            rollback_over=mono > op.deadline + ROLLBACK_PERIOD,
        )

    def _wait(self, op: _Operation, view: _View, step: Step) -> _View | None:
        """Wait for a change after ``view``, or until the step's or the op's deadline.

        While every change is a write of the state alone, its value comes with the
        watch event and no read is needed: the step is taken on it, and the wait goes
        on while it says wait. Neither waiting nor finishing needs the dead-node check
        that precedes a write (a deletion of an alive key is a change of another key;
        a finished join is checked by :meth:`check_round`), so the alive keys of
        ``view`` need not be current for them. When a round completes, its nodes thus
        do not all read the state at once.

        Returns:
            the view the operation finishes on (built from the event); ``None`` when
            the caller must read: a timeout, another change, or a step that writes.
        """
        watcher = self._waiter()
        while True:
            limits = [MAX_WAIT]
            if not step.untimed:
                mono = time.monotonic()
                end = op.deadline if mono <= op.deadline else op.deadline + ROLLBACK_PERIOD
                limits.append(end - mono)
            if step.wake_at is not None:
                limits.append(step.wake_at - time.time())
            timeout = max(min(limits), 0.0) + 0.005  # a hair past the deadline waited for
            if not watcher.wait(view.revision, timeout):
                return None
            got = watcher.value_if_only_change(self._keys.rdzv_state, view.revision)
            if got is None:
                return None
            try:
                state = decode_state(
                    got[0], run_id=self.settings.run_id, where=self._keys.rdzv_state
                )
            except CorruptStateError:
                return None  # a full read replaces it
            # joining: a finished join was admitted by a write that consumed its request
            view = replace(
                view, state=state, token=got[1], revision=got[1], joining={}, partial=True
            )
            clock = self._clock(op)
            if clock.timed_out:
                return None  # the timeout is handled on a full read
            step = op.step_fn(state, clock)
            op.untimed = step.untimed
            if step.action is Action.FINISH:
                return view
            if step.action is not Action.WAIT:
                return None
