"""A save's handle: its bytes are staged; its commit runs on a thread of the store."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ._slotfile import CheckpointError


class SaveHandle:
    """A save whose bytes are staged; :meth:`wait` returns once it is committed."""

    def __init__(self, step: int, slot: int) -> None:
        self.step = step
        self.slot = slot
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, commit: Callable[[], None]) -> None:
        def run() -> None:
            try:
                commit()
            except BaseException as exc:  # reported by wait()
                self.error = exc

        self._thread = threading.Thread(target=run, name="kelastic-checkpoint-commit")
        self._thread.start()

    def done(self) -> bool:
        """Whether the commit has ended (committed, or failed: :meth:`wait` says)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the commit, ``timeout`` seconds at most (None: no limit).

        Raises:
            TimeoutError: still committing after ``timeout``.
            CheckpointError: the commit failed (its cause chained); the last committed
                step is still the one before.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"step {self.step} still committing after {timeout} s")
        if self.error is not None:
            raise CheckpointError(f"commit of step {self.step} failed: {self.error}") from (
                self.error
            )
