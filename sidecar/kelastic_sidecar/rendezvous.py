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
from dataclasses import dataclass
from typing import Any

from kelastic.contract import Keys

from .etcd_backend import EtcdRendezvousBackend
from .etcd_store import EtcdLeaseNotFoundError, EtcdStore, EtcdUnavailableError, Lease
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
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RendezvousStateError,
    RendezvousTimeoutError,
    RoundCheck,
    Step,
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
    "NODES_WAITING",
    "PARTICIPANT_LEFT",
    "PARTICIPANT_LOST",
    "ROUND_ADVANCED",
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
    departing: dict[str, str]  # node -> reason of the operator's departure notices


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
        self._watch = [keys.rdzv_state, keys.alive_prefix, keys.departing_prefix]
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
        departing = {
            key[len(self._keys.departing_prefix) :]: raw.decode(errors="replace")
            for key, (raw, _) in snap.values.items()
            if key.startswith(self._keys.departing_prefix)
        }
        got = snap.values.get(self._keys.rdzv_state)
        if got is None:
            state, token = RendezvousState(run_id=self.settings.run_id), None
        else:
            state = decode_state(got[0], run_id=self.settings.run_id, where=self._keys.rdzv_state)
            token = got[1]
        return _View(state, token, alive, snap.revision, departing)

    def _write(self, view: _View, new: RendezvousState) -> bool:
        """Compare-and-set ``new`` over ``view``; False when someone wrote first."""
        result = self._backend.set_state(encode_state(new), view.token)
        return result is not None and result[2]

    def _sync(self) -> _View:
        """Read the state and write back the removal of dead nodes, if any."""
        while True:
            view = self._read()
            clean, dead = sanitize(view.state, view.alive, self.settings, view.departing)
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
        state, dead = sanitize(view.state, view.alive, self.settings, view.departing)
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
