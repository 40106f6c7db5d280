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
  others too (:func:`~kelastic_sidecar.rendezvous.steps.admit_requests`), in the same
  transaction, which deletes them and fails if one was withdrawn meanwhile. A node
  withdraws its request before it acts on its own join timeout. The requests only
  save writes: each node still writes its own join if nobody admitted it first.

The state machine is pure: :class:`~kelastic_sidecar.rendezvous.state.RendezvousState`
and its transitions (:mod:`kelastic_sidecar.rendezvous.state`) plus the step functions
of :mod:`kelastic_sidecar.rendezvous.steps`, unit-testable without etcd. Three classes
run it against etcd, as torch's ``DynamicRendezvousHandler`` splits its state holder,
operation executor and handler:
:class:`~kelastic_sidecar.rendezvous.holder.RendezvousStateHolder` (read, write and
sync the state by compare-and-set, the join requests, the node's lease, alive key and
watch), :class:`~kelastic_sidecar.rendezvous.executor.RendezvousExecutor` (runs an
operation: read, decide, write or wait) and :class:`EtcdRendezvousHandler` (the public
API; etcd failures leave it as one :class:`RendezvousConnectionError`, torch's term).
Deadlines in the state are wall-clock seconds (``time.time()``);
operation timeouts are measured with ``time.monotonic()``.

Over ~400 lines because it is one cohesive thing: the public handler (torch's
``RendezvousHandler`` API: next rendezvous, round checks, leave, close, shutdown) and the
one error its etcd failures become; this docstring, the rendezvous' design, is an eighth
of it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kelastic.contract import Keys
from kelastic.etcd_values import decode_departure
from kelastic_etcd import EtcdClient, EtcdError, EtcdUnavailable

from ..vocabulary import DEPARTURE_REJOIN
from .executor import RendezvousExecutor
from .holder import RendezvousStateHolder, View
from .state import (
    CLOSED,
    HEALTHY,
    LEASE_LOST,
    NODES_WAITING,
    PARTICIPANT_LEFT,
    PARTICIPANT_LOST,
    ROUND_ADVANCED,
    CorruptStateError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RendezvousStateError,
    RendezvousTimeoutError,
    RoundCheck,
)
from .steps import (
    close_step,
    evaluate_round,
    exit_step,
    join_step,
    leave_step,
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
    "RendezvousConnectionError",
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


class RendezvousFencedError(RendezvousError):
    """This node's Pod was declared lost by the operator (its Node was not Ready past the
    job's ``nodeLostSeconds``) and another Pod runs in its name: it must not join."""


class RendezvousConnectionError(RendezvousError, EtcdError):
    """etcd failed a rendezvous operation (torch's ``RendezvousConnectionError``): it stayed
    unreachable past the operation's patience, or refused a request.

    The client's error is the ``__cause__``: :class:`~kelastic_etcd.EtcdUnavailable`
    (retry later) or :class:`~kelastic_etcd.EtcdRefused`. Also an
    :class:`~kelastic_etcd.EtcdError`, so code that caught etcd's errors from the handler
    catches this.

    Attributes:
        endpoint: the etcd member last tried.
    """

    def __init__(self, node: str, cause: EtcdError) -> None:
        ConnectionError.__init__(self, f"{node}: rendezvous: {cause}")
        self.endpoint = cause.endpoint


@contextmanager
def _etcd_boundary(node: str) -> Iterator[None]:
    """Raise an etcd failure as :class:`RendezvousConnectionError`."""
    try:
        yield
    except RendezvousConnectionError:
        raise
    except EtcdError as exc:
        raise RendezvousConnectionError(node, exc) from exc


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

    Thread-safe: ``check_round``/``wait_for_change`` may run in another thread than
    ``next_rendezvous``. etcd failures (unreachable past an operation's patience, or a
    refused request) leave every public method as :class:`RendezvousConnectionError`.
    """

    def __init__(
        self,
        store: EtcdClient,
        keys: Keys,
        node: str,
        settings: RendezvousSettings,
        on_corrupt: Callable[[CorruptStateError], None] | None = None,
    ) -> None:
        if not node or "/" in node:
            raise ValueError(f"node name must be non-empty and contain no '/': {node!r}")
        self.node = node
        self.settings = settings
        self._store = store
        self._keys = keys
        #: Reads, writes and syncs the state; holds the lease, alive key and watch.
        self.state = RendezvousStateHolder(store, keys, node, settings, on_corrupt)
        #: Runs the operations (join, exit, leave, close) over :attr:`state`.
        self.executor = RendezvousExecutor(self.state)
        self._op_lock = threading.Lock()  # one state-changing operation at a time
        self._cursor = 0  # store revision up to which wait_for_change has reported
        # After we took a new lease in a round that went on (etcd was away longer than
        # the TTL): until then, a participant's missing alive key does not count.
        self._grace_until = 0.0
        self._recheck_due = False
        self._cursor_lock = threading.Lock()

    @property
    def corrupt_states(self) -> int:
        """Corrupt states read (and replaced on the next write)."""
        return self.state.corrupt_states

    # ------------------------------------------------------------------ public API

    @property
    def lease_lost(self) -> bool:
        """True when this node's lease was lost (expired, or revoked by :meth:`shutdown`)."""
        return self.state.lease_lost

    def open(self) -> None:
        """Open this node's etcd session ahead of the first rendezvous.

        etcd's session pattern (``concurrency.NewSession``, and ``clientv3``'s one watch
        stream per client): the lease that carries the node's liveness is granted once
        and kept alive in the background, and the watch a waiting node needs (the
        state, departure notices, alive keys deleted) is created once on a long-lived
        stream (:class:`~kelastic_etcd.watcher.Watcher`). Every round then
        reuses both, so no rendezvous waits for a grant or opens a stream. Call it when
        the node starts (the sidecar does so while its trainer container starts).
        Optional: :meth:`next_rendezvous` opens what is missing itself. Idempotent;
        nothing is written but the lease.

        Raises:
            RendezvousError: the handler was shut down.
            RendezvousConnectionError: etcd stayed unreachable for the store's timeout.
        """
        with _etcd_boundary(self.node):
            self.state.open()

    def next_rendezvous(self) -> RendezvousInfo:
        """Exit the current round if in one, then join the next and wait until it completes.

        Blocks up to ``join_timeout`` seconds (not counting time on the redundancy list).

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousFencedError: the operator declared this Pod incarnation lost
                (``settings.incarnation``; :meth:`kelastic.contract.Keys.fenced`): a
                Pod of its name runs elsewhere now.
            RendezvousTimeoutError: the round did not complete within ``join_timeout``.
            RendezvousStateError: the state in etcd is corrupt.
            RendezvousConnectionError: etcd stayed unreachable.
        """
        started = time.monotonic()
        with self._op_lock, _etcd_boundary(self.node):
            self._refuse_if_fenced(started + self.settings.join_timeout)
            timeout = self.settings.join_timeout
            self.state.join_requested = False
            view: View | None = None
            try:
                view = self.executor.run(
                    "exit",
                    functools.partial(exit_step, node=self.node, settings=self.settings),
                    timeout,
                    need_alive=True,
                    request_join=True,  # written with the alive key: one request less
                )
                view = self.executor.run(
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
                if self.state.join_requested and (view is None or self.node in view.joining):
                    self.state.withdraw_join_request()
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
        with _etcd_boundary(self.node):
            return len(self.state.sync().state.wait_list)

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
            RendezvousConnectionError: etcd stayed unreachable.
            RendezvousError: a new lease could not be kept alive.
            RendezvousStateError: the state in etcd is corrupt.
        """
        with _etcd_boundary(self.node):
            return self._check_round(info)

    def _check_round(self, info: RendezvousInfo) -> RoundCheck:
        view = self.state.read()
        if self.state.lease_gone(view):
            if self._still_in(view.state, info):
                # etcd was away longer than the lease TTL (stalled, or cut off from us),
                # and the round goes on without us having left it: take a new lease and
                # write the alive key again instead of stopping the workers. The peers
                # get as long to do the same before a missing alive key counts.
                view = self.state.ensure_alive()
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
        view = self.state.sync(view, tolerate=frozenset(tolerate))
        self._advance(view.revision)  # the caller learns everything up to this read
        lease_lost = self.lease_lost or self.node not in view.alive
        return evaluate_round(view.state, info, self.node, lease_lost=lease_lost)

    def _fenced(self) -> str | None:
        """Why this incarnation was fenced (:meth:`kelastic.contract.Keys.fenced`), None
        when it was not or has no uid (one etcd read, only on Kubernetes)."""
        uid = self.settings.incarnation
        got = self._store.get(self._keys.fenced(uid)) if uid else None
        return None if got is None else decode_departure(got[0])  # never raises

    def _fenced_or_unknown(self) -> str | None:
        """:meth:`_fenced`, or None when etcd does not answer: the operation goes on and
        rides out the outage as it would have (a leave is a courtesy to the peers)."""
        try:
            return self._fenced()
        except EtcdError:
            return None

    def _refuse_if_fenced(self, deadline: float) -> None:
        """Raise :class:`RendezvousFencedError` when this incarnation was fenced. An etcd
        outage is ridden out until ``deadline`` (``time.monotonic()``), as the join rides
        it out: a node cut off from etcd for longer than the client's timeout, as it
        begins its next rendezvous, joins once etcd answers again (before, this one read
        failed the Pod: the partition test's 60 s cut, 2026-11-27).

        Raises:
            EtcdUnavailable: etcd did not answer by ``deadline``.
        """
        outage = False
        while True:
            try:
                reason = self._fenced()
                break
            except EtcdUnavailable as exc:
                now = time.monotonic()
                if now >= deadline:
                    raise
                if not outage:
                    log.warning("%s: fence check: etcd unavailable (%s); retrying", self.node, exc)
                    outage = True
                time.sleep(min(0.5, deadline - now))
        if reason is not None:
            raise RendezvousFencedError(
                f"{self.node}: this Pod (uid {self.settings.incarnation}) was declared lost "
                f"by the operator ({reason}); a Pod of its name runs elsewhere now: not joining"
            )

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
        store, state_key = self.state.store, self.state.keys.rdzv_state
        with _etcd_boundary(self.node):
            if since == 0:
                since = store.read([state_key]).revision
                self._advance(since)
            changed = self.state.waiter().wait(since, timeout)
            if changed:
                self._advance(store.read([state_key]).revision)
        return changed

    def leave(self, reason: str) -> None:
        """Leave the rendezvous gracefully (``"succeeded"``, ``"scale_down"``, ``"shutdown"``).

        Removes this node from the participants and waiting lists and records
        ``reason`` in the state until the round advances, so peers report
        ``participant_left``, not ``participant_lost``. Keeps the lease (see
        :meth:`shutdown`). A fenced incarnation (see :meth:`next_rendezvous`) leaves
        nothing: the node of its name is another Pod's now.

        A departure is a courtesy to the peers (without it they count the node lost
        when its lease expires): an etcd outage is ridden out for at most
        :data:`LEAVE_OUTAGE_TIMEOUT` seconds, so a node that stops while etcd is down
        does not hang on to its Pod for the whole ``close_timeout``.

        Raises:
            RendezvousTimeoutError: not done within ``close_timeout``.
            RendezvousConnectionError: etcd stayed unreachable, see above.
        """
        if not reason:
            raise ValueError("a departure needs a reason")
        with self._op_lock, _etcd_boundary(self.node):
            if self._fenced_or_unknown() is not None:  # its name is the new Pod's
                log.warning("%s: fenced by the operator; not leaving in its name", self.node)
                return
            step = functools.partial(
                leave_step, node=self.node, settings=self.settings, reason=reason
            )
            self.executor.run(
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
        with self._op_lock, _etcd_boundary(self.node):
            if self._fenced_or_unknown() is not None:  # a lost Pod's view is not the job's
                log.warning("%s: fenced by the operator; not closing the rendezvous", self.node)
                return
            self.executor.run(
                "close",
                functools.partial(close_step, reason=dict(reason)),
                self.settings.close_timeout,
            )

    def closed_reason(self) -> dict[str, Any] | None:
        """The reason the rendezvous was closed (``{}`` if none given); ``None`` while open."""
        with _etcd_boundary(self.node):
            state = self.state.sync().state
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
        self.state.shutdown()

    def _advance(self, revision: int) -> None:
        with self._cursor_lock:
            self._cursor = max(self._cursor, revision)
