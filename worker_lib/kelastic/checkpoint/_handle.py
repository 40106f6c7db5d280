"""A save's handle: its bytes are staged; its commit runs on a thread of the store."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ._slotfile import CheckpointError


class SaveHandle:
    """A save whose bytes are staged; :meth:`wait` returns once it is committed.

    The commit's end is an :class:`threading.Event` the commit thread sets, not the
    thread's ``join``: CPython 3.11's ``Thread.join`` interrupted by an exception raised
    into the waiting thread (an in-process abort, ``KeyboardInterrupt``) marks the live
    thread as stopped, so every later ``join`` and ``is_alive`` would say the commit had
    ended while it still wrote the slot.
    """

    def __init__(self, step: int, slot: int) -> None:
        self.step = step
        self.slot = slot
        self.error: BaseException | None = None
        self._ended: threading.Event | None = None

    def _start(self, commit: Callable[[], None]) -> None:
        ended = self._ended = threading.Event()

        def run() -> None:
            try:
                commit()
            except BaseException as exc:  # reported by wait()
                self.error = exc
            finally:
                ended.set()

        try:
            threading.Thread(target=run, name="kelastic-checkpoint-commit").start()
        except RuntimeError as exc:  # no thread to be had: the commit failed
            self.error = exc
            ended.set()

    def done(self) -> bool:
        """Whether the commit has ended (committed, or failed: :meth:`wait` says)."""
        return self._ended is None or self._ended.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the commit, ``timeout`` seconds at most (None: no limit).

        Raises:
            TimeoutError: still committing after ``timeout``.
            CheckpointError: the commit failed (its cause chained); the last committed
                step is still the one before.
        """
        if self._ended is not None and not self._ended.wait(timeout):
            raise TimeoutError(f"step {self.step} still committing after {timeout} s")
        if self.error is not None:
            raise CheckpointError(f"commit of step {self.step} failed: {self.error}") from (
                self.error
            )
