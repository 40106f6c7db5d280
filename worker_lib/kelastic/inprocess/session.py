"""One call of a wrapped function with in-process restart on: the worker's half of the
protocol (:mod:`kelastic.inprocess_messages`). Stdlib only.

::

    hello(iteration n)
    loop:
        run the function as iteration n          -> returned: done(n), return its value
        it raised on its own: tear down the connections, fault(n, exception)
        wait for abort(m), m > n                 (give_up / closed: re-raise, exit)
        leave: destroy process groups, abort, finalize, health_check hooks
                                                 (a failure: fault(m, ...), exit)
        ready(m); wait for go(m)                 (abort(k > m): ready(k), wait go(k))
        os.environ.update(go.env); n = m

Semantics from NVIDIA's in-process restart (``CallWrapper.__call__``), where the ranks' store
barriers become messages to the sidecar's coordinator.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kelastic import contract, errors, timer
from kelastic.inprocess import abort
from kelastic.inprocess.call import PARAMETER, CallWrapper, Hooks
from kelastic.inprocess.client import Closed, Connection
from kelastic.inprocess.errors import GiveUpError, RestartAbort
from kelastic.inprocess.inject import Injector
from kelastic.inprocess.interrupt import AbortGuard
from kelastic.inprocess.monitor import Heartbeat, Monitor
from kelastic.inprocess.store_wait import wait_for_store
from kelastic.inprocess_messages import (
    CAUSE_ABORT_FAILED,
    CAUSE_EXCEPTION,
    CAUSE_HEALTH_CHECK,
    Abort,
    Done,
    Fault,
    GiveUp,
    Go,
    Hello,
    Progress,
    Ready,
)

__all__ = ["Session", "summary"]

R = TypeVar("R")

#: Seconds between checks while waiting for the sidecar (signals, Ctrl-C in between).
WAIT_TICK = 0.5
#: Seconds a rank whose collective failed because a peer went away waits for the abort
#: before it reports the failure as its own fault (the peer's fault, the cause, goes first).
PEER_FAILURE_GRACE = 0.5
#: Words of the errors a collective raises when a peer closed its connections (gloo:
#: "Connection closed by peer", "Connection reset by peer"; c10d's store).
_PEER_FAILURE_WORDS = ("connection closed", "connection reset", "broken pipe",
                       "connection was likely closed")  # fmt: skip


def summary(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"`` of ``exc``, at most 500 characters."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line[:500]


def _int_env(name: str, default: int = 0) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {os.environ[name]!r}") from None


@dataclass
class _Outcome(Generic[R]):
    returned: bool
    value: R | None = None
    error: BaseException | None = None


class _Stop(Exception):
    """The sidecar gave up or went away (internal)."""


class Session(Generic[R]):
    """Runs ``fn`` through its restart iterations (made by :class:`Wrapper`; one per
    call). See the module docstring for the sequence."""

    def __init__(
        self,
        wrapper: Hooks,
        fn: Callable[..., R],
        wants_call_wrapper: bool,
        args: Any,
        kwargs: Any,
    ) -> None:
        self._wrapper = wrapper
        self._soft_timeout, _ = wrapper.timeouts()
        self._fn = fn
        self._args = args
        self._spare = os.environ.get(contract.ENV_INPROCESS_SPARE) == "1"
        self._await_go = os.environ.pop(contract.ENV_INPROCESS_AWAIT_GO, "") == "1"
        self._local_rank = _int_env(contract.LOCAL_RANK)
        self._rank = _int_env(contract.RANK)
        self._first = _int_env(contract.ENV_INPROCESS_ITERATION)
        self._snapshot = abort.snapshot()
        self._guard = AbortGuard(self._tear_down)
        self._heartbeat = Heartbeat(self._send_progress)
        self.call_wrapper = CallWrapper(self._first, self._heartbeat, self._guard)
        self._kwargs = {**kwargs, PARAMETER: self.call_wrapper} if wants_call_wrapper else kwargs
        self._conn: Connection | None = None
        self._monitor: Monitor | None = None
        self._injector = Injector()
        self._kept_store: Any = None  # abort.keep_store(): the aborted iteration's store
        self._timers: frozenset[str] = frozenset()  # timers held as the iteration began
        #: The exception hook before the first iteration, which each one starts with (torch's
        #: ``init_process_group`` adds a ``[rank<r>]: `` prefix to it each time it is called).
        self._excepthook = sys.excepthook

    # ------------------------------------------------------------------ plumbing

    def _tear_down(self) -> None:
        abort.abort_nccl()
        abort.shutdown_connections(self._snapshot)

    def _send_progress(self, iteration: int) -> None:
        if self._conn is not None:
            self._conn.send(Progress(iteration=iteration, local_rank=self._local_rank))

    def _fault(self, iteration: int, cause: str, exc: BaseException) -> None:
        assert self._conn is not None
        self._conn.send(Fault(iteration=iteration, local_rank=self._local_rank, cause=cause,
                              message=summary(exc)))  # fmt: skip

    def _next(self) -> Abort | Go | GiveUp | Closed:
        assert self._monitor is not None
        while True:
            try:
                item = self._monitor.inbox.get(timeout=WAIT_TICK)
            except queue.Empty:
                continue
            if isinstance(item, (Abort, Go, GiveUp, Closed)):
                return item

    def run(self) -> R:
        """Connect, say hello, run the iterations; return the function's value.

        Raises:
            ConnectionError: the sidecar cannot be reached.
            BaseException: the own fault re-raised on ``give_up``, or
                :class:`GiveUpError`; a failing hook's exception.
        """
        path = contract.inprocess_socket_path()
        self._conn = Connection.connect(path, self._wrapper.connect_timeout)
        previous_hook = timer.set_progress_hook(self._heartbeat.ping)
        try:
            self._conn.send(Hello(pid=os.getpid(), local_rank=self._local_rank, rank=self._rank,
                                  iteration=self._first, spare=self._spare))  # fmt: skip
            self._monitor = Monitor(self._conn, self._guard, self._heartbeat,
                                    self._soft_timeout, self._local_rank)  # fmt: skip
            self._monitor.start()
            if self._spare:
                self._await_promotion()
            elif self._await_go:
                self._await_first_go()
            with self._injector:
                return self._loop()
        finally:
            timer.set_progress_hook(previous_hook)
            if self._monitor is not None:
                self._monitor.stop()
            self._conn.close()

    def _await_promotion(self) -> None:
        """A spare: wait (warm, before the first call) for the ``go`` that makes this
        process a rank, and take that rank's identity: ``os.environ`` gets the ``go``'s env
        (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, the timer
        token ...), the default timer client is dropped (the next ``expires()`` makes one
        with the new token), and this session speaks as that local rank from now on.

        Raises:
            SystemExit: (code 0) ``give_up`` or the sidecar gone: a spare that was not
                needed ends quietly.
        """
        assert self._conn is not None and self._monitor is not None
        item = self._next()
        while isinstance(item, Abort):  # not for a spare; a confused sidecar: wait on
            item = self._next()
        if not isinstance(item, Go):
            print(f"kelastic.inprocess: spare (pid {os.getpid()}) not needed: {_why(item)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(0)  # run()'s finally closes the connection
        os.environ.update(item.env)
        os.environ[contract.ENV_INPROCESS_ITERATION] = str(item.iteration)
        os.environ.pop(contract.ENV_INPROCESS_SPARE, None)
        timer.forget_default_client()
        self._spare = False
        self._local_rank = _int_env(contract.LOCAL_RANK)
        self._rank = _int_env(contract.RANK)
        self._first = item.iteration
        self._monitor.set_local_rank(self._local_rank)  # its faults name it
        self.call_wrapper.set_iteration(item.iteration)
        print(f"kelastic.inprocess: spare (pid {os.getpid()}) promoted to local rank "
              f"{self._local_rank} (rank {self._rank}) in iteration {item.iteration}",
              file=sys.stderr, flush=True)  # fmt: skip
        wait_for_store()

    def _await_first_go(self) -> None:
        """Started again at its death (the hybrid rung's early respawn): this rank's
        peers are still leaving the iteration it died in; pass the termination barrier
        with them (ready, then the ``go``, whose env names the iteration's store) before
        the first call.

        Raises:
            GiveUpError: the sidecar gave up the restart or went away.
        """
        try:
            self._first = self._barrier(self._first)
        except _Stop as stop:
            why = f"in-process restart ended before this rank's start: {stop}"
            raise GiveUpError(why) from None
        self.call_wrapper.set_iteration(self._first)

    # --------------------------------------------------------------- the course

    def _loop(self) -> R:
        assert self._conn is not None and self._monitor is not None
        iteration = self._first
        while True:
            outcome = self._run_once(iteration)
            aborted = self._monitor.abort_target > iteration or self._monitor.gave_up
            if outcome.returned and not aborted:
                self._conn.send(Done(iteration=iteration, local_rank=self._local_rank))
                return outcome.value  # type: ignore[return-value]
            error = outcome.error
            if error is not None and not isinstance(error, Exception | RestartAbort):
                raise error  # SystemExit, KeyboardInterrupt: the process is ending
            if not aborted and error is not None and _peer_failure(error):
                # Probably a consequence: a faulted peer tore down its connections and
                # its fault is on the way; the abort that follows makes this no fault.
                self._monitor.wait_for_abort(iteration, PEER_FAILURE_GRACE)
                aborted = self._monitor.abort_target > iteration or self._monitor.gave_up
            own = not aborted
            if own:  # report first: the peers the teardown releases must not overtake the cause
                self._fault(iteration, CAUSE_EXCEPTION, error or RuntimeError("no error"))
                self._guard.tear_down()  # release the peers blocked on this rank now
            self.call_wrapper.fault = error
            stopped: _Stop | None = None
            try:
                target = self._await_abort(iteration)
                self._leave(target, error)
                iteration = self._barrier(target)
            except _Stop as stop:
                stopped = stop
            if stopped is not None:  # outside the handler: the fault re-raised unchanged
                if own and error is not None:
                    raise error
                raise GiveUpError(f"in-process restart ended: {stopped}") from error

    def _run_once(self, iteration: int) -> _Outcome[R]:
        """Call the function as ``iteration``; whatever it raises is returned."""
        assert self._monitor is not None
        self.call_wrapper.set_iteration(iteration)
        sys.excepthook = self._excepthook
        self._snapshot = abort.snapshot()
        self._timers = timer.held_scopes()  # what the iteration acquires, it releases
        self._heartbeat.begin(iteration)
        self._guard.start()
        outcome: _Outcome[R] | None = None
        try:
            try:
                self._injector.armed = True
                if self._monitor.abort_target > iteration or self._monitor.gave_up:
                    raise RestartAbort("aborted before the iteration started")
                if self._wrapper.initialize is not None:
                    self._wrapper.initialize(self.call_wrapper)
                value = self._fn(*self._args, **self._kwargs)
                outcome = _Outcome(returned=True, value=value)
            except BaseException as exc:
                errors.stamp_fault(exc)  # re-raised later, maybe: the error file says when
                outcome = _Outcome(returned=False, error=exc)
            finally:
                self._stop_iteration()
        except RestartAbort as late:  # the abort landed after the function had left
            self._stop_iteration()
            if outcome is None:
                outcome = _Outcome(returned=False, error=late)
        return outcome

    def _stop_iteration(self) -> None:
        self._injector.armed = False
        self._heartbeat.end()
        self._guard.stop()
        # an abort inside an expires() __enter__ skipped its __exit__ (timer.release_since)
        for scope in timer.release_since(self._timers):
            print(f"kelastic.inprocess: released timer {scope!r} the aborted iteration left "
                  "held", file=sys.stderr)  # fmt: skip

    def _await_abort(self, iteration: int) -> int:
        """Wait for the sidecar's ``abort`` of ``iteration``; return the next iteration."""
        assert self._monitor is not None
        if self._monitor.abort_target > iteration:
            return self._monitor.abort_target
        while True:
            item = self._next()
            if isinstance(item, (GiveUp, Closed)):
                raise _Stop(_why(item))
            if isinstance(item, Abort) and item.iteration > iteration:
                return item.iteration

    def _leave(self, target: int, error: BaseException | None) -> None:
        """Destroy the process groups, run the hooks; a failure is reported and raised."""
        wrapper = self._wrapper
        # Shut down (peers' half-written sends drained first) before the groups close their
        # sockets: closed with bytes unread, they reset a peer whose send then never ends.
        abort.shutdown_connections(self._snapshot)
        # The aborted iteration's objects (a DDP reducer) go before their process group: a
        # reducer freed after its group blocked in its destructor (test_hybrid_rung, DDP).
        _release_frames(error)
        failed = abort.destroy_process_groups()
        # The host's store listens until the next go (a rank may still be connecting).
        self._kept_store = abort.keep_store()
        if failed is None and wrapper.abort is not None:
            failed = _call_hook(wrapper.abort, self.call_wrapper)
        if failed is None and wrapper.finalize is not None:
            failed = _call_hook(wrapper.finalize, self.call_wrapper)
        if failed is not None:
            self._fault(target, CAUSE_ABORT_FAILED, failed)
            raise failed from error
        if wrapper.health_check is not None:
            failed = _call_hook(wrapper.health_check, self.call_wrapper)
            if failed is not None:
                self._fault(target, CAUSE_HEALTH_CHECK, failed)
                raise failed from error

    def _barrier(self, target: int) -> int:
        """Termination barrier: ``ready(target)``, wait for ``go``; return the iteration
        entered (a later ``abort`` during the wait moves the target)."""
        assert self._conn is not None and self._monitor is not None
        self._monitor.leave_watch.left(target)
        self._conn.send(Ready(iteration=target, local_rank=self._local_rank))
        while True:
            item = self._next()
            if isinstance(item, (GiveUp, Closed)):
                raise _Stop(_why(item))
            if isinstance(item, Abort) and item.iteration > target:
                target = item.iteration
                self._monitor.leave_watch.left(target)
                self._conn.send(Ready(iteration=target, local_rank=self._local_rank))
            elif isinstance(item, Go) and item.iteration >= target:
                self._kept_store = None  # every rank left the aborted iteration
                os.environ.update(item.env)
                os.environ[contract.ENV_INPROCESS_ITERATION] = str(item.iteration)
                wait_for_store()
                return item.iteration


def _peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective broken by a peer (torch's
    ``DistNetworkError``, or a ``RuntimeError`` saying a connection closed)."""
    if any(cls.__name__ == "DistNetworkError" for cls in type(exc).__mro__):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _PEER_FAILURE_WORDS)


def _release_frames(error: BaseException | None) -> None:
    """Drop the local variables of the frames the iteration's exception (and its causes)
    went through: tensors, models and process groups of the aborted iteration are freed
    now, by reference counting, instead of by a slow full garbage collection. The
    traceback itself (file, line, function) stays printable."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _why(item: GiveUp | Closed) -> str:
    if isinstance(item, GiveUp):
        return f"the sidecar gave up ({item.reason or 'no reason given'})"
    return f"lost the sidecar ({item.why})"


def _call_hook(hook: Callable[[Any], object], call_wrapper: Any) -> Exception | None:
    try:
        hook(call_wrapper)
    except Exception as exc:
        print(f"kelastic.inprocess: {getattr(hook, '__name__', hook)!s} failed: {summary(exc)}",
              file=sys.stderr, flush=True)  # fmt: skip
        return exc
    return None
