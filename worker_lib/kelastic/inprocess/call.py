"""``CallWrapper``: the state of one call of a wrapped function across its restart
iterations, and what a :class:`~kelastic.inprocess.session.Session` reads of its
:class:`~kelastic.inprocess.wrapper.Wrapper` (:class:`Hooks`). Stdlib only; imports
neither the wrapper nor the session (they both import this).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Final, Protocol

from kelastic.inprocess.interrupt import AbortGuard
from kelastic.inprocess.monitor import Heartbeat

__all__ = ["PARAMETER", "CallWrapper", "Hook", "Hooks"]

#: A hook: called with the :class:`CallWrapper`; ``health_check`` fails by raising.
Hook = Callable[["CallWrapper"], object]

#: Name of the wrapped function's parameter that receives the :class:`CallWrapper`.
PARAMETER: Final = "call_wrapper"


class _Atomic:
    """The context manager :meth:`CallWrapper.atomic` returns."""

    def __init__(self, guard: AbortGuard | None) -> None:
        self._guard = guard

    def __enter__(self) -> None:
        if self._guard is not None:
            self._guard.enter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._guard is not None:
            self._guard.exit()


_NO_ATOMIC: Final = _Atomic(None)


class CallWrapper:
    """The state of one call of a wrapped function, across its restart iterations.

    Made by :class:`Wrapper` for each call; passed to the wrapped function as its
    ``call_wrapper`` argument when it has one, and to every hook. Semantics from
    NVIDIA's ``CallWrapper`` (``iteration``, ``ping``, ``atomic``).
    """

    def __init__(
        self,
        iteration: int = 0,
        heartbeat: Heartbeat | None = None,
        guard: AbortGuard | None = None,
    ) -> None:
        self._iteration = iteration
        self._heartbeat = heartbeat
        self._atomic = _Atomic(guard) if guard is not None else _NO_ATOMIC
        #: The exception that ended the last iteration on this rank (the own fault, the
        #: :class:`RestartAbort`, or a collective's error after an abort); None in the
        #: first iteration. Hooks may look at it.
        self.fault: BaseException | None = None

    @property
    def iteration(self) -> int:
        """The restart iteration being run: 0 at first (or ``$KELASTIC_INPROCESS_ITERATION``
        for a rank started into a running job), then the one each ``go`` named."""
        return self._iteration

    def set_iteration(self, iteration: int) -> None:
        """Make ``iteration`` the one being run (the session calls it as each iteration
        starts, and when a spare takes a rank); not for the wrapped function.

        Args:
            iteration: the restart iteration, ``>= 0``.

        Raises:
            ValueError: ``iteration`` is negative.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        self._iteration = iteration

    def ping(self) -> None:
        """Report progress: resets the soft-timeout clock; the first ping of an iteration
        tells the sidecar the rank is stepping again. Cheap; never raises; a no-op when
        in-process restart is off. A :func:`kelastic.timer.expires` acquire counts too."""
        if self._heartbeat is not None:
            self._heartbeat.ping()

    def atomic(self) -> _Atomic:
        """Context manager for a section no abort may interrupt (a checkpoint write, an
        optimizer step): an abort that arrives inside it is delivered right after it (as
        :class:`RestartAbort` raised from the ``with`` statement), and the section is not
        entered once an abort is under way (:class:`RestartAbort` from the ``with``).
        Reentrant; main thread only; a no-op when in-process restart is off.

        Raises:
            RestartAbort: as described.
        """
        return self._atomic


class Hooks(Protocol):
    """What a session reads of its :class:`~kelastic.inprocess.wrapper.Wrapper`: the
    hooks (each ``None`` or called with the :class:`CallWrapper`), the timeouts and the
    seconds to keep trying the sidecar's socket."""

    initialize: Hook | None
    abort: Hook | None
    finalize: Hook | None
    health_check: Hook | None
    connect_timeout: float

    def timeouts(self) -> tuple[float, float]:
        """``(soft_timeout, hard_timeout)`` in seconds."""
        ...
