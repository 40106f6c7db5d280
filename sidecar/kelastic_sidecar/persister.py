"""The node's checkpoint slots persisted in torch DCP's format (``spec.checkpoint.persist``):
the sidecar's part that makes a step survive the loss of every node's memory.

What is written and how is :mod:`kelastic.checkpoint.persist` (one DCP checkpoint per rank
under ``step-<S>/rank-<R>``, ``COMPLETE`` once every rank of the world is there, each
folder renamed into place whole). This part decides *which* steps, and when:

- **every ``everySteps``**: the trainer's save marks each committed step that is a
  multiple of ``everySteps`` due (:mod:`kelastic.checkpoint.due`: the writer keeps off
  that slot until it is persisted, so no due step is overwritten however fast the steps
  are); a thread of this part finds the markers (a folder listing every 0.2 s), persists
  each marked slot, oldest step first, and removes the marker. The schedule is by step
  number, so every rank of the job marks the same steps and each becomes complete. If
  the disk is so slow that the writer needs a marked slot back, it drops the marker
  (logged) and that step is not persisted: the trainer never waits for the disk.
- **when the Pod is stopped** (SIGTERM: a deletion, drain, preemption, scale-down; after
  the workers were stopped, so the slots hold still): every step that every rank of the
  node still holds, newest first, within the stop's deadline. Nodes that stopped one
  step apart each write the steps they hold, so the newest step every rank held is the
  one that becomes complete.
- **retention**: the writer that completes a step removes the steps older than the
  ``keep``-th newest complete one.

"This node's ranks" are those with a committed slot of the newest round the folder shows
(a rank of an earlier round, gone after a new rendezvous, is not waited for). With a
*replicated* state (``spec.checkpoint.stateLayout: Replicated``) only rank 0 is persisted
(every rank's state is the same: one copy on the shared volume, not one per rank; the
step is complete with it), so the node running rank 0 writes and the others only give
their marked slots back. The
semantics are DLRover's flash checkpoint (an agent persists the staged shared memory
while training goes on; on a stop, what memory holds is saved) and NVRx's local
checkpoints (a step counts once every rank's part is there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kelastic.checkpoint.commit import finish_staged
from kelastic.checkpoint.due import clear, due_markers
from kelastic.checkpoint.persist import Persisted, PersistError, persist, prune
from kelastic.checkpoint.scan import CommittedSlot, committed_slots

if TYPE_CHECKING:  # a type only: the part does not depend on the configuration's module
    from .config import PersistSettings

__all__ = ["Persister", "current_ranks", "node_steps"]

log = logging.getLogger(__name__)

#: Seconds between looks for due markers.
POLL_SECONDS = 0.2


def current_ranks(slots: list[CommittedSlot]) -> set[int]:
    """This node's ranks: those with a committed slot of the newest round ``slots`` show."""
    newest = max((s.round for s in slots), default=None)
    return {s.rank for s in slots if s.round == newest}


def node_steps(slots: list[CommittedSlot]) -> list[int]:
    """The steps every rank of this node holds committed, newest first (see the module
    doc for which ranks count)."""
    if not slots:
        return []
    ranks = current_ranks(slots)
    held: set[int] | None = None
    for rank in ranks:
        steps = {s.step for s in slots if s.rank == rank}
        held = steps if held is None else held & steps
    return sorted(held or (), reverse=True)


