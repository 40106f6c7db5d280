"""Fault injection: SIGUSR1 raises :class:`InjectedFault` in the wrapped function.

Enabled by ``KELASTIC_INJECT_RAISE=1`` (``kelastic run --fault raise:rank=R,after=S``
sets it and later sends the worker SIGUSR1). The handler raises only while the wrapped
function runs ("armed"); a signal outside it is reported on stderr and otherwise ignored.
Python runs signal handlers in the main thread, so the handler is installed only when the
wrapper is called there. Stdlib only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from kelastic import contract
from kelastic.inprocess.errors import InjectedFault

__all__ = ["MESSAGE", "Injector"]

MESSAGE = "fault injected by kelastic run --fault raise"


class Injector:
    """Context manager: installs the SIGUSR1 handler when enabled, restores the previous
    one on exit. :attr:`armed` says whether a signal raises now."""

    def __init__(self) -> None:
        self.armed = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> Injector:
        if os.environ.get(contract.ENV_INJECT_RAISE) != "1":
            return self
        if threading.current_thread() is not threading.main_thread():
            print("kelastic.inprocess: KELASTIC_INJECT_RAISE needs the wrapper called in "
                  "the main thread; fault injection is off", file=sys.stderr)  # fmt: skip
            return self
        self._previous = signal.signal(signal.SIGUSR1, self._handle)
        self._installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.armed = False
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGUSR1, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False  # one signal, one fault
            raise InjectedFault(MESSAGE)
        print("kelastic.inprocess: SIGUSR1 outside the wrapped function; no fault injected",
              file=sys.stderr, flush=True)  # fmt: skip
