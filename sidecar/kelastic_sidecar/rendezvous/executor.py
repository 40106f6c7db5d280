"""The rendezvous operation executor: drives one operation (join, exit, leave, close)
to its end: read, sanitize, decide (a step function of
:mod:`kelastic_sidecar.rendezvous.steps`), then write or wait, riding out etcd outages
up to the operation's deadline. The reads and writes are the
:class:`~kelastic_sidecar.rendezvous.holder.RendezvousStateHolder`'s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kelastic_etcd import EtcdLeaseNotFound, EtcdUnavailable

from .holder import RendezvousStateHolder, View
from .state import (
    MAX_WAIT,
    ROLLBACK_PERIOD,
    CorruptStateError,
    RendezvousClosedError,
    RendezvousState,
    RendezvousTimeoutError,
    decode_state,
    sanitize,
)
from .steps import Action, Clock, Step, admit_requests

log = logging.getLogger("kelastic_sidecar.rendezvous")


@dataclass
class Operation:
    """A running handler operation (join, exit, leave, close)."""

    what: str
    step_fn: Callable[[RendezvousState, Clock], Step]
    timeout: float  # seconds
    deadline: float  # time.monotonic()
    need_alive: bool
    untimed: bool = False  # the last step waits without a deadline (redundant node)
    request_join: bool = False  # hold a join request while running (next_rendezvous)
    admit: bool = False  # our writes apply the other nodes' join requests too


class RendezvousExecutor:
    """Runs rendezvous operations for one node over its state holder.

    Args:
        holder: the node's state holder (reads, writes, session).
    """

    def __init__(self, holder: RendezvousStateHolder) -> None:
        self._holder = holder
        self.node = holder.node
        self.settings = holder.settings

    def run(
        self,
        what: str,
        step_fn: Callable[[RendezvousState, Clock], Step],
        timeout: float,
        *,
        need_alive: bool = False,
        request_join: bool = False,
        admit: bool = False,
        view: View | None = None,
        outage_timeout: float | None = None,
    ) -> View:
        """Drive ``step_fn`` until it finishes: read, sanitize, decide, write or wait.

        Starts from ``view`` when given (a current view), else from a fresh read; each
        write's transaction returns the next view, so only waits are followed by a read.
        With ``request_join`` our join request is written first (once per
        ``next_rendezvous``) and withdrawn before a timeout is acted on; with
        ``admit`` our writes apply the other nodes' join requests too
        (:func:`~kelastic_sidecar.rendezvous.steps.admit_requests`).

        An etcd outage is ridden out until the operation's deadline (for a redundant
        node, for ``timeout`` seconds of outage; with ``outage_timeout``, for at most
        that many seconds of outage); then its error propagates.

        Returns:
            the view the step finished on.

        Raises:
            RendezvousClosedError / RendezvousTimeoutError: as the step decides.
            EtcdUnavailable: etcd stayed unreachable, see above.
            EtcdRefused: etcd refused a request (at once).
        """
        op = Operation(what, step_fn, timeout, time.monotonic() + timeout, need_alive)
        op.request_join, op.admit = request_join, admit
        outage_since: float | None = None
        while True:
            try:
                if view is None:
                    if need_alive and not self._holder.announced:  # a first join: no need to look
                        view = self._holder.ensure_alive(
                            request_join and not self._holder.join_requested
                        )
                    else:
                        view = self._holder.read()
                view, finished = self._turn(op, view)
            except (EtcdUnavailable, EtcdLeaseNotFound) as exc:
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

    def _turn(self, op: Operation, view: View) -> tuple[View | None, bool]:
        """One decide-act cycle of ``op`` on ``view``.

        Returns:
            ``(view, True)`` once the step finishes; else ``(next view, False)``, the
            next view being ``None`` when it must be read afresh (after a wait).
        """
        wants_request = op.request_join and not self._holder.join_requested
        if op.need_alive and (self.node not in view.alive or self._holder.lease_lost):
            return self._holder.ensure_alive(wants_request), False
        if wants_request:
            return self._holder.request_join(), False
        state, dead = sanitize(view.state, view.alive, self.settings, view.departing)
        clock = self._clock(op)
        if op.request_join and clock.timed_out and self.node in view.joining:
            self._holder.withdraw_join_request()  # first, so that nobody admits us any more
            return None, False
        step = op.step_fn(state, clock)
        op.untimed = step.untimed
        if step.action is Action.WRITE and step.state is not None and step.state != state:
            new: RendezvousState = step.state
            admitted: tuple[str, ...] = ()
            if op.admit and not clock.timed_out:
                requests = [n for n in view.joining if n != self.node and n in view.alive]
                new, admitted = admit_requests(new, requests, clock, settings=self.settings)
            ok, after = self._holder.write(view, new, admitted)
            if ok:
                if dead:
                    self._holder.log_dead(view.state, dead)
                log.info("%s: %s", self.node, step.note)
                if admitted:
                    log.info("%s: admitted %s with it", self.node, ", ".join(admitted))
                if step.restart_timer:
                    op.deadline = time.monotonic() + op.timeout
            return after, False  # look again at what we (or the winner) wrote
        if dead:
            ok, after = self._holder.write(view, state)
            if ok:
                self._holder.log_dead(view.state, dead)
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
    def _clock(op: Operation) -> Clock:
        mono = time.monotonic()
        return Clock(
            now=time.time(),
            timed_out=mono > op.deadline,
            rollback_over=mono > op.deadline + ROLLBACK_PERIOD,
        )

    def _wait(self, op: Operation, view: View, step: Step) -> View | None:
        """Wait for a change after ``view``, or until the step's or the op's deadline.

        While every change is a write of the state alone, its value comes with the
        watch event and no read is needed: the step is taken on it, and the wait goes
        on while it says wait. Neither waiting nor finishing needs the dead-node check
        that precedes a write (a deletion of an alive key is a change of another key;
        a finished join is checked by the handler's ``check_round``), so the alive keys of
        ``view`` need not be current for them. When a round completes, its nodes thus
        do not all read the state at once.

        Returns:
            the view the operation finishes on (built from the event); ``None`` when
            the caller must read: a timeout, another change, or a step that writes.
        """
        watcher = self._holder.waiter()
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
            got = watcher.value_if_only_change(self._holder.keys.rdzv_state, view.revision)
            if got is None:
                return None
            try:
                state = decode_state(
                    got[0], run_id=self.settings.run_id, where=self._holder.keys.rdzv_state
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