class Persister:
    """Persists the node's committed steps (see the module doc).

    Args:
        settings: ``spec.checkpoint.persist`` as the sidecar's configuration.
        job: the job's id (the slots' ``job``).
        slots: the node's slot folder.
        on_persisted: called with each rank's :class:`Persisted` and the seconds it took.
        on_failure: called with each :class:`PersistError` (also logged).
        on_step: called with each step the node persisted (for one of its ranks or
            more), newer than any before.
        replicated: the state is replicated: rank 0 alone is persisted.
    """

    def __init__(
        self,
        settings: PersistSettings,
        job: str,
        slots: Path,
        *,
        on_persisted: Callable[[Persisted, float], None] = lambda _p, _s: None,
        on_failure: Callable[[PersistError], None] = lambda _e: None,
        on_step: Callable[[int], None] = lambda _s: None,
        replicated: bool = False,
    ) -> None:
        self.settings, self.job, self.slots = settings, job, slots
        self.replicated = replicated
        self._on_persisted, self._on_failure, self._on_step = on_persisted, on_failure, on_step
        self._lock = threading.Lock()  # one writer at a time: the poll or the stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The newest step this node persisted (for one of its ranks or more; at a stop,
        #: for all of them).
        self.last_step: int | None = None

    def start(self) -> None:
        """Start the poll (only with ``every_steps``)."""
        if self.settings.every_steps and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckpt-persist", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the poll; a write in progress goes on to its end (up to ``timeout``
        seconds are waited for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.poll()
            except Exception:  # never let the thread die: the next poll tries again
                log.exception("checkpoint persistence: poll failed")

    def poll(self) -> int | None:
        """Persist every slot marked due (:mod:`kelastic.checkpoint.due`), oldest step
        first, and give each slot back to the writer (its marker removed, persisted or
        not: the trainer never waits for the disk); return the newest step persisted, or
        None."""
        if not self.settings.every_steps:
            return None
        try:
            markers = due_markers(self.slots)
        except OSError as exc:
            log.error("checkpoint persistence: cannot list %s: %s", self.slots, exc)
            return None
        newest: int | None = None
        for m in sorted(markers, key=lambda m: (m.step if m.step is not None else -1, m.rank)):
            if m.step is None:
                log.warning("checkpoint persistence: %s is no step marker: removed", m.path.name)
            elif self.replicated and m.rank != 0:
                pass  # rank 0's copy is the step's: this slot goes back to the writer
            elif self._persist_rank(m.rank, m.step):
                newest = m.step if newest is None else max(newest, m.step)
            clear(self.slots, m.rank, m.slot)
        if newest is not None and (self.last_step is None or newest > self.last_step):
            self.last_step = newest
            self._on_step(newest)
        return newest

    def at_stop(self, deadline: float) -> list[int]:
        """What the node's ranks still hold, newest first, until ``deadline`` (a
        ``time.monotonic()`` value); return the steps persisted in full. Call it once the
        workers are stopped: a save a worker returned from before the stop killed it is
        committed first (:func:`kelastic.checkpoint.commit.finish_staged`). Nothing when
        ``on_stop`` is off."""
        self.close()
        if not self.settings.on_stop:
            return []
        try:  # a save a worker killed by the stop returned from, committed first
            finish_staged(self.slots, self.job, persist_every=self.settings.every_steps)
        except OSError as exc:
            log.error("checkpoint persistence: cannot read the slots in %s: %s", self.slots, exc)
        done = []
        slots = self._slots()
        if self.replicated and 0 not in current_ranks(slots):
            return []  # rank 0's node persists the replicated state
        for step in node_steps(slots):
            if time.monotonic() >= deadline:
                log.warning("checkpoint persistence: the stop's deadline passed before step %d",
                            step)  # fmt: skip
                break
            if self._persist_step(step):
                done.append(step)
        return done

    def _slots(self) -> list[CommittedSlot]:
        try:
            return committed_slots(self.slots, self.job)
        except OSError as exc:
            log.error("checkpoint persistence: cannot read the slots in %s: %s", self.slots, exc)
            return []

    def _persist_step(self, step: int) -> bool:
        """Persist ``step`` for every rank of the node that holds it; True when all did."""
        ranks = sorted({s.rank for s in self._slots() if s.step == step})
        if self.replicated:
            ranks = [r for r in ranks if r == 0]
        ok = bool(ranks)
        for rank in ranks:
            ok = self._persist_rank(rank, step) and ok
        if ok and (self.last_step is None or step > self.last_step):
            self.last_step = step
            self._on_step(step)
        return ok

    def _persist_rank(self, rank: int, step: int) -> bool:
        """Persist ``rank``'s slot of ``step``; False (logged, reported) when it fails."""
        with self._lock:
            started = time.monotonic()
            try:
                done = persist(self.slots, rank, self.job, step, self.settings.directory,
                               replicated=self.replicated)  # fmt: skip
            except PersistError as exc:
                log.error("checkpoint persistence: %s", exc)
                self._on_failure(exc)
                return False
            took = time.monotonic() - started
            if done.nbytes:
                log.info("checkpoint step %d of rank %d persisted to %s (%d bytes, %.3f s)%s",
                         step, rank, done.path, done.nbytes, took,
                         "; the step is complete" if done.completed_step else "")  # fmt: skip
            self._on_persisted(done, took)
            if done.completed_step:
                for gone in prune(self.settings.directory, self.settings.keep):
                    log.info("checkpoint persistence: removed %s (keep %d)", gone,
                             self.settings.keep)  # fmt: skip
            return True
