"""``Wrapper``: the public face of in-process restart (stdlib only); its ``CallWrapper`` is
:mod:`kelastic.inprocess.call`'s.

Semantics from NVIDIA's ``nvidia_resiliency_ext.inprocess.Wrapper`` (nvidia-resiliency-ext),
with the coordination (which iteration comes next, the termination barrier, the restart
budget, the hard timeout) done by the node's kelastic sidecar instead of a TCPStore
among the ranks; :mod:`kelastic.inprocess.session` is the worker's half of that protocol.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kelastic import contract
from kelastic.inprocess.call import PARAMETER, CallWrapper, Hook
from kelastic.inprocess.client import CONNECT_TIMEOUT
from kelastic.inprocess.inject import Injector
from kelastic.inprocess.session import Session

__all__ = ["CallWrapper", "Hook", "Wrapper"]

P = ParamSpec("P")
R = TypeVar("R")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {raw!r}") from None


def _wants_call_wrapper(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return PARAMETER in params and params[PARAMETER].kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.POSITIONAL_ONLY,
    )


class Wrapper:
    """Decorator: restart the wrapped function in the same process when any rank faults.

    ::

        @Wrapper(health_check=check_gpu)
        def train(call_wrapper: CallWrapper | None = None) -> None: ...

    With ``$KELASTIC_INPROCESS`` other than ``"1"`` the function is simply called once
    (with a :class:`CallWrapper` of iteration 0 whose ``ping``/``atomic`` do nothing).
    Otherwise each call connects to the sidecar (``contract.inprocess_socket_path()``),
    runs the function as iteration ``$KELASTIC_INPROCESS_ITERATION`` (default 0) and,
    whenever a rank faults (an exception, a soft timeout), every rank leaves the
    function (its process groups torn down, :class:`RestartAbort` raised in it),
    destroys its process groups, runs ``abort``, ``finalize`` and ``health_check``,
    waits at the termination barrier and calls the function again with the next
    iteration's env (``MASTER_PORT`` and the like) in ``os.environ``. The function must
    set up its process group itself, inside, each time. The call returns the function's
    value once it returned on this rank.

    NVIDIA's ``rank_assignment`` and ``rank_filter`` are not parameters here: the ranks
    and world size of each iteration are the sidecars' (the ``go``'s env), so that every
    rank of the job gets them from one place. What those hooks do there is done by the
    restart ladder: after a lost node the survivors are re-ranked by the next rendezvous
    round, compactly, in group-rank order (``ShiftRanks``); a dead local rank is replaced
    in place by its respawn, or by a spare worker that waited warm in this Wrapper
    (``spec.inProcess.spareRanks``: ``FillGaps`` with inactive ranks); the world size
    follows the nodes in the round (``minReplicas``..``maxReplicas``).

    Args:
        initialize: called at the start of each iteration, before the function; an
            exception there is the iteration's fault.
        abort: called when leaving a faulted iteration, after the process groups were
            destroyed (release what else the iteration holds).
        finalize: called after ``abort``.
        health_check: called last; raising fails it: the rank reports a
            ``health_check`` fault and the exception ends the process (non-zero exit).
        soft_timeout: seconds without progress (``ping``, ``expires()``) before this rank
            reports a ``soft_timeout`` fault; default ``$KELASTIC_INPROCESS_SOFT_TIMEOUT``,
            else :data:`kelastic.contract.DEFAULT_INPROCESS_SOFT_TIMEOUT`.
        hard_timeout: documented value only: the sidecar kills a rank that did not reach
            the barrier this many seconds after an abort (from
            ``$KELASTIC_INPROCESS_HARD_TIMEOUT``); must exceed ``soft_timeout``.
        connect_timeout: seconds to keep trying to reach the sidecar's socket.

    Raises:
        ValueError: a timeout is not a positive finite number, ``soft_timeout`` is not
            below ``hard_timeout``, or an env value is not a number (at call time).
        ConnectionError: (at call time) the sidecar cannot be reached.
        GiveUpError: (at call time) the sidecar gave up, or went away, while this rank
            had no exception of its own; else that exception is re-raised.
    """

    def __init__(
        self,
        *,
        initialize: Hook | None = None,
        abort: Hook | None = None,
        finalize: Hook | None = None,
        health_check: Hook | None = None,
        soft_timeout: float | None = None,
        hard_timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.initialize = initialize
        self.abort = abort
        self.finalize = finalize
        self.health_check = health_check
        self._soft_timeout = soft_timeout
        self._hard_timeout = hard_timeout
        self.connect_timeout = connect_timeout
        if soft_timeout is not None or hard_timeout is not None:
            self.timeouts()  # fail early on explicit values

    def timeouts(self) -> tuple[float, float]:
        """``(soft_timeout, hard_timeout)`` in seconds, resolved now (argument, env,
        contract default).

        Raises:
            ValueError: as for the constructor.
        """
        soft = self._soft_timeout
        if soft is None:
            soft = _env_seconds(contract.ENV_INPROCESS_SOFT_TIMEOUT,
                                contract.DEFAULT_INPROCESS_SOFT_TIMEOUT)  # fmt: skip
        hard = self._hard_timeout
        if hard is None:
            hard = _env_seconds(contract.ENV_INPROCESS_HARD_TIMEOUT,
                                contract.DEFAULT_INPROCESS_HARD_TIMEOUT)  # fmt: skip
        for name, value in (("soft_timeout", soft), ("hard_timeout", hard)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if soft >= hard:
            raise ValueError(f"soft_timeout ({soft:g} s) must be below hard_timeout ({hard:g} s)")
        return soft, hard

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Wrap ``fn``; the result takes ``fn``'s arguments and returns its value. A
        ``call_wrapper`` parameter of ``fn`` (by name) receives the :class:`CallWrapper`.
        """
        wants = _wants_call_wrapper(fn)

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            return self._call(fn, wants, args, kwargs)

        return wrapped

    def _call(self, fn: Callable[..., R], wants: bool, args: Any, kwargs: Any) -> R:
        if os.environ.get(contract.ENV_INPROCESS) != "1":
            call_wrapper = CallWrapper()
            if wants:
                kwargs = {**kwargs, PARAMETER: call_wrapper}
            with Injector() as injector:
                injector.armed = True
                return fn(*args, **kwargs)
        session: Session[R] = Session(self, fn, wants, args, kwargs)
        return session.run()
