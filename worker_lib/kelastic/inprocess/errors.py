"""Exceptions of the in-process restart wrapper (stdlib only)."""

from __future__ import annotations

__all__ = ["GiveUpError", "InjectedFault", "RestartAbort"]


class RestartAbort(BaseException):
    """Raised in the main thread, inside the wrapped function, when the sidecar aborts the
    current iteration (another rank faulted, or this one timed out).

    It derives from :class:`BaseException` so that a training loop's ``except Exception``
    does not swallow it; :class:`kelastic.inprocess.Wrapper` catches it and restarts the
    function in the next iteration. Counterpart of NVIDIA's ``RankShouldRestart``.
    """


class InjectedFault(Exception):
    """Raised inside the wrapped function on SIGUSR1 when ``KELASTIC_INJECT_RAISE=1``
    (``kelastic run --fault raise:rank=R,after=S``): an ordinary exception of the training
    code, so it takes the same path as any other."""


class GiveUpError(RuntimeError):
    """The sidecar gave up on in-process restarts (``give_up``), or went away, while this
    rank had no exception of its own to re-raise. The process exits non-zero and the
    process-restart path takes over."""
