"""How the launcher starts an attempt's workers: cold or warm, two strategies of one interface.

- :class:`ColdStart`: each worker is a new interpreter started by ``subprocess``
  (:meth:`kelastic._workers.Worker.start` with no spawner).
- :class:`WarmStart`: each worker is forked by a zygote that imported the ``--preload``
  modules while the node joined the rendezvous (:mod:`kelastic._warm`). When the zygote
  fails, dies or is not ready in time, warm start is off from then on (logged) and the
  workers start cold; a worker the zygote cannot fork starts cold.

:func:`make_starter` picks one from the launcher's configuration. The launcher calls
:meth:`WorkerStarter.prepare` before each attempt's workers start, passes
:meth:`~WorkerStarter.spawner` and :meth:`~WorkerStarter.keep` to the
:class:`~kelastic._workers.WorkerGroup`, hands every reaped child it does not know to
:meth:`~WorkerStarter.on_reaped`, and calls :meth:`~WorkerStarter.close` on exit.
Stdlib only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kelastic._warm import Zygote, ZygoteError, parse_python_command
from kelastic._workers import Spawner, WorkerSpec

__all__ = ["ColdStart", "WarmStart", "WorkerStarter", "make_starter"]

logger = logging.getLogger("kelastic.launch")


class WorkerStarter(Protocol):
    """One way of starting workers (see the module doc)."""

    def prepare(self, wake_fd: int, on_wake: Callable[[], None]) -> None:
        """Get ready to start an attempt's workers.

        Args:
            wake_fd: readable when the launcher has signals to handle.
            on_wake: handles them (may raise to stop waiting).
        """

    def spawner(self) -> Spawner | None:
        """What :meth:`kelastic._workers.WorkerGroup.start` tries first; None: cold."""

    def keep(self) -> frozenset[int]:
        """Descendants the worker group must not kill as strays (the zygote)."""

    def on_reaped(self, pid: int, returncode: int) -> bool:
        """A child that is no worker was reaped; True when it was this starter's."""

    def close(self) -> None:
        """Stop what the starter runs (the launcher is exiting)."""


class ColdStart:
    """Every worker is a new interpreter (``subprocess``)."""

    def prepare(self, wake_fd: int, on_wake: Callable[[], None]) -> None:
        """Nothing to wait for."""

    def spawner(self) -> Spawner | None:
        """None: ``subprocess`` starts the command."""
        return None

    def keep(self) -> frozenset[int]:
        """Nothing to keep."""
        return frozenset()

    def on_reaped(self, pid: int, returncode: int) -> bool:
        """No child of its own."""
        return False

    def close(self) -> None:
        """Nothing to stop."""


class WarmStart:
    """Workers forked by a started :class:`~kelastic._warm.Zygote`; cold once it is gone.

    Args:
        zygote: started (:meth:`~kelastic._warm.Zygote.start`).
        ready_timeout: how long :meth:`prepare` waits for it to finish preloading.
    """

    def __init__(self, zygote: Zygote, ready_timeout: float) -> None:
        self._zygote: Zygote | None = zygote
        self._timeout = ready_timeout

    @property
    def active(self) -> bool:
        """False once warm start is off (workers then start cold)."""
        return self._zygote is not None

    def prepare(self, wake_fd: int, on_wake: Callable[[], None]) -> None:
        """Wait (handling signals) until the zygote preloaded, failed or timed out."""
        zygote = self._zygote
        if zygote is None or zygote.ready:
            return
        timeout = self._timeout
        deadline = time.monotonic() + timeout
        logger.info("waiting for the warm-start zygote to finish preloading")
        while True:
            if time.monotonic() >= deadline:
                self._drop(f"the zygote was not ready within {timeout:g}s")
                return
            try:
                if zygote.wait_ready(deadline - time.monotonic(), wake_fd):
                    return
            except ZygoteError as e:
                self._drop(str(e))
                return
            on_wake()

    def spawner(self) -> Spawner | None:
        """Fork from the zygote while there is one; None once warm start is off."""
        return self._spawn if self._zygote is not None else None

    def keep(self) -> frozenset[int]:
        """The zygote's pid."""
        zygote = self._zygote
        return frozenset({zygote.pid}) if zygote is not None and zygote.pid else frozenset()

    def on_reaped(self, pid: int, returncode: int) -> bool:
        """The zygote exited: warm start is off from now on."""
        zygote = self._zygote
        if zygote is None or pid != zygote.pid:
            return False
        zygote.set_reaped(returncode)
        self._drop(f"the zygote (pid {pid}) exited with returncode {returncode}")
        return True

    def close(self) -> None:
        """Stop the zygote and reap it."""
        if self._zygote is not None:
            self._zygote.close(reap=True)

    def _spawn(self, spec: WorkerSpec, stdout_fd: int, stderr_fd: int) -> int | None:
        zygote = self._zygote
        if zygote is None or not zygote.ready:
            return None
        try:
            return zygote.spawn(spec.env, os.getcwd(), stdout_fd, stderr_fd)
        except ZygoteError as e:
            self._drop(f"local_rank {spec.local_rank}: {e}")
            return None

    def _drop(self, reason: str) -> None:
        zygote = self._zygote
        if zygote is None:
            return
        logger.warning("warm start is off from now on: %s; workers start cold", reason)
        zygote.close()
        self._zygote = None


def make_starter(
    warm_start: bool,
    subreaper: bool,
    cmd: Sequence[str],
    preload: Sequence[str],
    environ: Mapping[str, str],
    ready_timeout: float,
) -> WorkerStarter:
    """The launcher's starter: :class:`WarmStart` when asked for and possible (the
    zygote started), else :class:`ColdStart` (the reason logged).

    Args:
        warm_start: ``--warm-start``.
        subreaper: whether the launcher became a child subreaper (warm start needs it).
        cmd: the workers' command.
        preload: the modules the zygote imports.
        environ: the launcher's environment.
        ready_timeout: ``--warm-start-timeout``.
    """
    if not warm_start:
        return ColdStart()
    if not subreaper:
        logger.warning(
            "warm start needs PR_SET_CHILD_SUBREAPER (Linux), which failed: workers start cold"
        )
        return ColdStart()
    try:
        command = parse_python_command(cmd, environ.get("PATH"))
    except ValueError as e:
        logger.warning("warm start is off for this command (%s): workers start cold", e)
        return ColdStart()
    zygote = Zygote(command, preload, environ, cmd)
    try:
        zygote.start()
    except ZygoteError as e:
        logger.warning("warm start is off: %s; workers start cold", e)
        return ColdStart()
    return WarmStart(zygote, ready_timeout)
